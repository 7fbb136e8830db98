"""The draft tree of tree speculative decoding, and every operation on it.

One type, `DraftTree`, carries every draft of every drafter, from the builders
(`ngram_native.builders`: DART, DDTree, chain; `ngram_native.context`: lookup trees) to the
engine's verify block. It is flat arrays in canonical order - by depth, then by parent index,
then siblings by score descending (ties: token id ascending) - so the arrays are topological,
each node's children are contiguous and siblings come in proposal order, which is the order a
verifier tries them in. The root (the last committed token) is not a node: its children have
parent -1 and depth 1.

Everything that reads or reshapes a tree is here, so that the tree's invariants are written
down once, next to the code that relies on them:

- `check_tree`: the one validator (the engine's structural check on every tree it is handed,
  and the full canonical check of `DraftTree.validate` that the tests run);
- `ancestor_mask(s)`, `position_offsets`, `children`: the attention mask, positions and walk
  table every verify derives from the arrays;
- `subtree`: a prefix-closed cut (the tree sizer's);
- `merge_trees` and `graft`: two trees of one root as one (the hybrid modes and the lookup
  drafters' job cache), in C++ because it runs per sequence per round.

    tree.validate()
    mask = tree.ancestor_mask()          # [N + 1, N + 1], index 0 = root
    positions = start + tree.position_offsets()
    child = tree.find_child(-1, token)   # verification walk from the root
    both = merge_trees(model_tree, lookup_tree, budget=60)
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np

from ngram_native import _core

# Where a draft node came from (bit flags; a node two sources proposed carries both), so the
# engine can report how many accepted tokens each source contributed.
SOURCE_HEAD = 1  # the draft head's distributions (chain, ddtree, dart)
SOURCE_CONTEXT = 2  # the request's own text (context lookup)
SOURCE_JOB_CACHE = 4  # earlier rows' finished outputs (the job-level cache of the lookup drafters)
SOURCE_GRAMMAR = 8  # text a request's structured-output grammar allows alone (dart_worker/sampling/grammar.py)
SOURCE_NAMES = {SOURCE_HEAD: "head", SOURCE_CONTEXT: "context", SOURCE_JOB_CACHE: "job_cache",
                SOURCE_GRAMMAR: "grammar"}
# Sources accepted in long runs, unlike a head's one-level-at-a-time drafts: copied earlier text, and
# the text a grammar forces (the deferred greedy walk projects ahead through them).
SOURCE_COPIED = SOURCE_CONTEXT | SOURCE_JOB_CACHE | SOURCE_GRAMMAR


class TreeLike(Protocol):
    """What the engine needs of a draft tree (`DraftTree` satisfies it).

    Arrays of length N in topological order: parents[i] < i, -1 for a child of the root;
    depths are 1-based (a child of the root has depth 1).
    """

    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray


@dataclass(frozen=True, eq=False)
class DraftTree:
    """One flattened draft tree (root excluded), in canonical order.

    tokens, parents, depths: int32 [N]; parents[i] is -1 for children of the root, else an
    earlier index; depths are 1-based. scores: float64 [N], the builder's path score of each
    node (its ranking criterion), or None for hand-made trees.
    """

    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    scores: np.ndarray | None = None
    sources: np.ndarray | None = None  # uint8 [N] SOURCE_* bits per node, or None (not tracked)

    def from_source(self, source: int) -> DraftTree:
        """This tree with every node marked as proposed by `source` (a SOURCE_* bit)."""
        return dataclasses.replace(self, sources=np.full(self.size, source, dtype=np.uint8))

    @property
    def size(self) -> int:
        """Number of nodes N (the root is not counted)."""
        return int(self.tokens.shape[0])

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError unless this is a well-formed tree in canonical order
        (`check_tree(self, canonical=True)`)."""
        check_tree(self, canonical=True, vocab_size=vocab_size)

    @cached_property
    def _children(self) -> tuple[np.ndarray, np.ndarray]:
        return children(self.parents)

    def children(self) -> tuple[np.ndarray, np.ndarray]:
        """CSR child table, see the module-level `children`. Computed once per tree."""
        return self._children

    @cached_property
    def _child_by_token(self) -> dict[tuple[int, int], int]:
        """(parent, token) -> the first such child. A dict, because walks step one token at a
        time from Python, many per round (the lookup payoff's walks,
        `dart_worker.drafters.hybrid.LookupPayoff`), where a numpy scan of the children per step
        costs a call's overhead per step (docs/benchmarks.md)."""
        keys = list(zip(self.parents.tolist(), self.tokens.tolist()))
        return dict(zip(reversed(keys), range(len(keys) - 1, -1, -1)))  # the first child wins

    def find_child(self, node: int, token: int) -> int:
        """Index of the child of `node` (-1 = root) that carries `token`, or -1 if none."""
        return self._child_by_token.get((int(node), int(token)), -1)

    def matched_length(self, continuation: Sequence[int]) -> int:
        """How many tokens of `continuation` (what came after the root) one path of this tree
        spells from the root: the tokens verification accepts when the target commits
        `continuation`, greedy or with coupled sampling (whose draws do not depend on the tree)."""
        return self.walk(continuation)[1]

    def walk(self, continuation: Sequence[int], node: int = -1) -> tuple[int, int]:
        """Follow `continuation` down from `node` (-1 = root) as far as the tree spells it: the node
        reached and how many tokens it matched. A walk resumes from where an earlier one stopped
        when the continuation grows (`dart_worker.drafters.hybrid.LookupPayoff`)."""
        matched = 0
        for token in continuation:
            child = self.find_child(node, int(token))
            if child < 0:
                break
            node, matched = child, matched + 1
        return node, matched

    def ancestor_mask(self) -> np.ndarray:
        """bool [N + 1, N + 1], see the module-level `ancestor_mask`."""
        return ancestor_mask(self.parents)

    def position_offsets(self) -> np.ndarray:
        """int64 [N + 1], see the module-level `position_offsets`."""
        return position_offsets(self.depths)


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------


