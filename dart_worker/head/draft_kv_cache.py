"""The draft head's own KV cache: one layer's keys and values of committed rows, ragged over the batch.

Kept apart from the head because the drafter that owns it (`drafters.head.HeadDrafter`) keeps it
across rounds alongside the target's batch: sequences leave (`select`), join (`concat`) and are
partly skipped after a pause (`skip`), while the head only appends to it and reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from dart_worker.hardware.transfer import to_device


class DraftKVCache:
    """The head's one-layer KV cache of committed rows, ragged over the batch.

    Sequence b owns slots 0..lengths[b]-1 of `keys[b]`/`values[b]` ([B, kv_heads, T, hd] with
    T = max(lengths)); slots past its length are stale and always masked out. `keys`/`values` are
    views of buffers with spare capacity, so appending is amortised O(new rows); an append
    invalidates views taken before it. `lengths` is host data (numpy int64): where rows go is
    decided on the host, so appending and selecting never wait for the device.

    `skipped[b]`: committed rows of sequence b that were never read into the cache (a head paused
    for long reads only the latest rows when it resumes, `HeadDrafter.catch_up`); the next row's
    absolute position is `lengths + skipped` (`next_positions`), so RoPE distances stay true.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, lengths, skipped=None) -> None:
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.detach().cpu().numpy()
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if keys.shape != values.shape or keys.dim() != 4 or lengths.shape != (keys.shape[0],):
            raise ValueError(f"inconsistent cache shapes: keys {tuple(keys.shape)}, values "
                             f"{tuple(values.shape)}, lengths {tuple(lengths.shape)}")
        self._key_buffer, self._value_buffer = keys, values
        self._used = keys.shape[2]
        self.lengths = lengths
        self.skipped = np.zeros_like(lengths) if skipped is None else np.asarray(skipped, dtype=np.int64).copy()
        if self.skipped.shape != lengths.shape:
            raise ValueError(f"skipped {self.skipped.shape} must match lengths {lengths.shape}")

    def next_positions(self) -> np.ndarray:
        """Per sequence, the absolute position of its next committed row."""
        return self.lengths + self.skipped

    def skip(self, rows) -> None:
        """Sequence b's next `rows[b]` committed rows will never be read (see the class doc)."""
        self.skipped = self.skipped + np.asarray(rows, dtype=np.int64)

    @property
    def keys(self) -> torch.Tensor:
        return self._key_buffer[:, :, : self._used]

    @property
    def values(self) -> torch.Tensor:
        return self._value_buffer[:, :, : self._used]

    def __len__(self) -> int:
        return self.lengths.shape[0]

    @torch.inference_mode()
    def append(self, keys: torch.Tensor, values: torch.Tensor, num_new: np.ndarray,
               index: torch.Tensor | None = None) -> None:
        """Write row i < num_new[b] of keys/values [B, kv_heads, n, hd] to slot lengths[b] + i.

        `index`: `self.append_index(num_new)` already on the device (the head uploads it with its
        other inputs); made here when not given.
        """
        num_new = np.asarray(num_new, dtype=np.int64)
        new_max_length = int((self.lengths + num_new).max(initial=0))
        capacity = self._key_buffer.shape[2]
        if new_max_length > capacity:
            self._grow(max(new_max_length, 2 * capacity, 16))
        if index is None:
            index = to_device(self.append_index(num_new), keys.device)
        batch_idx, row_idx, slots = index.unbind(0)
        self._key_buffer[batch_idx, :, slots] = keys[batch_idx, :, row_idx]
        self._value_buffer[batch_idx, :, slots] = values[batch_idx, :, row_idx]
        self._used = max(self._used, new_max_length)
        self.lengths = self.lengths + num_new

    def widened(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys and values over the first `slots` slots (>= the used ones), the buffers grown if
        needed: a bucketed read-out attends over a bucket's slots, the ones past a sequence's
        length masked out as stale slots always are."""
        if slots < self._used:
            raise ValueError(f"cannot view {slots} slots of a cache using {self._used}")
        if slots > self._key_buffer.shape[2]:
            self._grow(slots)
        return self._key_buffer[:, :, :slots], self._value_buffer[:, :, :slots]

    def _grow(self, capacity: int) -> None:
        """New zeroed buffers of `capacity` slots holding the used ones (stale slots stay masked)."""
        grown_keys = self._key_buffer.new_zeros(*self._key_buffer.shape[:2], capacity, self._key_buffer.shape[3])
        grown_values = torch.zeros_like(grown_keys)
        grown_keys[:, :, : self._used] = self.keys
        grown_values[:, :, : self._used] = self.values
        self._key_buffer, self._value_buffer = grown_keys, grown_values

    def append_index(self, num_new: np.ndarray) -> np.ndarray:
        """[3, sum(num_new)] int64: (sequence, row of the new block, destination slot) per new row."""
        num_new = np.asarray(num_new, dtype=np.int64)
        batch_idx = np.repeat(np.arange(len(num_new)), num_new)
        row_idx = np.arange(batch_idx.shape[0]) - np.repeat(np.cumsum(num_new) - num_new, num_new)
        return np.stack([batch_idx, row_idx, self.lengths[batch_idx] + row_idx])

    @torch.inference_mode()
    def select(self, index: torch.Tensor | Sequence[int]) -> None:
        """Keep only sequences `index` (in that order), in place, cropped to their longest length.

        For batch bookkeeping alongside the target's state: drop finished sequences, reorder.
        """
        if isinstance(index, torch.Tensor):
            index = index.tolist()
        order = np.asarray(index, dtype=np.int64).reshape(-1)
        lengths = self.lengths[order]
        length = int(lengths.max(initial=0))
        device_index = to_device(order, self._key_buffer.device)
        self._key_buffer = self.keys[device_index, :, :length].contiguous()
        self._value_buffer = self.values[device_index, :, :length].contiguous()
        self._used = length
        self.lengths = lengths
        self.skipped = self.skipped[order]

    @staticmethod
    @torch.inference_mode()
    def concat(caches: Sequence[DraftKVCache]) -> DraftKVCache:
        """One cache holding the sequences of `caches` in order (e.g. to add newly prefilled ones)."""
        if not caches:
            raise ValueError("concat needs at least one cache")
        length = max(c.keys.shape[2] for c in caches)

        def padded(t: torch.Tensor) -> torch.Tensor:
            return F.pad(t, (0, 0, 0, length - t.shape[2]))

        return DraftKVCache(torch.cat([padded(c.keys) for c in caches]),
                            torch.cat([padded(c.values) for c in caches]),
                            np.concatenate([c.lengths for c in caches]), np.concatenate([c.skipped for c in caches]))
