"""The target's KV cache: transformers' `DynamicCache`, appended in place instead of concatenated.

`DynamicLayer.update` concatenates the whole cache with every forward's new rows: on a CPU at
batch 16 with ~350-token contexts that copies ~200 MB per decoding step (18 layers x keys and
values), a copy that grows with the context while the step's own work does not (the profile is in
docs/benchmarks.md). Here each
layer's `keys`/`values` are prefix views of buffers with spare slots, and new rows are written
after the prefix. Everything `TargetState` does to a layer keeps working unchanged:

- cropping (`keys[:, :, :keep]`) and compaction (indexed assignment into `keys`) act on the
  views, that is, on the buffers;
- finished sequences leave and prefilled ones join in place (`keep_sequences`,
  `append_sequences`): the buffers have rows for as many sequences as were ever live together,
  only sequences moved into a finished one's rows are copied, and joiners are written after the
  live ones, so continuous batching never copies the whole cache (it did twice per finished row);
- anything else that assigns fresh tensors makes the next append adopt them into a new buffer.

Stale buffer slots past the view are never read: attention only ever gets the views.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from dart_worker.hardware.transfer import move_to, to_device
from dart_worker.target import packed_rows

SPARE_SLOTS = 256  # slots added beyond need when a buffer grows (plus a quarter of the need)


def buffer_slots(needed: int) -> int:
    """Slots a buffer gets when it must hold `needed`: room to grow without a copy every round
    (`dart_worker.target.kv_budget` bounds a job's cache memory with the same rule)."""
    return needed + SPARE_SLOTS + needed // 4


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values are prefix views of buffers with spare slots."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Empty keys/values made on the device (transformers' own builds them from a host list,
        a host-to-device copy per layer per new cache)."""
        self.device = key_states.device
        self.keys = key_states.new_empty(0)
        self.values = value_states.new_empty(0)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        layout = packed_rows.active()
        if layout is not None:  # a forward of packed rows appends its whole padded block
            key_states, value_states = layout.spread_heads(key_states), layout.spread_heads(value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        total = used + key_states.shape[-2]
        batch = key_states.shape[0]
        if not self._views_buffer() or total > self._key_buffer.shape[-2]:
            self._adopt(key_states, value_states, used, total)
        self._key_buffer[:batch, :, used:total] = key_states
        self._value_buffer[:batch, :, used:total] = value_states
        self.keys = self._key_buffer[:batch, :, :total]
        self.values = self._value_buffer[:batch, :, :total]
        return self.keys, self.values

    def _views_buffer(self) -> bool:
        """Are keys/values still the prefix views handed out last (not replaced by a select/join)?"""
        buffer = self._key_buffer
        return (buffer is not None and self.keys.dim() == 4 and self.keys.data_ptr() == buffer.data_ptr()
                and self.keys.shape[0] <= buffer.shape[0] and self.keys.shape[1] == buffer.shape[1]
                and self.keys.stride() == buffer.stride()
                and self.values.data_ptr() == self._value_buffer.data_ptr()
                and self.values.stride() == self._value_buffer.stride())

    def _adopt(self, key_states: torch.Tensor, value_states: torch.Tensor, used: int, total: int) -> None:
        """New buffers for `total` slots and spare ones, holding the current `used` slots."""
        capacity = buffer_slots(total)
        batch, heads, _, dim = key_states.shape
        if self._key_buffer is not None and self._key_buffer.shape[1] == heads:  # keep the rows once had
            batch = max(batch, self._key_buffer.shape[0])
        keys = key_states.new_zeros(batch, heads, capacity, dim)
        values = value_states.new_zeros(batch, value_states.shape[1], capacity, value_states.shape[-1])
        if used:
            keys[: self.keys.shape[0], :, :used] = self.keys
            values[: self.values.shape[0], :, :used] = self.values
        self._key_buffer, self._value_buffer = keys, values

    def pad_slots(self, slots: int) -> None:
        """Widen the views to `slots` slots (bucketed shapes: the context a forward attends over
        rounded up; the slots past every sequence's length are stale and masked out). A view of
        the buffer when it has the room (no copy), else a larger buffer."""
        if not self.is_initialized or self.keys.dim() != 4 or slots <= self.keys.shape[-2]:
            return
        batch, used = self.keys.shape[0], self.keys.shape[-2]
        if not self._views_buffer() or slots > self._key_buffer.shape[-2]:
            self._adopt(self.keys, self.values, used, slots)
        self.keys = self._key_buffer[:batch, :, :slots]
        self.values = self._value_buffer[:batch, :, :slots]

    def resize_batch(self, batch: int) -> None:
        """Views over the first `batch` buffer rows (bucketed shapes: padding sequences after the
        live ones). Narrowing drops the last sequences; widening exposes rows that hold a finished
        sequence's stale K/V or zeros, never copied or cleared: a padding sequence has no
        context, so nothing reads them. Grows the buffers only past the rows they have."""
        if not self.is_initialized or self.keys.dim() != 4 or batch == self.keys.shape[0]:
            return
        used = self.keys.shape[-2]
        if batch < self.keys.shape[0]:
            self.keys, self.values = self.keys[:batch], self.values[:batch]  # still prefix views
            return
        if not self._views_buffer():
            self._adopt(self.keys, self.values, used, used)
        if batch > self._key_buffer.shape[0]:
            self._grow(batch, used, used)
        self.keys = self._key_buffer[:batch, :, :used]
        self.values = self._value_buffer[:batch, :, :used]

    @torch.no_grad()
    def keep_sequences(self, order: list[int], index: torch.Tensor | None = None) -> None:
        """Keep sequences `order` (source indices, new order) in place: only the sequences whose
        index changes are copied, into the buffer rows of the ones that left. With the engine's
        retirement order (`retire_order`: the last live sequences fill the holes) a finished row
        costs one sequence's copy, not the whole cache's. `index`: `moved_index(order)` on the
        cache's device (uploaded once for every layer)."""
        if index is None:
            index = to_device(moved_index(order), self.keys.device)
        if not self._views_buffer():  # replaced by someone else: plain indexing, adopted later
            whole = index[2, : len(order)]
            self.keys, self.values = self.keys[whole], self.values[whole]
            return
        used = self.keys.shape[-2]
        moved = int(np.count_nonzero(np.asarray(order) != np.arange(len(order))))
        if moved:
            dst, src = index[0, :moved], index[1, :moved]
            # Advanced indexing reads the moved sources into a temporary before writing.
            self._key_buffer[dst, :, :used] = self._key_buffer[src, :, :used]
            self._value_buffer[dst, :, :used] = self._value_buffer[src, :, :used]
        self.keys = self._key_buffer[: len(order), :, :used]
        self.values = self._value_buffer[: len(order), :, :used]

    @torch.no_grad()
    def append_sequences(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add sequences after the current ones (continuous batching: prefilled requests join):
        their K/V [k, H, T', D] go into the buffer rows after the live ones, the live sequences'
        cache stays where it is unless the buffer must grow. Slots past a sequence's own length
        are stale for every sequence alike, so the shorter side is left unwritten there."""
        if not self.is_initialized or self.keys.dim() != 4 or not self._views_buffer():
            self.keys = keys if not self.is_initialized or self.keys.dim() != 4 else _join(self.keys, keys)
            self.values = values if not self.is_initialized or self.values.dim() != 4 else _join(self.values, values)
            self.is_initialized = True
            self.dtype, self.device = keys.dtype, keys.device
            return
        batch, used = self.keys.shape[0], self.keys.shape[-2]
        total_batch, total = batch + keys.shape[0], max(used, keys.shape[-2])
        if total_batch > self._key_buffer.shape[0] or total > self._key_buffer.shape[-2]:
            self._grow(total_batch, total, used)
        self._key_buffer[batch:total_batch, :, : keys.shape[-2]] = keys
        self._value_buffer[batch:total_batch, :, : values.shape[-2]] = values
        self.keys = self._key_buffer[:total_batch, :, :total]
        self.values = self._value_buffer[:total_batch, :, :total]

    def _grow(self, batch: int, slots: int, used: int) -> None:
        """Buffers for at least `batch` sequences and `slots` slots (with spares), holding the current ones."""
        old_keys, old_values = self.keys, self.values
        capacity = max(buffer_slots(slots), self._key_buffer.shape[-2])
        rows = max(batch, self._key_buffer.shape[0])
        _, heads, _, dim = old_keys.shape
        self._key_buffer = old_keys.new_zeros(rows, heads, capacity, dim)
        self._value_buffer = old_values.new_zeros(rows, old_values.shape[1], capacity, old_values.shape[-1])
        self._key_buffer[: old_keys.shape[0], :, :used] = old_keys
        self._value_buffer[: old_values.shape[0], :, :used] = old_values


def _join(mine: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] + [k, H, T', D] -> [B + k, H, max(T, T'), D], zero-padded slots past each side's own."""
    slots = max(mine.shape[-2], theirs.shape[-2])
    pad = torch.nn.functional.pad
    return torch.cat([pad(mine, (0, 0, 0, slots - mine.shape[-2])), pad(theirs, (0, 0, 0, slots - theirs.shape[-2]))])


def moved_index(order: list[int]) -> np.ndarray:
    """[3, len(order)] int64 for `GrowingLayer.keep_sequences`: destinations and sources of the
    sequences that change index (first columns; the rest unused), then `order` itself."""
    order = np.asarray(order, dtype=np.int64).reshape(-1)
    moved = np.flatnonzero(order != np.arange(len(order)))
    index = np.zeros((3, len(order)), dtype=np.int64)
    index[0, : len(moved)] = moved
    index[1, : len(moved)] = order[moved]
    index[2] = order
    return index


def per_device(index: torch.Tensor | np.ndarray | list[int]):
    """`on(device)` -> `index` (host ints, or a tensor already on some device) as an int64 tensor on
    `device`, uploaded or copied once per device: the layers of a target split over several
    devices each hold their cache where they run, and are indexed there."""
    copies: dict[torch.device, torch.Tensor] = {}
    if isinstance(index, torch.Tensor):
        copies[index.device] = index
    else:
        index = np.asarray(index, dtype=np.int64)

    def on(device: torch.device) -> torch.Tensor:
        if device not in copies:
            copies[device] = move_to(index, device) if isinstance(index, torch.Tensor) else to_device(index, device)
        return copies[device]

    return on


def retire_order(finished: list[bool]) -> list[int]:
    """The order in which the unfinished of `finished` sequences stay: each hole left below the
    new batch size is filled by the last unfinished sequence beyond it, the others keep their
    place, so a cache keeps its rows in place except for the few moved into holes."""
    keep = len(finished) - sum(finished)
    order = list(range(keep))
    movers = [i for i in range(keep, len(finished)) if not finished[i]]
    for hole in (i for i in range(keep) if finished[i]):
        order[hole] = movers.pop()
    return order


class GrowingCache(DynamicCache):
    """A `DynamicCache` of `GrowingLayer`s (one per decoder layer, created on first use)."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)

    def keep_sequences(self, order: list[int]) -> None:
        if not self.layers:
            return
        index = per_device(moved_index(order))  # one upload per device, shared by its layers
        for layer in self.layers:
            layer.keep_sequences(order, index(layer.keys.device))

    def resize_batch(self, batch: int) -> None:
        """Every layer's views over `batch` sequences (`GrowingLayer.resize_batch`)."""
        for layer in self.layers:
            layer.resize_batch(batch)

    def pad_slots(self, slots: int) -> None:
        """Every layer's views widened to `slots` slots (`GrowingLayer.pad_slots`)."""
        for layer in self.layers:
            layer.pad_slots(slots)

    @torch.no_grad()
    def repeat_sequences(self, index: torch.Tensor | np.ndarray | list[int]) -> None:
        """Sequences `index` (host ints or a device int64 tensor; repeats allowed: n completions of
        one prompt copy its prefilled rows), as new tensors. A copy of what is held, never a
        recomputation; the layers no longer view their buffers, so their next append adopts the
        copies. Layers on another device than a given tensor's (a target split over several
        devices) get the index copied there once."""
        on = per_device(index)
        for layer in self.layers:
            where = on(layer.keys.device)
            layer.keys, layer.values = layer.keys.index_select(0, where), layer.values.index_select(0, where)

    def append_sequences(self, other: DynamicCache) -> None:
        if len(self.layers) != len(other.layers):
            raise ValueError(f"cannot join caches of {len(self.layers)} and {len(other.layers)} layers")
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.append_sequences(theirs.keys, theirs.values)
