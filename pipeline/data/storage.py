"""Where the job's files live: one fsspec filesystem per URL, input expansion, clear storage errors.

The job reads prompts from and writes results to any fsspec URL (s3://, gs://, file://, plain
paths). fsspec gives one API for listing and globbing on all of them, and Ray Data readers take a
pyarrow filesystem, which `arrow_filesystem` builds from the fsspec one.

Credentials are never handled here. s3fs builds its client with botocore's standard chain
(environment, shared config files, instance or pod roles), so each Ray worker uses the credentials
of its own environment. The only thing taken from the driver's environment is the endpoint URL
(AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, which botocore honours too): it is not a secret, and pinning
it keeps the driver and every worker talking to the same server. Error messages pass through
`redact`, which blanks the values of secret environment variables should a library ever echo one.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from typing import Any

import fsspec
import pyarrow.fs
import ray

from dart_worker.artifacts import io_retry
from dart_worker.artifacts.url_filesystem import (  # re-exported: the job's storage errors are these
    StorageError,
    describe_error,
    filesystem_for,
    is_local,
    redact,
)

_GLOB_CHARS = "*?["


def arrow_filesystem(fs: fsspec.AbstractFileSystem) -> pyarrow.fs.FileSystem:
    """A pyarrow filesystem for Ray Data readers: pyarrow's own for local files, else the fsspec one wrapped."""
    if is_local(fs):
        return pyarrow.fs.LocalFileSystem()
    return pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))


def url_of(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """The canonical URL of `path` on `fs` (file:///abs/path locally, s3://bucket/key on S3)."""
    return fs.unstrip_protocol(path)


def is_hidden(relative_path: str) -> bool:
    """True when any part of the path is a name Ray Data and Spark treat as metadata (_SUCCESS, .crc, .tmp-)."""
    return any(part.startswith((".", "_")) for part in relative_path.strip("/").split("/"))


def _expand_one(url: str, storage_options: dict[str, Any] | None) -> list[str]:
    fs, path = filesystem_for(url, storage_options)
    try:
        fs.invalidate_cache()
        # A name holding glob characters ("prompts[1].jsonl") that exists is that file, not a pattern.
        if any(c in path for c in _GLOB_CHARS) and not fs.isfile(path):
            # As in a shell, a pattern matches hidden (dot) files only when it asks for them.
            show_hidden = posixpath.basename(path).startswith(".")
            matches = [
                p
                for p in fs.glob(path)
                if (show_hidden or not posixpath.basename(p).startswith(".")) and not fs.isdir(p)
            ]
            if not matches:
                raise StorageError(f"no files match {url}")
            return [url_of(fs, p) for p in matches]
        info = fs.info(path)
        if info["type"] == "directory":
            files = [p for p in fs.find(path) if not is_hidden(posixpath.relpath(p, path))]
            if not files:
                raise StorageError(f"no input files in directory {url}")
            return [url_of(fs, p) for p in files]
        return [url_of(fs, path)]
    except StorageError:
        raise
    except FileNotFoundError as e:
        raise StorageError(f"input not found: {url} ({redact(str(e))})") from e
    except Exception as e:  # network, permissions, unknown bucket: name the URL, not the credentials
        raise StorageError(describe_error("list", url, e)) from e


def expand_inputs(urls: Iterable[str], storage_options: dict[str, Any] | None = None) -> list[str]:
    """Every input file named by `urls` (files, directories, globs) as canonical URLs, sorted, without repeats.

    Directories are walked recursively, skipping names that start with '.' or '_' (as Ray Data and
    Spark do). A URL that names nothing, or a bucket that cannot be reached, is a StorageError
    naming that URL. The order is the sorted order of the URLs, so it does not depend on listing order.
    """
    urls = list(urls)
    if not urls:
        raise StorageError("no input URLs given")
    found: set[str] = set()
    for url in urls:
        found.update(_expand_one(url, storage_options))
    return sorted(found)


_object_cache: dict[str, Any] = {}


def get_once(ref: ray.ObjectRef) -> Any:
    """ray.get(ref), fetched once per worker process: every batch of a stage reuses the same object.

    Used to ship one large read-only value (a set of keys, a dict of duplicates) to map_batches
    functions through the object store instead of pickling it into every task. Only the most
    recent object is kept, so a long-lived worker does not accumulate old ones.
    """
    key = ref.hex()
    if key not in _object_cache:
        _object_cache.clear()
        _object_cache[key] = ray.get(ref)
    return _object_cache[key]


class _StorageWaitMetrics:
    """Ray metrics of a process's storage waits (`dart_storage_retries`, `dart_storage_waiting`),
    made on first use and only inside a Ray worker or driver."""

    retries = None
    waiting = None

    @classmethod
    def record(cls, op: str, retried: bool, waiting: bool) -> None:
        if not ray.is_initialized():
            return
        if cls.retries is None:
            from ray.util.metrics import Counter, Gauge

            cls.retries = Counter("dart_storage_retries", "object-storage operations tried again after a "
                                  "transient failure", tag_keys=("operation",))
            cls.waiting = Gauge("dart_storage_waiting", "1 while an operation of this process waits on "
                                "object storage to come back", tag_keys=("operation",))
        if retried:
            cls.retries.inc(1, tags={"operation": op})
        cls.waiting.set(1 if waiting else 0, tags={"operation": op})


def retry_policy(budget_s: float) -> io_retry.RetryPolicy:
    """The job's retry policy (`run.io_retry_s`, dart_worker/artifacts/io_retry.py) for one of its
    processes - the driver, a worker's start-up, a node's trie store, a write task - with a ledger
    of its own and its waits reported as Ray metrics."""
    return io_retry.RetryPolicy(budget_s, ledger=io_retry.RetryLedger(), report=_StorageWaitMetrics.record)
