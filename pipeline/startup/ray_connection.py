"""Where the job's Ray is, and stopping it when told.

Two cases, and nothing in between:

- **An address is given** (`run.ray_address`, else `RAY_ADDRESS`, which `ray job submit` and
  KubeRay set): the job connects there and only there. The address is checked first, with a
  deadline (`CONNECT_TIMEOUT_S`): a port that refuses, a host that does not answer or a GCS that
  does not reply stops the job at start-up with one line naming the address, instead of Ray's own
  connect loop, which retries for minutes and does not return to Python for a signal.
- **No address**: a private Ray instance is started for this job (`ray.init(address="local")`),
  never one some other process started. A bare `ray.init()` attaches to whatever cluster Ray's
  session record on the machine names (`$RAY_TMPDIR/ray/ray_current_cluster`, default /tmp/ray),
  dead or alive, another user's included. Every process of the private instance binds to
  127.0.0.1: Ray's single-machine mode (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, its default on
  macOS and Windows) makes the node's address loopback, and every gRPC and HTTP server of Ray
  listens on the node's address; `ray.init(_node_ip_address="127.0.0.1")` alone does not do it
  (Ray 2.60 replaces a loopback node address by the machine's network address). Ray's ports
  carry unauthenticated job submission (CVE-2023-48022); a single-machine job has no reason to
  listen beyond the machine.

SIGTERM (what Kubernetes sends before it kills a pod) and SIGINT raise `JobStopped` in the main
thread, so the driver unwinds: the local Ray it started is shut down, the parts already written
stay (each is written atomically), and run.py says how to resume. A second signal ends the
process at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import ray

from pipeline.startup.preflight import StartupError

log = logging.getLogger("pipeline")

# A named cluster that has not answered within this long stops the job (the check, then ray.init).
CONNECT_TIMEOUT_S = 30.0
LOOPBACK = "127.0.0.1"
# Ray's own switch for single-machine mode (ray._private.ray_constants.ENABLE_RAY_CLUSTER).
_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class JobStopped(BaseException):
    """SIGTERM or SIGINT arrived: the driver unwinds (a BaseException, so no `except Exception`
    on the way swallows it). `note` is filled in by whoever knows what was written."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.note: str | None = None

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's convention for a process ended by a signal


@dataclass(frozen=True)
class RayTarget:
    """Where the job runs: `address` None means a private local instance."""

    address: str | None
    source: str  # "run.ray_address", "RAY_ADDRESS" or "local"

    def describe(self) -> str:
        if self.address is None:
            return f"a private local Ray on {LOOPBACK}, started for this job"
        return f"the Ray cluster at {self.address} ({self.source})"


def ray_target(ray_address: str | None) -> RayTarget:
    """`run.ray_address` if set, else RAY_ADDRESS, else a private local instance."""
    if ray_address:
        return RayTarget(ray_address.strip(), "run.ray_address")
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env:
        return RayTarget(env, "RAY_ADDRESS")
    return RayTarget(None, "local")


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a GCS or Ray client address; None for forms only Ray resolves ("auto")."""
    rest = address.split("://", 1)[1] if "://" in address else address
    rest = rest.split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _unreachable(target: RayTarget, why: str) -> StartupError:
    unset = "unset run.ray_address" if target.source == "run.ray_address" else "unset RAY_ADDRESS"
    return StartupError(
        f"cannot reach the Ray cluster at {target.address} ({target.source}): {why}; check that the cluster "
        f"is up (ray status --address {target.address}) and reachable from this machine, or {unset} to run "
        f"on a private local Ray")


def check_reachable(target: RayTarget, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise StartupError (one line naming the address and what to check) unless the cluster at
    `target.address` answers within `timeout_s`: a TCP connection to its port, then, for a GCS
    address, a read from the GCS (`_ask_gcs`)."""
    if target.address is None:
        return
    deadline = time.monotonic() + timeout_s
    where = _host_port(target.address)
    if where is None:
        if target.address != "auto":
            raise _unreachable(target, "not an address of the form host:port or ray://host:port")
        return  # "auto": Ray's own discovery, asked for by name; ray.init reports what it finds
    host, port = where
    try:
        with socket.create_connection((host, port), timeout=max(1.0, deadline - time.monotonic())):
            pass
    except socket.gaierror as exc:
        raise _unreachable(target, f"cannot resolve {host!r} ({exc.strerror})") from None
    except TimeoutError:
        raise _unreachable(target, f"no answer from {host}:{port} within {timeout_s:.0f} s") from None
    except OSError as exc:
        raise _unreachable(target, f"{exc.strerror or exc} at {host}:{port}") from None
    if "://" in target.address:
        return  # a Ray client server: ray.init reports its own protocol errors
    problem = _ask_gcs(target.address, max(1.0, deadline - time.monotonic()))
    if problem is not None:
        raise _unreachable(target, f"port {port} is open but {problem}")


