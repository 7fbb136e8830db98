"""The context index (prompt lookup drafting) against a brute-force Python reference.

The reference rescans the whole sequence for every query, so it states the rules plainly: the
longest suffix match, its occurrences most recent first, the continuation trie with counts, the
best `budget` nodes by (count desc, depth asc, most recent occurrence first), in canonical order.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_native import ContextIndex, DraftTree, build_lookup_trees
from tests.hypothesis_budget import examples


def reference_match(seq: list[int], min_match: int, max_match: int, max_occ: int) -> tuple[int, list[int]]:
    n = len(seq)
    for length in range(min(max_match, n - 1), min_match - 1, -1):
        suffix = seq[n - length:]
        ends = [e for e in range(n - 1, length - 1, -1) if seq[e - length:e] == suffix]
        if ends:
            return length, ends[:max_occ]
    return 0, []


def reference_tree(seq, cap, *, min_match, max_match, budget, depth_factor, max_occ, eos=()) -> DraftTree:
    length, ends = reference_match(seq, min_match, max_match, max_occ)
    depth = min(cap, math.floor(depth_factor * length))
    nodes: dict[tuple[int, ...], list[int]] = {}  # path -> [count, first occurrence]
    if length and depth > 0:
        for o, e in enumerate(ends):
            path: tuple[int, ...] = ()
            for token in seq[e:min(e + depth, len(seq))]:
                path = (*path, token)
                nodes.setdefault(path, [0, o])[0] += 1
                if token in eos:
                    break
    kept = sorted(nodes, key=lambda p: (-nodes[p][0], len(p), nodes[p][1]))[:budget]
    # Canonical order: by depth, then parent's index, then score desc, token asc.
    index: dict[tuple[int, ...], int] = {}
    out = []
    for depth_ in range(1, max((len(p) for p in kept), default=0) + 1):
        level = [p for p in kept if len(p) == depth_]
        level.sort(key=lambda p: (index.get(p[:-1], -1), -nodes[p][0], p[-1]))
        for p in level:
            index[p] = len(out)
            out.append((p[-1], index.get(p[:-1], -1), depth_, math.log(nodes[p][0] / len(ends))))
    cols = list(zip(*out)) or [(), (), (), ()]
    return DraftTree(*(np.asarray(c, np.int32) for c in cols[:3]), np.asarray(cols[3], np.float64))


def assert_same_tree(got: DraftTree, want: DraftTree) -> None:
    got.validate()
    for name in ("tokens", "parents", "depths"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    np.testing.assert_allclose(got.scores, want.scores, rtol=0, atol=1e-12)


# Few distinct tokens make repeats (and so matches) common.
streams = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=12), min_size=1, max_size=8)


@settings(max_examples=examples(150), deadline=None)
@given(chunks=streams, min_match=st.integers(1, 3), extra=st.integers(0, 4), max_occ=st.integers(1, 6),
       budget=st.integers(0, 12), cap=st.integers(0, 9), depth_factor=st.sampled_from([0.5, 1.0, 2.5, 4.0]),
       eos=st.sampled_from([(), (3,)]))
def test_index_and_trees_equal_the_reference(chunks, min_match, extra, max_occ, budget, cap, depth_factor, eos):
    max_match = min_match + extra
    index = ContextIndex(min_match=min_match, max_match=max_match)
    seq: list[int] = []
    for chunk in chunks:  # a query after every append: the index is incremental
        index.append(chunk)
        seq += chunk
        assert len(index) == len(seq) and index.tokens().tolist() == seq
        length, ends = index.match(max_occ)
        assert (length, ends.tolist()) == reference_match(seq, min_match, max_match, max_occ)
        tree, = build_lookup_trees([index], [cap], budget=budget, depth_factor=depth_factor,
                                   max_occurrences=max_occ, eos_ids=eos)
        assert_same_tree(tree, reference_tree(seq, cap, min_match=min_match, max_match=max_match, budget=budget,
                                              depth_factor=depth_factor, max_occ=max_occ, eos=eos))
        assert tree.size <= budget and tree.depths.max(initial=0) <= min(cap, depth_factor * length)


def test_a_batch_gets_one_tree_per_index_with_its_own_depth_cap():
    text = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
    indexes = [ContextIndex(text), ContextIndex([1, 2, 3]), ContextIndex(text)]
    trees = build_lookup_trees(indexes, [8, 8, 2], budget=16)
    assert trees[0].tokens.tolist() == [8, 9, 10, 11, 5, 6, 7]  # match "5 6 7" (L = 3), one occurrence
    assert trees[0].parents.tolist() == [-1, 0, 1, 2, 3, 4, 5]
    np.testing.assert_allclose(trees[0].scores, 0.0)
    assert trees[1].size == 0  # no repeat, no draft
    assert trees[2].tokens.tolist() == [8, 9]
    assert build_lookup_trees([], [], budget=4) == []


def test_repeated_continuations_vote_and_recent_ones_win_ties():
    #          a  b  X ... a  b  Y ... a  b  X ... a  b
    seq = [1, 2, 7, 0, 1, 2, 8, 0, 1, 2, 7, 0, 1, 2]
    tree, = build_lookup_trees([ContextIndex(seq, min_match=2, max_match=2)], [1], budget=4)
    assert tree.tokens.tolist() == [7, 8]  # 7 twice, 8 once
    np.testing.assert_allclose(tree.scores, np.log([2 / 3, 1 / 3]))
    tree, = build_lookup_trees([ContextIndex(seq, min_match=2, max_match=2)], [1], budget=1)
    assert tree.tokens.tolist() == [7]
    seq = [1, 2, 7, 0, 1, 2, 8, 0, 1, 2]  # one each: the most recent (8) is kept under budget 1
    tree, = build_lookup_trees([ContextIndex(seq, min_match=2, max_match=2)], [1], budget=1)
    assert tree.tokens.tolist() == [8]


def test_long_contexts_stay_exact_and_bounded():
    rng = np.random.default_rng(0)
    block = rng.integers(0, 50_000, 300)
    seq = np.concatenate([rng.integers(0, 50_000, 5000), block, rng.integers(0, 50_000, 5000), block[:40]])
    index = ContextIndex(seq, max_match=8)
    length, ends = index.match()
    assert (length, ends.tolist()) == (8, [5040])  # the first copy of the block, amid 10k other tokens
    tree, = build_lookup_trees([index], [32], budget=64)
    assert tree.tokens.tolist() == block[40:72].tolist()
    small = ContextIndex([1, 2, 3], max_tokens=4)
    small.append([4])
    with pytest.raises(ValueError, match="context index is full: 4 \\+ 1 tokens > max_tokens 4"):
        small.append([5])


def test_bad_input_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="token id -1 outside"):
        ContextIndex([1, -1])
    index = ContextIndex([1, 2])
    with pytest.raises(ValueError, match="at least one token"):
        index.append([])
    with pytest.raises(ValueError, match="must be 1-D"):
        index.append([[1, 2]])
    with pytest.raises(ValueError, match="integer token ids"):
        index.append([1.5])
    with pytest.raises(ValueError, match="max_match must be >= 3"):
        ContextIndex(min_match=3, max_match=2)
    with pytest.raises(ValueError, match="min_match must be >= 1"):
        ContextIndex(min_match=0)
    with pytest.raises(ValueError, match=r"max_depths must be 1 integers"):
        build_lookup_trees([index], [1, 2])
    with pytest.raises(ValueError, match="max_depths must be >= 0"):
        build_lookup_trees([index], [-1])
    with pytest.raises(ValueError, match="max_depths is required"):
        build_lookup_trees([index], None)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        build_lookup_trees([index], [1], budget=-1)
    with pytest.raises(ValueError, match="depth_factor must be finite and > 0"):
        build_lookup_trees([index], [1], depth_factor=float("nan"))
    with pytest.raises(TypeError, match=r"indexes\[0\] must be a ContextIndex"):
        build_lookup_trees([[1, 2]], [1])
    assert len(index) == 2  # refused appends left the index as it was
