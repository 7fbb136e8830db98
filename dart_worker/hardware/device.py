"""Turning user-facing device / dtype / thread settings into torch objects.

Configs say "auto", "cpu", "cuda", "cuda:1", "bf16", ...; the engine wants a torch.device and
a torch.dtype it can rely on. Resolution happens once, here, with errors that name what was
asked for and what the machine has, instead of a CUDA assertion deep inside a forward pass.

"auto" policy (kept deliberately simple):
  device: CUDA when torch sees a GPU, else CPU.
  dtype:  bf16 where the hardware computes it natively (CUDA with bf16 support; CPUs with
          AVX512-BF16 or AMX), else fp32. fp16 is never chosen automatically: Gemma-family
          activations overflow fp16's range, and bf16-less GPUs are old enough that fp32 is
          the safe default there.
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

import torch

from dart_worker.defaults import DEFAULT_DTYPE

log = logging.getLogger(__name__)

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """"auto" | "cpu" | "cuda" | "cuda:N" | "mps" (or a torch.device) -> a concrete torch.device.

    CUDA devices come back with an explicit index ("cuda" -> the current device, normally
    index 0 of those Ray made visible), so two resolved devices compare equal when they are
    the same GPU.
    """
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        return resolve_device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec.strip().lower() if isinstance(spec, str) else spec)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"unknown device {spec!r}; expected 'auto', 'cpu', 'cuda' or 'cuda:N'") from err
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device {spec!r} requested but CUDA is not available (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda or 'none'}, "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
                "use device 'cpu' or 'auto'"
            )
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= count:
            raise RuntimeError(f"device {spec!r} requested but only {count} CUDA device(s) are visible "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
        return torch.device("cuda", index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise RuntimeError(f"device {spec!r} requested but MPS is not available; use 'cpu' or 'auto'")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unsupported device type {device.type!r} (from {spec!r}); "
                         "expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'")
    return device


class DeviceUnavailable(RuntimeError):
    """A worker was given a device it cannot use (Ray assigned GPUs, torch cannot reach them)."""


def cuda_problem() -> str | None:
    """Why torch cannot use CUDA here, in words (None: it can). Initialising CUDA is what
    surfaces a driver older than the wheel's CUDA, so this does (`torch.cuda.init`)."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    try:
        torch.cuda.init()
    except Exception as err:  # torch raises RuntimeError or AssertionError for driver problems
        return f"CUDA initialisation failed: {str(err).strip().splitlines()[0] if str(err).strip() else err!r}"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "torch sees no CUDA device"
    return None


def resolve_worker_device(spec: str, assigned_gpus: list[str]) -> torch.device:
    """The device of a pipeline worker to which the cluster assigned `assigned_gpus` (Ray's GPU
    ids; empty when it reserved none).

    The assignment decides, never what happens to be visible: "auto" means CUDA when GPUs were
    assigned and the CPU otherwise, "cuda" without an assignment and "cpu" with one are errors, and
    a worker holding GPUs that torch cannot use stops with one line saying what was assigned, what
    torch sees and the wheel's CUDA version, instead of running on the CPU, far slower, unnoticed.
    """
    name = spec.strip().lower()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    if not assigned_gpus:
        if name.startswith("cuda"):
            raise DeviceUnavailable(f"model.device={spec!r} but the cluster assigned this worker no GPU: set "
                                    "resources.num_gpus_per_worker (Ray gives a worker only the GPUs it reserves)")
        return resolve_device("cpu" if name == "auto" else spec)
    if name == "cpu" or name == "mps":
        raise DeviceUnavailable(f"model.device={spec!r} but the cluster assigned this worker GPU(s) "
                                f"{', '.join(assigned_gpus)}: set resources.num_gpus_per_worker=0 to run on CPUs")
    problem = cuda_problem()
    if problem is not None:
        raise DeviceUnavailable(
            f"the cluster assigned this worker GPU(s) {', '.join(assigned_gpus)} (CUDA_VISIBLE_DEVICES={visible}), "
            f"but torch {torch.__version__} (built with CUDA {torch.version.cuda or 'none'}) cannot use them: "
            f"{problem}; install a torch build for this node's driver, or set resources.num_gpus_per_worker=0 "
            "and model.device=cpu to run on CPUs")
    try:
        return resolve_device("cuda" if name == "auto" else spec)
    except (RuntimeError, ValueError) as err:  # e.g. cuda:1 with one GPU assigned (Ray renumbers them from 0)
        raise DeviceUnavailable(f"model.device={spec!r} on a worker assigned GPU(s) {', '.join(assigned_gpus)} "
                                f"(CUDA_VISIBLE_DEVICES={visible}): {err}") from None