def check_tree(tree: TreeLike, *, canonical: bool = False, vocab_size: int | None = None,
               name: str = "tree") -> int:
    """Validate `tree` and return its node count N; raise ValueError naming the first offender.

    Always - the invariants masks, positions and verification walks rely on, which the engine
    checks once per tree as it builds the verify block (`dart_worker.target.tree_batch`), so that a
    broken drafter fails loudly there instead of yielding a silently wrong mask or walk:
    tokens, parents, depths are 1-D integer arrays of one length; parents[i] is -1 or an
    earlier index; depth = parent's depth + 1 (1 under the root); tokens lie in
    [0, vocab_size) (or are >= 0 without a vocab_size).

    With `canonical` - what every builder and `merge_trees` promise (`DraftTree.validate`):
    int32 arrays; nodes sorted by depth, then by parent; distinct tokens among siblings;
    scores and sources, where present, one per node; siblings by score descending, ties by
    token id ascending.
    """
    tokens, parents, depths = np.asarray(tree.tokens), np.asarray(tree.parents), np.asarray(tree.depths)
    for label, arr in (("tokens", tokens), ("parents", parents), ("depths", depths)):
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"{name}.{label} must be a 1-D integer array, got {arr.dtype} shape {arr.shape}")
        if canonical and arr.dtype != np.int32:
            raise ValueError(f"{name}.{label} must be a 1-D int32 array, got {arr.dtype}")
    n = tokens.shape[0]
    if parents.shape[0] != n or depths.shape[0] != n:
        raise ValueError(
            f"{name}: tokens/parents/depths lengths differ: {n}/{parents.shape[0]}/{depths.shape[0]}"
        )
    scores = getattr(tree, "scores", None) if canonical else None
    if canonical:
        for label in ("scores", "sources"):
            extra = getattr(tree, label, None)
            if extra is not None and np.shape(extra) != (n,):
                raise ValueError(f"{name}.{label} has shape {np.shape(extra)}, tokens ({n},)")
    if n == 0:
        return 0
    # Called for every tree of every round: whole-array checks first, details only on failure.
    topological = (parents >= -1) & (parents < np.arange(n))
    if not topological.all():
        i = int(np.argmin(topological))
        raise ValueError(
            f"{name}: node {i} has parent {int(parents[i])}; need -1 <= parent < {i} (an earlier index)"
        )
    expected_depth = depths[parents] + 1  # parent -1 reads the last entry; fixed on the next line
    expected_depth[parents < 0] = 1
    depth_ok = depths == expected_depth
    if not depth_ok.all():
        i = int(np.argmin(depth_ok))
        raise ValueError(f"{name}: node {i} has depth {int(depths[i])}, expected {int(expected_depth[i])} "
                         "(parent depth + 1)")
    if tokens.min() < 0 or (vocab_size is not None and tokens.max() >= vocab_size):
        i = int(np.argmax((tokens < 0) | (tokens >= (vocab_size if vocab_size is not None else np.inf))))
        raise ValueError(f"{name}: node {i} has token {int(tokens[i])} outside [0, {vocab_size or 'inf'})")
    if canonical:
        _check_canonical_order(tokens, parents, depths, scores, name)
    return n


