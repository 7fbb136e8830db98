"""The C++ tree merge (`ngram_native.trees.merge_trees`) equals its pure-Python definition exactly.

tests/tree_reference.py holds the definition (the merge as first written, in Python); here random
trees - small vocabularies so that the two trees share paths, few distinct scores so that keys tie,
-0.0 next to 0.0, infinities, trees without scores or sources, empty trees, budgets from 0 to past
the union - go through both, and every output array must be equal (scores bit for bit). Also:
trees from the real builders, the errors, and `graft`'s shortcuts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_native.builders import build_dart_trees, build_ddtree_trees
from ngram_native.trees import SOURCE_CONTEXT, SOURCE_HEAD, DraftTree, graft, merge_trees
from tests.hypothesis_budget import examples
from tests.tree_reference import merge_trees_reference

SCORES = st.one_of(
    st.sampled_from([0.0, -0.0, -0.5, -1.0, -2.0, -math.inf]),  # ties, signed zeros, -inf
    st.floats(-30.0, 0.0),
    st.floats(allow_nan=False),  # anything but NaN, +inf included
)
SOURCES = st.sampled_from([0, 1, 2, 4, 3, 7])


def assert_same_tree(got: DraftTree, want: DraftTree) -> None:
    for name in ("tokens", "parents", "depths", "scores", "sources"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        if name == "scores":  # bit for bit: -0.0 is not 0.0 here
            assert g.view(np.uint64).tolist() == w.view(np.uint64).tolist(), (g, w)
        else:
            assert g.tolist() == w.tolist(), (name, g, w)


def canonical(parents: list[int], tokens: list[int], scores: list[float] | None,
              sources: list[int] | None) -> DraftTree:
    """Topological nodes (unique siblings) -> a DraftTree in canonical order."""
    n = len(tokens)
    depth = [0] * n
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    rank = scores if scores is not None else [0.0] * n
    new, order = {}, []
    for d in range(1, max(depth, default=0) + 1):
        level = sorted((i for i in range(n) if depth[i] == d),
                       key=lambda i: (new.get(parents[i], -1), -rank[i], tokens[i]))
        for i in level:
            new[i] = len(order)
            order.append(i)
    return DraftTree(np.array([tokens[i] for i in order], np.int32),
                     np.array([new[parents[i]] if parents[i] >= 0 else -1 for i in order], np.int32),
                     np.array([depth[i] for i in order], np.int32),
                     None if scores is None else np.array([scores[i] for i in order], np.float64),
                     None if sources is None else np.array([sources[i] for i in order], np.uint8))


@st.composite
def trees(draw, max_size: int = 20, structure: DraftTree | None = None) -> DraftTree:
    """A random tree over a 3-token vocabulary: canonical (unique siblings, sorted) or, sometimes,
    merely topological with repeated siblings (the merge accepts any topological tree). With
    `structure`, that tree's tokens and parents with fresh scores and sources (every path shared)."""
    if structure is not None:
        parents, tokens = structure.parents.tolist(), structure.tokens.tolist()
        is_canonical = True
    else:
        is_canonical = draw(st.booleans()) or draw(st.booleans())
        parents, tokens, seen = [], [], set()
        for _ in range(draw(st.integers(0, max_size))):
            parent = draw(st.integers(-1, len(tokens) - 1))
            token = draw(st.integers(0, 2))
            if is_canonical and (parent, token) in seen:
                continue
            seen.add((parent, token))
            parents.append(parent)
            tokens.append(token)
    n = len(tokens)
    scores = draw(st.none() | st.lists(SCORES, min_size=n, max_size=n))
    sources = draw(st.none() | st.lists(SOURCES, min_size=n, max_size=n))
    if is_canonical:
        return canonical(parents, tokens, scores, sources)
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return DraftTree(np.array(tokens, np.int32), np.array(parents, np.int32), np.array(depth, np.int32),
                     None if scores is None else np.array(scores, np.float64),
                     None if sources is None else np.array(sources, np.uint8))


