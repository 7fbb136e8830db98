"""Counting the device-to-host synchronisations a piece of decoding makes.

On a GPU a forward of a small model takes a few milliseconds, and every read of a device value by
the host (`.item()`, `.tolist()`, `int(t)`, a boolean mask index...) stalls until all queued work is
done: host and device stop overlapping. How many a round makes is a property of the code, so it
is counted, not guessed:

- on CUDA, by torch itself: `torch.cuda.set_sync_debug_mode("warn")` makes every synchronising
  operation warn, and the warnings are counted;
- on a CPU, where nothing synchronises, by the operations that would: a `TorchFunctionMode`
  counts calls that read tensor values on the host (`READS`) and blocking copies between host
  and device (`.to(...)`/`.cpu()` without `non_blocking`, `torch.tensor(..., device=...)`), which
  on CUDA wait for the stream as well. Host bookkeeping kept in numpy or Python is not counted
  (it costs nothing on a GPU either); a torch tensor read back on the host is, even where on a
  GPU it would have been a host tensor, so the count errs high, never low.
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods and functions that hand a device value to the host, or need one to size
# their output (nonzero, boolean-mask indexing, unique, masked_select).
READS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
                   "nonzero", "argwhere", "unique", "masked_select", "unique_consecutive"})
_CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


class _CountingMode(TorchFunctionMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name in READS or (name == "__getitem__" and _bool_index(args))
                or (name in ("to", "cpu") and _blocking_copy(name, args, kwargs))
                or (name in ("tensor", "as_tensor") and kwargs.get("device") is not None)):
            self.counts[name] += 1
        return func(*args, **kwargs)


def _blocking_copy(name: str, args, kwargs) -> bool:
    """`.cpu()`, or `.to(device)` (a device or device string, positional or `device=`), without
    `non_blocking=True`; `.to(dtype)` alone copies nothing between devices."""
    if kwargs.get("non_blocking"):
        return False
    if name == "cpu":
        return True
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device))


def _bool_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class SyncCounter:
    """`with SyncCounter(device) as syncs: ...` then `syncs.count` (and `syncs.by_op` on a CPU)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.by_op: Counter = Counter()
        self._cuda_warnings: list | None = None

    @property
    def count(self) -> int:
        if self._cuda_warnings is not None:
            return sum(_CUDA_SYNC_WARNING in str(w.message) for w in self._cuda_warnings)
        return sum(self.by_op.values())

    def __enter__(self) -> SyncCounter:
        if self.device.type == "cuda":
            self._previous = torch.cuda.get_sync_debug_mode()
            self._catcher = warnings.catch_warnings(record=True)
            self._cuda_warnings = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._mode = _CountingMode(self.by_op)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(self._previous)
            self._catcher.__exit__(*exc)
        else:
            self._mode.__exit__(*exc)
