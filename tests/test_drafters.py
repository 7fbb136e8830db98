"""The drafter seam: a drafter defined here, in the test file only, plugs into the engine and the
pipeline config through the registry; what enters the engine is checked once; artifacts that
do not fit (a head trained on other taps) are refused; one stats row behind the Parquet schema.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from dart_worker.drafters import DrafterSpec, drafter_names, drafter_spec, register_drafter, unregister_drafter
from dart_worker.drafters.base import CommittedBlock, Drafter, Finished
from dart_worker.engine_factory import EngineParts, build_engine, eos_ids_of
from dart_worker.head.draft_checkpoint import DraftHeadLoadError, load_draft_head, save_draft_head
from dart_worker.head.draft_head import DartDraftHead
from dart_worker.sampling.params import SamplingParams
from dart_worker.stats import STAT_COLUMNS, RequestStats
from dart_worker.target.adapter import TargetAdapter
from ngram_native import DraftTree, InvalidTreeParams, TreeParams
from ngram_native import _core as native
from ngram_native import builders as builders_module
from pipeline.data.outputs import OUTPUT_SCHEMA
from pipeline.settings.config import ConfigError, load_config
from tests.tiny_models import tiny_model

VOCAB = 32


class RepeatDrafter(Drafter):
    """Guesses that the last token repeats: a chain of it, plus a sibling branch of token 3.

    Records how the engine drives it, so the test can check the protocol's calls."""

    name = "repeat"

    def __init__(self, depth: int):
        self.depth = depth
        self.calls: list[tuple] = []
        self.live = 0

    def observe(self, block: CommittedBlock) -> None:
        if block.joined:  # newcomers, after the live ones
            self.live += len(block.rows)
        assert len(block.rows) == len(block.tokens) <= self.live
        for rows, tokens in zip(block.rows, block.tokens):
            assert 1 <= len(rows) <= len(tokens) and all(r < block.taps.shape[1] for r in rows)
        self.calls.append(("join" if block.joined else "observe", [len(r) for r in block.rows]))

    def retire(self, finished: Finished, keep: Sequence[int]) -> None:
        assert all(len(seq) > p for seq, p in zip(finished.tokens, finished.num_prompt, strict=True))
        self.calls.append(("retire", len(finished.tokens), list(keep)))
        self.live = len(keep)

    def propose(self, tokens: Sequence[Sequence[int]], max_depths: Sequence[int]) -> list[DraftTree]:
        assert len(tokens) == len(max_depths) == self.live
        trees = []
        for seq, cap in zip(tokens, max_depths):
            depth, last = min(self.depth, cap), seq[-1]
            # Canonical order (by depth, then parent): the first level holds the guess and, unless
            # it is 3 already, a sibling 3; the guess's chain goes on below the first node.
            level_one = ([last] if last == 3 else [last, 3]) if depth else []
            tokens_, parents, depths = level_one, [-1] * len(level_one), [1] * len(level_one)
            for d in range(2, depth + 1):
                parents.append(0 if d == 2 else len(tokens_) - 1)
                tokens_.append(last)
                depths.append(d)
            trees.append(DraftTree(*(np.asarray(a, np.int32) for a in (tokens_, parents, depths))))
        self.calls.append(("propose", [t.size for t in trees]))
        return trees


class BrokenDrafter(Drafter):
    name = "broken"

    def propose(self, tokens, max_depths):
        bad = np.asarray([5, 6], np.int32)
        return [DraftTree(bad, np.asarray([-1, 1], np.int32), np.asarray([1, 2], np.int32)) for _ in tokens]


@pytest.fixture
def toy_drafters():
    made: list[RepeatDrafter] = []

    def build(resources, tree):
        made.append(RepeatDrafter(depth=tree.max_depth or 3))
        return made[-1]

    register_drafter(DrafterSpec("repeat", build, summary="test only: the last token repeats"))
    register_drafter(DrafterSpec("broken", lambda resources, tree: BrokenDrafter()))
    register_drafter(DrafterSpec("repeat_head", build, needs_head=True))
    yield made
    for name in ("repeat", "broken", "repeat_head"):
        unregister_drafter(name)


@pytest.fixture(scope="module")
def parts():
    return EngineParts(target=TargetAdapter(tiny_model("llama", vocab_size=VOCAB)), eos_token_ids=(2,))


