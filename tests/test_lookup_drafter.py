"""The `lookup` drafter (prompt lookup over each request's own text) is lossless and accepts.

Greedy output equals `ar` token for token on tiny fp32 models of every family, at B = 1 and B > 1
with ragged prompts; prompts that repeat themselves get drafts accepted (tau > 1); the config
takes decoding.mode=lookup with neither a draft head nor a trie. The hybrids (dart_lookup,
ddtree_lookup) merge the lookup tree into the head's tree: canonical, budgeted, lossless.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dart_worker.drafters import drafter_spec
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.head.draft_head import DartDraftHead
from dart_worker.sampling.params import SamplingParams
from dart_worker.target.adapter import TargetAdapter
from ngram_native import DraftTree, TreeParams
from ngram_native.trees import SOURCE_CONTEXT, SOURCE_HEAD, merge_trees
from pipeline.settings.config import load_config
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
            # Every accepted draft token came from the request's own text or (the second call) from
            # the job cache of the first call's outputs.
            row = r.stats.to_row()
            assert row["accepted_context"] <= sum(r.stats.accept_lengths) \
                <= row["accepted_context"] + row["accepted_job_cache"]
            assert r.stats.to_row()["accepted_head"] == 0
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


def tree_of(paths: dict[tuple[int, ...], float]) -> DraftTree:
    """A canonical tree from {path: score} (prefix-closed), via merge with an empty tree."""
    empty = DraftTree(*(np.zeros(0, np.int32) for _ in range(3)), np.zeros(0))
    tokens, parents, depths, scores, index = [], [], [], [], {}
    for path in sorted(paths, key=len):
        index[path] = len(tokens)
        tokens.append(path[-1])
        parents.append(index.get(path[:-1], -1))
        depths.append(len(path))
        scores.append(paths[path])
    raw = DraftTree(*(np.asarray(a, np.int32) for a in (tokens, parents, depths)), np.asarray(scores))
    return merge_trees(raw, empty, len(tokens))


def test_merged_trees_are_prefix_merged_canonical_and_within_budget():
    model = tree_of({(5,): -0.1, (5, 6): -0.5, (7,): -1.0, (7, 8): -3.0})
    lookup = tree_of({(5,): -2.0, (5, 6): -2.0, (5, 6, 9): -2.0, (4,): -0.2})
    merged = merge_trees(model, lookup, budget=10)
    merged.validate()
    assert merged.tokens.tolist() == [5, 4, 7, 6, 8, 9]  # one 5 and one 5-6: no duplicate siblings
    assert merged.parents.tolist() == [-1, -1, -1, 0, 2, 3]
    np.testing.assert_allclose(merged.scores, [-0.1, -0.2, -1.0, -0.5, -3.0, -2.0])
    small = merge_trees(model, lookup, budget=3)  # the best keys, prefix-closed
    small.validate()
    assert sorted(zip(small.depths.tolist(), small.tokens.tolist())) == [(1, 4), (1, 5), (2, 6)]
    assert merge_trees(model, lookup, budget=0).size == 0
    # Sources merge: a path both trees hold carries both bits.
    both = merge_trees(model.from_source(SOURCE_HEAD), lookup.from_source(SOURCE_CONTEXT), budget=10)
    assert both.sources.tolist() == [SOURCE_HEAD | SOURCE_CONTEXT, SOURCE_CONTEXT, SOURCE_HEAD,
                                     SOURCE_HEAD | SOURCE_CONTEXT, SOURCE_HEAD, SOURCE_CONTEXT]


@pytest.mark.parametrize("mode", ["ddtree_lookup", "dart_lookup"])
def test_hybrid_drafters_equal_ar_greedy(mode):
    model = tiny_model("qwen3", vocab_size=VOCAB)
    torch.manual_seed(123)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4)
    parts = EngineParts(target=TargetAdapter(model), head=head, eos_token_ids=(2,))
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    prompts = repeating_prompts(0, (5, 11, 17))
    expected = build_engine(parts, "ar").generate(prompts, params)
    got = build_engine(parts, mode, TreeParams(budget=12)).generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert all(max(r.stats.tree_sizes, default=0) <= 12 for r in got)
    assert sum(sum(r.stats.accept_lengths) for r in got) > 0
    for r in got:  # each accepted token is credited to at least one source, at most to all three
        row, accepted = r.stats.to_row(), sum(r.stats.accept_lengths)
        assert accepted <= row["accepted_head"] + row["accepted_context"] + row["accepted_job_cache"] <= 3 * accepted


def _tree(paths: list[list[int]]) -> DraftTree:
    """A canonical tree holding these root paths (scores 0: a lookup tree's ties)."""
    out = DraftTree(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0))
    for path in paths:
        chain = DraftTree(np.array(path, np.int32), np.arange(-1, len(path) - 1, dtype=np.int32),
                          np.arange(1, len(path) + 1, dtype=np.int32), np.zeros(len(path)))
        out = chain if not out.size else merge_trees(out, chain, budget=100)
    return out


