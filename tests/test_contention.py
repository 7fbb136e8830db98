"""The CPU-contention meter that keeps timings taken under load out of the calibration cache."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from dart_worker.hardware import contention
from dart_worker.hardware.contention import MAX_QUIET_SHARE, ContentionMeter, run_queue_seconds

linux_only = pytest.mark.skipif(run_queue_seconds() is None, reason="no /proc/<pid>/task/*/schedstat here")


def _matmuls(seconds: float) -> None:
    a = torch.randn(512, 512)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


@linux_only
def test_work_beside_a_spinning_process_per_core_is_contended():
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        time.sleep(0.3)
        with ContentionMeter() as meter:
            _matmuls(1.5)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert meter.share is not None and meter.share > MAX_QUIET_SHARE, meter.describe()
    assert not meter.quiet and "waiting for a CPU" in meter.describe()


def test_the_share_is_waiting_over_wall_time_and_compute_threads(monkeypatch):
    waits = iter([10.0, 10.6])  # 0.6 s of waiting summed over threads
    clock = iter([100.0, 101.0])  # in 1 s of wall time
    monkeypatch.setattr(contention, "run_queue_seconds", lambda: next(waits))
    monkeypatch.setattr(contention.time, "perf_counter", lambda: next(clock))
    with ContentionMeter(threads=2) as meter:
        pass
    assert meter.share == pytest.approx(0.3) and not meter.quiet


def test_without_schedstat_the_share_is_unknown_and_counts_as_quiet(monkeypatch):
    monkeypatch.setattr(contention, "_TASKS", contention.Path("/nonexistent/task"))
    assert run_queue_seconds() is None
    with ContentionMeter() as meter:
        pass
    assert meter.share is None and meter.quiet and meter.describe() == "CPU contention unknown"
