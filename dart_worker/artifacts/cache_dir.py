"""The project's on-disk cache, and safe concurrent building of the artifacts in it.

Everything the project generates (the converted default model, fingerprints, N-gram tries
fetched or built locally) lives under one root so that users can find, size and delete it:
`$DART_CACHE_DIR`, or `~/.cache/dart-batch` when unset.

Several processes on a node (Ray workers, a test run next to a job) may want the same
artifact at the same moment. `build_atomically` makes that safe: the first process takes a
per-artifact lock and builds into a private temporary path, then renames it into place, so
a reader sees either nothing or the complete artifact, never a half-written one; the others
wait on the lock and then find the artifact ready. The lock is `fcntl.flock`, which the
kernel releases when its holder dies, so a crashed builder never leaves the cache stuck.
This module imports nothing heavy (no torch) so that tools and tests can use it cheaply.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV_VAR = "DART_CACHE_DIR"
DEFAULT_CACHE_ROOT = Path("~/.cache/dart-batch")


def cache_root() -> Path:
    """The cache root: `$DART_CACHE_DIR` if set (and non-empty), else `~/.cache/dart-batch`."""
    configured = os.environ.get(CACHE_ENV_VAR, "").strip()
    return Path(configured).expanduser() if configured else DEFAULT_CACHE_ROOT.expanduser()


def cache_dir(*parts: str) -> Path:
    """The directory `<cache root>/<parts...>`, created (with parents) if missing.

    Parts are plain relative names; an absolute part or `..` would escape the cache and is
    rejected rather than silently writing elsewhere.
    """
    for part in parts:
        if not part or Path(part).is_absolute() or ".." in Path(part).parts:
            raise ValueError(f"cache_dir part {part!r} must be a non-empty relative name without '..'")
    path = cache_root().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def file_lock(lock_path: Path | str, timeout: float | None = None, poll_seconds: float = 0.2) -> Iterator[None]:
    """Hold an exclusive cross-process lock on `lock_path` (created if missing).

    Blocks until the lock is free; with `timeout` (seconds) raises TimeoutError naming the lock
    file instead of waiting forever. Logs once when it has to wait, so that a worker stuck
    behind a long conversion says why. The lock file itself is left in place: deleting it
    while another process waits on it would let two holders in at once.
    """
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = time.monotonic()
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if timeout is not None and waited >= timeout:
                    raise TimeoutError(f"could not lock {lock_path} within {timeout:.1f} s "
                                       "(another process is holding it)") from None
                if not announced:
                    log.info("waiting for lock %s (another process is building this artifact)", lock_path)
                    announced = True
                time.sleep(poll_seconds)
        yield
    finally:
        # Closing the descriptor releases the flock.
        os.close(fd)


def announce(message: str) -> None:
    """One line on stderr before a slow one-time step (or for its progress): what, why, where it is
    cached and roughly how long. stderr, not the log, so a first run says why it is slow even where
    logging is not configured (a Ray worker's stderr lands in its log file and the driver's console)."""
    print(f"[dart-batch] {message}", file=sys.stderr, flush=True)


class Steps:
    """Per-step progress lines for a slow one-time build: `step(text)` prints "<title> k/n: text"
    with the time since the previous step, `done()` the total."""

    def __init__(self, title: str, total: int):
        self.title, self.total, self.k = title, total, 0
        self.started = self.last = time.monotonic()

    def step(self, text: str) -> None:
        now = time.monotonic()
        self.k += 1
        after = f" (previous step {now - self.last:.1f} s)" if self.k > 1 else ""
        announce(f"{self.title} {self.k}/{self.total}: {text}{after}")
        self.last = now

    def done(self, where: Path | str) -> None:
        announce(f"{self.title} finished in {time.monotonic() - self.started:.1f} s; cached at {where}")


def lock_path_for(final_path: Path) -> Path:
    """The lock file guarding `final_path`: a hidden sibling, so it lives on the same filesystem."""
    return final_path.parent / f".{final_path.name}.lock"


def _temp_prefix(final_path: Path) -> str:
    return f".{final_path.name}.tmp-"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def build_atomically(final_path: Path | str, build: Callable[[Path], None],
                     is_valid: Callable[[Path], bool] = Path.exists,
                     timeout: float | None = None) -> Path:
    """Make sure a valid artifact exists at `final_path`, building it at most once across processes.

    `build(tmp_path)` must create the artifact (a file or a directory) at `tmp_path`, a fresh
    path on the same filesystem that does not exist yet. `is_valid(final_path)` says whether
    what is there now is complete and current; an existing but invalid artifact (an older
    format, an interrupted copy made by hand) is replaced, with a log line saying so.

    The fast path (already valid) takes no lock. Otherwise: lock, check again (another process
    may have just finished), clear temporaries left by crashed builders, build, check the
    result, rename into place. If `build` raises, nothing is left behind and the error
    propagates; the next call tries again.
    """
    final_path = Path(final_path)
    if is_valid(final_path):
        return final_path
    final_path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(lock_path_for(final_path), timeout=timeout):
        if is_valid(final_path):
            return final_path
        # We hold the lock, so any temporary for this artifact belongs to a dead builder.
        for stale in final_path.parent.glob(_temp_prefix(final_path) + "*"):
            log.info("removing leftover temporary %s from an interrupted build", stale)
            _remove(stale)
        tmp_path = final_path.parent / f"{_temp_prefix(final_path)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            build(tmp_path)
            if not tmp_path.exists():
                raise RuntimeError(f"build step for {final_path} did not create {tmp_path}")
            if not is_valid(tmp_path):
                raise RuntimeError(f"build step for {final_path} produced an artifact that fails validation")
            if final_path.exists() or final_path.is_symlink():
                log.warning("replacing invalid or incomplete artifact at %s", final_path)
                # Move aside first: rename cannot replace a non-empty directory.
                aside = final_path.parent / f"{_temp_prefix(final_path)}old-{uuid.uuid4().hex[:8]}"
                os.rename(final_path, aside)
                _remove(aside)
            os.rename(tmp_path, final_path)
        except BaseException:
            _remove(tmp_path)
            raise
    return final_path


def write_text_atomically(path: Path | str, text: str) -> None:
    """Write a small text file so that readers see the old or the new content, never a torn one."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
