"""Pure-Python definitions of the tree operations that run in C++ (ngram_native.trees), for tests.

`merge_trees_reference` is the merge as it was first written (ngram_native/merge.py, before it
moved to C++): paths as tuple-keyed dicts, every rule spelled out in a line or two. It is slow
(13-19 times the C++ per round, docs/benchmarks.md), so it is kept only as the definition the C++
`ngram_native.trees.merge_trees` must equal exactly (tests/test_tree_merge.py) and as the
baseline of its micro-benchmark (`python -m jobs.bench tree_merge`).
"""

from __future__ import annotations

import numpy as np

from ngram_native.trees import DraftTree


def merge_trees_reference(first: DraftTree, second: DraftTree, budget: int) -> DraftTree:
    """The best `budget` nodes of the union of two trees (same root), in canonical order: the union
    merged as a trie, a path's score the best either tree gave it (missing: 0), ranked by key =
    min(score, parent's key), then depth, then path; output scores are the keys.

    Node sources (`DraftTree.sources` bits) are merged too: a path both trees hold carries both.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    best: dict[tuple[int, ...], float] = {}
    origin: dict[tuple[int, ...], int] = {}
    for tree in (first, second):
        paths: list[tuple[int, ...]] = []
        scores = tree.scores if tree.scores is not None else np.zeros(tree.size)
        sources = tree.sources.tolist() if tree.sources is not None else [0] * tree.size
        for token, parent, score, source in zip(tree.tokens.tolist(), tree.parents.tolist(), scores.tolist(),
                                                sources):
            path = (*(paths[parent] if parent >= 0 else ()), token)
            paths.append(path)
            best[path] = max(best.get(path, -np.inf), score)
            origin[path] = origin.get(path, 0) | source
    key: dict[tuple[int, ...], float] = {}
    for path in sorted(best, key=len):  # parents first
        key[path] = min(best[path], key[path[:-1]]) if len(path) > 1 else best[path]
    kept = sorted(best, key=lambda p: (-key[p], len(p), p))[:budget]
    index: dict[tuple[int, ...], int] = {}
    tokens, parents, depths, out_scores, out_sources = [], [], [], [], []
    for depth in range(1, max(map(len, kept), default=0) + 1):
        level = sorted((p for p in kept if len(p) == depth), key=lambda p: (index.get(p[:-1], -1), -key[p], p[-1]))
        for path in level:
            index[path] = len(tokens)
            tokens.append(path[-1])
            parents.append(index.get(path[:-1], -1))
            depths.append(depth)
            out_scores.append(key[path])
            out_sources.append(origin[path])
    return DraftTree(np.asarray(tokens, np.int32), np.asarray(parents, np.int32), np.asarray(depths, np.int32),
                     np.asarray(out_scores, np.float64), np.asarray(out_sources, np.uint8))