def _ask_gcs(address: str, timeout_s: float) -> str | None:
    """None when a Ray GCS at `address` answers a read within `timeout_s`, else why not. Ray's
    GCS client blocks in C++ (about 40 s against a silent port), so it is asked from a daemon
    thread that is abandoned at the deadline: the job stops then anyway."""
    answer: dict[str, BaseException | bool] = {}

    def ask() -> None:
        try:
            from ray._raylet import GcsClient

            GcsClient(address=address).internal_kv_get(b"dart-probe", namespace=None, timeout=timeout_s)
            answer["ok"] = True
        except Exception as exc:  # RpcError, ValueError (a bad address), an auth failure
            answer["error"] = exc

    probe = threading.Thread(target=ask, name="ray-gcs-probe", daemon=True)
    probe.start()
    probe.join(timeout_s)
    if "ok" in answer:
        return None
    if "error" in answer:
        return f"Ray's GCS did not answer ({type(answer['error']).__name__}: {str(answer['error'])[:200]})"
    return f"no Ray GCS answered within {timeout_s:.0f} s"


def _start_local(num_cpus: int | None) -> None:
    """ray.init of a private instance whose every process listens on loopback only."""
    from ray._private import ray_constants

    # The Ray processes started below read the variable at import (the raylet's workers inherit it
    # from the raylet); this process imported Ray already, so its copy of the flag is set too. Both
    # are put back afterwards: a `ray start --address` run from this process later must still work.
    previous_env = os.environ.get(_SINGLE_MACHINE_ENV)
    previous = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_SINGLE_MACHINE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address="local", num_cpus=num_cpus, _node_ip_address=LOOPBACK, dashboard_host=LOOPBACK,
                 logging_level="WARNING")
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = previous
        if previous_env is None:
            os.environ.pop(_SINGLE_MACHINE_ENV, None)
        else:
            os.environ[_SINGLE_MACHINE_ENV] = previous_env


@contextlib.contextmanager
def job_ray(target: RayTarget, num_cpus: int | None = None) -> Iterator[bool]:
    """Connected to `target` for the block; yields whether this job started Ray itself (then it is
    shut down on the way out, whatever ends the block). A caller that has already connected this
    process to Ray (a test, an embedding program) keeps its connection and its Ray."""
    if ray.is_initialized():
        yield False
        return
    started = target.address is None
    try:
        try:
            if started:
                _start_local(num_cpus)
            else:
                check_reachable(target)
                ray.init(address=target.address, logging_level="WARNING")
        except SystemExit as exc:  # ray.init's own SIGTERM handler (sys.exit(SIGTERM)) while it starts
            if exc.code == signal.SIGTERM:
                raise JobStopped(signal.SIGTERM) from None
            raise
        finally:
            _reinstall_stop_handlers()  # ray.init replaced the SIGTERM handler with its own
        yield started
    finally:
        if started or ray.is_initialized():
            began = time.monotonic()
            ray.shutdown()
            log.info("%s Ray in %.1f s", "stopped the local" if started else "disconnected from the",
                     time.monotonic() - began)


# ------------------------------------------------------------------------------------ signals

_installed: dict[int, object] = {}
_stopping: list[int] = []


def _on_signal(signum: int, frame) -> None:
    if _stopping:  # the second signal: stop now, without unwinding
        os._exit(128 + signum)
    _stopping.append(signum)
    raise JobStopped(signum)


def _reinstall_stop_handlers() -> None:
    if _installed and not _stopping:
        for signum in _installed:
            signal.signal(signum, _on_signal)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise JobStopped in the main thread for the block (elsewhere: no change,
    Python lets only the main thread set handlers); the previous handlers are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _stopping.clear()
    for signum in (signal.SIGTERM, signal.SIGINT):
        _installed[signum] = signal.signal(signum, _on_signal)
    try:
        yield
    finally:
        for signum, previous in _installed.items():
            signal.signal(signum, previous)
        _installed.clear()
        _stopping.clear()