def test_matched_length_is_the_longest_path_prefix_of_the_continuation():
    tree = _tree([[5, 6, 7], [5, 9], [8]])
    assert tree.matched_length([5, 6, 7, 1]) == 3
    assert tree.matched_length([5, 9, 9]) == 2
    assert tree.matched_length([5, 1]) == 1
    assert tree.matched_length([8, 8]) == 1
    assert tree.matched_length([4]) == 0
    assert tree.matched_length([]) == 0
    node, matched = tree.walk([5])  # a walk resumes where an earlier one stopped
    assert matched == 1 and tree.walk([6, 7, 1], node)[1] == 2 and tree.walk([9], node)[1] == 1
    assert tree.walk([6], node)[0] == tree.walk([5, 6])[0] != node and tree.walk([4], node) == (node, 0)


def test_lookup_payoff_judges_a_tree_once_everything_it_could_match_is_known():
    from dart_worker.drafters.base import CommittedBlock, Finished
    from dart_worker.drafters.hybrid import LOOKUP_MIN_TOKENS, LookupPayoff

    def block(tokens, joined=False):
        return CommittedBlock(taps=torch.zeros(len(tokens), 1, 1), rows=[[0]] * len(tokens), tokens=tokens,
                              joined=joined)

    payoff = LookupPayoff()
    payoff.observe(block([[1, 2, 3], [1, 2, 3]], joined=True))
    assert payoff.wanted(0) and payoff.wanted(1)  # no evidence yet: graft
    records = payoff.records
    good, bad = _tree([[5, 6, 7]]), _tree([[9, 9]])
    for _ in range(8):  # sequence 0 repeats what its lookup proposed; sequence 1 never does
        tokens = [[1, 2, 3], [1, 2, 3]]
        payoff.proposed(0, 3, good)
        payoff.proposed(1, 3, bad)
        payoff.observe(block([tokens[0] + [5], tokens[1] + [4]]))  # tree 0 may still match 6 7: it waits
        assert len(records[0].pending) == 1 and not records[1].pending  # tree 1 missed at once: judged
        payoff.observe(block([tokens[0] + [5, 6, 7, 8], tokens[1] + [4, 4, 4]]))
        assert not records[0].pending and not records[1].pending
    assert records[0].gain > 2.5 and payoff.wanted(0)
    assert records[1].gain < 0.05 and not payoff.wanted(1)
    survivor = records[1].gain
    payoff.retire(Finished([[1, 2, 3, 5, 6, 7, 8]], [3]), [1])  # sequence 0 finished: the survivor keeps its record
    assert [r.gain for r in records] == [survivor] and not payoff.wanted(0)
    payoff.observe(block([[4, 5]], joined=True))
    assert payoff.wanted(1) and records[1].gain == LOOKUP_MIN_TOKENS


def test_hybrid_grafts_lookup_only_for_requests_where_it_pays():
    """Two live requests whose prompts both repeat: the one whose committed text keeps following
    its lookup tree keeps context nodes; the one whose text never does gets the head's tree alone."""
    from dart_worker.drafters.base import CommittedBlock, Drafter
    from dart_worker.drafters.hybrid import HybridDrafter

    class FixedHead(Drafter):  # the head's tree: one node, token 30
        name, has_model = "fixed", False

        def propose(self, tokens, max_depths):
            return [_tree([[30]]).from_source(SOURCE_HEAD) for _ in tokens]

    drafter = HybridDrafter(FixedHead(), TreeParams(budget=8), eos_token_ids=(2,))
    block = [4, 5, 6, 7]
    seqs = [block + block, block + block]  # lookup proposes 4 5 6 7 ... after both
    drafter.observe(CommittedBlock(taps=torch.zeros(2, 8, 1), rows=[[0], [0]], tokens=[list(s) for s in seqs],
                                   joined=True))
    for k in range(12):
        trees = drafter.propose(seqs, [8, 8])
        context = [bool((t.sources & SOURCE_CONTEXT).any()) for t in trees]
        seqs[0] = seqs[0] + seqs[0][-8:-4]  # follows its own repeat
        seqs[1] = seqs[1] + [100 + 2 * k, 101 + 2 * k, 4, 5]  # never what lookup proposed, then "4 5" again
        drafter.observe(CommittedBlock(taps=torch.zeros(2, 4, 1), rows=[[0]] * 2, tokens=[list(s) for s in seqs]))
    assert context == [True, False]
    assert drafter.payoff.wanted(0) and not drafter.payoff.wanted(1)


def test_hybrid_with_payoff_stays_lossless_sampled():
    model = tiny_model("llama", vocab_size=VOCAB)
    torch.manual_seed(5)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4)
    parts = EngineParts(target=TargetAdapter(model), head=head, eos_token_ids=(2,))
    prompts = repeating_prompts(3, (9, 13, 6))
    params = SamplingParams(temperature=1.0, seed=7, max_new_tokens=40)
    expected = build_engine(parts, "ar").generate(prompts, params)
    got = build_engine(parts, "dart_lookup", TreeParams(budget=12)).generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