def _check_canonical_order(t: np.ndarray, p: np.ndarray, d: np.ndarray, s: np.ndarray | None, name: str) -> None:
    def first_bad(message: str, bad: np.ndarray) -> None:
        hits = np.flatnonzero(bad)
        if hits.shape[0]:
            raise ValueError(f"{name}: node {int(hits[0]) + 1} {message}")

    first_bad("breaks the order: nodes must be sorted by depth", np.diff(d) < 0)
    first_bad("breaks the order: nodes of one depth must be sorted by parent", (d[1:] == d[:-1]) & (p[1:] < p[:-1]))
    pair = (p.astype(np.int64) + 1) * 2**32 + t
    if np.unique(pair).shape[0] != t.shape[0]:
        raise ValueError(f"{name}: two siblings carry the same token")
    if s is not None:
        s = np.asarray(s)
        in_order = (s[:-1] > s[1:]) | ((s[:-1] == s[1:]) & (t[:-1] < t[1:]))
        first_bad("breaks the order: siblings must be sorted by score desc, then token asc",
                  (p[1:] == p[:-1]) & ~in_order)


# ---------------------------------------------------------------------------------------
# Helpers on a flattened tree
# ---------------------------------------------------------------------------------------


def _as_parents(parents: np.ndarray | Sequence[int]) -> np.ndarray:
    p = np.asarray(parents)
    if p.ndim != 1:
        raise ValueError(f"parents must be 1-D, got shape {p.shape}")
    if p.shape[0] and p.dtype.kind not in "iu":
        raise ValueError(f"parents must be integers, got {p.dtype}")
    n = p.shape[0]
    if n and (p.min() < -1 or np.any(p >= np.arange(n))):
        raise ValueError("parents[i] must be -1 (root) or an index < i")
    return np.ascontiguousarray(p, dtype=np.int32)


def ancestor_mask(parents: np.ndarray | Sequence[int]) -> np.ndarray:
    """Tree attention mask: bool [N + 1, N + 1], index 0 = root, node i at i + 1.

    Row r marks r itself and all its ancestors including the root, so a node attends to
    exactly its own path (the committed prefix is handled by the caller).
    """
    p = _as_parents(parents).astype(np.int64)
    parent_row = np.arange(p.shape[0] + 1)
    parent_row[1:] = p + 1
    return ancestor_masks(parent_row[None])[0]


def ancestor_masks(parent_row: np.ndarray) -> np.ndarray:
    """Batched ancestor masks: bool [B, S, S] from parent rows int [B, S].

    `parent_row[b, r]` is the row of r's parent in the same block; a row that points at itself
    (the root, padding) is a fixed point. Row r of the result marks r and every row on its
    parent chain. The one implementation behind every tree mask (`ancestor_mask`, the engine's
    padded verify blocks): parent pointers are chased for all rows of all trees at once, one
    vectorised step per tree level.
    """
    parent_row = np.asarray(parent_row, dtype=np.int64)
    batch, width = parent_row.shape
    mask = np.zeros((batch, width, width), dtype=bool)
    b_index = np.arange(batch)[:, None]
    r_index = np.arange(width)[None, :]
    mask[b_index, r_index, r_index] = True
    cursor = parent_row.copy()
    while True:  # after step k, `cursor` holds each row's k-th ancestor (or a fixed point)
        mask[b_index, r_index, cursor] = True
        following = np.take_along_axis(parent_row, cursor, axis=1)
        if np.array_equal(following, cursor):
            return mask
        cursor = following


