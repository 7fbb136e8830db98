"""One retry policy for the job's object-storage operations: transient failures are retried with
exponential backoff and jitter until `run.io_retry_s` has passed since the operation's first
failure; permanent ones stop at once.

It lives beside the artifact fetchers because they follow it too: a worker's target, tokenizer and
draft head (`target_store`) and a node's N-gram trie (pipeline/cluster/ngram_store.py) ride out an
outage at start-up as the job's reads and writes do, under the policy each process sets
(`using`: the driver for the run, a worker actor for its start-up, a node's trie store for its
fetch, a write task for its part).

Three layers retry, each for what it sees:
- botocore retries each HTTP request (its `standard` mode: 5xx, throttling, connection errors;
  AWS_MAX_ATTEMPTS / AWS_RETRY_MODE or ~/.aws/config set how many tries), and s3fs retries
  throttling and dropped connections a few times more. Neither has a time budget: together they
  ride out seconds, not an outage of minutes.
- `RetryPolicy.call` wraps a whole operation of the job (upload one part, list the output, read a
  part for resume, write the summary) and tries it again while the failure is transient, for up
  to `budget_s` after its first failure. What is transient is botocore's own classification
  (`botocore.retries.standard`: HTTP 500/502/503/504, the throttling codes such as SlowDown, the
  transient codes such as RequestTimeout, connection errors and timeouts), found in the chain of
  the exception s3fs raised (s3fs turns a ClientError into an OSError whose __cause__ it is),
  plus dropped connections and timeouts of the HTTP layer below (aiohttp, asyncio, the OS). Waits
  follow botocore's `ExponentialBackoff` (full jitter: a random share of 2^attempt seconds, at
  most `max_backoff_s`). Everything else is permanent: HTTP 403/404 and other 4xx, a full disk,
  a read-only or missing path, a URL no filesystem serves.
- Ray Data's reads of the input files retry opening a file on the errors listed in
  `DataContext.retried_io_errors` (pipeline/run.py adds the transient ones), a fixed number of
  tries with backoff: a reader that fails mid-file fails its task.

`RetryPolicy.call` counts what it did per operation (`RetryLedger`): the job summary reports the
counts, a waiting operation logs one line per try (what failed, for how long, how long it will
still try), and Ray metrics `dart_storage_retries` / `dart_storage_waiting` follow them live
(`RetryPolicy.report`, which the job's processes set: pipeline/data/storage.py).
When it gives up, the StorageError names the URL, the HTTP status and code, and whether and for
how long the operation was retried.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TypeVar

from dart_worker.artifacts.url_filesystem import StorageError, StorageNotFoundError, redact

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_BUDGET_S = 600.0
MAX_BACKOFF_S = 30.0
# OS errors that no wait mends: the disk is full, the path is read-only, missing or forbidden.
_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
                     errno.EISDIR, errno.ENOTDIR, errno.EINVAL, errno.ENAMETOOLONG}
# Substrings of the messages of transient failures, for Ray Data's `retried_io_errors` (it matches
# error text, not classes): what s3fs, botocore and aiohttp say for 5xx, throttling and resets.
# Letters and spaces only, so each matches the same text read as a substring or as a regular
# expression (Ray Data reads them as regular expressions from December 2026 on: `add_to_ray_data`).
RETRIED_IO_ERROR_TEXT = ("Please try again", "SlowDown", "reduce your request rate", "Service Unavailable",
                         "ServiceUnavailable", "InternalError", "Connection reset", "Connection was closed",
                         "Server disconnected", "Read timeout", "Connect timeout", "timed out")


def add_to_ray_data(context: Any) -> None:
    """Add RETRIED_IO_ERROR_TEXT to a Ray Data `DataContext`'s `retried_io_errors`, so its readers
    retry opening and reading an input file on these errors too (its own fixed tries and backoff).

    Ray Data warns, on any change to that list, that its entries will be read as regular
    expressions instead of substrings from December 2026 on: a DeprecationWarning in every job's
    log that asks nothing of this job, whose entries match the same text either way (letters and
    spaces: tests/test_storage_outage.py). That warning alone is silenced, here only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`retried_io_errors` using substring matching",
                                category=DeprecationWarning)
        context.retried_io_errors = list(dict.fromkeys([*context.retried_io_errors, *RETRIED_IO_ERROR_TEXT]))


