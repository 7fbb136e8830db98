"""A verify forward over its real rows only: a padded [B, S] tree block packed into one row of R tokens.

A batch's trees differ in size, and the padded verify block has B x S rows for B + sum N real
ones. Where a forward costs its rows (a CPU without matrix units, whose forward time grows with
its rows; docs/benchmarks.md), padding is paid in full: one sequence's 8-node tree in a
batch of 16 made a 144-row forward out of 24 real rows. Everything in a decoder layer but
attention is row by row (embedding, norms, projections, MLP, rotary embeddings at each row's own
position), so it runs on the packed [1, R] rows; only attention needs the block, whose rows read
their own sequence's cache under the tree mask. So, for the duration of one forward
(`packing`):

- the KV cache (`kv_cache.GrowingLayer.update`) spreads each layer's new keys and values back
  into the [B, H, S, D] block it appends (padding slots get zeros: nothing real attends to them,
  and they are never committed);
- the attention function (`tree_attention.tree_attention_forward`) spreads the queries the same
  way, attends exactly as for a padded block, and packs its output again.

The block is the same attention over the same keys as the padded forward's, so a real row's
output equals the padded forward's (tests/test_target.py checks logits, taps and the cache).
Bucketed shapes (a GPU, `shape_buckets`) keep the padded block: there a forward costs about the
same for 1 row as for 32, and one shape per bucket is what graphs and kernels want.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch

from dart_worker.hardware.transfer import move_to


class PackedRows:
    """Where the R packed rows sit in the [B, S] block: `rows[i]` = b * S + s of packed row i.

    Built on the host from the trees' sizes (`layout`) and uploaded with the rest of a round's
    tree (`TreeBatch.from_trees`), so using it never waits for the device."""

    NAMES = ("rows", "roots", "nodes", "node_sequences", "node_places")

    def __init__(self, tensors: Sequence[torch.Tensor], num_nodes: Sequence[int], width: int):
        self.batch, self.width = len(num_nodes), width
        self.node_batch = sum(1 for n in num_nodes if n)  # sequences with a tree
        self._tensors = dict(zip(self.NAMES, tensors, strict=True))
        self._on = {(name, tensor.device): tensor for name, tensor in self._tensors.items()}
        self.rows = self._tensors["rows"]

    @classmethod
    def layout(cls, num_nodes: Sequence[int], width: int) -> list[np.ndarray]:
        """Host int64 arrays, in NAMES order: each real row's flat place in the block (b * S + s,
        roots and nodes in order); the packed positions of the roots and of the nodes; the
        sequences with a tree; and each node's flat place in their [node_batch, S - 1] block."""
        sizes = np.asarray(num_nodes, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(1 + sizes)[:-1]]).astype(np.int64)
        with_nodes = np.flatnonzero(sizes).astype(np.int64)

        def joined(parts) -> np.ndarray:
            return np.concatenate([np.zeros(0, np.int64), *parts]).astype(np.int64)

        return [joined(b * width + np.arange(1 + n) for b, n in enumerate(sizes)),
                starts,
                joined(starts[b] + 1 + np.arange(n) for b, n in enumerate(sizes)),
                with_nodes,
                joined(rank * (width - 1) + np.arange(sizes[b]) for rank, b in enumerate(with_nodes))]

    def _index(self, device: torch.device, name: str = "rows") -> torch.Tensor:
        """Index tensor `name` on `device` (a target split over devices indexes each layer where
        it runs)."""
        key = (name, device)
        if key not in self._on:
            self._on[key] = move_to(self._tensors[name], device)
        return self._on[key]

    def pack(self, block: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] -> [R, ...]: the real rows of a block."""
        flat = block.reshape(self.batch * self.width, *block.shape[2:])
        return flat.index_select(0, self._index(flat.device))

    def spread(self, packed: torch.Tensor, zeros: bool = True) -> torch.Tensor:
        """[R, ...] -> [B, S, ...]: packed rows at their places in the block, zeros elsewhere
        (`zeros` False: anything; a block of logits is too large to clear for nobody to read)."""
        shape = (self.batch * self.width, *packed.shape[1:])
        block = packed.new_zeros(shape) if zeros else packed.new_empty(shape)
        block.index_copy_(0, self._index(packed.device), packed)
        return block.view(self.batch, self.width, *packed.shape[1:])

    def spread_heads(self, packed: torch.Tensor) -> torch.Tensor:
        """[1, H, R, D] (a layer's queries, keys or values) -> [B, H, S, D]."""
        return self.spread(packed[0].transpose(0, 1)).transpose(1, 2)

    def attend(self, attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """`attention(query [b, Hq, s, D], key, value [b, Hkv, T, D], mask [b, 1, s, T])` -> [b, s, Hq, D]
        for packed queries [1, Hq, R, D] over the block's keys, values and mask: [1, R, Hq, D].

        Attention costs every query row of its block, padding included (a 9-row block reads the
        cache for all 9 rows, where the roots alone read it once). When few sequences have a
        tree, the roots attend as one [B, 1] block and the nodes as a block of only the sequences
        with a tree (their keys and values gathered: a copy of their share of the cache), else
        everything as the padded block.
        """
        if not 0 < 3 * self.node_batch <= self.batch:
            return self.pack(attention(self.spread_heads(query), key, value, mask))[None]
        rows = query[0].transpose(0, 1)  # [R, Hq, D]
        device = rows.device
        roots, nodes = self._index(device, "roots"), self._index(device, "nodes")
        mask = mask.expand(self.batch, *mask.shape[1:])
        out_roots = attention(rows.index_select(0, roots)[:, :, None], key, value, mask[:, :, :1])
        sequences, places = self._index(device, "node_sequences"), self._index(device, "node_places")
        width = self.width - 1
        node_query = rows.new_zeros((self.node_batch * width, *rows.shape[1:]))
        node_query.index_copy_(0, places, rows.index_select(0, nodes))
        node_query = node_query.view(self.node_batch, width, *rows.shape[1:]).transpose(1, 2)
        out_nodes = attention(node_query, key.index_select(0, sequences), value.index_select(0, sequences),
                              mask.index_select(0, sequences)[:, :, 1:])
        out = out_nodes.new_empty((rows.shape[0], *out_nodes.shape[2:]))
        out.index_copy_(0, roots, out_roots[:, 0])
        out.index_copy_(0, nodes, out_nodes.reshape(-1, *out_nodes.shape[2:]).index_select(0, places))
        return out[None]


_ACTIVE: ContextVar[PackedRows | None] = ContextVar("packed_rows", default=None)


def active() -> PackedRows | None:
    """The layout of the forward running now, if it runs packed rows."""
    return _ACTIVE.get()


@contextmanager
def packing(layout: PackedRows | None) -> Iterator[None]:
    """Run the enclosed forward over `layout`'s packed rows (None: a plain forward)."""
    token = _ACTIVE.set(layout)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
