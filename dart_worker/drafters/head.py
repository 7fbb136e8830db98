"""Drafters over the DART draft head: `chain`, `ddtree` and `dart`.

They share the head's work (`HeadDrafter`): after each committed block the head reads the
committed rows (fused target taps paired with the next token's embedding, the shifted
pairing) into its own KV cache and predicts logits for the next D positions in one forward.
They differ only in how those per-position distributions become a tree:

- `chain`: the top-1 token per position (plain speculative decoding with a parallel drafter);
- `ddtree`: DDTree's best-first heap over per-position log-probs under the node budget;
- `dart`: DART's N-gram-guided beam search (the corpus trie re-scores the head's top-k).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dart_worker.drafters.base import CommittedBlock, Drafter, empty_tree
from ngram_native.trees import (
    SOURCE_HEAD,
    DraftTree,
    TreeParams,
    build_chain_trees,
    build_dart_trees,
    build_ddtree_trees,
)

# Committed tokens handed to the N-gram scorer as context (it reads only its last n - 1).
NGRAM_CONTEXT_TOKENS = 8


class HeadDrafter(Drafter):
    """Runs the draft head over every committed block and keeps its latest logits."""

    def __init__(self, head, tree: TreeParams, eos_token_ids: Sequence[int]):
        self.head = head
        self.tree = tree
        self.eos_ids = sorted(int(t) for t in eos_token_ids)
        self.cache = None
        self.logits: torch.Tensor | None = None  # [B, D, draft vocab] from the last block

    def start(self, batch_size: int) -> None:
        self.cache = self.head.new_cache(batch_size)
        self.logits = None

    def observe(self, block: CommittedBlock) -> None:
        device = self.head.device
        batch = len(block.rows)
        width = max(len(r) for r in block.rows)
        row_index = torch.zeros(batch, width, dtype=torch.long)
        next_tokens = torch.zeros(batch, width, dtype=torch.long)
        for b, (rows, tokens) in enumerate(zip(block.rows, block.tokens)):
            row_index[b, : len(rows)] = torch.as_tensor(rows)
            # Row k of the block carries the features of its token and the embedding of the token
            # after it (shifted pairing): the last committed row pairs with the newest token.
            next_tokens[b, : len(rows)] = torch.as_tensor(tokens[len(tokens) - len(rows) :])
        taps = block.taps
        row_index = row_index.to(taps.device)
        features = torch.gather(taps, 1, row_index[:, :, None].expand(-1, -1, taps.shape[-1]))
        num_new = torch.tensor([len(r) for r in block.rows], device=device)
        self.logits = self.head.propose(features, next_tokens.to(device), num_new, self.cache)

    def select(self, keep: torch.Tensor) -> None:
        self.cache.select(keep)
        if self.logits is not None:
            self.logits = self.logits[keep.to(self.logits.device)]

    def propose(self, tokens: Sequence[Sequence[int]], max_depths: Sequence[int]) -> list[DraftTree]:
        if self.logits is None:
            raise RuntimeError(f"{self.name}: propose() before any observe(): the head has read nothing")
        caps = [min(c, self.tree.max_depth) if self.tree.max_depth else c for c in max_depths]
        if max(caps, default=0) == 0:
            return [empty_tree() for _ in tokens]
        return [t.from_source(SOURCE_HEAD) for t in self.build(self.logits[:, : max(caps)], tokens, caps)]

    def build(self, logits: torch.Tensor, tokens: Sequence[Sequence[int]], caps: list[int]) -> list[DraftTree]:
        """Trees from draft logits [B, D', draft vocab] (D' = the deepest cap)."""
        raise NotImplementedError

    def target_ids(self, draft_ids: torch.Tensor) -> np.ndarray:
        return self.head.to_target_ids(draft_ids).to(torch.int32).cpu().numpy()


class ChainDrafter(HeadDrafter):
    name = "chain"

    def build(self, logits, tokens, caps):
        values, ids = logits.topk(1, dim=-1)
        return build_chain_trees(self.target_ids(ids), values.float().cpu().numpy(), budget=self.tree.budget,
                                 eos_ids=self.eos_ids, max_depths=caps)


class DDTreeDrafter(HeadDrafter):
    name = "ddtree"

    def build(self, logits, tokens, caps):
        top_k = min(self.tree.top_k, logits.shape[-1])
        values, ids = torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
        return build_ddtree_trees(self.target_ids(ids), values.cpu().numpy(), budget=self.tree.budget,
                                  eos_ids=self.eos_ids, max_depths=caps)


class DartDrafter(HeadDrafter):
    name = "dart"

    def __init__(self, head, tree: TreeParams, eos_token_ids: Sequence[int], trie):
        super().__init__(head, tree, eos_token_ids)
        self.trie = trie

    def build(self, logits, tokens, caps):
        top_k = min(self.tree.top_k, logits.shape[-1])
        values, ids = logits.float().topk(top_k, dim=-1)
        contexts = [t[-NGRAM_CONTEXT_TOKENS:] for t in tokens]
        return build_dart_trees(self.target_ids(ids), values.cpu().numpy(), contexts, self.trie,
                                params=self.tree, top_k=top_k, eos_ids=self.eos_ids, max_depths=caps)
