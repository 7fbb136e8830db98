"""dart_train.replay: tau without verification forwards equals the engine's, round by round.

The engine (fixed tree sizing, fp32 tiny models) and the replay decode the same prompts with the
same drafter settings, greedy and sampled (seeded: the engine's coupled draws make the sampled
reply fixed); every request's accept lengths, tree sizes and accepted-token sources must be the
same in both. The accepted path is checked against a brute-force reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_train.replay import accepted_path, mean_tau, replay, target_references
from dart_worker.engine_factory import EngineParts, build_drafter, build_engine
from dart_worker.head.draft_head import DartDraftHead
from dart_worker.sampling.params import SamplingParams
from dart_worker.target.adapter import TargetAdapter
from ngram_native import DraftTree, NgramTrie, TreeParams, build_trie
from tests.hypothesis_budget import examples
from tests.test_engine import VOCAB, random_prompts
from tests.tiny_models import tiny_model

MAX_NEW = 40


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def parts(request, tmp_path_factory) -> EngineParts:
    """A tiny target with a random head and a trie over its own greedy replies (so trees accept
    several tokens per round), and the looping prompts the lookup drafters draft from."""
    model = tiny_model(request.param, vocab_size=VOCAB)
    torch.manual_seed(123)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4)
    parts = EngineParts(target=TargetAdapter(model), head=head, eos_token_ids=(2,))
    ar = build_engine(parts, "ar", defer_logits=False)
    replies = ar.generate(random_prompts(12, seed=99), SamplingParams(temperature=0.0, max_new_tokens=48))
    path = tmp_path_factory.mktemp("trie") / "self.ngram"
    build_trie([np.asarray(r.token_ids, dtype=np.int32) for r in replies], path, order=3, vocab_size=VOCAB,
               tokenizer_fingerprint="tiny")
    parts.trie = NgramTrie.open(path, verify=True)
    return parts


def prompts() -> list[list[int]]:
    repeating = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 5 + [4]]  # the lookup drafters find their spans
    return random_prompts(5, seed=99) + repeating  # the first five replies are in the trie


@pytest.mark.parametrize("mode", ["chain", "ddtree", "dart", "lookup", "dart_lookup"])
@pytest.mark.parametrize("budget", [6, 60])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_replay_records_the_rounds_the_engine_records(parts, mode, budget, temperature):
    tree = TreeParams(budget=budget, lookup_cache_tokens=4096)  # the job cache learns from finished rows
    engine = build_engine(parts, mode, tree, defer_logits=False, sizing="fixed")
    params = SamplingParams(temperature=temperature, seed=7, max_new_tokens=MAX_NEW)
    results = engine.generate(prompts(), params)
    refs = target_references(parts, prompts(), MAX_NEW, replies=[r.token_ids for r in results])
    # the engine hands a sampled row's drafter its dice (coupled drafting, issue #48): replay the same
    replayed = replay(build_drafter(parts, mode, tree), refs, MAX_NEW, parts.target.max_positions, dice=params)
    for result, stats in zip(results, replayed, strict=True):
        assert stats.accept_lengths == result.stats.accept_lengths
        assert stats.tree_sizes == result.stats.tree_sizes
        assert stats.accepted_by_source == result.stats.accepted_by_source
    assert mean_tau(replayed) == pytest.approx(np.mean([r.stats.tau for r in results]))
    if budget == 60 and (mode == "dart" or (mode == "lookup" and temperature == 0)):
        # The test means something: multi-token rounds. (Sampled replies of the random target seldom
        # repeat a span, so the lookup's sampled cells may accept nothing at all.)
        assert max(max(s.accept_lengths) for s in replayed) >= 2
    if temperature > 0:  # and the sampled replies are not the greedy ones
        greedy = engine.generate(prompts(), SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
        assert sum(g.token_ids != r.token_ids for g, r in zip(greedy, results)) >= len(results) // 2


def test_sampled_replies_are_the_ones_ar_samples_with_that_seed(parts):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_new_tokens=12)
    expected = build_engine(parts, "ar", defer_logits=False).generate(prompts()[:3], params)
    refs = target_references(parts, prompts()[:3], 12, params=params)
    again = target_references(parts, prompts()[:3], 12, mode="dart", params=params)  # any lossless mode
    assert [r.reply for r in refs] == [e.token_ids for e in expected] == [r.reply for r in again]
    other = target_references(parts, prompts()[:3], 12, params=SamplingParams(temperature=1.0, seed=12))
    assert [r.reply for r in other] != [r.reply for r in refs]


def test_replies_default_to_the_targets_greedy_decoding(parts):
    engine = build_engine(parts, "ar", defer_logits=False)
    expected = engine.generate(prompts()[:3], SamplingParams(temperature=0.0, max_new_tokens=12))
    refs = target_references(parts, prompts()[:3], 12)
    assert [r.reply for r in refs] == [e.token_ids for e in expected]
    assert all(r.taps.shape[0] == len(r.prompt) + len(r.reply) for r in refs)


def test_mismatched_replies_are_refused(parts):
    with pytest.raises(ValueError, match="2 prompts but 1 replies"):
        target_references(parts, prompts()[:2], 8, replies=[[3]])
    with pytest.raises(ValueError, match="reply 0 has 0 tokens"):
        target_references(parts, prompts()[:1], 8, replies=[[]])


@st.composite
def trees_and_continuations(draw):
    """A random tree in canonical order (parents before children, depths = parent's + 1) over a
    3-token alphabet, so that paths often spell the continuation's start."""
    size = draw(st.integers(0, 14))
    parents, depths = [], []
    for i in range(size):
        parent = draw(st.integers(-1, i - 1))
        parents.append(parent)
        depths.append(1 if parent < 0 else depths[parent] + 1)
    tokens = draw(st.lists(st.integers(0, 2), min_size=size, max_size=size))
    continuation = draw(st.lists(st.integers(0, 2), max_size=6))
    tree = DraftTree(tokens=np.asarray(tokens, np.int32), parents=np.asarray(parents, np.int32),
                     depths=np.asarray(depths, np.int32))
    return tree, continuation


@settings(max_examples=examples(300), deadline=None)
@given(trees_and_continuations())
def test_accepted_path_is_the_deepest_matching_path(case):
    tree, continuation = case

    def path_of(node: int) -> list[int]:
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = int(tree.parents[node])
        return nodes[::-1]

    matching = [path_of(i) for i in range(tree.size)
                if [int(tree.tokens[n]) for n in path_of(i)] == continuation[: len(path_of(i))]
                and len(path_of(i)) <= len(continuation)]
    got = accepted_path(tree, continuation).tolist()
    assert len(got) == max((len(p) for p in matching), default=0)
    assert got in matching or got == []
