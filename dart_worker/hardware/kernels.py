"""Kernel strategies: where devices want different kernels for the same result, the choice is made here.

A decoding round has a few places where the fastest kernel depends on the device and dtype, while
the result must not: the engine is lossless on every device only if every strategy computes the
same thing. Each such choice is a named strategy, picked in one function of this module from the
device and dtype alone, and the CPU test suite runs every strategy (the GPU ones included) on CPU
tensors (`forced`), so no result can depend on a branch that only one kind of device takes.

- `projection` (a few hidden rows onto a vocabulary): `weight_first` (`W @ rows^T`) or `linear`
  (`rows @ W^T`, what `nn.Linear` computes). Preferred: `weight_first` for float32 on a CPU (MKL
  runs a few rows faster that way round, see projection.py), `linear` elsewhere.
- `warp` (temperature / top-k / top-p over a vocabulary): `candidates` (only the few tokens that
  can survive; host syncs) or `dense` (whole rows, no host syncs). Preferred: `candidates` on a
  CPU, where a pass over 262k logits costs milliseconds and a sync is free; `dense` elsewhere.
- `logits` (which verify rows are projected): `deferred` (only the rows a greedy walk reads, a
  tree level at a time) or `batched` (every tree row in one product). Preferred: `deferred` on a
  CPU where a measurement says it pays; `batched` on an accelerator, where a walk would add a
  host round trip per tree level.

- `gqa` (masked tree attention over grouped K/V heads, `dart_worker.target.tree_attention`): `repeat`
  (transformers' own: K/V copied per query head), `pack` (each group's query heads folded into
  its K/V head's rows, the mask repeated instead) or `enable_gqa` (SDPA's own). Preferred:
  `repeat` on a CPU, `pack` on CUDA (see `gqa_for`).
- `shapes` (the verify forward's block): `bucketed` (the batch, rows per sequence, 1 + tree size,
  and the cached context rounded up to a few buckets, `dart_worker.target.shape_buckets`: padding rows
  see only themselves and nothing sees them, padding sequences after the live ones hold no
  context, verify an empty tree and commit nothing, stale context slots are masked, so results
  are identical; a GPU can capture each bucket's forward in a CUDA graph) or `exact` (the block
  as the trees make it, over the live sequences only). Preferred: `bucketed` on CUDA, `exact` on a
  CPU, where a padded row, sequence or context slot costs its full share of a forward (see
  `shapes_for`).

The target's attention implementation must take the ready-made tree masks: `dart_tree` (the
adapter installs it in place of `sdpa`), `sdpa` or `eager`; `TargetAdapter` refuses the others.

What is deliberately *not* a strategy: how the target's logits are produced. `TargetAdapter`
always runs the decoder and projects the rows it needs itself, on every device, instead of
handing a tensor `logits_to_keep` to the model's own forward, whose meaning changed between
transformers versions (4.x indexed `hidden[:, logits_to_keep]`, 5.x gathers per sample).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

PROJECTIONS = ("weight_first", "linear")
WARPS = ("candidates", "dense")
LOGITS = ("deferred", "batched")
GQAS = ("pack", "enable_gqa", "repeat")
SHAPES = ("bucketed", "exact")
STRATEGIES: dict[str, tuple[str, ...]] = {"projection": PROJECTIONS, "warp": WARPS, "logits": LOGITS, "gqa": GQAS,
                                          "shapes": SHAPES}

_FORCED: ContextVar[dict[str, str]] = ContextVar("dart_forced_kernels", default={})  # noqa: B039 (never mutated)


@contextmanager
def forced(**choices: str) -> Iterator[None]:
    """Use the named strategies whatever the device (tests run GPU strategies on CPU tensors;
    benchmarks compare strategies side by side). Example: `with forced(projection="linear"): ...`.

    Decisions made while the block runs follow it; an engine decides `logits` when it is built.
    """
    for name, value in choices.items():
        if name not in STRATEGIES:
            raise ValueError(f"unknown kernel choice {name!r}; expected one of {sorted(STRATEGIES)}")
        if value not in STRATEGIES[name]:
            raise ValueError(f"unknown {name} strategy {value!r}; expected one of {STRATEGIES[name]}")
    token = _FORCED.set({**_FORCED.get(), **choices})
    try:
        yield
    finally:
        _FORCED.reset(token)


def _forced(name: str) -> str | None:
    return _FORCED.get().get(name)


def projection_for(device: torch.device, dtype: torch.dtype) -> str:
    """Strategy for projecting rows of `dtype` on `device` (see the table in the module docstring)."""
    preferred = "weight_first" if device.type == "cpu" and dtype == torch.float32 else "linear"
    return _forced("projection") or preferred


def warp_for(device: torch.device) -> str:
    """Strategy for warping scores on `device` into probabilities."""
    return _forced("warp") or ("candidates" if device.type == "cpu" else "dense")


def logits_for(device: torch.device, deferral_pays: Callable[[], bool]) -> str:
    """Strategy for the verify forward's logits on `device`; `deferral_pays` measures (CPU only)."""
    choice = _forced("logits")
    if choice is not None:
        return choice
    return "deferred" if device.type == "cpu" and deferral_pays() else "batched"


def gqa_for(device: torch.device) -> str:
    """Strategy for masked tree attention over grouped K/V heads (`dart_worker.target.tree_attention`).

    On a CPU, `repeat` (transformers' own numerics; `python -m jobs.bench verify_shapes` prints
    all three side by side). On CUDA, `pack`:
    its memory-efficient SDPA kernel takes a mask and the unexpanded K/V, where `enable_gqa` with
    a mask falls back to the math kernel; `jobs.gpu_acceptance` times all three on the GPU."""
    return _forced("gqa") or ("repeat" if device.type == "cpu" else "pack")


def shapes_for(device: torch.device) -> str:
    """Strategy for the verify forward's shapes on `device`: `bucketed` on CUDA (static shapes a
    CUDA graph can capture; kernel launches are the round there at small batch), `exact` on a CPU,
    where padding costs its full share of the forward (`python -m jobs.bench engine
    bucketed_modes=[...]` runs both side by side; docs/benchmarks.md has the measurement)."""
    return _forced("shapes") or ("bucketed" if device.type == "cuda" else "exact")


def describe(device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """The strategies a worker on `device` with `dtype` uses, for reports and `--dry-run` (on a
    CPU, `logits` is decided by a measurement when the engine is built)."""
    logits = _forced("logits") or ("deferred if measured to pay" if device.type == "cpu" else "batched")
    return {"projection": projection_for(device, dtype), "warp": warp_for(device), "logits": logits,
            "gqa": gqa_for(device), "shapes": shapes_for(device)}