def position_offsets(depths: np.ndarray | Sequence[int]) -> np.ndarray:
    """Position offsets int64 [N + 1] relative to the root: 0 for the root, then depths.

    Absolute positions are (root position) + offsets.
    """
    d = np.asarray(depths)
    if d.ndim != 1 or (d.shape[0] and d.dtype.kind not in "iu"):
        raise ValueError(f"depths must be a 1-D integer array, got {d.dtype} shape {d.shape}")
    out = np.zeros(d.shape[0] + 1, dtype=np.int64)
    out[1:] = d
    return out


def children(parents: np.ndarray | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """CSR child table for the verification walk.

    Returns (offsets int64 [N + 2], child_idx int32 [N]): the children of the root are
    child_idx[offsets[0]:offsets[1]], those of node i are child_idx[offsets[i + 1]:
    offsets[i + 2]], in index order - which, for canonical trees, is proposal order.
    """
    p = _as_parents(parents)
    n = p.shape[0]
    offsets = np.zeros(n + 2, dtype=np.int64)
    np.cumsum(np.bincount(p + 1, minlength=n + 1), out=offsets[1:])
    child_idx = np.argsort(p + 1, kind="stable").astype(np.int32)
    return offsets, child_idx


# ---------------------------------------------------------------------------------------
# Cutting and merging trees
# ---------------------------------------------------------------------------------------


def subtree(tree: DraftTree, keep: np.ndarray) -> DraftTree:
    """The nodes where `keep` (bool [N]) is set, which must be prefix-closed, in canonical order.

    A subset of a canonical tree, in its original order, is canonical: depths stay sorted,
    parents keep their relative order and siblings their score order.
    """
    if keep.all():
        return tree
    new_index = np.cumsum(keep) - 1
    parents = tree.parents[keep]
    remapped = np.where(parents >= 0, new_index[np.maximum(parents, 0)], -1).astype(np.int32)
    return DraftTree(tree.tokens[keep], remapped, tree.depths[keep],
                     None if tree.scores is None else tree.scores[keep],
                     None if tree.sources is None else tree.sources[keep])


def graft(first: DraftTree, second: DraftTree, budget: int) -> DraftTree:
    """`second` grafted into `first` (`merge_trees`); either alone, uncut, when the other is empty."""
    if not second.size:
        return first
    if not first.size:
        return second
    return merge_trees(first, second, budget)


def merge_trees(first: DraftTree, second: DraftTree, budget: int) -> DraftTree:
    """The best `budget` nodes of the union of two trees of the same root, in canonical order.

    A model drafter (DART, DDTree) is strong where the text is new, context lookup where it
    repeats; merging the lookup tree into the model's lets one verification try both. The trees
    are merged as tries (a path both hold becomes one node: no duplicate siblings); a node's
    score is the best either tree gave its path (a tree without scores counts 0, which ranks
    first) and its `sources` bits are OR-ed (none: 0). Ranked by key = min(score, parent's
    key) - keys never grow along a path - then depth, then the path's tokens, the best `budget`
    nodes form a prefix-closed tree, whose scores are those keys. Both kinds of builder score on
    a log scale <= 0 (path log-probabilities, ln(count / occurrences), DART's weighted
    log-scores), so comparing them is a heuristic, not a calibrated probability.

    In C++ with the GIL released (it runs per sequence per round); tests/tree_reference.py holds
    the pure-Python definition it is tested against. Raises ValueError for budget < 0, NaN
    scores, or parents that are not -1 or an earlier index.
    """
    budget = operator.index(budget)
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    tokens, parents, depths, scores, sources = _core._merge_trees(
        *_merge_input(first), *_merge_input(second), min(budget, first.size + second.size))
    return DraftTree(tokens, parents, depths, scores, sources)


def _merge_input(tree: DraftTree) -> tuple:
    return (np.ascontiguousarray(tree.tokens, dtype=np.int32), np.ascontiguousarray(tree.parents, dtype=np.int32),
            None if tree.scores is None else np.ascontiguousarray(tree.scores, dtype=np.float64),
            None if tree.sources is None else np.ascontiguousarray(tree.sources, dtype=np.uint8))
