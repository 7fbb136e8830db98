"""A batch's state in the target: its KV cache and each sequence's committed length.

Sequence b's committed tokens occupy cache slots [0, lengths[b]) contiguously (slot index ==
absolute position); slots past that are stale and always masked out, so sequences of different
lengths share one cache tensor. The engine keeps one state per running batch and reshapes it as
sequences finish (`select`), fork (`repeat`), join (`extend`) or the batch is padded to a shape
bucket (`resize_batch`); the adapter (`target.TargetAdapter`) runs the forwards that fill it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import DynamicCache

from dart_worker.hardware.transfer import to_device


class TargetState:
    """KV cache plus per-sequence committed lengths for a batch of sequences.

    The lengths live on the host (`lengths`, numpy int64): the engine's bookkeeping (depth caps,
    context limits, where compaction writes) reads them every round, and on a GPU each read of a
    device value would stall the host. The device copy the masks and positions need
    (`device_lengths`) is uploaded, non-blocking, once after each change.
    """

    def __init__(self, cache: DynamicCache, lengths) -> None:
        self.cache = cache
        self.lengths = lengths

    @property
    def lengths(self) -> np.ndarray:
        """[B] int64 on the host: committed tokens held in the cache."""
        return self._lengths

    @lengths.setter
    def lengths(self, value) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        self._lengths = np.array(value, dtype=np.int64).reshape(-1)
        self._device_lengths: torch.Tensor | None = None

    def device_lengths(self, device: torch.device) -> torch.Tensor:
        if self._device_lengths is None or self._device_lengths.device != device:
            self._device_lengths = to_device(self._lengths, device)
        return self._device_lengths

    @property
    def batch_size(self) -> int:
        return int(self._lengths.shape[0])

    def cache_len(self) -> int:
        """Number of slots in the cache tensors (>= every sequence's length)."""
        return self.cache.get_seq_length() if len(self.cache.layers) else 0

    def select(self, order: Sequence[int]) -> None:
        """Keep sequences `order` (indices, in their new order; finished ones leave the batch). In
        place: only sequences that change index are copied (`GrowingCache.keep_sequences`)."""
        order = [int(i) for i in order]
        if len(self.cache.layers):
            self.cache.keep_sequences(order)
        self.lengths = self._lengths[order]

    def repeat(self, order: Sequence[int], index: torch.Tensor | None = None) -> None:
        """Sequences `order` (indices, repeats allowed), copied: n completions of one prompt share
        its prefill, whose cache rows are copied on the device rather than recomputed
        (`GrowingCache.repeat_sequences`). `index`: `order` already on a device (copied to the
        layers held on others)."""
        order = [int(i) for i in order]
        if len(self.cache.layers):
            self.cache.repeat_sequences(index if index is not None else np.asarray(order, dtype=np.int64))
        self.lengths = self._lengths[order]

    def resize_batch(self, batch: int) -> None:
        """Hold `batch` sequences (bucketed shapes, `shape_buckets.batch_bucket`): the first ones
        stay as they are; sequences past them are dropped, or added as padding sequences of length
        0, whose rows are never read by a real row nor (having no context) by their own, so nothing
        is copied or cleared for them (`GrowingCache.resize_batch`)."""
        if batch == self.batch_size:
            return
        if len(self.cache.layers):
            self.cache.resize_batch(batch)
        kept = self._lengths[:batch]
        self.lengths = np.concatenate([kept, np.zeros(batch - len(kept), dtype=np.int64)])

    @torch.no_grad()
    def extend(self, other: TargetState) -> None:
        """Append `other`'s sequences after these (continuous batching: newly prefilled requests
        join a running batch), written after the live ones' rows of the cache buffers. Slots past
        a sequence's length are stale and always masked out, whoever's longer."""
        self.cache.append_sequences(other.cache)
        self.lengths = np.concatenate([self._lengths, other.lengths])