@dataclass(frozen=True)
class Failure:
    """What one failed attempt was: transient or not, and what the server said."""

    transient: bool
    status: int | None = None  # HTTP status, when there was a response
    code: str | None = None  # the store's error code (SlowDown, AccessDenied, ...)

    def describe(self) -> str:
        if self.status is None:
            return "no HTTP response"
        # Some answers carry no error document, and botocore then names the code by the status.
        named = self.code and self.code != str(self.status)
        return f"HTTP {self.status}" + (f" {self.code}" if named else "")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _transient_classes() -> tuple[type[BaseException], ...]:
    """Connection drops and timeouts of every HTTP layer an object store is reached through."""
    import asyncio

    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError
    from fsspec.exceptions import FSTimeoutError

    classes: list[type[BaseException]] = [ConnectionError, TimeoutError, asyncio.TimeoutError, BotoConnectionError,
                                          HTTPClientError, FSTimeoutError]
    try:
        from aiohttp import ClientConnectionError, ClientPayloadError, ServerTimeoutError

        classes += [ClientConnectionError, ClientPayloadError, ServerTimeoutError]
    except ImportError:  # s3fs brings aiohttp; other stores may not
        pass
    return tuple(classes)


def classify(exc: BaseException) -> Failure:
    """Transient or permanent, by botocore's retry rules for a response and by class otherwise."""
    from botocore.exceptions import ClientError
    from botocore.retries.standard import RetryContext, ThrottledRetryableChecker, TransientRetryableChecker

    for e in _chain(exc):
        if isinstance(e, ClientError):
            response = e.response or {}
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = response.get("Error", {}).get("Code")

            context = RetryContext(attempt_number=1, parsed_response=response,
                                   http_response=SimpleNamespace(status_code=status) if status is not None else None)
            transient = TransientRetryableChecker().is_retryable(context) or \
                ThrottledRetryableChecker().is_retryable(context) or status == 429
            return Failure(bool(transient), status, code)
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _PERMANENT_ERRNOS:
            return Failure(False)
        if isinstance(e, _transient_classes()):
            return Failure(True)
    return Failure(False)


@dataclass
class OperationCount:
    retries: int = 0  # attempts after a failed one
    waited_s: float = 0.0  # seconds spent waiting between them
    recovered: int = 0  # operations that failed at first and then succeeded
    gave_up: int = 0  # operations that were still failing when the budget ran out


@dataclass
class RetryLedger:
    """Retries per operation ("write part", "list output", ...) in this process; thread-safe
    (parts are read in parallel threads)."""

    counts: dict[str, OperationCount] = field(default_factory=lambda: defaultdict(OperationCount))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        with self.lock:
            return {op: {"retries": c.retries, "waited_s": round(c.waited_s, 3), "recovered": c.recovered,
                         "gave_up": c.gave_up} for op, c in sorted(self.counts.items())}

    def merge(self, other: dict[str, dict[str, Any]]) -> None:
        with self.lock:
            for op, c in other.items():
                mine = self.counts[op]
                mine.retries += int(c.get("retries", 0))
                mine.waited_s += float(c.get("waited_s", 0.0))
                mine.recovered += int(c.get("recovered", 0))
                mine.gave_up += int(c.get("gave_up", 0))

    def total_retries(self) -> int:
        with self.lock:
            return sum(c.retries for c in self.counts.values())


LEDGER = RetryLedger()  # this process's


