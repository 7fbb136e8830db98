"""Tree helpers (masks, positions, child tables), DraftTree checks, input validation and
the test-only dict scorer, each against a plain-Python reference."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_native import _core
from ngram_native.builders import build_chain_trees, build_dart_trees, build_ddtree_trees, ngram_probs
from ngram_native.trees import DraftTree, ancestor_mask, children, position_offsets
from tests.hypothesis_budget import examples


@st.composite
def parent_arrays(draw, max_size=30):
    n = draw(st.integers(0, max_size))
    return np.array([draw(st.integers(-1, i - 1)) for i in range(n)], dtype=np.int32)


# ---------------------------------------------------------------------------------------
# Helpers vs references
# ---------------------------------------------------------------------------------------


@settings(max_examples=examples(100), deadline=None)
@given(parent_arrays())
def test_ancestor_mask_marks_exactly_self_and_ancestors(parents):
    n = parents.shape[0]
    want = np.zeros((n + 1, n + 1), dtype=bool)
    want[0, 0] = True
    for i in range(n):
        want[i + 1, 0] = True
        x = i
        while x >= 0:
            want[i + 1, x + 1] = True
            x = parents[x]
    got = ancestor_mask(parents)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, want)


@settings(max_examples=examples(100), deadline=None)
@given(parent_arrays())
def test_children_csr_lists_every_child_in_index_order(parents):
    n = parents.shape[0]
    offsets, child_idx = children(parents)
    assert offsets.shape == (n + 2,) and child_idx.shape == (n,)
    for row in range(n + 1):  # row 0 = root, row i + 1 = node i
        want = [i for i in range(n) if parents[i] == row - 1]
        assert child_idx[offsets[row] : offsets[row + 1]].tolist() == want


def test_position_offsets_prepend_the_root():
    np.testing.assert_array_equal(position_offsets(np.array([1, 1, 2, 3], np.int32)), [0, 1, 1, 2, 3])
    assert position_offsets([]).tolist() == [0]
    assert position_offsets(np.array([1], np.int32)).dtype == np.int64


@settings(max_examples=examples(100), deadline=None)
@given(parent_arrays(), st.data())
def test_find_child_is_the_first_child_carrying_the_token(parents, data):
    """Against a scan of the children in index order, duplicate tokens among siblings included
    (the first wins), for every node and every token present plus one absent."""
    n = parents.shape[0]
    tokens = np.array(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), np.int32)
    depths = np.zeros(n, np.int32)
    for i in range(n):
        depths[i] = 1 if parents[i] < 0 else depths[parents[i]] + 1
    tree = DraftTree(tokens=tokens, parents=parents, depths=depths)
    for node in range(-1, n):
        for token in range(5):
            want = next((i for i in range(n) if parents[i] == node and tokens[i] == token), -1)
            assert tree.find_child(node, token) == want


def test_find_child_walks_the_tree():
    tree = DraftTree(
        tokens=np.array([5, 6, 7, 5], np.int32),
        parents=np.array([-1, -1, 0, 0], np.int32),
        depths=np.array([1, 1, 2, 2], np.int32),
    )
    tree.validate()
    assert tree.find_child(-1, 5) == 0
    assert tree.find_child(-1, 6) == 1
    assert tree.find_child(-1, 7) == -1
    assert tree.find_child(0, 5) == 3
    assert tree.find_child(0, 7) == 2
    assert tree.find_child(1, 5) == -1
    assert tree.find_child(3, 5) == -1
    np.testing.assert_array_equal(tree.position_offsets(), [0, 1, 1, 2, 2])
    assert tree.ancestor_mask()[4].tolist() == [True, True, False, False, True]


@pytest.mark.parametrize(
    ("parents", "depths", "tokens", "scores", "message"),
    [
        ([-1, 1], [1, 2], [1, 2], None, "earlier index"),
        ([-1, -1], [1, 2], [1, 2], None, "parent depth"),
        ([-1, 0, -1], [1, 2, 1], [1, 2, 3], None, "sorted by depth"),
        ([-1, -1, 1, 0], [1, 1, 2, 2], [1, 2, 3, 4], None, "sorted by parent"),
        ([-1, -1], [1, 1], [4, 4], None, "same token"),
        ([-1, -1], [1, 1], [1, 2], [-2.0, -1.0], "score desc"),
        ([-1, -1], [1, 1], [2, 1], [-1.0, -1.0], "score desc"),
        ([-1], [1], [-3], None, "outside"),
    ],
)
def test_validate_rejects_malformed_trees(parents, depths, tokens, scores, message):
    tree = DraftTree(
        tokens=np.array(tokens, np.int32),
        parents=np.array(parents, np.int32),
        depths=np.array(depths, np.int32),
        scores=None if scores is None else np.array(scores),
    )
    with pytest.raises(ValueError, match=message):
        tree.validate()


def test_validate_rejects_wrong_dtypes_and_lengths():
    with pytest.raises(ValueError, match="int32"):
        DraftTree(np.array([1]), np.array([-1], np.int32), np.array([1], np.int32)).validate()
    with pytest.raises(ValueError, match="lengths differ"):
        DraftTree(np.array([1], np.int32), np.array([-1, 0], np.int32), np.array([1], np.int32)).validate()


def test_helper_input_errors():
    with pytest.raises(ValueError, match="index < i"):
        ancestor_mask([0])
    with pytest.raises(ValueError, match="index < i"):
        children([-1, -2])
    with pytest.raises(ValueError, match="1-D"):
        ancestor_mask(np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="integers"):
        children(np.array([-1.0]))


# ---------------------------------------------------------------------------------------
# Input validation of the builders
# ---------------------------------------------------------------------------------------

LOGITS = np.zeros((2, 3, 5), dtype=np.float32)
BUILDERS = [build_dart_trees, build_ddtree_trees, build_chain_trees]


@pytest.mark.parametrize("build", BUILDERS)
def test_builders_reject_bad_draft_inputs(build):
    with pytest.raises(ValueError, match=r"\[B, D, V\]"):
        build(logits=np.zeros((3, 5), np.float32))
    with pytest.raises(ValueError, match="D >= 1"):
        build(logits=np.zeros((1, 0, 5), np.float32))
    with pytest.raises(ValueError, match="at least one candidate"):
        build(logits=np.zeros((1, 2, 0), np.float32))
    with pytest.raises(ValueError, match="real numbers"):
        build(logits=np.zeros((1, 2, 3), np.complex64))
    with pytest.raises(ValueError, match="either"):
        build(logits=LOGITS, topk_ids=np.zeros((2, 3, 1), np.int32), topk_values=np.zeros((2, 3, 1)))
    with pytest.raises(ValueError, match="both topk_ids and topk_values"):
        build(topk_ids=np.zeros((2, 3, 1), np.int32))
    with pytest.raises(ValueError, match="differs from topk_values shape"):
        build(topk_ids=np.zeros((2, 3, 2), np.int32), topk_values=np.zeros((2, 3, 1)))
    with pytest.raises(ValueError, match="integer token ids"):
        build(topk_ids=np.zeros((2, 3, 1)), topk_values=np.zeros((2, 3, 1)))
    with pytest.raises(ValueError, match="outside"):
        build(topk_ids=np.full((2, 3, 1), -1), topk_values=np.zeros((2, 3, 1)))
    with pytest.raises(ValueError, match="outside"):
        build(topk_ids=np.full((2, 3, 1), 7), topk_values=np.zeros((2, 3, 1)), vocab_size=7)
    with pytest.raises(ValueError, match="outside"):
        build(topk_ids=np.full((2, 3, 1), 2**40), topk_values=np.zeros((2, 3, 1)))
    with pytest.raises(ValueError, match=r"topk_ids\[1, 2\] holds token id 3 twice"):
        ids = np.tile(np.arange(2), (2, 3, 1))
        ids[1, 2] = [3, 3]
        build(topk_ids=ids, topk_values=np.zeros((2, 3, 2)))
    with pytest.raises(ValueError, match="vocab_size 4 differs"):
        build(logits=LOGITS, vocab_size=4)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        build(logits=LOGITS, budget=-1)
    with pytest.raises(TypeError, match="budget must be an integer"):
        build(logits=LOGITS, budget=2.5)
    with pytest.raises(ValueError, match="eos_ids"):
        build(logits=LOGITS, eos_ids=[-1])


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize(("value", "message"), [(np.nan, "NaN"), (np.inf, r"\+inf")])
def test_builders_reject_nan_and_positive_infinity(build, value, message):
    logits = LOGITS.copy()
    logits[1, 2, 3] = value
    with pytest.raises(ValueError, match=rf"logits\[1, 2\] contains {message}"):
        build(logits=logits)
    values = np.zeros((2, 3, 2), np.float32)
    values[0, 1, 1] = value
    with pytest.raises(ValueError, match=rf"topk_values\[0, 1\] contains {message}"):
        build(topk_ids=np.tile(np.arange(2), (2, 3, 1)), topk_values=values)


@pytest.mark.parametrize("build", BUILDERS)
def test_builders_reject_rows_without_a_finite_value(build):
    logits = LOGITS.copy()
    logits[0, 1] = -np.inf
    with pytest.raises(ValueError, match=r"logits\[0, 1\] has only -inf values"):
        build(logits=logits)


@pytest.mark.parametrize("build", BUILDERS)
def test_builders_accept_other_dtypes(build):
    ids = np.tile(np.arange(3, dtype=np.uint16), (1, 2, 1))
    values = np.array([[[0.0, -1.0, -2.0], [-0.5, 0.0, -3.0]]], dtype=np.float64)
    a = build(topk_ids=ids, topk_values=values)
    b = build(topk_ids=ids.astype(np.int32), topk_values=values.astype(np.float32))
    np.testing.assert_array_equal(a[0].tokens, b[0].tokens)
    c = build(logits=values.astype(np.float16))
    c[0].validate()


def test_dart_specific_validation():
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        build_dart_trees(logits=LOGITS, top_k=0)
    with pytest.raises(ValueError, match="beam_width must be >= 1"):
        build_dart_trees(logits=LOGITS, beam_width=0)
    with pytest.raises(ValueError, match="draft_decay must be >= 0"):
        build_dart_trees(logits=LOGITS, draft_decay=-0.1)
    with pytest.raises(ValueError, match="ngram_weight must be >= 0"):
        build_dart_trees(logits=LOGITS, ngram_weight=-1)
    with pytest.raises(ValueError, match="depth_decay must be finite"):
        build_dart_trees(logits=LOGITS, depth_decay=float("nan"))
    scorer = _core._DictScorer(3, {(1,): 1})
    with pytest.raises(ValueError, match="contexts are required"):
        build_dart_trees(logits=LOGITS, scorer=scorer)
    with pytest.raises(ValueError, match="got 1 contexts for a batch of 2"):
        build_dart_trees(logits=LOGITS, scorer=scorer, contexts=[[1]])
    with pytest.raises(ValueError, match="got 3 contexts for a batch of 2"):
        build_dart_trees(logits=LOGITS, contexts=[[1], [], []])
    with pytest.raises(ValueError, match=r"contexts\[1\] holds token id 5 outside \[0, 5\)"):
        build_dart_trees(logits=LOGITS, scorer=scorer, contexts=[[1], [5]])
    with pytest.raises(ValueError, match=r"contexts\[0\] must hold integer"):
        build_dart_trees(logits=LOGITS, scorer=scorer, contexts=[[1.5], [1]])
    with pytest.raises(ValueError, match=r"contexts\[0\] must be 1-D"):
        build_dart_trees(logits=LOGITS, scorer=scorer, contexts=[np.zeros((2, 2), np.int32), [1]])
    # Only the used tail (n - 1 = 2 tokens) is checked: old out-of-range ids are ignored.
    build_dart_trees(logits=LOGITS, scorer=scorer, contexts=[[99, 1, 2], np.array([], np.int64)])


def test_ddtree_specific_validation():
    with pytest.raises(ValueError, match="values must be"):
        build_ddtree_trees(logits=LOGITS, values="probs")
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        build_ddtree_trees(logits=LOGITS, top_k=0)


def test_builders_release_the_gil_and_are_thread_safe():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, 6, 500)).astype(np.float32)
    want = build_dart_trees(logits=logits)
    results = [None] * 4

    def work(i):
        results[i] = build_dart_trees(logits=logits)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in results:
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a.tokens, b.tokens)


# ---------------------------------------------------------------------------------------
# Test-only dict scorer vs the NgramScorer contract
# ---------------------------------------------------------------------------------------


def reference_probs(counts: dict, order: int, context: list[int], candidates: list[int]) -> list[float]:
    """Longest matching suffix (at most n - 1 tokens, at least 1) decides each candidate."""
    out = [0.0] * len(candidates)
    longest = min(len(context), order - 1)
    for length in range(longest, 0, -1):
        suffix = tuple(context[len(context) - length :])
        total = counts.get(suffix, 0)
        if total == 0:
            continue
        for i, t in enumerate(candidates):
            if out[i] == 0.0 and counts.get((*suffix, t), 0) > 0:
                out[i] = float(np.float32(counts[(*suffix, t)] / total))
    return out


@settings(max_examples=examples(100), deadline=None)
@given(
    st.integers(1, 4),
    st.lists(st.integers(0, 5), max_size=40),
    st.lists(st.integers(0, 5), max_size=6),
    st.lists(st.integers(0, 6), max_size=7),
)
def test_dict_scorer_follows_the_ngram_scorer_contract(order, corpus, context, candidates):
    counts: dict = {}
    for n in range(1, order + 1):
        for i in range(len(corpus) - n + 1):
            key = tuple(corpus[i : i + n])
            counts[key] = counts.get(key, 0) + 1
    scorer = _core._DictScorer(order, counts)
    assert scorer.order == order
    got = ngram_probs(scorer, context, candidates)
    assert got.dtype == np.float32
    assert got.tolist() == reference_probs(counts, order, context, candidates)


# ---------------------------------------------------------------------------------------
# Per-sequence depth limits and the positional (hot-path) call form
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("build", BUILDERS)
def test_max_depths_equal_building_on_fewer_positions(build):
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, 5, 9)).astype(np.float32)
    caps = [0, 1, 3, 9]
    capped = build(logits=logits, max_depths=caps, budget=30)
    for b, cap in enumerate(caps):
        if cap == 0:
            assert capped[b].size == 0
            continue
        (want,) = build(logits=logits[b : b + 1, :cap], budget=30)
        np.testing.assert_array_equal(capped[b].tokens, want.tokens)
        np.testing.assert_array_equal(capped[b].parents, want.parents)
        np.testing.assert_array_equal(capped[b].scores, want.scores)
    # Rows past a sequence's limit are never read, so NaN there is not an error.
    logits[0, 1:] = np.nan
    build(logits=logits, max_depths=[1, 5, 5, 5])
    with pytest.raises(ValueError, match="max_depths must be 4 integers"):
        build(logits=logits, max_depths=[1, 2])
    with pytest.raises(ValueError, match="max_depths must be >= 0"):
        build(logits=logits, max_depths=[1, 2, -1, 0])


def test_positional_topk_form():
    """The decoding engine passes (ids, values[, contexts, scorer]) positionally."""
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, 4, 30)).astype(np.float32)
    ids = np.argsort(-logits, axis=-1)[..., :6].astype(np.int32)
    values = np.take_along_axis(logits, ids, axis=-1)
    logprobs = values - np.log(np.exp(logits).sum(-1, keepdims=True))
    scorer = _core._DictScorer(2, {(1,): 2, (1, 2): 2})
    contexts = [np.array([1], np.int32), np.array([3, 1], np.int32)]
    for tree in build_dart_trees(ids, values, contexts, scorer, budget=10):
        tree.validate()
        assert tree.size == 10
    for tree in build_ddtree_trees(ids, logprobs, budget=10):
        tree.validate()
        assert tree.size == 10
    with pytest.raises(ValueError, match='pass values="logits"'):
        build_ddtree_trees(ids, values + 5.0)
    for tree in build_chain_trees(ids[..., :1], values[..., :1]):
        np.testing.assert_array_equal(tree.scores, 0.0)


def test_one_validator_with_two_levels():
    """`check_tree` checks what verification relies on for every tree the engine is handed, and
    with canonical=True (`DraftTree.validate`) also the order every builder promises."""
    from ngram_native.trees import check_tree

    twins = DraftTree(np.array([1, 1], np.int64), np.array([-1, -1], np.int64), np.array([1, 1], np.int64))
    assert check_tree(twins) == 2  # any integer dtype, repeated siblings: a walk still works
    with pytest.raises(ValueError, match="int32"):
        check_tree(twins, canonical=True)
    with pytest.raises(ValueError, match="same token"):
        DraftTree(*(a.astype(np.int32) for a in (twins.tokens, twins.parents, twins.depths))).validate()
    with pytest.raises(ValueError, match=r"trees\[3\]: node 0 has token 9 outside \[0, 5\)"):
        check_tree(DraftTree(*(np.array([v], np.int32) for v in (9, -1, 1))), vocab_size=5, name="trees[3]")
    with pytest.raises(ValueError, match="scores has shape"):
        DraftTree(*(np.array([v], np.int32) for v in (1, -1, 1)), np.zeros(2)).validate()
