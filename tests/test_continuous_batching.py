"""Continuous batching (`generate(..., max_live=N)`): sequences join a running batch as others
finish, and every request decodes exactly what it decodes alone.

Greedy: every drafter, with fixed and measured tree sizes, equals `ar` decoding all prompts at
once (hypothesis over prompt lengths, token limits and `max_live`). Sampling: a request's seeded
output does not depend on which requests shared its batch. The target's cache joins and the
drafters' states stay aligned with the live sequences (a misalignment changes outputs).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dart_worker.decode_round import StageClock
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.head.draft_head import DartDraftHead
from dart_worker.sampling.params import SamplingParams
from dart_worker.target.adapter import TargetAdapter
from ngram_native import TreeParams
from tests.hypothesis_budget import examples
from tests.tiny_models import tiny_model

VOCAB = 32
MODES = ("chain", "ddtree", "dart", "lookup", "dart_lookup")


@pytest.fixture(scope="module")
def parts():
    model = tiny_model("qwen3", vocab_size=VOCAB)
    torch.manual_seed(5)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4)
    return EngineParts(target=TargetAdapter(model), head=head, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def engines(parts):
    built = {("ar", "fixed"): build_engine(parts, "ar")}
    for mode in MODES:
        for sizing in ("fixed", "auto"):
            built[mode, sizing] = build_engine(parts, mode, TreeParams(budget=10), sizing=sizing)
    return built


def _prompts(seed: int, count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for k in range(count):
        n = int(torch.randint(3, 30, (1,), generator=gen))
        prompt = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
        if k % 2:
            prompt = (prompt[:4] * 8)[:n]  # repetitive: lookup drafts long chains
        prompts.append(prompt)
    return prompts


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), count=st.integers(1, 6), max_live=st.integers(1, 4),
       mode=st.sampled_from(MODES), sizing=st.sampled_from(["fixed", "auto"]),
       limits=st.lists(st.integers(1, 24), min_size=6, max_size=6))
def test_continuous_batches_decode_what_ar_decodes(engines, seed, count, max_live, mode, sizing, limits):
    prompts = _prompts(seed, count)
    params = [SamplingParams(temperature=0.0, max_new_tokens=limits[k]) for k in range(count)]
    expected = engines["ar", "fixed"].generate(prompts, params)
    results = engines[mode, sizing].generate(prompts, params, max_live=max_live)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [r.finish_reason for r in results] == [r.finish_reason for r in expected]


@pytest.mark.parametrize("mode", ["ar", "dart"])
def test_seeded_sampling_does_not_depend_on_the_batch_it_shared(engines, mode):
    prompts = _prompts(7, 5)
    params = [SamplingParams(temperature=1.0, seed=100 + k, max_new_tokens=8 + 5 * k) for k in range(5)]
    engine = engines[mode, "fixed"]
    alone = [engine.generate([p], [q])[0].token_ids for p, q in zip(prompts, params)]
    for max_live in (1, 2, 5):
        assert [r.token_ids for r in engine.generate(prompts, params, max_live=max_live)] == alone


def test_slots_refill_as_sequences_finish(engines):
    """Short requests leave early and the waiting ones take their slots: every request's wall
    time is its own (from joining to finishing), and errors never take a slot."""
    prompts = _prompts(3, 6)
    prompts.insert(2, [])  # an error row: reported, never admitted
    params = [SamplingParams(temperature=0.0, max_new_tokens=1 if k % 3 == 0 else 20) for k in range(7)]
    results = engines["dart_lookup", "auto"].generate(prompts, params, max_live=2)
    expected = engines["ar", "fixed"].generate(prompts, params)
    assert results[2].error == "empty prompt"
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    total = sum(r.stats.wall_seconds for r in results if r.error is None)
    assert all(r.stats.wall_seconds > 0 for r in results if r.error is None)
    assert max(r.stats.wall_seconds for r in results) < total


def test_max_live_must_be_positive(engines):
    with pytest.raises(ValueError, match="max_live"):
        engines["ar", "fixed"].generate([[3, 4]], max_live=0)


def test_rows_report_batch_occupancy_and_model_rounds(engines):
    """`mean_batch_live` counts the sequences verified together (never above max_live, and 1
    for a request decoded alone); `model_rounds` counts head forwards (every round when sizes
    are fixed and a tree is wanted, none for a drafter without a model)."""
    prompts = _prompts(11, 5)
    params = [SamplingParams(temperature=0.0, max_new_tokens=6 + 3 * k) for k in range(5)]
    for max_live in (1, 2, 3):
        for r in engines["dart", "fixed"].generate(prompts, params, max_live=max_live):
            assert 1.0 <= r.stats.mean_batch_live <= max_live
            # (a round where no live row wants a tree, e.g. each has one token left, runs no model)
            assert sum(size > 0 for size in r.stats.tree_sizes) <= r.stats.model_rounds <= r.stats.rounds
    static = engines["dart", "fixed"].generate(prompts, params)
    assert static[0].stats.mean_batch_live == 5.0  # the shortest row ends while all five are live
    assert max(r.stats.mean_batch_live for r in engines["ar", "fixed"].generate(prompts, params, max_live=1)) == 1.0
    assert all(r.stats.model_rounds == 0 for r in engines["lookup", "fixed"].generate(prompts, params))
    for r in engines["dart", "auto"].generate(prompts, params, max_live=2):
        assert 0 <= r.stats.model_rounds <= r.stats.rounds


def test_stage_clocks_synchronise_a_gpu_only_when_asked(engines, monkeypatch):
    """Without `sync_timing` a CUDA round waits on the device only for the verification
    transfer: the stage clock must not call torch.cuda.synchronize."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    engine = engines["dart", "fixed"]
    monkeypatch.setattr(engine.clock, "device", torch.device("cuda", 0))  # only the clock reads it here
    engine.clock.now()
    assert calls == []
    monkeypatch.setattr(engine, "sync_timing", True)  # what a benchmark sets on a built engine
    engine.clock.now()
    assert calls == [torch.device("cuda", 0)]
    StageClock(torch.device("cpu"), sync=True).now()  # nothing to synchronise on a CPU
    assert len(calls) == 1
