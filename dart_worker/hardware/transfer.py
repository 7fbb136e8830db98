"""Moving data between the host and the device, in one place.

On a GPU a decoding round of a small model takes a few milliseconds, and every blocking transfer
(a device value read on the host, or a host-to-device copy without `non_blocking`, which waits for
the stream too) stops the host until all queued device work is done. So the engine keeps its
bookkeeping (lengths, slots, tree shapes) on the host and crosses the boundary only here:

- `to_device`: host data (numpy, lists) becomes a device tensor without waiting for the device:
  on CUDA through pinned memory (torch's caching host allocator keeps the staging block alive
  until the copy has run, so the caller may reuse its array at once) and `non_blocking`;
- `to_host`: several device tensors come back in ONE transfer (packed into one buffer on the
  device, split on the host), the round's single wait.

`dart_worker.hardware.sync_counter` counts what crosses anywhere else; arrays `to_host` returns are host
data and are not counted again when read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Attribute set on the host tensor `to_host` read back: reading it is not another transfer.
HOST_MARK = "_dart_on_host"


def move_to(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`: itself when it is there already (the one-device case: no call at all),
    else a non-blocking device-to-device copy (a target split over devices, per layer or LM head),
    which queues on the stream and never makes the host wait."""
    device = torch.device(device)
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=True)


def to_device(array, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy of host data `array` (numpy array, list, scalar) as a tensor on `device`.

    Never waits for the device and never aliases the caller's memory (a CPU "upload" copies too,
    so every device behaves alike when the caller changes its array afterwards).
    """
    host = torch.tensor(np.asarray(array))
    if dtype is not None:
        host = host.to(dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> tuple[np.ndarray, ...]:
    """numpy copies of `tensors` (any shapes, integer, bool or float dtypes) in one transfer.

    Tensors of one dtype travel as they are; mixed ones as float64, which holds every int32, every
    int64 below 2**53 (token ids, row indices) and every float32 exactly, and come back in their
    own dtypes.
    """
    if not tensors:
        return ()
    dtypes = {t.dtype for t in tensors}
    common = tensors[0].dtype if len(dtypes) == 1 else torch.float64
    flat = [t.detach().reshape(-1).to(common) for t in tensors]
    packed = flat[0] if len(flat) == 1 else torch.cat(flat)
    host = packed.cpu()
    setattr(host, HOST_MARK, True)
    values = host.numpy()
    out, offset = [], 0
    for tensor in tensors:
        count = tensor.numel()
        part = values[offset : offset + count].reshape(tuple(tensor.shape))
        out.append(part.astype(_numpy_dtype(tensor.dtype), copy=True))
        offset += count
    return tuple(out)


# numpy has no bfloat16: bf16 values are exact in float32.
_NUMPY_DTYPES = {torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
                 torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16,
                 torch.bfloat16: np.float32, torch.float32: np.float32, torch.float64: np.float64}
_TORCH_DTYPES = {np.dtype(n).type: t for t, n in _NUMPY_DTYPES.items() if t != torch.bfloat16}


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return np.dtype(_NUMPY_DTYPES[dtype])


def to_device_packed(arrays: Sequence[np.ndarray], device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """Tensors on `device` holding `arrays` (any dtypes and shapes), uploaded as ONE buffer.

    The arrays' bytes are laid out one after another (each at an 8-byte boundary) in one host
    buffer, uploaded with `to_device`, and viewed back per array on the device: a round's tree
    (tokens, depths, masks) crosses in one copy however many tensors it is.
    """
    arrays = [np.ascontiguousarray(a) for a in arrays]
    offsets, size = [], 0
    for array in arrays:
        offsets.append(size)
        size += -(-array.nbytes // 8) * 8
    buffer = np.zeros(size, dtype=np.uint8)
    for array, offset in zip(arrays, offsets, strict=True):
        buffer[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)
    uploaded = to_device(buffer, device)
    return tuple(
        uploaded[offset : offset + array.nbytes].view(_TORCH_DTYPES[array.dtype.type]).view(array.shape)
        for array, offset in zip(arrays, offsets, strict=True)
    )
