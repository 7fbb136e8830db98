"""`flaky://`: local files behind an fsspec filesystem whose reads fail on demand, for I/O-failure tests.

With FLAKY_FS_FAIL=<file name>:<state dir> set (in the driver and the Ray workers), and the
file <state dir>/allow holding a number N, the opens of that file are counted across processes
and every one after the first N fails with an OSError, as a storage outage would; without the
allow file nothing fails. A job reads each input twice (the duplicate-id pass, then generation),
so N = 1 makes a file unreadable once generation has begun. Importing this module registers the
protocol; Ray workers import it when they unpickle the filesystem (the repository must be on
their PYTHONPATH).
"""

from __future__ import annotations

import os

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

FAIL_ENV = "FLAKY_FS_FAIL"


class FlakyFileSystem(AbstractFileSystem):
    protocol = "flaky"
    root_marker = "/"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._local = LocalFileSystem()

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path).removeprefix("flaky://")
        return path.rstrip("/") or "/"

    def ls(self, path, detail=True, **kwargs):
        return self._local.ls(self._strip_protocol(path), detail=detail)

    def info(self, path, **kwargs):
        return self._local.info(self._strip_protocol(path))

    def _open(self, path, mode="rb", **kwargs):
        path = self._strip_protocol(path)
        if "r" in mode:
            _maybe_fail(path)
        return self._local._open(path, mode, **kwargs)


def _maybe_fail(path: str) -> None:
    spec = os.environ.get(FAIL_ENV)
    if not spec:
        return
    name, state_dir = spec.split(":", 1)
    allow = os.path.join(state_dir, "allow")
    if os.path.basename(path) != name or not os.path.exists(allow):
        return
    n = 0
    while True:  # count this open: the process that creates open-<n> owns number n
        try:
            os.close(os.open(os.path.join(state_dir, f"open-{n}"), os.O_CREAT | os.O_EXCL))
            break
        except FileExistsError:
            n += 1
    with open(allow) as f:
        if n >= int(f.read()):
            raise OSError(f"connection reset while reading flaky://{path} (simulated storage outage)")


fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
