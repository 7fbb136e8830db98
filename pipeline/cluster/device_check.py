"""Which device the workers decode on, decided by what Ray assigns them, and checked before any work.

A worker's device follows its Ray reservation (`dart_worker.hardware.device.resolve_worker_device`): GPUs
reserved (`resources.num_gpus_per_worker > 0`) means CUDA, none means the CPU. What can go wrong
only shows on the worker's node: a torch without CUDA, or a driver older than the wheel's CUDA.
So before the dataset starts, one probe task with a worker's exact resources resolves the
device there; a problem stops the job at start-up with that one line (exit 2), instead of every
actor failing, or worse, a GPU job decoding on CPUs. Each worker resolves its device the same way
again when it starts (nodes of a cluster may differ), and `worker_failure` turns such an actor
failure into the same one line.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import ray

from dart_worker.hardware.device import DeviceUnavailable, resolve_dtype, resolve_worker_device
from dart_worker.hardware.kernels import describe
from pipeline.cluster.remote_errors import exception_chain
from pipeline.settings.config import PipelineConfig

log = logging.getLogger(__name__)

# The line a worker's traceback text ends with: the exception's qualified name (its module's path).
_REMOTE_DEVICE_ERROR = re.compile(re.escape(f"{DeviceUnavailable.__module__}.{DeviceUnavailable.__name__}: ")
                                  + "(.+)$", re.MULTILINE)


def assigned_gpus() -> list[str]:
    """GPU ids Ray assigned to the calling task or actor (empty outside Ray or without GPUs)."""
    if not ray.is_initialized():
        return []
    return [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def worker_device_report(model_device: str, model_dtype: str) -> dict[str, Any]:
    """Resolve the device here, as a worker would, and describe it (raises DeviceUnavailable)."""
    import socket

    import torch

    gpus = assigned_gpus()
    device = resolve_worker_device(model_device, gpus)
    dtype = resolve_dtype(model_dtype, device)
    report = {"node": socket.gethostname(), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
              "assigned_gpus": gpus, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
              "kernels": describe(device, dtype)}
    if device.type == "cuda":
        report["gpu_name"] = torch.cuda.get_device_name(device)
    return report


def planned_device(cfg: PipelineConfig) -> str:
    """The device each worker will use, from the config alone (what `--dry-run` prints)."""
    spec, gpus = cfg.model.device, cfg.resources.num_gpus_per_worker
    if gpus > 0:
        name = "cuda" if spec.strip().lower() == "auto" else spec
        return f"{name} ({gpus:g} Ray GPU per worker; checked on the worker's node at start-up)"
    return "cpu (no GPU reserved: resources.num_gpus_per_worker=0)"


class DeviceProbe:
    """The probe task, started: `result()` waits for its report. Started before the duplicate pass,
    so the probe's process start and torch import run while the inputs are read."""

    def __init__(self, ref: Any, external: bool) -> None:
        self._ref, self._external = ref, external

    def result(self) -> dict[str, Any]:
        """The worker's device report; a device problem there is a DeviceUnavailable with its line."""
        try:
            report = ray.get(self._ref)
        except Exception as exc:
            line = worker_failure(exc)
            if line is None:
                raise
            raise DeviceUnavailable(line) from None
        if report["device"] == "cpu" and not self._external:
            try:
                import torch

                if torch.cuda.is_available():
                    log.warning("torch sees %d CUDA device(s) here, but the job reserves no GPU per worker "
                                "(resources.num_gpus_per_worker=0): workers decode on CPUs",
                                torch.cuda.device_count())
            except Exception:  # only a hint; never a reason to stop
                pass
        return report


def start_probe(cfg: PipelineConfig) -> DeviceProbe:
    """Start one task with a worker's resources (a cluster with too few GPUs for a local job is a
    DeviceUnavailable here, at once); its report comes from `DeviceProbe.result()`."""
    r = cfg.resources
    # A cluster joined, not started here: pipeline.startup.ray_connection.ray_target's rule, spelled out so
    # that this module (imported by the workers) stays clear of the driver's start-up modules.
    external = bool(cfg.run.ray_address or os.environ.get("RAY_ADDRESS", "").strip())
    gpus_here = ray.cluster_resources().get("GPU", 0.0)
    if r.num_gpus_per_worker > 0 and gpus_here < r.num_gpus_per_worker:
        message = (f"resources.num_gpus_per_worker={r.num_gpus_per_worker:g} but the Ray cluster has "
                   f"{gpus_here:g} GPU(s)")
        if not external:
            raise DeviceUnavailable(message + " (a local Ray instance: set num_gpus_per_worker=0 to run on CPUs)")
        log.warning("%s; waiting for the autoscaler to add a GPU node", message)
    probe = ray.remote(worker_device_report).options(num_cpus=min(r.num_cpus_per_worker, 1.0),
                                                     num_gpus=r.num_gpus_per_worker or None, max_retries=0)
    return DeviceProbe(probe.remote(cfg.model.device, cfg.model.dtype), external)


def worker_failure(exc: BaseException) -> str | None:
    """The DeviceUnavailable line behind a failed Ray task or actor (None if that is not the cause).

    Ray re-raises a remote exception as a RayTaskError subclass of the original type when it can,
    and otherwise (an actor that died in its constructor) only carries the traceback text.
    """
    for e in exception_chain(exc):
        cause = getattr(e, "cause", None)
        if isinstance(e, DeviceUnavailable) and not isinstance(cause, DeviceUnavailable):
            found = _REMOTE_DEVICE_ERROR.search(str(e))
            return found.group(1) if found else str(e)
    found = _REMOTE_DEVICE_ERROR.search(str(exc))
    return found.group(1) if found else None
