"""TreeBatch: padded tokens/depths/validity and the ancestor-only attention mask.

The reference is the ancestor relation computed naively, by walking parent pointers node by
node; padding must never change what a real row computes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_worker.target.tree_batch import TreeBatch
from ngram_native.trees import DraftTree, ancestor_mask, check_tree
from tests.hypothesis_budget import examples


def make_tree(tokens, parents):
    """A tree from tokens and parents (topological order); depths derived."""
    parents = np.asarray(parents, dtype=np.int32)
    depths = np.zeros(len(parents), dtype=np.int32)
    for i, p in enumerate(parents):
        depths[i] = 1 if p < 0 else depths[p] + 1
    return DraftTree(tokens=np.asarray(tokens, dtype=np.int32), parents=parents, depths=depths)


def random_tree(rng: np.random.Generator, vocab: int, max_depth: int, max_children: int,
                min_children: int = 0):
    """Canonical-order random tree: by depth, then parent, siblings with distinct tokens."""
    tokens: list[int] = []
    parents: list[int] = []
    frontier = [-1]
    for _ in range(max_depth):
        next_frontier = []
        for parent in frontier:
            k = int(rng.integers(min_children, max_children + 1))
            for token in rng.choice(vocab, size=k, replace=False):
                tokens.append(int(token))
                parents.append(parent)
                next_frontier.append(len(tokens) - 1)
        frontier = next_frontier
    return make_tree(tokens, parents)


@st.composite
def trees(draw, vocab: int = 16, max_depth: int = 4, max_children: int = 3):
    """Hypothesis strategy for canonical-order trees (possibly empty)."""
    tokens: list[int] = []
    parents: list[int] = []
    frontier = [-1]
    for _ in range(draw(st.integers(0, max_depth))):
        next_frontier = []
        for parent in frontier:
            k = draw(st.integers(0, max_children))
            for token in draw(st.lists(st.integers(0, vocab - 1), min_size=k, max_size=k, unique=True)):
                tokens.append(token)
                parents.append(parent)
                next_frontier.append(len(tokens) - 1)
        frontier = next_frontier
    return make_tree(tokens, parents)


def naive_ancestor(parents) -> np.ndarray:
    """[N+1, N+1] with row 0 = root: row r sees column c iff c is r or an ancestor of r."""
    n = len(parents)
    mask = np.zeros((n + 1, n + 1), dtype=bool)
    for r in range(n + 1):
        mask[r, r] = True
        mask[r, 0] = True
        node = r - 1
        while node >= 0:
            mask[r, node + 1] = True
            node = int(parents[node])
    return mask


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(trees(), min_size=1, max_size=5), st.integers(0, 3), st.data())
def test_batch_matches_naive_ancestor_relation(tree_list, extra_pad, data):
    roots = data.draw(st.lists(st.integers(0, 99), min_size=len(tree_list), max_size=len(tree_list)))
    width = 1 + max(len(t.tokens) for t in tree_list) + extra_pad
    batch = TreeBatch.from_trees(roots, tree_list, "cpu", pad_to=width, pad_token_id=7)

    assert batch.tokens.shape == (len(tree_list), width)
    assert batch.ancestor.shape == (len(tree_list), width, width)
    assert batch.num_nodes == tuple(len(t.tokens) for t in tree_list)
    for b, tree in enumerate(tree_list):
        n = len(tree.tokens)
        assert batch.tokens[b, 0] == roots[b]
        assert batch.tokens[b, 1 : n + 1].tolist() == tree.tokens.tolist()
        assert (batch.tokens[b, n + 1 :] == 7).all()
        assert batch.depth[b, 0] == 0
        assert batch.depth[b, 1 : n + 1].tolist() == tree.depths.tolist()
        assert batch.valid[b].tolist() == [True] * (n + 1) + [False] * (width - n - 1)
        mask = batch.ancestor[b].numpy()
        np.testing.assert_array_equal(mask[: n + 1, : n + 1], naive_ancestor(tree.parents))
        # real rows never see padding; padding rows see exactly themselves
        assert not mask[: n + 1, n + 1 :].any()
        np.testing.assert_array_equal(mask[n + 1 :], np.eye(width, dtype=bool)[n + 1 :])
        # a row's number of visible columns is its depth + 1 (itself and every ancestor)
        np.testing.assert_array_equal(mask[: n + 1].sum(1), batch.depth[b, : n + 1].numpy() + 1)


def test_matches_ngram_native_ancestor_mask():
    rng = np.random.default_rng(0)
    for _ in range(20):
        tree = random_tree(rng, vocab=10, max_depth=4, max_children=3)
        batch = TreeBatch.from_trees([1], [tree], "cpu")
        np.testing.assert_array_equal(batch.ancestor[0].numpy(), ancestor_mask(tree.parents))


def test_padding_rows_do_not_change_real_rows():
    """Attention over a tree alone equals its rows inside a padded batch; no NaN anywhere."""
    rng = np.random.default_rng(1)
    small = random_tree(rng, vocab=10, max_depth=2, max_children=2, min_children=1)
    large = random_tree(rng, vocab=10, max_depth=3, max_children=3, min_children=2)
    alone = TreeBatch.from_trees([3], [small], "cpu")
    padded = TreeBatch.from_trees([3, 4], [small, large], "cpu", pad_to=len(large.tokens) + 5)
    n = len(small.tokens)

    gen = torch.Generator().manual_seed(0)
    width = padded.seq_len
    q, k, v = (torch.randn(2, 1, width, 8, generator=gen) for _ in range(3))
    out_padded = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=padded.ancestor[:, None])
    out_alone = torch.nn.functional.scaled_dot_product_attention(
        q[:1, :, : n + 1], k[:1, :, : n + 1], v[:1, :, : n + 1], attn_mask=alone.ancestor[:, None]
    )
    assert torch.isfinite(out_padded).all()
    torch.testing.assert_close(out_padded[:1, :, : n + 1], out_alone)


def test_empty_trees_and_root_tensor():
    empty = make_tree([], [])
    batch = TreeBatch.from_trees(torch.tensor([5, 6]), [empty, make_tree([1], [-1])], "cpu")
    assert batch.num_nodes == (0, 1)
    assert batch.seq_len == 2
    assert batch.tokens.tolist() == [[5, 0], [6, 1]]
    assert batch.ancestor.tolist() == [[[True, False], [False, True]], [[True, False], [True, True]]]
    assert batch.tokens.dtype == torch.int64 and batch.depth.dtype == torch.int64
    assert batch.valid.dtype == torch.bool and batch.ancestor.dtype == torch.bool


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (DraftTree(np.array([1, 2]), np.array([-1, 1]), np.array([1, 2])), "node 1 has parent 1"),
        (DraftTree(np.array([1, 2]), np.array([-1, -2]), np.array([1, 1])), "node 1 has parent -2"),
        (DraftTree(np.array([1, 2]), np.array([-1, 0]), np.array([1, 1])), "node 1 has depth 1, expected 2"),
        (DraftTree(np.array([1, 2]), np.array([-1]), np.array([1, 1])), "lengths differ"),
        (DraftTree(np.array([1.0]), np.array([-1]), np.array([1])), "integer array"),
        (DraftTree(np.array([-3]), np.array([-1]), np.array([1])), "token -3 outside"),
    ],
)
def test_bad_trees_are_named(tree, message):
    with pytest.raises(ValueError, match=message):
        check_tree(tree)
    with pytest.raises(ValueError, match=r"trees\[1\]"):
        TreeBatch.from_trees([0, 0], [make_tree([1], [-1]), tree], "cpu")


def test_bad_batch_arguments():
    tree = make_tree([1, 2], [-1, 0])
    with pytest.raises(ValueError, match="2 root tokens for 1 trees"):
        TreeBatch.from_trees([0, 1], [tree], "cpu")
    with pytest.raises(ValueError, match="pad_to=2 is smaller"):
        TreeBatch.from_trees([0], [tree], "cpu", pad_to=2)
    with pytest.raises(ValueError, match="token 2 outside"):
        TreeBatch.from_trees([0], [tree], "cpu", vocab_size=2)
    with pytest.raises(ValueError, match="at least one tree"):
        TreeBatch.from_trees([], [], "cpu")