@dataclass(frozen=True)
class RetryPolicy:
    """Retry transient failures of an operation until `budget_s` after its first failure."""

    budget_s: float = DEFAULT_BUDGET_S
    max_backoff_s: float = MAX_BACKOFF_S
    ledger: RetryLedger = field(default_factory=lambda: LEDGER, compare=False)
    # Told of every wait as it starts and ends: (operation, retried, waiting). The job's processes
    # report them as Ray metrics (`pipeline.data.storage.retry_policy`); this package imports no Ray.
    report: Callable[[str, bool, bool], None] | None = field(default=None, compare=False)
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False)
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)

    def call(self, op: str, url: str, fn: Callable[[], T]) -> T:
        """`fn()`, tried again on transient failures; a failure it gives up on (permanent, or the
        budget spent) is raised as StorageError naming `url`, the HTTP status, and the retries. `op`
        ("write part", "list output", ...) keys the counts; its first word is the message's verb."""
        from botocore.retries.standard import ExponentialBackoff, RetryContext

        backoff = ExponentialBackoff(max_backoff=self.max_backoff_s)
        first: float | None = None
        attempt = 0
        while True:
            try:
                result = fn()
            except Exception as exc:
                failure = classify(exc)
                now = self.clock()
                first = now if first is None else first
                spent = now - first
                if not failure.transient and not attempt and isinstance(exc, StorageError):
                    raise  # already says what failed where (a missing bucket, a corrupt part)
                if not failure.transient or spent >= self.budget_s:
                    raise self._give_up(op, url, exc, failure, attempt, spent) from exc
                attempt += 1
                delay = min(backoff.delay_amount(RetryContext(attempt_number=attempt)), self.budget_s - spent)
                self._note_wait(op, url, exc, failure, first, attempt, delay)
                self._report(op, retried=True, waiting=True)
                self.sleep(delay)
                with self.ledger.lock:
                    self.ledger.counts[op].retries += 1
                    self.ledger.counts[op].waited_s += delay
                continue
            if attempt:
                with self.ledger.lock:
                    self.ledger.counts[op].recovered += 1
                log.warning("storage is back: %s %s succeeded after %d retries over %.0f s", op, url, attempt,
                            self.clock() - first)
                self._report(op, retried=False, waiting=False)
            return result

    def _report(self, op: str, retried: bool, waiting: bool) -> None:
        if self.report is not None:
            try:
                self.report(op, retried, waiting)
            except Exception:  # metrics never fail an operation
                log.debug("storage retry metrics unavailable", exc_info=True)

    def _note_wait(self, op: str, url: str, exc: BaseException, failure: Failure, first: float,
                   attempt: int, delay: float) -> None:
        what = f"{failure.describe()}: {_short(exc)}"
        until = first + self.budget_s
        log.warning("waiting on storage: %s %s failing for %.0f s (%s); try %d in %.1f s, retrying for %.0f s more "
                    "(run.io_retry_s=%g)", op, url, self.clock() - first, what, attempt + 1, delay,
                    max(0.0, until - self.clock()), self.budget_s)

    def _give_up(self, op: str, url: str, exc: BaseException, failure: Failure, retries: int,
                 spent: float) -> StorageError:
        if retries:
            with self.ledger.lock:
                self.ledger.counts[op].gave_up += 1
            self._report(op, retried=False, waiting=False)
            how = (f"transient, retried {retries} time{'s' if retries != 1 else ''} over {spent:.0f} s, until "
                   f"run.io_retry_s={self.budget_s:g} ran out")
        elif failure.transient:
            how = f"transient, not retried: run.io_retry_s={self.budget_s:g}"
        else:
            how = "permanent, not retried"
        verb = op.split()[0]  # "write part" -> "cannot write <url>", as describe_error words it
        missing = any(isinstance(e, FileNotFoundError) for e in _chain(exc))
        return (StorageNotFoundError if missing else StorageError)(
            f"cannot {verb} {url}: {failure.describe()} ({how}): {type(exc).__name__}: {_short(exc)}")


def _short(exc: BaseException) -> str:
    return redact(" ".join(str(exc).split()))[:300]


NO_RETRY = RetryPolicy(budget_s=0.0)
_active: list[RetryPolicy] = [NO_RETRY]


def active() -> RetryPolicy:
    """The policy this process's storage operations follow: the job sets its own (`use`); outside a
    job (tests, tools) none retries beyond the storage client's own tries."""
    return _active[-1]


@contextlib.contextmanager
def using(policy: RetryPolicy) -> Iterator[RetryPolicy]:
    """`policy` is this process's for the block (the job's driver for the run, a write task for its
    part); the one before is back after it."""
    _active.append(policy)
    try:
        yield policy
    finally:
        _active.remove(policy)
