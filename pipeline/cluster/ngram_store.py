"""One N-gram trie per Ray node, shared by every worker on it.

DART's tree builder scores every draft candidate against an N-gram trie, thousands of times per
second, so the trie must be in the worker's own address space: a remote call per query would
cost more than the decoding step it accelerates. The trie file is flat and read-only, so the
cheap way to give N workers on a node the same trie is one file that they all `mmap`: the
kernel keeps one copy in memory, whatever N is. This module arranges that.

    # in a worker (a Ray actor or task), once at start-up:
    trie = acquire_trie("s3://bucket/tries/sharegpt.trie", expected_tokenizer_fingerprint=fp)
    # in the driver:
    info = check_trie_url(url, fp)       # before any work: missing / corrupt / wrong tokenizer
    ...
    shutdown_ngram_stores()              # at the end: every store removes its file

How it works
------------
Per node and per trie content there is one *store actor* (`NgramStore`, num_cpus=0), named
`dart-ngram-<node id[:16]>-<content key>` in the namespace `dart-batch`. The first worker on a
node that asks creates it (`get_if_exists=True`, pinned to that node with a hard
NodeAffinitySchedulingStrategy); the others find it by name. Nodes that join later get their
own store the first time one of their workers asks. (On a one-node cluster the driver starts the
node's store at job start, `start_store_for_one_node_cluster`, so the workers find it placing the
trie already.) The store is *detached*: a worker that
crashes and is restarted by Ray Data does not take the node's trie with it (an owned actor
dies with its owner). The driver removes every store at the end (`shutdown_ngram_stores`).

On creation the store fetches the trie from its URL (any fsspec URL; s3:// uses the
environment's endpoint and credentials), verifies all of it (payload checksum and structure),
and places it in node-local shared memory, `/dev/shm/dart-batch/` (override:
`$DART_NGRAM_SHM_DIR`), or in the local-disk cache when /dev/shm is missing or would keep
less than max(256 MiB, 10% of its size) free: Ray's object store lives in /dev/shm too, and
filling it would fail unrelated work. Workers get the path from one call and map the file
themselves: there is no remote call on the decoding path, and opening is O(1) (the store has
verified the bytes, so workers only check the header and the tokenizer fingerprint).

The content key is the trie's payload checksum read from its header, not its URL: a rebuilt
trie uploaded to the same URL gets a new store instead of the stale one, and the store
checks that what it downloaded is what the key names (an object replaced mid-download is an
error, not a silent mix of two versions). A store only ever hands out bytes whose checksum
matches its key, so two URLs holding the same trie share one store and one copy per node.

Local paths are used in place. A plain path or file:// URL on a local filesystem is verified
once by the store and then mapped directly: copying it into /dev/shm would only add a second
copy of the same bytes to memory. (On a multi-node cluster such a path must exist on every
node, e.g. baked into the image.) A path on a network filesystem (NFS, CIFS, FUSE mounts, ...)
is copied like a remote URL, because mapping it would turn page faults into network round
trips and a replacement of the file on the server into SIGBUS in the workers.

Cleanup: the store removes its file in `close()`, which `shutdown_ngram_stores` calls before
killing it, and from an atexit hook (Ray turns SIGTERM in a worker into SystemExit, so atexit
runs on a graceful stop). A store killed with SIGKILL cannot clean up; for that case each store
holds an flock on its file while it lives, and a new store sweeps the files in its directory
whose lock is free. Workers that still map a removed file keep working: unlinking a mapped
file frees it only when the last mapping goes.

Outside Ray (`ray` not initialised) `acquire_trie` opens the file in this process: a local path
in place, a remote URL fetched once into `<cache>/tries/fetched/` (see dart_worker.artifacts.cache_dir),
both fully verified, so that the engine works without a cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import re
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dart_worker.artifacts import io_retry
from dart_worker.artifacts.cache_dir import build_atomically, cache_dir
from dart_worker.artifacts.url_filesystem import url_filesystem
from ngram_native import (
    TRIE_HEADER_SIZE,
    NgramTrie,
    TokenizerMismatchError,
    TrieFormatError,
    TrieHeader,
    read_trie_header,
)
from pipeline.data.storage import retry_policy

log = logging.getLogger(__name__)

NAMESPACE = "dart-batch"
STORE_NAME_PREFIX = "dart-ngram-"
SHM_DIR_ENV = "DART_NGRAM_SHM_DIR"
DEFAULT_SHM_DIR = "/dev/shm/dart-batch"
TIMEOUT_ENV = "DART_NGRAM_STORE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 900.0  # a worker waits this long for its node's store (fetch + verify)
SHM_RESERVE_BYTES = 256 << 20  # /dev/shm must keep max(this, fraction x size) free after the trie
SHM_RESERVE_FRACTION = 0.10
FAILURE_RETRY_AFTER_S = 30.0  # a failed store answers with its error, then tries again after this
ORPHAN_TMP_MIN_AGE_S = 60.0  # a temporary younger than this may be between create and lock
_COPY_CHUNK = 8 << 20
_PROGRESS_EVERY_S = 10.0

# Network filesystems: a trie there is copied to the node rather than mapped in place.
NETWORK_FS_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "lustre", "gpfs", "glusterfs", "ceph",
    "beegfs", "afs", "ncpfs", "davfs", "fuse", "fuseblk",
})

_STORE_FILE_RE = re.compile(r"^\.?ngram-[0-9a-f]{16}-[0-9a-f]{16}\.trie(\.tmp-\d+)?$")


class TrieUnavailableError(RuntimeError):
    """The trie could not be fetched, read or placed (missing, unreachable, no space, store died)."""


@dataclass(frozen=True)
class MappingMemory:
    """Memory of one process's mappings of one file (from /proc/<pid>/smaps), in bytes.

    rss: pages of the file this process has touched. pss: the same, each page divided by the
    number of processes mapping it, so summing pss over processes counts shared pages once.
    """

    size: int
    rss: int
    pss: int


# ----- URLs ---------------------------------------------------------------------------------


def redact_url(url: str) -> str:
    """`url` without user, password and query string (presigned URLs carry secrets there)."""
    parts = urllib.parse.urlsplit(url)
    if not parts.scheme or len(parts.scheme) == 1:  # a path (or a Windows drive letter)
        return url
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = "<redacted>" if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def local_path_of(url: str) -> str | None:
    """The local path `url` names (a plain path or file://...), or None for any other scheme."""
    parts = urllib.parse.urlsplit(url)
    if not parts.scheme:
        return os.path.abspath(os.path.expanduser(url))
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file:// URL {url!r} names host {parts.netloc!r}; use file:///absolute/path")
        return urllib.parse.unquote(parts.path)
    return None


def _mount_fs_type(path: str, mountinfo: str) -> str | None:
    """Filesystem type of the mount holding `path`, from /proc/self/mountinfo text."""
    best, best_type = "", None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right:
            continue
        # Mount points escape space, tab, newline and backslash as octal.
        mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, right.split()[0]
    return best_type


def is_network_filesystem(path: str, mountinfo: str | None = None) -> bool:
    """Whether `path` lives on a network filesystem (see NETWORK_FS_TYPES; fuse.* counts)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return False  # not Linux: nothing to tell, use the file in place
    fs_type = _mount_fs_type(os.path.realpath(path), mountinfo)
    if fs_type is None:
        return False
    return fs_type in NETWORK_FS_TYPES or fs_type.startswith("fuse.")


def _reword(exc: BaseException, url: str) -> str:
    """The exception's message without the URL's secrets (libraries quote URLs in many shapes)."""
    message = str(exc)
    if not url:
        return message
    message = message.replace(url, redact_url(url))
    parts = urllib.parse.urlsplit(url)
    for secret in (parts.password, parts.query):
        if secret:
            message = message.replace(secret, "<redacted>")
    return message


def _unavailable(url: str, what: str, exc: BaseException) -> TrieUnavailableError:
    return TrieUnavailableError(
        f"N-gram trie {redact_url(url)}: {what}: {type(exc).__name__}: {_reword(exc, url)}")


# ----- the header ---------------------------------------------------------------------------


def _parse_header(head: bytes, actual_size: int, url: str) -> TrieHeader:
    """The validated header of the trie at `url` (ngram_native checks it), errors naming the URL."""
    try:
        return read_trie_header(head, actual_size)
    except TrieFormatError as exc:
        raise TrieFormatError(f"N-gram trie {redact_url(url)}: {exc}") from None


def _header_of_file(path: str | Path, url: str) -> TrieHeader:
    """The validated header of a local copy of the trie at `url`."""
    with open(path, "rb") as f:
        return _parse_header(f.read(TRIE_HEADER_SIZE), os.fstat(f.fileno()).st_size, url)


def _read_head(url: str) -> tuple[bytes, int]:
    """The first 512 bytes of the trie at `url` and its size; TrieUnavailableError if unreadable."""
    local = local_path_of(url)
    try:
        if local is not None:
            with open(local, "rb") as f:
                return f.read(TRIE_HEADER_SIZE), os.fstat(f.fileno()).st_size
        fs, path = url_filesystem(url)

        def head_and_size() -> tuple[bytes, int]:
            size = fs.info(path).get("size")
            if size is None:
                raise OSError("the storage does not report the object's size")
            return fs.cat_file(path, start=0, end=TRIE_HEADER_SIZE), int(size)

        # A transient failure (HTTP 5xx, throttling, a reset) is waited out under the process's policy.
        return io_retry.active().call("read artifact", url, head_and_size)
    except FileNotFoundError as exc:  # also when the retry policy gave up on one
        raise _unavailable(url, "not found", exc) from None
    except Exception as exc:  # unreachable endpoint, no credentials, missing fsspec backend, ...
        raise _unavailable(url, "cannot be read", exc) from exc


def _check_fingerprint(info: TrieHeader, url: str, expected: str | None) -> None:
    if expected and info.tokenizer_fingerprint != expected:
        raise TokenizerMismatchError(
            f"N-gram trie {redact_url(url)} was built for tokenizer fingerprint '{info.tokenizer_fingerprint}', "
            f"but the tokenizer in use has fingerprint '{expected}': rebuild the trie with this tokenizer")


def check_trie_url(trie_url: str, expected_tokenizer_fingerprint: str | None = None) -> TrieHeader:
    """Driver start-up check: the trie exists, is reachable, has a valid header and the right tokenizer.

    Cheap whatever the trie's size: the size plus the 512-byte header (one ranged read for a
    remote object), checked by `ngram_native.read_trie_header` as an open checks it (every
    section's bounds included); a local file is also opened (O(1)).
    The full checksum is the stores' job, once per node. Raises TrieUnavailableError,
    TrieFormatError or TokenizerMismatchError, each naming the (redacted) URL.
    """
    head, size = _read_head(trie_url)
    info = _parse_header(head, size, trie_url)
    _check_fingerprint(info, trie_url, expected_tokenizer_fingerprint)
    local = local_path_of(trie_url)
    if local is not None:
        _open_trie(local, trie_url, verify=False, expected_fingerprint=expected_tokenizer_fingerprint).close()
    return info


# ----- fetching and verifying ---------------------------------------------------------------


def _open_trie(path: str | Path, url: str, verify: bool, expected_fingerprint: str | None) -> NgramTrie:
    """NgramTrie.open with errors that name the URL the file came from."""
    try:
        return NgramTrie.open(path, verify=verify, expected_tokenizer_fingerprint=expected_fingerprint)
    except TrieFormatError as exc:  # TokenizerMismatchError included; keep the type
        raise type(exc)(f"N-gram trie {redact_url(url)}: {exc}") from None
    except OSError as exc:
        raise _unavailable(url, f"cannot open {path}", exc) from None


def _verify_file(path: str | Path, url: str, content_key: str) -> None:
    """Full verification of a placed file, and that it is the content `content_key` names."""
    with _open_trie(path, url, verify=True, expected_fingerprint=None):
        pass
    info = _header_of_file(path, url)
    if info.content_key != content_key:
        raise TrieUnavailableError(
            f"N-gram trie {redact_url(url)} changed while it was being fetched: expected content "
            f"{content_key}, got {info.content_key}; retry once the upload is complete")


def _download(url: str, dest_fd: int, expected_size: int) -> None:
    """Copy the object at `url` into the open file `dest_fd` (empty), logging progress for big files.
    A transient failure is waited out under the process's policy (dart_worker/artifacts/io_retry.py),
    and the next try continues from the bytes already in the file."""
    shown = redact_url(url)
    fs, path = url_filesystem(url)
    start = last_log = time.monotonic()
    copied = 0

    def copy_the_rest() -> None:
        nonlocal copied, last_log
        copied = os.fstat(dest_fd).st_size  # what earlier tries wrote (closing flushed it)
        with fs.open(path, "rb") as src, os.fdopen(os.dup(dest_fd), "wb") as dst:
            dst.seek(copied)
            if copied:
                src.seek(copied)
            while chunk := src.read(_COPY_CHUNK):
                dst.write(chunk)
                copied += len(chunk)
                if time.monotonic() - last_log >= _PROGRESS_EVERY_S:
                    last_log = time.monotonic()
                    log.info("fetching N-gram trie %s: %.0f / %.0f MiB", shown, copied / 2**20, expected_size / 2**20)

    try:
        io_retry.active().call("read artifact", url, copy_the_rest)
    except Exception as exc:
        raise _unavailable(url, "download failed", exc) from exc
    if copied != expected_size:
        raise TrieUnavailableError(f"N-gram trie {shown}: download gave {copied} bytes, the object has {expected_size}")
    log.info("fetched N-gram trie %s: %.1f MiB in %.1f s", shown, copied / 2**20, time.monotonic() - start)


def _fetch_verified(url: str, dest: Path, info: TrieHeader) -> int:
    """Download `url` to the new file `dest` and verify it; returns the file's descriptor, flock'ed.

    The lock is taken before the first byte is written, so a sweeper never mistakes a file
    being fetched for an orphan. On failure the file is removed and the error propagates.
    """
    fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _download(url, fd, info.file_size)
        os.fsync(fd)  # a disk copy that survives a crash must be whole (no-op in /dev/shm)
        _verify_file(dest, url, info.content_key)
        return fd
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            dest.unlink()
        raise


# ----- where a store puts its file ----------------------------------------------------------


def shm_dir() -> Path:
    """The node-local shared-memory directory for trie files (`$DART_NGRAM_SHM_DIR` or the default)."""
    return Path(os.environ.get(SHM_DIR_ENV, "").strip() or DEFAULT_SHM_DIR)


def _free_bytes(path: Path) -> tuple[int, int]:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def choose_store_dir(size: int, shm: Path, disk: Path) -> tuple[Path, str]:
    """Where a trie of `size` bytes goes: (`shm`, "shm") if it fits with the reserve left, else the disk.

    Shared memory is preferred: it never goes through a block device and it is what
    /dev/shm is for. It must keep max(SHM_RESERVE_BYTES, SHM_RESERVE_FRACTION x its size)
    free after the trie. The disk directory must hold the trie plus 1%; otherwise
    TrieUnavailableError says how much each place has.
    """
    shm_note = "missing"
    if shm.parent.is_dir():
        try:
            shm.mkdir(exist_ok=True)
            free, total = _free_bytes(shm)
            reserve = max(SHM_RESERVE_BYTES, int(SHM_RESERVE_FRACTION * total))
            if free - size >= reserve:
                return shm, "shm"
            shm_note = f"{free / 2**20:.0f} MiB free, {reserve / 2**20:.0f} MiB kept in reserve"
        except OSError as exc:
            shm_note = f"unusable ({exc})"
    disk.mkdir(parents=True, exist_ok=True)
    disk_free, _ = _free_bytes(disk)
    if disk_free >= size + size // 100:
        log.info("N-gram trie of %.0f MiB goes to local disk %s (shared memory %s: %s)",
                 size / 2**20, disk, shm, shm_note)
        return disk, "disk"
    raise TrieUnavailableError(
        f"no room for an N-gram trie of {size / 2**20:.0f} MiB on this node: shared memory {shm}: "
        f"{shm_note}; local disk {disk}: {disk_free / 2**20:.0f} MiB free")


def store_file_name(node_id: str, content_key: str) -> str:
    return f"ngram-{node_id[:16]}-{content_key}.trie"


def sweep_orphans(directory: Path) -> list[Path]:
    """Remove store files in `directory` whose store is gone (their flock is free); returns them.

    A live store holds an exclusive flock on its file from the moment it creates it; the
    kernel drops the lock when the process dies, however it dies. Files of other programs
    (names not matching a store file) are never touched.
    """
    removed = []
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        if not _STORE_FILE_RE.match(path.name):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # gone already
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # its store is alive
        try:
            st = os.fstat(fd)
            if ".tmp-" in path.name and time.time() - st.st_mtime < ORPHAN_TMP_MIN_AGE_S:
                continue  # may be a fetch between create and lock
            if _same_file(path, st):
                path.unlink()
                removed.append(path)
                log.info("removed orphaned N-gram trie file %s (its store is gone)", path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _same_file(path: Path, st: os.stat_result) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


# ----- the store actor ----------------------------------------------------------------------


class NgramStore:
    """Body of the per-node store actor (see the module doc). Instantiate through `acquire_trie`.

    Methods answer with plain dicts rather than raising: a worker gets a clear exception built
    from {"error_type", "message"} instead of a remote traceback wrapped by Ray, and a failed
    store stays alive to give the same answer to every worker of the node (no N downloads of a
    corrupt file); it tries again when asked FAILURE_RETRY_AFTER_S after a failure.
    """

    def __init__(self, trie_url: str, content_key: str, node_id: str,
                 io_retry_s: float = io_retry.DEFAULT_BUDGET_S) -> None:
        self._url = trie_url
        self._key = content_key
        self._node_id = node_id
        # The job's `run.io_retry_s`, as the worker that started the store follows it: the fetch
        # waits out a storage outage instead of failing every worker of the node.
        self._retry = retry_policy(io_retry_s)
        self._owned: tuple[Path, int] | None = None  # (file we placed, its locked descriptor)
        self._answer: dict[str, Any] = {}
        self._failed_at = 0.0
        atexit.register(self.close)
        self._prepare()

    def path(self) -> dict[str, Any]:
        """{"path", "placement" (shm/disk/in-place), "file_size", "pid", "node_id"} or {"error_type", "message"}."""
        if "error_type" in self._answer and time.monotonic() - self._failed_at >= FAILURE_RETRY_AFTER_S:
            self._prepare()
        return self._answer

    def close(self) -> bool:
        """Remove the file this store placed (never an in-place user file); True if it removed one."""
        if self._owned is None:
            return False
        path, fd = self._owned
        self._owned = None
        removed = False
        try:
            if _same_file(path, os.fstat(fd)):  # not a file someone renamed over ours
                path.unlink()
                removed = True
                log.info("removed N-gram trie file %s", path)
        except OSError as exc:
            log.warning("could not remove N-gram trie file %s: %s", path, exc)
        finally:
            os.close(fd)
        return removed

    def _prepare(self) -> None:
        start = time.monotonic()
        try:
            with io_retry.using(self._retry):
                self._answer = self._place()
            log.info("N-gram store ready on node %s: %s (%s) in %.1f s", self._node_id[:16],
                     self._answer["path"], self._answer["placement"], time.monotonic() - start)
        except Exception as exc:
            self._failed_at = time.monotonic()
            self._answer = {"error_type": type(exc).__name__, "message": _describe(exc, self._url)}
            log.error("N-gram store for %s failed: %s", redact_url(self._url), self._answer["message"])

    def _place(self) -> dict[str, Any]:
        head, size = _read_head(self._url)
        info = _parse_header(head, size, self._url)
        if info.content_key != self._key:
            raise TrieUnavailableError(f"N-gram trie {redact_url(self._url)} changed: workers asked for content "
                                       f"{self._key}, the URL now holds {info.content_key}")
        local = local_path_of(self._url)
        if local is not None and not is_network_filesystem(local):
            _verify_file(local, self._url, self._key)
            return self._answer_for(local, "in-place", size)
        disk = cache_dir("ngram-store")
        for place in (shm_dir(), disk):
            sweep_orphans(place)
        directory, placement = choose_store_dir(size, shm_dir(), disk)
        final = directory / store_file_name(self._node_id, self._key)
        tmp = directory / f".{final.name}.tmp-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # ours from an earlier failed attempt in this process
        fd = _fetch_verified(self._url, tmp, info)
        os.rename(tmp, final)
        self._owned = (final, fd)
        return self._answer_for(str(final), placement, size)

    def _answer_for(self, path: str, placement: str, size: int) -> dict[str, Any]:
        return {"path": path, "placement": placement, "file_size": size, "pid": os.getpid(), "node_id": self._node_id}


def _describe(exc: BaseException, url: str) -> str:
    message = _reword(exc, url)
    return message if redact_url(url) in message else f"N-gram trie {redact_url(url)}: {message}"


_ERROR_TYPES: dict[str, type[Exception]] = {
    "TrieFormatError": TrieFormatError,
    "TokenizerMismatchError": TokenizerMismatchError,
}


# ----- worker and driver API ----------------------------------------------------------------


def _ray_running() -> bool:
    """Whether this process is connected to Ray (without importing ray when nothing did)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def store_actor_name(node_id: str, content_key: str) -> str:
    return f"{STORE_NAME_PREFIX}{node_id[:16]}-{content_key}"


_store_actor_class = None


def _store_handle(node_id: str, content_key: str, url: str, namespace: str) -> Any:
    """This node's store for `content_key`, created (detached, pinned to the node) if missing; a
    new one fetches under this process's retry budget (`io_retry.active`)."""
    global _store_actor_class
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if _store_actor_class is None:
        _store_actor_class = ray.remote(NgramStore)
    return _store_actor_class.options(
        name=store_actor_name(node_id, content_key),
        namespace=namespace,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_restarts=0,  # a dead store is replaced by the next acquire (its name is freed)
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(url, content_key, node_id, io_retry.active().budget_s)


def _store_path(url: str, content_key: str, namespace: str, timeout_s: float) -> str:
    """Ask this node's store for the placed file's path, with a deadline and clear errors.

    A store found dead (killed between lookup and call, e.g. by a previous job's shutdown) is
    replaced once: its name is freed when it dies, so the second lookup creates a new one.
    """
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    node_id = ray.get_runtime_context().get_node_id()
    shown = redact_url(url)
    deadline = time.monotonic() + timeout_s
    for attempt in (1, 2):
        try:
            store = _store_handle(node_id, content_key, url, namespace)
            answer = ray.get(store.path.remote(), timeout=max(0.0, deadline - time.monotonic()))
            break
        except GetTimeoutError:
            raise TimeoutError(f"N-gram store for {shown} on node {node_id[:16]} gave no path within "
                               f"{timeout_s:.3g} s (still fetching? see the store actor's log; "
                               f"raise ${TIMEOUT_ENV} for very large tries)") from None
        except RayActorError as exc:
            if attempt == 2:
                raise TrieUnavailableError(f"N-gram store for {shown} on node {node_id[:16]} died: {exc}") from None
            log.warning("N-gram store for %s on node %s died; starting a new one", shown, node_id[:16])
            time.sleep(0.5)  # let the registry free the dead store's name
    if "error_type" in answer:
        raise _ERROR_TYPES.get(answer["error_type"], TrieUnavailableError)(answer["message"])
    return answer["path"]


def _open_outside_ray(url: str, info: TrieHeader, expected_fingerprint: str | None) -> NgramTrie:
    local = local_path_of(url)
    if local is not None:
        return _open_trie(local, url, verify=True, expected_fingerprint=expected_fingerprint)

    def is_valid(path: Path) -> bool:  # a cached copy is named by content: check its header says so
        try:
            return _header_of_file(path, url).content_key == info.content_key
        except (OSError, TrieFormatError):
            return False

    def fetch(tmp: Path) -> None:
        os.close(_fetch_verified(url, tmp, info))

    final = build_atomically(cache_dir("tries", "fetched") / f"{info.content_key}.trie", fetch, is_valid=is_valid)
    return _open_trie(final, url, verify=False, expected_fingerprint=expected_fingerprint)


def start_store(trie_url: str, *, namespace: str = NAMESPACE) -> None:
    """Have this node's store start placing the trie now, without waiting for it.

    A worker calls this before loading its target, so that the store's start (a new Ray worker
    process, then the copy into shared memory and its check) runs while the target loads instead
    of after it (on the start-up's critical path it is what makes a drafting worker start later
    than an `ar` one); `acquire_trie` later
    finds the store answering. Does nothing outside Ray; any problem is left for `acquire_trie`
    to report with its full checks."""
    if not _ray_running():
        return
    try:
        head, size = _read_head(trie_url)
        info = _parse_header(head, size, trie_url)
        import ray

        _store_handle(ray.get_runtime_context().get_node_id(), info.content_key, trie_url, namespace).path.remote()
    except Exception as exc:  # acquire_trie raises the real error, with its context
        log.debug("could not start the N-gram store for %s early: %s", redact_url(trie_url), exc)


def start_store_for_one_node_cluster(trie_url: str, *, worker_cpus: float, worker_gpus: float,
                                     namespace: str = NAMESPACE) -> bool:
    """In the driver, at job start: start this node's store now when it is the node every worker
    will run on, so that the workers find the trie placed instead of waiting for it.

    A worker's own `start_store` comes after its process start and imports (torch, transformers:
    seconds of CPU); the store's process start then competes with the target load for the same
    cores, and on a small machine the worker ended up waiting for it. The driver knows the
    workers' node only on a one-node cluster whose node can hold a worker (the usual private
    local Ray): there the store starts while the inputs are read and the workers start. On any
    other cluster nothing happens here (a store on a node without workers would hold the trie
    in memory for nothing) and each node's first worker starts its store as before. Returns
    whether a store was started; never raises (`acquire_trie` reports any problem)."""
    if not _ray_running():
        return False
    try:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        alive = [node for node in ray.nodes() if node.get("Alive")]
        if len(alive) != 1 or alive[0].get("NodeID") != node_id:
            return False
        resources = alive[0].get("Resources") or {}
        if resources.get("CPU", 0.0) < worker_cpus or resources.get("GPU", 0.0) < worker_gpus:
            return False  # the workers will run on nodes still to come (an autoscaler adds them)
    except Exception as exc:
        log.debug("could not tell whether the driver's node runs the workers: %s", exc)
        return False
    start_store(trie_url, namespace=namespace)
    return True


def acquire_trie(
    trie_url: str,
    expected_tokenizer_fingerprint: str | None = None,
    *,
    timeout_s: float | None = None,
    namespace: str = NAMESPACE,
) -> NgramTrie:
    """The trie at `trie_url`, mapped in this process from this node's shared copy.

    Call once per worker, at start-up. In a process connected to Ray (a worker actor or task;
    also a driver, which then uses its own node's store): finds or creates the node's store,
    waits (at most `timeout_s`, default `$DART_NGRAM_STORE_TIMEOUT_S` or 900 s) for its path
    and maps it, checking the header and the tokenizer fingerprint (the store has verified the
    bytes). Without Ray: opens the file here, fetching a remote URL into the cache first, with
    full verification.

    Errors name the (redacted) URL: TrieUnavailableError (missing, unreachable, no space, store
    died), TrieFormatError (corrupt, truncated, wrong version), TokenizerMismatchError,
    TimeoutError.
    """
    head, size = _read_head(trie_url)
    info = _parse_header(head, size, trie_url)
    _check_fingerprint(info, trie_url, expected_tokenizer_fingerprint)
    if not _ray_running():
        return _open_outside_ray(trie_url, info, expected_tokenizer_fingerprint)
    if timeout_s is None:
        timeout_s = float(os.environ.get(TIMEOUT_ENV, "") or DEFAULT_TIMEOUT_S)
    path = _store_path(trie_url, info.content_key, namespace, timeout_s)
    return _open_trie(path, trie_url, verify=False, expected_fingerprint=expected_tokenizer_fingerprint)


def list_ngram_stores(namespace: str = NAMESPACE) -> list[str]:
    """Names of the live store actors in `namespace` (empty without Ray)."""
    if not _ray_running():
        return []
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == namespace and a["name"].startswith(STORE_NAME_PREFIX))


def shutdown_ngram_stores(namespace: str = NAMESPACE, timeout_s: float = 30.0) -> int:
    """Driver, at the end of a job: every store removes its file and is killed; returns how many.

    Each store is asked to `close()` (remove its file) and given `timeout_s` to answer, then
    killed whatever it answered; stores that are already dead or die meanwhile are skipped.
    Waits until the stores are gone from the actor registry, so that a new job started right
    after does not find a dying store by name.

    Stores are shared by content, so this also stops the stores of another job running the same
    trie on the same cluster. That job keeps working: its workers' mappings outlive the files'
    removal, and a worker that starts later creates a new store.
    """
    if not _ray_running():
        return 0
    import ray

    handles = []
    for name in list_ngram_stores(namespace):
        with contextlib.suppress(ValueError):  # died between listing and lookup
            handles.append((name, ray.get_actor(name, namespace=namespace)))
    if not handles:
        return 0
    closing = [handle.close.remote() for _, handle in handles]
    ray.wait(closing, num_returns=len(closing), timeout=timeout_s)
    for name, handle in handles:
        try:
            ray.kill(handle, no_restart=True)
        except Exception as exc:  # already dead
            log.debug("N-gram store %s: kill: %s", name, exc)
    deadline = time.monotonic() + timeout_s
    killed = {name for name, _ in handles}
    while killed & set(list_ngram_stores(namespace)) and time.monotonic() < deadline:
        time.sleep(0.05)
    log.info("shut down %d N-gram store(s)", len(handles))
    return len(handles)


def trie_memory_usage(path: str | Path, pid: int | str = "self") -> MappingMemory:
    """Size, Rss and Pss of process `pid`'s mappings of the file `path` (Linux /proc/<pid>/smaps).

    Summing pss over every process that maps the file gives the memory the file really costs:
    one copy for N workers sharing a store's file, N copies if each had its own.
    """
    target = os.path.realpath(path)
    totals = {"Size": 0, "Rss": 0, "Pss": 0}
    in_target = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split(None, 5)
            if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                name = fields[5].rstrip("\n") if len(fields) == 6 else ""
                in_target = name in (target, f"{target} (deleted)")
            elif in_target and fields and fields[0].rstrip(":") in totals:
                totals[fields[0].rstrip(":")] += int(fields[1]) * 1024
    return MappingMemory(size=totals["Size"], rss=totals["Rss"], pss=totals["Pss"])