def prompts(seed: int, count: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in torch.randint(4, 12, (count,), generator=gen).tolist():
        # Repeated runs give the repeat guess something to accept.
        out.append([4, *torch.randint(4, VOCAB, (n,), generator=gen).tolist(), 7, 7, 7])
    return out


def test_a_drafter_defined_in_a_test_runs_through_the_engine_losslessly(toy_drafters, parts):
    assert "repeat" in drafter_names()
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    batch = prompts(seed=1)
    expected = build_engine(parts, "ar").generate(batch, params)
    got = build_engine(parts, "repeat", TreeParams(max_depth=4)).generate(batch, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in expected]
    assert all(r.stats.mean_tree_size > 0 for r in got)
    calls = toy_drafters[-1].calls
    assert calls[0] == ("retire", 0, [])  # an empty batch to start from
    assert calls[1] == ("join", [len(p) for p in batch])  # the prompts' rows, committed by prefill
    assert {c[0] for c in calls} == {"retire", "join", "observe", "propose"}
    assert sum(c[1] for c in calls if c[0] == "retire") == len(batch)  # each finished once
    # Continuous batching: sequences join a running batch and retire from it; same tokens.
    one_at_a_time = build_engine(parts, "repeat", TreeParams(max_depth=4)).generate(batch, params, max_live=2)
    assert [r.token_ids for r in one_at_a_time] == [r.token_ids for r in expected]
    assert any(c[0] == "join" for c in toy_drafters[-1].calls[2:])


def test_a_batch_that_raised_leaves_no_drafter_state_behind(parts):
    """A pipeline worker retries a failed batch row by row on the same engine: what the drafter
    kept of the batch that raised (here: lookup's per-sequence indexes) must not reach the next."""
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    batch = prompts(seed=4)
    engine = build_engine(parts, "lookup", TreeParams(max_depth=4))
    propose, calls = engine.drafter.propose, []

    def fails_once(tokens, max_depths):
        calls.append(len(tokens))
        if len(calls) == 2:
            raise RuntimeError("boom")
        return propose(tokens, max_depths)

    engine.drafter.propose = fails_once
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate(batch, params)
    got = engine.generate(batch[:2], params)
    assert [r.token_ids for r in got] == [r.token_ids for r in build_engine(parts, "ar").generate(batch[:2], params)]


def test_what_a_drafter_returns_is_checked_where_it_enters_the_engine(toy_drafters, parts):
    engine = build_engine(parts, "broken")
    with pytest.raises(ValueError, match=r"trees\[0\]: node 1 has parent 1"):
        engine.generate(prompts(seed=2, count=1), SamplingParams(temperature=0.0, max_new_tokens=4))


def test_the_pipeline_config_validates_modes_against_the_registry(toy_drafters, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("input:\n  urls: [prompts.jsonl]\noutput:\n  url: out/\n")
    cfg = load_config(path, ["decoding.mode=repeat", "model.draft_head=null", "model.trie=null"])
    assert cfg.decoding.mode == "repeat"
    with pytest.raises(ConfigError, match="mode 'repeat_head' needs a draft head"):
        load_config(path, ["decoding.mode=repeat_head", "model.draft_head=null"])
    unregister_drafter("repeat")
    with pytest.raises(ConfigError, match=r"decoding.mode: must be one of \[.*'dart'.*\], got 'repeat'"):
        load_config(path, ["decoding.mode=repeat"])


def test_registry_refuses_duplicates_and_bad_names():
    with pytest.raises(ValueError, match="already registered"):
        register_drafter(DrafterSpec("dart", lambda r, t: None))
    with pytest.raises(ValueError, match="use letters, digits"):
        register_drafter(DrafterSpec("no spaces", lambda r, t: None))
    with pytest.raises(ValueError, match=r"unknown decoding mode 'nope'; expected one of \['ar', 'chain'"):
        drafter_spec("nope")
    assert drafter_spec("dart").needs_trie and drafter_spec("chain").needs_head and not drafter_spec("ar").uses_tree


def test_build_engine_needs_a_head_where_the_drafter_does(parts):
    with pytest.raises(ValueError, match="mode 'chain' needs a draft head"):
        build_engine(parts, "chain")


def test_tree_params_have_one_set_of_defaults_the_native_ones():
    native_defaults = native.DartParams()
    params = TreeParams()
    for name in ("budget", "top_k", "beam_width", "depth_decay", "draft_decay", "ngram_weight", "keep_pruned",
                 "prune"):
        assert getattr(params, name) == pytest.approx(getattr(native_defaults, name)), name
    round_trip = TreeParams(budget=7, top_k=3, ngram_weight=0.25, keep_pruned=False).to_native()
    assert (round_trip.budget, round_trip.top_k, round_trip.ngram_weight, round_trip.keep_pruned) == (7, 3, 0.25, False)


def test_bad_tree_params_fail_when_built_naming_every_bad_field(tmp_path):
    with pytest.raises(InvalidTreeParams, match="top_k must be >= 1, got 0; draft_decay must be") as caught:
        TreeParams(top_k=0, draft_decay=-1.0, max_depth=0)
    assert caught.value.problems == [
        ("top_k", "must be >= 1, got 0"), ("draft_decay", "must be >= 0.0, got -1.0"),
        ("max_depth", "must be >= 1 or None, got 0")]
    with pytest.raises(ValueError, match="budget must be >= 0, got -1"):
        dataclasses.replace(TreeParams(), budget=-1)
    with pytest.raises(TypeError, match="beam_width must be an integer, got float"):
        TreeParams(beam_width=2.5)
    path = tmp_path / "c.yaml"  # a config: the same check, under the config's keys, before any work
    path.write_text("input:\n  urls: [prompts.jsonl]\noutput:\n  url: out/\n")
    with pytest.raises(ConfigError, match=r"decoding\.tree\.top_k: must be >= 1, got 0\n  "
                                          r"decoding\.tree\.beam_width: must be >= 1, got 0"):
        load_config(path, ["decoding.tree.top_k=0", "decoding.tree.beam_width=0"])


def test_tree_params_are_not_checked_again_per_round(monkeypatch):
    model = tiny_model("llama", vocab_size=VOCAB)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=3)
    parts = EngineParts(target=TargetAdapter(model), head=head, eos_token_ids=(2,))
    engines = {mode: build_engine(parts, mode, TreeParams(budget=6, top_k=4)) for mode in ("dart", "dart_lookup")}
    checks = []
    monkeypatch.setattr(builders_module, "_problems", lambda params: checks.append(params) or [])
    for engine in engines.values():
        results = engine.generate(prompts(seed=3), SamplingParams(temperature=0.0, max_new_tokens=12))
        assert all(r.stats.mean_tree_size > 0 for r in results)
    assert checks == []


def test_a_head_trained_on_other_taps_is_refused(tmp_path):
    model = tiny_model("llama", vocab_size=VOCAB)
    target = TargetAdapter(model)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=2, tap_layers=(0, 1, 2))
    save_draft_head(head, tmp_path / "head")
    assert target.tap_layers != (0, 1, 2)
    with pytest.raises(DraftHeadLoadError, match=r"trained on the inputs of target layers \[0, 1, 2\].*tapped at"):
        EngineParts.from_model(model, head=tmp_path / "head", target=target)
    with pytest.raises(DraftHeadLoadError, match=r"\[0, 1, 2\]"):
        EngineParts.from_model(model, head=head, target=target)  # a loaded head is checked too
    fits = EngineParts.from_model(model, head=tmp_path / "head", tap_layers=(0, 1, 2))
    assert fits.head.config.tap_layers == [0, 1, 2]
    # A head that records nothing (published DART heads) is taken as trained on the reference taps.
    plain = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=2)
    plain.config.tap_layers = None
    save_draft_head(plain, tmp_path / "plain")
    assert "tap_layers" not in (tmp_path / "plain" / "config.json").read_text()
    load_draft_head(tmp_path / "plain", model.config, model.get_input_embeddings(), tap_layers=target.tap_layers)
    with pytest.raises(DraftHeadLoadError, match="none recorded"):
        load_draft_head(tmp_path / "plain", model.config, model.get_input_embeddings(), tap_layers=(0, 1, 2))


def test_eos_ids_come_from_every_source_the_target_declares():
    class Source:
        def __init__(self, eos):
            self.eos_token_id = eos

    class Model:
        generation_config = Source([1, 106])
        config = Source(1)

    assert eos_ids_of(Model(), Source(2)) == (1, 2, 106)
    assert eos_ids_of(Model()) == (1, 106)


def test_one_stats_row_is_what_the_parquet_schema_holds():
    row = RequestStats(num_prompt_tokens=3, accept_lengths=[1, 0], tree_sizes=[4, 4], tree_depths=[2, 1]).to_row()
    assert list(row) == list(STAT_COLUMNS)
    names = OUTPUT_SCHEMA.names
    assert names[names.index("num_prompt_tokens"): names.index("num_prompt_tokens") + len(STAT_COLUMNS)] == list(row)
    assert row["tau"] == pytest.approx(1.5) and row["acceptance_histogram"] == [1, 1]
