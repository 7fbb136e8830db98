"""DDTree best-first trees vs brute-force enumeration of every prefix; chain trees.

Brute force: list every draft prefix (candidate rank per position, never continuing past
an EOS token), score it as the running sum of per-position log-probs (same summation order
as C++), sort by (score desc, depth asc, ranks asc) and keep the first `budget`.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_native.builders import build_chain_trees, build_ddtree_trees
from ngram_native.trees import DraftTree
from tests.hypothesis_budget import examples

# ---------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------


def sorted_rows(values: np.ndarray, ids: np.ndarray | None) -> list[list[tuple[float, int]]]:
    """Per position, every (value, id) by value desc, id asc."""
    rows = []
    for d in range(values.shape[0]):
        row_ids = range(values.shape[1]) if ids is None else ids[d].tolist()
        rows.append(sorted(zip(values[d].tolist(), row_ids), key=lambda x: (-x[0], x[1])))
    return rows


def log_softmax_rows(
    rows: list[list[tuple[float, int]]], dense: np.ndarray | None = None
) -> list[list[tuple[float, int]]]:
    """(log-prob, id) per row with the C++ arithmetic: best + ln(sum of exp(v - best)),
    summed over the full dense row in vocabulary order if given, else over the sorted row."""
    out = []
    for d, row in enumerate(rows):
        best = row[0][0]
        total = 0.0
        for v in (v for v, _ in row) if dense is None else dense[d].tolist():
            total += math.exp(v - best)
        norm = best + math.log(total)
        out.append([(v - norm, t) for v, t in row])
    return out


def canonical(nodes: list[tuple[tuple[int, ...], int, float]]) -> DraftTree:
    """nodes: (rank path, token, score). Canonical order by depth, parent, score desc, token."""
    index_of: dict[tuple[int, ...], int] = {}
    ordered = []
    for depth in sorted({len(p) for p, _, _ in nodes}):
        group = [n for n in nodes if len(n[0]) == depth]
        group.sort(key=lambda n: (index_of.get(n[0][:-1], -1), -n[2], n[1]))
        for n in group:
            index_of[n[0]] = len(ordered)
            ordered.append(n)
    return DraftTree(
        tokens=np.array([t for _, t, _ in ordered], dtype=np.int32),
        parents=np.array([index_of.get(p[:-1], -1) for p, _, _ in ordered], dtype=np.int32),
        depths=np.array([len(p) for p, _, _ in ordered], dtype=np.int32),
        scores=np.array([s for _, _, s in ordered], dtype=np.float64),
    )


def brute_force_ddtree(lp_rows: list[list[tuple[float, int]]], budget: int, eos_ids=()) -> DraftTree:
    prefixes = []
    for depth in range(1, len(lp_rows) + 1):
        for path in itertools.product(*(range(len(r)) for r in lp_rows[:depth])):
            tokens = [lp_rows[d][j][1] for d, j in enumerate(path)]
            if any(t in eos_ids for t in tokens[:-1]):
                continue  # nothing grows past an EOS token
            score = 0.0
            for d, j in enumerate(path):
                score = score + lp_rows[d][j][0]
            prefixes.append((path, tokens[-1], score))
    prefixes.sort(key=lambda n: (-n[2], len(n[0]), n[0]))
    return canonical(prefixes[:budget])


def assert_same_tree(got: DraftTree, want: DraftTree) -> None:
    got.validate()
    want.validate()
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.parents, want.parents)
    np.testing.assert_array_equal(got.depths, want.depths)
    np.testing.assert_array_equal(got.scores, want.scores)


# ---------------------------------------------------------------------------------------
# DDTree
# ---------------------------------------------------------------------------------------

LOGPROB_VALUES = st.sampled_from([0.0, -0.5, -1.0, -1.0, -2.0, -math.inf])
LOGIT_VALUES = st.one_of(st.sampled_from([-1.0, 0.0, 0.0, 2.0]), st.floats(-6, 6, width=32))


@st.composite
def ddtree_case(draw, element):
    batch = draw(st.integers(1, 2))
    positions = draw(st.integers(1, 4))
    width = draw(st.integers(1, 4))
    shape = (batch, positions, width)
    values = np.array(draw(st.lists(element, min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))),
                      dtype=np.float32).reshape(shape)  # fmt: skip
    values[..., 0] = np.maximum(values[..., 0], -1.0)  # at least one finite value per row
    vocab = draw(st.integers(width, 12))
    ids = np.array([[draw(st.permutations(range(vocab)))[:width] for _ in range(positions)] for _ in range(batch)])
    budget = draw(st.integers(0, 30))
    eos = tuple(draw(st.sets(st.integers(0, vocab - 1), max_size=3)))
    return values, ids, budget, eos


@settings(max_examples=examples(200), deadline=None)
@given(ddtree_case(LOGPROB_VALUES))
def test_ddtree_logprobs_equal_brute_force_top_prefixes(case):
    values, ids, budget, eos = case
    trees = build_ddtree_trees(topk_ids=ids, topk_values=values, budget=budget, eos_ids=eos)  # log-probs by default
    for b, tree in enumerate(trees):
        rows = sorted_rows(values[b], ids[b])  # log-probs used as given
        assert_same_tree(tree, brute_force_ddtree(rows, budget, eos))


@settings(max_examples=examples(100), deadline=None)
@given(ddtree_case(LOGIT_VALUES))
def test_ddtree_topk_logits_are_log_softmaxed_over_the_k(case):
    values, ids, budget, eos = case
    trees = build_ddtree_trees(ids, values, values="logits", budget=budget, eos_ids=eos)
    for b, tree in enumerate(trees):
        rows = log_softmax_rows(sorted_rows(values[b], ids[b]))
        assert_same_tree(tree, brute_force_ddtree(rows, budget, eos))


@settings(max_examples=examples(100), deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 6),
    st.integers(0, 20),
    st.sampled_from([LOGIT_VALUES, st.sampled_from([0.0, 1.0, -math.inf])]),
    st.data(),
)
def test_ddtree_dense_logits_equal_brute_force_over_the_whole_vocabulary(positions, vocab, budget, element, data):
    """The default top_k = min(budget, V) loses nothing: brute force over all V agrees."""
    logits = np.array(data.draw(st.lists(element, min_size=positions * vocab, max_size=positions * vocab)),
                      dtype=np.float32).reshape(1, positions, vocab)  # fmt: skip
    logits[..., 0] = np.maximum(logits[..., 0], -1.0)
    eos = tuple(data.draw(st.sets(st.integers(0, vocab - 1), max_size=2)))
    (tree,) = build_ddtree_trees(logits=logits, budget=budget, eos_ids=eos)
    rows = log_softmax_rows(sorted_rows(logits[0], None), dense=logits[0])
    assert_same_tree(tree, brute_force_ddtree(rows, budget, eos))


def test_ddtree_explicit_top_k_limits_the_branching():
    logits = np.zeros((1, 2, 10), dtype=np.float32)
    (tree,) = build_ddtree_trees(logits=logits, budget=100, top_k=3)
    assert tree.size == 3 + 9
    np.testing.assert_array_equal(tree.tokens[:3], [0, 1, 2])


def test_ddtree_small_logprob_noise_is_clamped_and_large_positives_rejected():
    ids = np.array([[[4, 7]]])
    (tree,) = build_ddtree_trees(topk_ids=ids, topk_values=np.array([[[5e-5, -1.0]]]), values="logprobs")
    np.testing.assert_array_equal(tree.scores, [0.0, -1.0])
    with pytest.raises(ValueError, match="must be <= 0"):
        build_ddtree_trees(topk_ids=ids, topk_values=np.array([[[0.5, -1.0]]]), values="logprobs")


def test_ddtree_budget_zero_one_and_single_position():
    values = np.log(np.array([[[0.5, 0.3, 0.2]]], dtype=np.float32))
    ids = np.array([[[9, 3, 5]]])
    assert build_ddtree_trees(topk_ids=ids, topk_values=values, budget=0)[0].size == 0
    (one,) = build_ddtree_trees(topk_ids=ids, topk_values=values, budget=1)
    np.testing.assert_array_equal(one.tokens, [9])
    (all_,) = build_ddtree_trees(topk_ids=ids, topk_values=values, budget=10)
    np.testing.assert_array_equal(all_.tokens, [9, 3, 5])
    np.testing.assert_array_equal(all_.parents, [-1, -1, -1])


# ---------------------------------------------------------------------------------------
# Chain
# ---------------------------------------------------------------------------------------


def test_chain_is_the_argmax_path():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 20)).astype(np.float32)
    for b, tree in enumerate(build_chain_trees(logits=logits)):
        tree.validate()
        np.testing.assert_array_equal(tree.tokens, logits[b].argmax(-1))
        np.testing.assert_array_equal(tree.parents, np.arange(5) - 1)
        np.testing.assert_array_equal(tree.depths, np.arange(1, 6))
        logp = logits[b].astype(np.float64) - np.log(np.exp(logits[b].astype(np.float64)).sum(-1, keepdims=True))
        np.testing.assert_allclose(tree.scores, np.cumsum(logp.max(-1)), rtol=1e-12)


def test_chain_ties_pick_the_lowest_id_and_budget_limits_depth():
    logits = np.zeros((1, 4, 3), dtype=np.float32)
    (tree,) = build_chain_trees(logits=logits, budget=2)
    np.testing.assert_array_equal(tree.tokens, [0, 0])
    assert build_chain_trees(logits=logits, budget=0)[0].size == 0


def test_chain_stops_after_eos():
    logits = np.zeros((1, 4, 3), dtype=np.float32)
    logits[0, 1, 2] = 1.0
    (tree,) = build_chain_trees(logits=logits, eos_ids=[2])
    np.testing.assert_array_equal(tree.tokens, [0, 2])
    (tree,) = build_chain_trees(logits=logits, eos_ids=2)
    np.testing.assert_array_equal(tree.tokens, [0, 2])


def test_chain_from_topk_uses_the_best_given_candidate():
    ids = np.array([[[5, 2, 8], [1, 0, 3]]])
    values = np.array([[[-1.0, -0.5, -3.0], [-2.0, -2.0, -0.1]]], dtype=np.float32)
    (tree,) = build_chain_trees(topk_ids=ids, topk_values=values, values="logprobs")
    np.testing.assert_array_equal(tree.tokens, [2, 3])
    np.testing.assert_array_equal(tree.scores, [-0.5, np.float32(-0.5) + np.float64(np.float32(-0.1))])
    (one,) = build_chain_trees(topk_ids=ids[:, :1], topk_values=values[:, :1])
    assert one.size == 1 and one.tokens[0] == 2


# ---------------------------------------------------------------------------------------
# Every builder: structure
# ---------------------------------------------------------------------------------------


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(1, 8), st.integers(0, 40), st.data())
def test_every_builder_returns_canonical_prefix_closed_trees(batch, positions, vocab, budget, data):
    from ngram_native.builders import build_dart_trees

    flat = data.draw(st.lists(st.floats(-4, 4, width=32), min_size=batch * positions * vocab,
                              max_size=batch * positions * vocab))  # fmt: skip
    logits = np.array(flat, dtype=np.float32).reshape(batch, positions, vocab)
    eos = data.draw(st.sets(st.integers(0, vocab - 1), max_size=2))
    for trees in (
        build_dart_trees(logits=logits, budget=budget, eos_ids=eos, top_k=data.draw(st.integers(1, vocab)),
                         beam_width=data.draw(st.integers(1, 4))),
        build_ddtree_trees(logits=logits, budget=budget, eos_ids=eos),
        build_chain_trees(logits=logits, budget=budget, eos_ids=eos),
    ):  # fmt: skip
        assert len(trees) == batch
        for tree in trees:
            tree.validate()  # dtypes, topological, depths, canonical sibling order by score
            assert tree.size <= budget
            if tree.size:
                assert tree.depths.max() <= positions
            expanded_eos = set(tree.parents[tree.parents >= 0].tolist()) & set(
                np.flatnonzero(np.isin(tree.tokens, list(eos))).tolist()
            )
            assert not expanded_eos