@st.composite
def tree_pairs(draw) -> tuple[DraftTree, DraftTree, int]:
    first = draw(trees())
    second = draw(trees(structure=first) if first.size and draw(st.integers(0, 4)) == 0 else trees())
    total = first.size + second.size
    budget = draw(st.integers(0, total + 2) | st.sampled_from([0, 1, total, 10**6]))
    return first, second, budget


@settings(max_examples=examples(600), deadline=None)
@given(tree_pairs())
def test_merge_equals_the_python_reference(pair):
    first, second, budget = pair
    got = merge_trees(first, second, budget)
    assert_same_tree(got, merge_trees_reference(first, second, budget))
    got.validate()  # canonical, whatever order the inputs were in
    assert_same_tree(merge_trees(second, first, budget), merge_trees_reference(second, first, budget))


@pytest.mark.parametrize("budget", [0, 7, 32, 60, 90, 200])
def test_merge_of_builder_trees_equals_the_reference(budget):
    """The default mode's shape: a DART tree and a smaller tree of the same root sharing paths."""
    rng = np.random.default_rng(budget)
    logits = (3.0 * rng.normal(size=(4, 6, 50))).astype(np.float32)
    dart = build_dart_trees(logits=logits, budget=60)
    ddtree = build_ddtree_trees(logits=logits + rng.normal(size=logits.shape).astype(np.float32), budget=20)
    for model, lookup in zip(dart, ddtree, strict=True):
        model, lookup = model.from_source(SOURCE_HEAD), lookup.from_source(SOURCE_CONTEXT)
        for a, b in ((model, lookup), (lookup, model), (model, model)):
            assert_same_tree(merge_trees(a, b, budget), merge_trees_reference(a, b, budget))


def test_output_dtypes_and_empty_inputs():
    empty = DraftTree(*(np.zeros(0, np.int32) for _ in range(3)))
    out = merge_trees(empty, empty, 5)
    assert out.size == 0
    assert [a.dtype for a in (out.tokens, out.parents, out.depths, out.scores, out.sources)] == [
        np.int32, np.int32, np.int32, np.float64, np.uint8]
    chain = DraftTree(np.array([4, 5], np.int64), np.array([-1, 0], np.int64), np.array([1, 2], np.int64),
                      np.array([-1.0, -2.0], np.float32))  # other dtypes are converted
    assert_same_tree(merge_trees(chain, empty, 1), merge_trees_reference(chain, empty, 1))


def test_merge_rejects_bad_input():
    tree = DraftTree(np.array([1, 2], np.int32), np.array([-1, 0], np.int32), np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="budget must be >= 0"):
        merge_trees(tree, tree, -1)
    with pytest.raises(TypeError):
        merge_trees(tree, tree, 2.5)
    loop = DraftTree(np.array([1, 2], np.int32), np.array([-1, 1], np.int32), np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="node 1 has parent 1"):
        merge_trees(tree, loop, 4)
    nan = DraftTree(tree.tokens, tree.parents, tree.depths, np.array([0.0, np.nan]))
    with pytest.raises(ValueError, match="NaN"):
        merge_trees(nan, tree, 4)
    short = DraftTree(tree.tokens, tree.parents[:1], tree.depths)
    with pytest.raises(ValueError, match="one length"):
        merge_trees(tree, short, 4)


def test_graft_returns_either_tree_alone_when_the_other_is_empty():
    tree = canonical([-1, 0, -1], [3, 4, 5], [-0.5, -1.0, -2.0], None)
    empty = DraftTree(*(np.zeros(0, np.int32) for _ in range(3)))
    assert graft(tree, empty, 1) is tree  # uncut: the drafter's own budget already applied
    assert graft(empty, tree, 1) is tree
    assert_same_tree(graft(tree, tree, 2), merge_trees_reference(tree, tree, 2))
