"""A real S3-compatible server on loopback for tests: `moto_server` (from moto[server]) as a subprocess.

Usage in a test module (start the server before Ray, so that Ray workers get the same variables):

    from tests.s3_server import running_s3_server

    @pytest.fixture(scope="module")
    def s3():
        with running_s3_server(buckets=["inputs", "outputs"]) as server:
            yield server              # AWS_* variables are set in this process meanwhile

    @pytest.fixture(scope="module")
    def ray_session(s3, join_shared_ray):   # tests/conftest.py: forwards the AWS_* variables
        with join_shared_ray(connect=True):
            yield

`server.env` holds the endpoint, dummy credentials, region and fast-failing retry settings.
Ray workers do not see variables set in the driver after `ray.init`; the join hands them to the
job's workers in its runtime_env (which is also how a real job hands credentials to its workers
when they do not come from the nodes' environment or roles).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import pytest

START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    """A running moto_server; `stop()` ends it."""

    endpoint: str
    process: subprocess.Popen
    log_path: str
    buckets: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """Variables that point boto/s3fs at this server, with dummy credentials and one attempt per call."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_MAX_ATTEMPTS": "2",
            "AWS_RETRY_MODE": "standard",
        }

    def filesystem(self):
        """An s3fs filesystem bound to this server (independent of the process environment)."""
        import s3fs

        return s3fs.S3FileSystem(
            endpoint_url=self.endpoint,
            key="testing",
            secret="testing-secret",
            client_kwargs={"region_name": "us-east-1"},
            skip_instance_cache=True,
        )

    def create_bucket(self, name: str) -> None:
        import boto3  # installed with moto

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing-secret",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=name)
        self.buckets.append(name)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(os.path.dirname(self.log_path), ignore_errors=True)


def _moto_command() -> list[str]:
    executable = shutil.which("moto_server")
    if executable:
        return [executable]
    return [sys.executable, "-m", "moto.server"]


def start_s3_server(buckets: Iterable[str] = ()) -> S3Server:
    """Start moto_server on 127.0.0.1 on a free port, wait until it answers, create `buckets`.

    Skips the calling test when moto[server] is not installed; fails with the server's log when
    it does not come up.
    """
    pytest.importorskip("moto.server", reason="moto[server] is needed for the local S3 server")
    port = free_port()
    log_dir = tempfile.mkdtemp(prefix="moto-")
    log_path = os.path.join(log_dir, "moto.log")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*_moto_command(), "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    server = S3Server(endpoint=f"http://127.0.0.1:{port}", process=process, log_path=log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            log_text = server.log()
            server.stop()
            raise RuntimeError(f"moto_server exited with code {process.returncode}:\n{log_text}")
        try:
            with urllib.request.urlopen(server.endpoint + "/", timeout=1):
                break
        except urllib.error.HTTPError:  # any HTTP answer means the server is up
            break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                log_text = server.log()
                server.stop()
                raise RuntimeError(f"moto_server did not answer within {START_TIMEOUT_S} s:\n{log_text}") from None
            time.sleep(0.1)
    try:
        for bucket in buckets:
            server.create_bucket(bucket)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def running_s3_server(buckets: Iterable[str] = ()) -> Iterator[S3Server]:
    """A started server with its `env` set in this process (restored afterwards); stopped on exit.

    Uses pytest.MonkeyPatch so it works in fixtures of any scope.
    """
    server = start_s3_server(buckets)
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, value in server.env.items():
                mp.setenv(name, value)
            for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
                mp.delenv(name, raising=False)
            forget_cached_s3_filesystems()
            yield server
    finally:
        server.stop()
        forget_cached_s3_filesystems()


def use_s3_server(monkeypatch: pytest.MonkeyPatch, server: S3Server) -> None:
    """Point this test's environment at `server` (function-scoped variant of running_s3_server's env)."""
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    forget_cached_s3_filesystems()


def forget_cached_s3_filesystems() -> None:
    """Drop s3fs' cached filesystems, so the next `fsspec.filesystem("s3")` reads the environment again.

    fsspec caches a filesystem per constructor arguments, not per environment: without this, a
    test that points AWS_ENDPOINT_URL at its server can be handed a filesystem an earlier module
    made for a server that has since stopped (CI's one failure at 9ff21f8: test_openai_batch after
    test_inputs' module server, "Could not connect to the endpoint URL").
    """
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
