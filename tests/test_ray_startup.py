"""Where a job's Ray is (issue #50): a run without an address starts a private Ray on loopback,
whatever cluster Ray's session record on the machine names; an address that does not answer
stops the job at start-up in seconds; SIGTERM stops the driver in seconds and keeps its parts.

The jobs run as `python -m pipeline.run` in a process of their own, each with RAY_TMPDIR set to a
temp dir of the test's (Ray's session record and session dirs go there, so nothing here sees or
stops another Ray on the machine), on the tiny target with mode ar and one worker.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray

from pipeline.data.outputs import read_output, written_rows
from pipeline.run import SUMMARY_NAME, main
from pipeline.startup.ray_connection import LOOPBACK, RayTarget, check_reachable, ray_target
from tests.ray_processes import free_port, kill_ray_processes_under, short_temp_dir
from tests.test_pipeline_run import config_file, write_inputs

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 600  # generous: a loaded 2-core CI machine starts Ray and torch workers slowly


@pytest.fixture
def ray_tmp():
    """RAY_TMPDIR of this test's jobs; every process started under it is killed afterwards."""
    path = short_temp_dir("r50-")
    try:
        yield Path(path)
    finally:
        kill_ray_processes_under(path)
        shutil.rmtree(path, ignore_errors=True)


def job_env(ray_tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "PYTHONPATH": str(REPO), "RAY_TMPDIR": str(ray_tmp)}


def small_job(tmp_path: Path, artifacts: dict, good: int, **extra) -> tuple[Path, Path, int]:
    """(config, output dir, rows the job writes): mode ar, one worker, a part every two rows."""
    write_inputs(tmp_path / "in.jsonl", good=good)
    out = tmp_path / "out"
    settings = {"decoding__mode": "ar", "model__draft_head": None, "model__trie": None, "resources__num_workers": 1,
                "resources__batch_size": 1, "output__rows_per_file": 2, **extra}
    return config_file(tmp_path, artifacts, [str(tmp_path / "in.jsonl")], str(out), **settings), out, good + 6


