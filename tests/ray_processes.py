"""Ray clusters that tests start out of process, and stopping them (and only them).

`ray stop` kills every Ray process on the machine, including clusters of other test runs,
so a test that starts Ray out of process gives it a temp dir of its own and cleans up by it.

`start_ray_head` starts a head with every port it opens chosen free (GCS, raylet, object
manager, dashboard, dashboard agent, runtime-env agent, metrics, Ray client): Ray's defaults
(8265, 52365, 10001, ...) collide with any other Ray cluster on the machine, and a head whose
dashboard agent could not bind its port never registers it, so `ray job submit` answers "No
available agent" until it gives up. Every head binds 127.0.0.1 only: Ray's single-machine mode
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, as pipeline/startup/ray_connection.py uses for a local job; without
it Ray 2.60 turns `--node-ip-address=127.0.0.1` into the machine's network address and its
servers listen on every interface), `--node-ip-address=127.0.0.1`, the dashboard on 127.0.0.1.
Drivers that connect must be in the same mode (tests/conftest.py sets it for the test run).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

import psutil

# Names of this process's variables that a Ray job started here hands to its workers
# (`forward_env_hook`), space-separated. Workers of a cluster started out of process inherit
# the environment of `ray start`, not the driver's.
FORWARD_ENV_VAR = "DART_TEST_FORWARD_ENV"


def short_temp_dir(prefix: str) -> str:
    """A temp dir under /tmp with a short path: Ray's unix socket paths have a length limit."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_ray_processes_under(temp_dir: str, timeout_s: float = 10.0) -> int:
    """SIGKILL every process whose command line mentions `temp_dir`; returns how many."""
    victims = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if temp_dir in " ".join(proc.info["cmdline"] or []):
                proc.kill()
                victims.append(proc)
    psutil.wait_procs(victims, timeout=timeout_s)
    return len(victims)


@dataclass
class RayHead:
    """A single-node Ray cluster started with `ray start --head` in a temp dir of its own."""

    address: str  # GCS address, what ray.init(address=...) and RAY_ADDRESS take
    temp_dir: str
    agent_port: int  # the dashboard agent's HTTP port (job agent, health checks)
    dashboard_url: str | None  # http://127.0.0.1:<port> when started with the dashboard
    env: dict[str, str]  # the environment `ray start` ran with (its workers inherit it)

    def ray_cli(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        """The `ray` CLI of this interpreter's Ray (not whichever `ray` is first on PATH: in the
        dependency floors' venv that is another Ray version, which drivers here refuse)."""
        return subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], env=self.env,
                              capture_output=True, text=True, check=check, timeout=timeout)

    def wait_for_job_agent(self, timeout_s: float = 240.0) -> None:
        """Ask the head's dashboard agent until it answers its health check (the job agent
        serves on the same HTTP server, and registers itself with the head as that server
        starts); raises naming the agent's log if it never does."""
        url = f"http://127.0.0.1:{self.agent_port}/api/healthz"
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=5) as answer:
                    if answer.status == 200:
                        return
                    last = f"HTTP {answer.status}"
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}: {exc.read()[:200]!r}"
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                last = repr(exc)
            time.sleep(0.25)
        raise TimeoutError(f"the dashboard agent at {url} did not answer healthy within {timeout_s:.0f} s "
                           f"(last: {last}); see {self.temp_dir}/session_latest/logs/dashboard_agent.log")

    def stop(self) -> None:
        kill_ray_processes_under(self.temp_dir)  # `ray stop` would stop every Ray cluster on the machine
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_ray_head(num_cpus: int = 2, env: Mapping[str, str] | None = None, dashboard: bool = False,
                   prefix: str = "rh-", extra_args: tuple[str, ...] = ()) -> RayHead:
    """`ray start --head` bound to 127.0.0.1 with every port chosen free; `env` is the whole
    environment of `ray start` (default: this process's, without RAY_ADDRESS). With
    RAY_AUTH_MODE=token there (tests/conftest.py sets it for the suite, as Ray 2.60 itself does
    for the first local `ray.init`), the head and every driver use ~/.ray/auth_token."""
    env = dict(os.environ if env is None else env)
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # single-machine mode: 127.0.0.1 only
    temp_dir = short_temp_dir(prefix)
    gcs_port, agent_port, dashboard_port = free_port(), free_port(), free_port()
    args = ["start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}", f"--num-cpus={num_cpus}",
            f"--temp-dir={temp_dir}", "--disable-usage-stats",
            f"--dashboard-agent-listen-port={agent_port}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
            f"--ray-client-server-port={free_port()}", f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}", f"--include-dashboard={'true' if dashboard else 'false'}",
            *extra_args]
    head = RayHead(address=f"127.0.0.1:{gcs_port}", temp_dir=temp_dir, agent_port=agent_port,
                   dashboard_url=f"http://127.0.0.1:{dashboard_port}" if dashboard else None, env=env)
    try:
        if env.get("RAY_AUTH_MODE", "").lower() == "token":  # the token in ~/.ray/auth_token, made if missing
            head.ray_cli("get-auth-token", "--generate", timeout=120)
        head.ray_cli(*args, timeout=180)
    except subprocess.CalledProcessError as exc:
        head.stop()
        raise RuntimeError(f"ray start failed:\n{exc.stdout[-3000:]}\n{exc.stderr[-3000:]}") from None
    except BaseException:
        head.stop()
        raise
    return head


def forward_env_hook(runtime_env: dict | None) -> dict:
    """A `RAY_RUNTIME_ENV_HOOK` (Ray calls it in `ray.init` with the job's runtime_env): adds this
    process's values of the variables named in $DART_TEST_FORWARD_ENV to the job's env_vars, so a
    job that joins a cluster started earlier hands its workers what a test set for them (a crash
    hook, an S3 endpoint), as a private `ray.init` would by inheritance."""
    runtime_env = dict(runtime_env or {})
    names = os.environ.get(FORWARD_ENV_VAR, "").split()
    forwarded = {name: os.environ[name] for name in names if name in os.environ}
    if forwarded:
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **forwarded}
    return runtime_env