def worker_devices(device: torch.device, assigned_gpus: list[str]) -> list[torch.device]:
    """The devices a pipeline worker spreads its target over: every GPU Ray assigned it
    (`resources.num_gpus_per_worker: N` gives N), as torch numbers them in this process, else just
    `device` (the CPU, or a worker holding one GPU or a fraction of one).

    Ray sets CUDA_VISIBLE_DEVICES to the assigned ids, so torch sees them as cuda:0..N-1 in the
    order that variable lists them; where it lists other ids (Ray told not to set it), an
    assigned id is found at its position there, and with the variable unset the ids are torch's.
    """
    if device.type != "cuda" or len(assigned_gpus) <= 1:
        return [device]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    listed = [v.strip() for v in visible.split(",")] if visible is not None else None
    indices = []
    for gpu in assigned_gpus:
        if listed is not None and str(gpu) in listed:
            indices.append(listed.index(str(gpu)))
        elif listed is None and str(gpu).isdigit():
            indices.append(int(gpu))
        else:
            raise DeviceUnavailable(f"the cluster assigned this worker GPUs {', '.join(assigned_gpus)} but GPU "
                                    f"{gpu} is not among CUDA_VISIBLE_DEVICES={visible}")
    return [torch.device("cuda", i) for i in indices]


def cpu_model_name() -> str:
    """The CPU's model name (/proc/cpuinfo), for figures and caches that depend on the machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX tiles).

    Without them torch emulates bf16 on CPU, which is slower than fp32 and less accurate.
    """
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def resolve_dtype(spec: str | torch.dtype = DEFAULT_DTYPE, device: torch.device | str = "cpu") -> torch.dtype:
    """"auto" | "bf16"/"bfloat16" | "fp16"/"float16" | "fp32"/"float32" (or a torch.dtype) -> torch.dtype.

    "auto" follows the policy in the module docstring for `device`.
    """
    device = torch.device(device) if isinstance(device, str) else device
    if isinstance(spec, torch.dtype):
        if spec not in SUPPORTED_DTYPES:
            raise ValueError(f"unsupported model dtype {spec}; expected one of {SUPPORTED_DTYPES}")
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"dtype must be a string or torch.dtype, got {type(spec).__name__}")
    name = spec.strip().lower().removeprefix("torch.")
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        if device.type == "cpu":
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        return torch.float32
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {spec!r}; expected 'auto' or one of {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]


def configure_cpu_threads(num_threads: int | None = None) -> int:
    """Set torch's intra-op thread count and return it.

    Explicit `num_threads` wins; otherwise OMP_NUM_THREADS (Ray sets it to the CPUs it allotted
    to the actor, so two workers on one node do not fight over cores); otherwise the cores this
    process may run on. Oversubscribing threads on a shared node costs more than it gains.
    """
    source = "argument"
    if num_threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "").strip()
        if env:
            source = "OMP_NUM_THREADS"
            try:
                num_threads = int(env)
            except ValueError:
                raise ValueError(f"OMP_NUM_THREADS={env!r} is not an integer") from None
        else:
            source = "CPU affinity"
            num_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"number of CPU threads must be a positive integer, got {num_threads!r} (from {source})")
    torch.set_num_threads(num_threads)
    log.debug("torch intra-op threads = %d (from %s)", num_threads, source)
    return num_threads
