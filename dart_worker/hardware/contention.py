"""How much of a timed stretch this process spent waiting for a CPU that other work held.

Timings that are cached and reused by later processes (the verify-cost calibration) must not be
taken while something else loads the machine: a curve measured under heavy load (every size
slowed, and the larger ones flattened by the same load) made every later job on the machine
believe a plain step costs several times what it does, so trees looked cheap and a sampling job
ran slower than `ar` (docs/benchmarks.md has the figures). Wall time alone cannot tell a slow machine
from a busy one; the kernel can: /proc/<pid>/task/<tid>/schedstat holds, per thread, the
nanoseconds it sat runnable on a run queue waiting for a CPU. Summed over this process's threads
and divided by the wall time of the stretch, that is how many of our threads were waiting on
average; divided again by the compute threads torch runs, the share of our compute lost to
other work. Linux only: elsewhere the share is unknown (None) and callers treat it as quiet.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

_TASKS = Path("/proc/self/task")
# Above this share of the compute threads' time spent waiting, a timing is "contended": one
# thread in ten waiting on average. A quiet machine measures ~0.00-0.02; another process
# spinning on each core measures ~0.5.
MAX_QUIET_SHARE = 0.1


def run_queue_seconds() -> float | None:
    """Seconds this process's live threads have waited runnable for a CPU since they started;
    None where the kernel does not report it."""
    total = 0
    try:
        tasks = list(_TASKS.iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
        except (OSError, ValueError, IndexError):
            return None
    return total / 1e9


class ContentionMeter:
    """`with ContentionMeter() as meter: ...` then `meter.share`: the share of this process's
    compute threads' time spent waiting for a CPU during the block (None: unknown)."""

    def __init__(self, threads: int | None = None):
        self.threads = threads or torch.get_num_threads()
        self.share: float | None = None
        self.wall_seconds = 0.0

    def __enter__(self) -> ContentionMeter:
        self._wait = run_queue_seconds()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_seconds = time.perf_counter() - self._start
        waited = run_queue_seconds()
        if self._wait is None or waited is None or self.wall_seconds <= 0:
            self.share = None
            return
        # A thread that ended inside the block takes its count with it: never below zero.
        self.share = max(0.0, waited - self._wait) / (self.wall_seconds * max(1, self.threads))

    @property
    def quiet(self) -> bool:
        """True unless the block measurably waited on other work (unknown counts as quiet)."""
        return self.share is None or self.share <= MAX_QUIET_SHARE

    def describe(self) -> str:
        if self.share is None:
            return "CPU contention unknown"
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
        return (f"{self.share:.0%} of {self.threads} compute threads' time spent waiting for a CPU "
                f"(load average {load} on {os.cpu_count()} cores)")