def start_job(config: Path, ray_tmp: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline.run", str(config), *overrides], cwd=config.parent,
                            env=job_env(ray_tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def job_processes(proc: subprocess.Popen, ray_tmp: Path, every_process: bool = True) -> list[psutil.Process]:
    """The driver and its descendants (Ray's GCS, raylet, agents and workers are), and with
    `every_process` also any process whose command line names the job's Ray temp dir (one that
    outlived the driver; that scan reads every process of the machine, so it is not polled)."""
    found: dict[int, psutil.Process] = {}
    try:
        driver = psutil.Process(proc.pid)
        found[driver.pid] = driver
        found.update((p.pid, p) for p in driver.children(recursive=True))
    except psutil.NoSuchProcess:
        pass
    if every_process:
        for p in psutil.process_iter(["cmdline"]):
            if str(ray_tmp) in " ".join(p.info["cmdline"] or []):
                found.setdefault(p.pid, p)
    return list(found.values())


def names(processes: list[psutil.Process]) -> set[str]:
    found = set()
    for p in processes:
        with contextlib.suppress(psutil.Error):  # ended meanwhile
            found.add(p.name())
    return found


def listening_addresses(processes: list[psutil.Process]) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket and bound UDP socket."""
    found = []
    for p in processes:
        try:
            name = p.name()
            for c in p.net_connections(kind="inet"):
                listening = c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and c.laddr and not c.raddr)
                if listening:
                    found.append((name, c.laddr.ip, c.laddr.port))
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return found


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def wait_for(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the job did not end within {timeout_s:.0f} s:\n{err[-3000:]}")


# ------------------------------------------------------------------------------- local runs


@pytest.mark.slow
def test_a_stale_record_of_a_dead_cluster_is_ignored_and_every_ray_socket_is_on_loopback(
        tmp_path, tiny_artifacts, ray_tmp):
    """Ray's session record names a cluster whose GCS is gone (its port closed): the job starts a
    Ray of its own and finishes; while it runs, no process of it listens outside loopback."""
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
    config, out, rows = small_job(tmp_path, tiny_artifacts, good=4)
    proc = start_job(config, ray_tmp)
    seen, outside = set(), set()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        for name, ip, port in listening_addresses(job_processes(proc, ray_tmp, every_process=False)):
            seen.add(name)
            if not is_loopback(ip):
                outside.add((name, ip, port))
        time.sleep(0.5)
    _, err = wait_for(proc, max(1.0, deadline - time.monotonic()))
    assert proc.returncode == 0, err[-3000:]
    keys = read_output(str(out))["row_key"].to_pylist()
    assert len(keys) == len(set(keys)) == rows
    assert not outside, f"listening beyond loopback: {sorted(outside)}"
    assert {"gcs_server", "raylet"} <= seen, f"the job's Ray was never seen listening: {seen}"


@pytest.mark.slow
def test_sigterm_mid_job_stops_the_driver_in_seconds_and_resume_writes_every_row_once(
        tmp_path, tiny_artifacts, ray_tmp, shared_ray):
    config, out, rows = small_job(tmp_path, tiny_artifacts, good=14, decoding__max_new_tokens=16)
    proc = start_job(config, ray_tmp)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while proc.poll() is None and not list(out.glob("part-*.parquet")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, "the job ended before its first part: " + proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, err = wait_for(proc, 30)
    assert time.monotonic() - sent < 10, f"the driver took {time.monotonic() - sent:.1f} s to stop"
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    on_disk = written_rows(str(out))
    assert 0 < on_disk < rows
    note = next(line for line in err.splitlines() if line.startswith("stopped by SIGTERM: "))
    assert f"every part already written under {out} is kept ({on_disk} rows of this run on storage" in note, note
    assert "run.resume=true" in note
    assert not (out / SUMMARY_NAME).exists()
    _, alive = psutil.wait_procs(job_processes(proc, ray_tmp), timeout=10)
    assert not alive, f"the job's Ray outlived it: {[p.pid for p in alive]}"

    assert main([str(config), "run.resume=true"]) == 0  # on the session's Ray: RAY_ADDRESS
    keys = read_output(str(out))["row_key"].to_pylist()
    assert len(keys) == len(set(keys)) == rows
    summary = json.loads((out / SUMMARY_NAME).read_text())["this_run"]
    assert summary["rows_skipped_as_done"] == on_disk and summary["rows"] == rows - on_disk


def test_sigterm_while_ray_starts_stops_the_driver_and_its_ray(tmp_path, tiny_artifacts, ray_tmp):
    config, out, _ = small_job(tmp_path, tiny_artifacts, good=2)
    proc = start_job(config, ray_tmp)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline and "gcs_server" not in names(
            job_processes(proc, ray_tmp, every_process=False)):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, err = wait_for(proc, 30)
    assert time.monotonic() - sent < 10, f"the driver took {time.monotonic() - sent:.1f} s to stop"
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert any(line.startswith("stopped by SIGTERM: ") for line in err.splitlines()), err[-3000:]
    _, alive = psutil.wait_procs(job_processes(proc, ray_tmp), timeout=10)
    assert not alive, f"the job's Ray outlived it: {[(p.pid, p.name()) for p in alive]}"
    assert not list(out.glob("part-*.parquet"))


# --------------------------------------------------------------------------- given addresses


@pytest.fixture
def no_ray(monkeypatch):
    ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("how", ["run.ray_address", "RAY_ADDRESS"])
@pytest.mark.parametrize("dry_run", [False, True])
def test_an_address_that_does_not_answer_stops_the_job_in_seconds_with_one_line(
        tmp_path, tiny_artifacts, no_ray, monkeypatch, capsys, how, dry_run):
    config, out, _ = small_job(tmp_path, tiny_artifacts, good=2)
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    overrides = [f"run.ray_address={address}"] if how == "run.ray_address" else []
    if how == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", address)
    capsys.readouterr()
    began = time.monotonic()
    assert main([str(config), *overrides, *(["--dry-run"] if dry_run else [])]) == 2
    assert time.monotonic() - began < 30
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot reach the Ray cluster at {address} ({how}): ") and "\n" not in err, err
    assert f"ray status --address {address}" in err and f"unset {how}" in err
    assert not out.exists()


def test_an_open_port_without_ray_behind_it_fails_within_the_deadline():
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind((LOOPBACK, 0))
        silent.listen()
        address = f"{LOOPBACK}:{silent.getsockname()[1]}"
        began = time.monotonic()
        with pytest.raises(Exception, match=f"cannot reach the Ray cluster at {address} .*port .* is open but"):
            check_reachable(RayTarget(address, "run.ray_address"), timeout_s=3)
        assert time.monotonic() - began < 10


def test_the_config_key_wins_over_the_environment_and_neither_means_local(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_target(None) == RayTarget(None, "local")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert ray_target(None) == RayTarget("10.0.0.5:6379", "RAY_ADDRESS")
    assert ray_target(" 10.0.0.6:6379 ") == RayTarget("10.0.0.6:6379", "run.ray_address")
