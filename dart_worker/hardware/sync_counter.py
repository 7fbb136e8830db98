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
  GPU it would have been a host tensor, so the count errs high, never low. Two exceptions, both
  exact on every device: the host copy `dart_worker.hardware.transfer.to_host` read back (its one transfer
  was counted), and a `.to(x.device)` made inside a library (transformers' rotary embedding moves
  its buffers to the device of the hidden states: a no-op there, as on a GPU). The same call in
  this project's code is counted, because there a CPU tensor may stand for host data.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from dart_worker.hardware.transfer import HOST_MARK

# Tensor methods and functions that hand a device value to the host, or need one to size
# their output (nonzero, boolean-mask indexing, unique, masked_select).
READS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
                   "nonzero", "argwhere", "unique", "masked_select", "unique_consecutive"})
_CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"
# This project's source tree: calls made from files under it are its own.
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
_TORCH_ROOT = str(Path(torch.__file__).resolve().parent)


class _CountingMode(TorchFunctionMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if args and getattr(args[0], HOST_MARK, False):
            return func(*args, **kwargs)
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
    target = torch.device("cpu") if name == "cpu" else kwargs.get("device", args[1] if len(args) > 1 else None)
    if not isinstance(target, (str, torch.device)):
        return False
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    return not (source is not None and source.device == torch.device(target) and not _called_from_project())


def _called_from_project() -> bool:
    """Whether the nearest caller outside torch is a file of this project (not a library)."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_TORCH_ROOT) and filename != __file__ \
                and frame.f_code.co_name != "__torch_function__":
            return filename.startswith(_PROJECT_ROOT) and "site-packages" not in filename
        frame = frame.f_back
    return False


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
