"""Stopping the Ray processes of one test's cluster, and only those.

`ray stop` kills every Ray process on the machine, including clusters of other test runs,
so tests that start Ray out of process give it a temp dir of its own and clean up by it.
"""

from __future__ import annotations

import contextlib
import tempfile
import time

import psutil


def short_temp_dir(prefix: str) -> str:
    """A temp dir under /tmp with a short path: Ray's unix socket paths have a length limit."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def kill_ray_processes_under(temp_dir: str, timeout_s: float = 10.0) -> int:
    """SIGKILL every process whose command line mentions `temp_dir`; returns how many."""
    victims = []
    for proc in psutil.process_iter(["cmdline"]):
        if temp_dir in " ".join(proc.info["cmdline"] or []):
            with contextlib.suppress(psutil.Error):
                proc.kill()
                victims.append(proc)
    psutil.wait_procs(victims, timeout=timeout_s)
    time.sleep(0.2)
    return len(victims)
