"""The `lookup` drafter (prompt lookup over each request's own text) is lossless and accepts.

Greedy output equals `ar` token for token on tiny fp32 models of every family, at B = 1 and B > 1
with ragged prompts; prompts that repeat themselves get drafts accepted (tau > 1); the config
takes decoding.mode=lookup with neither a draft head nor a trie.
"""

from __future__ import annotations

import pytest
import torch

from dart_worker.drafters import drafter_spec
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.sampling import SamplingParams
from dart_worker.target import TargetAdapter
from ngram_native import TreeParams
from pipeline.config import load_config
from tests.tiny_models import FAMILIES, tiny_model

VOCAB = 32


def repeating_prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Each prompt is a random block, the block again and its start: the suffix has matches."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        block = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
        out.append(block + block + block[:3])
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_lookup_equals_ar_greedy_and_accepts_on_repeats(family):
    parts = EngineParts(target=TargetAdapter(tiny_model(family, vocab_size=VOCAB)), eos_token_ids=(2,))
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    ar, lookup = build_engine(parts, "ar"), build_engine(parts, "lookup", TreeParams(budget=16, max_depth=6))
    rounds = accepted = 0
    for prompts in (repeating_prompts(0, (5, 11, 17)), repeating_prompts(1, (9,))):
        expected = ar.generate(prompts, params)
        got = lookup.generate(prompts, params)
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]
        assert [r.finish_reason for r in got] == [r.finish_reason for r in expected]
        for r in got:
            assert r.stats.rounds == 0 or r.stats.tau >= 1
            assert max(r.stats.tree_depths, default=0) <= 6 and max(r.stats.tree_sizes, default=0) <= 16
            rounds += r.stats.rounds
            accepted += sum(r.stats.accept_lengths)
    # Fixed seeds, deterministic: the prompts repeat and so do these models' greedy paths.
    assert rounds and (accepted + rounds) / rounds > 1.0  # tau over every round of the family


def test_the_config_takes_lookup_without_head_or_trie(tmp_path):
    spec = drafter_spec("lookup")
    assert not spec.needs_head and not spec.needs_trie and spec.uses_tree
    path = tmp_path / "c.yaml"
    path.write_text("input:\n  urls: [prompts.jsonl]\noutput:\n  url: out/\n")
    cfg = load_config(path, ["decoding.mode=lookup", "model.draft_head=null", "model.trie=null",
                             "decoding.tree.budget=24"])
    assert cfg.decoding.mode == "lookup" and cfg.decoding.tree.budget == 24
