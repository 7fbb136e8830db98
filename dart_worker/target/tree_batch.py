"""Padded tensors for one target verify forward over B draft trees of different sizes.

Row layout per sequence (the target adapter's `verify` consumes it as is):

    row 0        the root: the last committed token (bonus of the previous round), depth 0
    row i + 1    tree node i, depth tree.depths[i]
    rows > N     padding: token `pad_token_id`, depth 0, invalid

`ancestor[b, r, c]` is True iff row c is row r itself or one of its ancestors (the root is an
ancestor of every node). That is exactly what a tree node may attend to inside the block:
its own path, never its siblings or cousins. Padding rows see only themselves, so every
softmax row has at least one unmasked key and padding never leaks into real rows (no real
row has a padding row as an ancestor).

Everything is built on the host with numpy (trees are small: N <= ~64, called every round)
and moved to the device in one non-blocking copy (`transfer.to_device_packed`). This is where
trees enter the engine, so it is also the one place they are checked
(`ngram_native.trees.check_tree`, the structural level): a broken drafter fails loudly here, and
nothing downstream (verification, KV compaction) checks them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dart_worker.hardware.transfer import to_device_packed
from dart_worker.target.packed_rows import PackedRows
from ngram_native.trees import TreeLike, ancestor_masks, check_tree


@dataclass(frozen=True)
class TreeBatch:
    """Padded verify-forward inputs for B trees; S = 1 + max N (or `pad_to`)."""

    tokens: torch.Tensor  # [B, S] int64, column 0 = root token
    depth: torch.Tensor  # [B, S] int64, root and padding 0
    valid: torch.Tensor  # [B, S] bool, root and real nodes
    ancestor: torch.Tensor  # [B, S, S] bool, row may attend to column (see module doc)
    num_nodes: tuple[int, ...]  # N per sequence (rows 1..N are nodes)
    # The real rows (roots and nodes) and where they sit in the block: the only rows that
    # verification reads, and with exact shapes the only rows the verify forward runs, packed
    # (`TargetAdapter.verify`'s `packed`).
    packed: PackedRows | None = None

    @property
    def real_rows(self) -> torch.Tensor:
        """[B + sum N] int64: the flat indices (b * S + row) of the roots and nodes, in order."""
        return self.packed.rows

    @property
    def num_real_rows(self) -> int:
        """Roots and nodes: the rows that are not padding."""
        return len(self.num_nodes) + sum(self.num_nodes)

    @property
    def batch_size(self) -> int:
        return len(self.num_nodes)

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    @classmethod
    def from_trees(
        cls,
        root_tokens: Sequence[int] | np.ndarray | torch.Tensor,
        trees: Sequence[TreeLike],
        device: torch.device | str,
        *,
        pad_to: int | None = None,
        pad_token_id: int = 0,
        vocab_size: int | None = None,
    ) -> TreeBatch:
        """Build the batch. `pad_to` fixes S (e.g. for stable shapes); it must be >= 1 + max N."""
        if isinstance(root_tokens, torch.Tensor):
            root_tokens = root_tokens.detach().cpu().numpy()
        roots = np.asarray(root_tokens, dtype=np.int64).reshape(-1)
        if roots.shape[0] != len(trees):
            raise ValueError(f"{roots.shape[0]} root tokens for {len(trees)} trees")
        if len(trees) == 0:
            raise ValueError("TreeBatch needs at least one tree")
        num_nodes = tuple(
            check_tree(tree, vocab_size=vocab_size, name=f"trees[{b}]") for b, tree in enumerate(trees)
        )
        width = 1 + max(num_nodes)
        if pad_to is not None:
            if pad_to < width:
                raise ValueError(f"pad_to={pad_to} is smaller than 1 + the largest tree ({width})")
            width = pad_to
        batch = len(trees)

        tokens = np.full((batch, width), pad_token_id, dtype=np.int64)
        depth = np.zeros((batch, width), dtype=np.int64)
        valid = np.zeros((batch, width), dtype=bool)
        # parent_row[b, r]: the row of r's parent; root and padding rows point at themselves.
        parent_row = np.broadcast_to(np.arange(width), (batch, width)).copy()
        tokens[:, 0] = roots
        valid[:, 0] = True
        for b, (tree, n) in enumerate(zip(trees, num_nodes, strict=True)):
            tokens[b, 1 : n + 1] = tree.tokens
            depth[b, 1 : n + 1] = tree.depths
            valid[b, 1 : n + 1] = True
            parent_row[b, 1 : n + 1] = np.asarray(tree.parents, dtype=np.int64) + 1
        ancestor = ancestor_masks(parent_row)

        tokens_t, depth_t, valid_t, ancestor_t, *packed = to_device_packed(
            [tokens, depth, valid, ancestor, *PackedRows.layout(num_nodes, width)], device)
        return cls(tokens=tokens_t, depth=depth_t, valid=valid_t, ancestor=ancestor_t, num_nodes=num_nodes,
                   packed=PackedRows(packed, num_nodes, width))
