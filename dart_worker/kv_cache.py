"""The target's KV cache: transformers' `DynamicCache`, appended in place instead of concatenated.

`DynamicLayer.update` concatenates the whole cache with every forward's new rows: on a CPU at
batch 16 with ~350-token contexts that copies ~200 MB per decoding step (18 layers x keys and
values), 16% of a step on the 2-core EPYC (torch.profiler: `aten::cat` 66 of 359 ms). Here each
layer's `keys`/`values` are prefix views of buffers with spare slots, and new rows are written
after the prefix. Everything `TargetState` does to a layer keeps working unchanged:

- cropping (`keys[:, :, :keep]`) and compaction (indexed assignment into `keys`) act on the
  views, that is, on the buffers;
- selecting sequences or joining caches assigns fresh tensors; the next append sees that `keys`
  no longer views its buffer and adopts it into a new one (one copy, as `cat` did every step).

Stale buffer slots past the view are never read: attention only ever gets the views.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

SPARE_SLOTS = 256  # slots added beyond need when a buffer grows (plus a quarter of the need)


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values are prefix views of buffers with spare slots."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        total = used + key_states.shape[-2]
        if not self._views_buffer() or total > self._key_buffer.shape[-2]:
            self._adopt(key_states, value_states, used, total)
        self._key_buffer[:, :, used:total] = key_states
        self._value_buffer[:, :, used:total] = value_states
        self.keys = self._key_buffer[:, :, :total]
        self.values = self._value_buffer[:, :, :total]
        return self.keys, self.values

    def _views_buffer(self) -> bool:
        """Are keys/values still the prefix views handed out last (not replaced by a select/join)?"""
        buffer = self._key_buffer
        return (buffer is not None and self.keys.dim() == 4 and self.keys.data_ptr() == buffer.data_ptr()
                and self.keys.shape[:2] == buffer.shape[:2] and self.keys.stride() == buffer.stride()
                and self.values.data_ptr() == self._value_buffer.data_ptr()
                and self.values.stride() == self._value_buffer.stride())

    def _adopt(self, key_states: torch.Tensor, value_states: torch.Tensor, used: int, total: int) -> None:
        """New buffers for `total` slots and spare ones, holding the current `used` slots."""
        capacity = total + SPARE_SLOTS + total // 4
        batch, heads, _, dim = key_states.shape
        keys = key_states.new_empty(batch, heads, capacity, dim)
        values = value_states.new_empty(batch, value_states.shape[1], capacity, value_states.shape[-1])
        if used:
            keys[:, :, :used] = self.keys
            values[:, :, :used] = self.values
        self._key_buffer, self._value_buffer = keys, values


class GrowingCache(DynamicCache):
    """A `DynamicCache` of `GrowingLayer`s (one per decoder layer, created on first use)."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
