"""`lookup`: drafts from the request's own text (prompt lookup / suffix matching), no model.

Each live sequence owns an `ngram_native.ContextIndex` over its prompt and committed tokens. A
round proposes the continuation trie of the longest earlier match of the sequence's suffix
(`build_lookup_trees`, one C++ call for the batch), so repetitive requests (code edits, quotes,
summaries that copy) get long accepted drafts while a draft costs no forward pass at all. A
sequence with no match proposes an empty tree: that round is a plain decoding step.
`ContextIndexes` is the per-batch state, shared with the hybrid drafters (`hybrid.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dart_worker.drafters.base import CommittedBlock, Drafter
from ngram_native.context import DEFAULT_MAX_MATCH, ContextIndex, build_lookup_trees
from ngram_native.trees import SOURCE_CONTEXT, DraftTree, TreeParams


class ContextIndexes:
    """One `ContextIndex` per live sequence, kept in step with the engine's batch."""

    def __init__(self, tree: TreeParams, eos_token_ids: Sequence[int]):
        self.tree = tree
        self.eos_ids = sorted(int(t) for t in eos_token_ids)
        self.indexes: list[ContextIndex] = []

    def start(self, batch_size: int) -> None:
        self.indexes = [self._new_index() for _ in range(batch_size)]

    def _new_index(self) -> ContextIndex:
        return ContextIndex(min_match=self.tree.lookup_min_match,
                            max_match=max(self.tree.lookup_min_match, DEFAULT_MAX_MATCH))

    def join(self, block: CommittedBlock) -> None:
        self.indexes.extend(self._new_index() for _ in block.rows)
        live = len(self.indexes) - len(block.rows)
        for index, tokens in zip(self.indexes[live:], block.tokens, strict=True):
            index.append(tokens)

    def observe(self, block: CommittedBlock) -> None:
        # block.tokens[b] is all of sequence b so far; the index holds a prefix of it (the prefill
        # block brings the prompt + the first token, a verify block the tokens committed since).
        for index, tokens in zip(self.indexes, block.tokens, strict=True):
            if len(tokens) > len(index):
                index.append(tokens[len(index):])

    def finish(self, tokens: Sequence[Sequence[int]]) -> None:
        """Finished sequences: nothing kept yet (a job-level cache of outputs would read them)."""

    def select(self, keep: torch.Tensor) -> None:
        self.indexes = [self.indexes[b] for b in keep.tolist()]

    def propose(self, tokens: Sequence[Sequence[int]], max_depths: Sequence[int]) -> list[DraftTree]:
        for b, (index, seq) in enumerate(zip(self.indexes, tokens, strict=True)):
            if len(index) != len(seq):
                raise RuntimeError(f"lookup: sequence {b} has {len(seq)} tokens, its index {len(index)}: "
                                   "observe() missed a committed block")
        cap = self.tree.max_depth
        caps = [min(c, cap) if cap else c for c in max_depths]
        trees = build_lookup_trees(self.indexes, caps, budget=self.tree.budget, eos_ids=self.eos_ids,
                                   depth_factor=self.tree.lookup_depth_factor,
                                   max_occurrences=self.tree.lookup_max_occurrences)
        return [t.from_source(SOURCE_CONTEXT) for t in trees]


class LookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, tree: TreeParams, eos_token_ids: Sequence[int]):
        self.context = ContextIndexes(tree, eos_token_ids)

    def start(self, batch_size: int) -> None:
        self.context.start(batch_size)

    def observe(self, block: CommittedBlock) -> None:
        self.context.observe(block)

    def join(self, block: CommittedBlock) -> None:
        self.context.join(block)

    def finish(self, tokens: Sequence[Sequence[int]]) -> None:
        self.context.finish(tokens)

    def select(self, keep: torch.Tensor) -> None:
        self.context.select(keep)

    def propose(self, tokens: Sequence[Sequence[int]], max_depths: Sequence[int]) -> list[DraftTree]:
        return self.context.propose(tokens, max_depths)
