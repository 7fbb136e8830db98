"""What a run does with an output location that already holds rows: stop, resume, write beside, replace.

Part files are named after their rows' keys, so a second run over the same inputs writes the same
names: before this module, running a job twice without `run.resume` silently replaced the first
run's parts, whatever had changed in between (the model, the prompts, the settings). Now the run
looks at `output.url` at start-up, before anything is generated, and `output.if_exists` decides:

- `error` (the default): an output that holds parts stops the run with one line saying what is
  there (run ids, rows, when last written, whether that run finished) and how to choose.
- `resume` (what `run.resume: true` means): rows already written are skipped, the rest generated.
  Without an explicit `run.run_id` the run continues under the id found there (one run only), so
  a resumed output stays one run.
- `beside`: this run writes to `<output.url>-<run id>`, next to the other run, which stays as it
  is. If that run has the same id, this one gets `<run id>-<UTC time>`.
- `replace`: this run writes to `<output.url>/_replace-<run id>/` (hidden from readers: names
  starting with `_` are skipped by Ray Data, Spark and pipeline.data.outputs) while readers keep seeing
  the old run; only when it has finished (every row and its job summary written) does it commit:
  a marker file naming its parts is written, then its parts move in and the old ones are deleted.
  A run that fails before the marker leaves the old run untouched (the next `replace` run removes
  the unfinished staging directory); a crash after the marker is rolled forward by the next run
  on that output, whatever its mode, before it looks at the output. While the swap runs (seconds)
  a reader may see rows of both runs; pipeline.data.outputs.read_output keeps one row per key.

An output whose directory holds no part files (absent, empty, only a summary) is fresh in every
mode. One job writes to an output at a time.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import posixpath
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pyarrow.parquet as pq

from dart_worker.artifacts import io_retry
from pipeline.data.outputs import list_parts
from pipeline.data.storage import StorageError, describe_error, filesystem_for, is_local, url_of
from pipeline.data.summary import SUMMARY_NAME
from pipeline.settings.config import PipelineConfig
from pipeline.startup.preflight import StartupError

logger = logging.getLogger(__name__)

STAGING_PREFIX = "_replace-"
COMMIT_MARKER = "_COMMITTED.json"
_THREADS = 8


def if_exists_mode(cfg: PipelineConfig) -> str:
    """The configured mode: `run.resume: true` is `resume` (config validation refuses it together
    with `beside` or `replace`)."""
    return "resume" if cfg.run.resume else cfg.output.if_exists


# ------------------------------------------------------------------------------- inspection


@dataclass(frozen=True)
class OutputState:
    """What an output location holds: its parts (by the run id in each part's metadata), when the
    newest was written, its job summary, and replacements left by earlier runs."""

    url: str
    parts: int = 0
    rows: int = 0
    rows_by_run: dict[str, int] = field(default_factory=dict)
    last_written: dt.datetime | None = None
    summary: dict[str, Any] | None = None
    unreadable_parts: int = 0
    committed_replacements: tuple[str, ...] = ()  # staging directories whose commit marker is written
    unfinished_replacements: tuple[str, ...] = ()  # staging directories without one

    @property
    def empty(self) -> bool:
        return self.parts == 0

    @property
    def finished(self) -> bool:
        """A job summary is there and counts every row the parts hold (a run that stopped, or a
        resumed one that is not done yet, has none, or an older one with fewer rows)."""
        totals = (self.summary or {}).get("output") or {}
        return self.summary is not None and totals.get("rows") == self.rows

    def describe(self) -> str:
        """'run 'local' (16 rows) in 2 parts, last written 2026-11-27 10:10 UTC, finished'."""
        runs = ", ".join(f"run {run_id!r} ({rows} rows)" for run_id, rows in sorted(self.rows_by_run.items()))
        when = self.last_written.strftime("%Y-%m-%d %H:%M UTC") if self.last_written else "at an unknown time"
        unreadable = f", {self.unreadable_parts} unreadable" if self.unreadable_parts else ""
        status = "finished" if self.finished else "not finished (no job summary for all its rows)"
        return f"{runs or 'no readable rows'} in {self.parts} parts{unreadable}, last written {when}, {status}"


def _modified(entry: dict[str, Any]) -> dt.datetime | None:
    """A listing entry's modification time: `mtime` (local, seconds) or `LastModified` (object stores)."""
    value = entry.get("mtime", entry.get("LastModified", entry.get("last_modified", entry.get("updated"))))
    if isinstance(value, (int, float)):
        return dt.datetime.fromtimestamp(value, dt.timezone.utc)
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    return None


def _footer(fs: fsspec.AbstractFileSystem, path: str) -> tuple[str, int] | None:
    """(run id, rows) from a part's Parquet footer, or None if it cannot be read."""
    try:
        with fs.open(path, "rb") as f:
            metadata = pq.read_metadata(f)
    except Exception:  # damaged outside the job: resume quarantines it; here it is only counted
        return None
    run_id = (metadata.metadata or {}).get(b"dart.run_id", b"?").decode("utf-8", "replace")
    return run_id, metadata.num_rows


def inspect_output(url: str) -> OutputState:
    """What `url` holds, read-only: one listing, every part's footer (in parallel threads; no row
    data), the job summary and the staging directories of replacements."""
    fs, directory = filesystem_for(url)
    parts = list_parts(fs, directory, url)  # StorageError for an unreachable store or missing bucket
    if not parts and not _exists(fs, directory, url):
        return OutputState(url)
    try:
        entries = {e["name"].rstrip("/"): e for e in fs.ls(directory, detail=True)}
    except FileNotFoundError:
        entries = {}
    except Exception as e:
        raise StorageError(describe_error("list", url, e)) from e
    with ThreadPoolExecutor(_THREADS) as pool:
        footers = list(pool.map(lambda p: _footer(fs, p), parts))
    rows_by_run: Counter[str] = Counter()
    for footer in footers:
        if footer is not None:
            rows_by_run[footer[0]] += footer[1]
    times = [t for p in parts if (t := _modified(entries.get(p.rstrip("/"), {}))) is not None]
    committed, unfinished = [], []
    for name, entry in sorted(entries.items()):
        if entry.get("type") == "directory" and posixpath.basename(name).startswith(STAGING_PREFIX):
            (committed if _exists(fs, posixpath.join(name, COMMIT_MARKER), url) else unfinished).append(name)
    return OutputState(url=url, parts=len(parts), rows=sum(rows_by_run.values()), rows_by_run=dict(rows_by_run),
                       last_written=max(times) if times else None, summary=_read_json(fs, directory, SUMMARY_NAME),
                       unreadable_parts=sum(f is None for f in footers), committed_replacements=tuple(committed),
                       unfinished_replacements=tuple(unfinished))


def _exists(fs: fsspec.AbstractFileSystem, path: str, url: str) -> bool:
    try:
        return bool(fs.exists(path))
    except Exception as e:
        raise StorageError(describe_error("reach", url, e)) from e


def _read_json(fs: fsspec.AbstractFileSystem, directory: str, name: str) -> dict[str, Any] | None:
    path = posixpath.join(directory, name)
    try:
        with fs.open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        logger.warning("cannot read %s; treating it as absent", url_of(fs, path))
        return None
    return data if isinstance(data, dict) else None


# ------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class OutputPlan:
    """Where this run writes and under which run id, decided from the mode and what is there."""

    mode: str
    url: str  # output.url as configured
    write_url: str  # where this run's parts go
    run_id: str
    state: OutputState  # what output.url held at start-up

    @property
    def resumes(self) -> bool:
        return self.mode == "resume" and not self.state.empty

    @property
    def stages(self) -> bool:
        """True when this run writes aside and replaces what is there once it has finished."""
        return self.write_url != self.url and self.mode == "replace"

    def describe(self) -> str:
        """One line: what the run will do with the output (the dry run prints it)."""
        pending = (f"; first completes the committed replacement {self.state.committed_replacements[0]}"
                   if self.state.committed_replacements else "")
        if self.state.empty:
            return f"fresh output{pending}"
        there = f"holds {self.state.describe()}"
        if self.mode == "resume":
            return f"{there}: resume as run {self.run_id!r}, rows already written are skipped{pending}"
        if self.mode == "beside":
            return f"{there}: this run ({self.run_id!r}) writes beside it, to {self.write_url}{pending}"
        return (f"{there}: this run ({self.run_id!r}) writes to {self.write_url} and replaces it only once it "
                f"has finished{pending}")

    def failure_note(self, rows_this_run: int, rows_earlier: int, *, exact: bool = True,
                     cause: str = "once the cause is fixed") -> str:
        """What a run that stopped mid-job leaves, and how to finish it. `rows_this_run`: rows of
        this run on storage (`exact`), or, when the store could not be read, the driver's count,
        a lower bound; `cause`: what must happen before the rerun."""
        rows = f"{rows_this_run} rows" if exact else f"at least {rows_this_run} rows"
        if self.stages:
            return (f"the job stopped; {self.url} is untouched (this run's {rows} under "
                    f"{self.write_url} are not committed): {cause}, rerun the same command "
                    f"(the replacement starts over)")
        resume = "rerun with run.resume=true"
        if self.write_url != self.url:
            resume = f"rerun with output.url={self.write_url} run.run_id={self.run_id} run.resume=true"
        return (f"the job stopped; every part already written under {self.write_url} is kept "
                f"({rows} of this run on storage, {rows_earlier} of earlier runs): {cause}, {resume} "
                f"to generate the rest")

    def job_config(self, cfg: PipelineConfig) -> PipelineConfig:
        """`cfg` as the job runs it: its parts go to `write_url`, its rows carry `run_id`."""
        return dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, url=self.write_url),
                                   run=dataclasses.replace(cfg.run, run_id=self.run_id))

    def as_dict(self) -> dict[str, Any]:
        s = self.state
        return {"if_exists": self.mode, "url": self.url, "write_url": self.write_url, "run_id": self.run_id,
                "found": {"parts": s.parts, "rows": s.rows, "rows_by_run": s.rows_by_run, "finished": s.finished,
                          "last_written": s.last_written.isoformat() if s.last_written else None}}


def beside_url(url: str, run_id: str) -> str:
    """`<output.url>-<run id>`: a sibling of the output, on the same store."""
    fs, directory = filesystem_for(url)
    if not is_local(fs) and "/" not in directory.strip("/"):
        raise StartupError(f"output.if_exists=beside: {url} is a bucket root; name a prefix in it as output.url")
    return f"{url.rstrip('/')}-{run_id}"


def staging_url(url: str, run_id: str) -> str:
    return f"{url.rstrip('/')}/{STAGING_PREFIX}{run_id}"


def plan_output(cfg: PipelineConfig, run_id: str, state: OutputState | None = None) -> OutputPlan:
    """The plan for a run of `cfg` as `run_id` (read-only, also for the dry run); StartupError when
    the output holds rows and `output.if_exists` does not say what to do with them."""
    url, mode = cfg.output.url, if_exists_mode(cfg)
    try:
        state = state or inspect_output(url)
    except StorageError as exc:
        raise StartupError(f"output {url}: {exc}") from None
    if state.empty:
        return OutputPlan(mode, url, url, run_id, state)
    if mode == "error":
        raise StartupError(
            f"output {url} already holds {state.describe()}; set output.if_exists to say what to do with it: "
            f"resume (finish or extend it, as run.resume=true does), beside (write this run to "
            f"{url.rstrip('/')}-<run id>) or replace (replace it once this run has finished)")
    if mode == "resume":
        if cfg.run.run_id is None and len(state.rows_by_run) == 1:
            run_id = next(iter(state.rows_by_run))  # keep the output one run: continue under its id
        return OutputPlan(mode, url, url, run_id, state)
    if mode == "beside":
        if run_id in state.rows_by_run:
            run_id = f"{run_id}-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%S')}"
        target = beside_url(url, run_id)
        try:
            there = inspect_output(target)
        except StorageError as exc:
            raise StartupError(f"output {target}: {exc}") from None
        if not there.empty:
            raise StartupError(f"output.if_exists=beside: {target} already holds {there.describe()}; "
                               f"set another run.run_id")
        return OutputPlan(mode, url, target, run_id, state)
    return OutputPlan(mode, url, staging_url(url, run_id), run_id, state)


# ------------------------------------------------------------------------------- real runs


def open_output(cfg: PipelineConfig, run_id: str) -> OutputPlan:
    """`plan_output` for a run that will write: first completes any committed replacement an
    earlier run left half-done, and for `replace` removes unfinished staging directories."""
    url = cfg.output.url
    try:
        state = inspect_output(url)
        for staging in state.committed_replacements:
            finish_replacement(url, staging)
        if state.committed_replacements:
            state = inspect_output(url)
    except StorageError as exc:
        raise StartupError(f"output {url}: {exc}") from None
    plan = plan_output(cfg, run_id, state)
    fs, _ = filesystem_for(url)
    if plan.mode == "replace":
        for staging in state.unfinished_replacements:
            logger.warning("removing %s: a replacement that did not finish; the rows there were never committed",
                           url_of(fs, staging))
            fs.rm(staging, recursive=True)
    if plan.write_url != url:
        wfs, wpath = filesystem_for(plan.write_url)
        wfs.makedirs(wpath, exist_ok=True)
    return plan


def commit_output(plan: OutputPlan) -> dict[str, Any] | None:
    """For a `replace` run that has finished: mark it committed, then swap it in (finish_replacement).
    Returns what was replaced (None for the other modes, which have nothing to commit)."""
    if not plan.stages:
        return None
    fs, staging = filesystem_for(plan.write_url)
    names = [posixpath.basename(p) for p in list_parts(fs, staging, plan.write_url)]
    marker = {"run_id": plan.run_id, "parts": names, "replaces": plan.state.rows_by_run,
              "committed_at": dt.datetime.now(dt.timezone.utc).isoformat()}
    marker_path = posixpath.join(staging, COMMIT_MARKER)
    retry = io_retry.active()  # the job's: transient store failures are waited out (dart_worker/artifacts/io_retry.py)
    retry.call("write marker", url_of(fs, marker_path),  # the commit point
               lambda: fs.pipe_file(marker_path, json.dumps(marker).encode()))
    retry.call("replace output", plan.url, lambda: finish_replacement(plan.url, staging))  # idempotent
    logger.info("replaced %s under %s with run %r (%d parts)", plan.state.describe(), plan.url, plan.run_id,
                len(names))
    return marker


def finish_replacement(url: str, staging: str) -> None:
    """Swap a committed staging directory in: move its parts up (a same-named old part is replaced),
    delete the parts the commit marker does not name, move its summary, remove the directory.
    Every step is idempotent, so a crash anywhere is finished by calling this again."""
    fs, directory = filesystem_for(url)
    marker_path = posixpath.join(staging, COMMIT_MARKER)
    with fs.open(marker_path, "rb") as f:
        keep = set(json.loads(f.read())["parts"])
    for path in list_parts(fs, staging, url):
        _move(fs, path, posixpath.join(directory, posixpath.basename(path)))
    for path in list_parts(fs, directory, url):
        if posixpath.basename(path) not in keep:
            fs.rm_file(path)
    summary = posixpath.join(staging, SUMMARY_NAME)
    if fs.exists(summary):
        _move(fs, summary, posixpath.join(directory, SUMMARY_NAME))
    fs.rm(staging, recursive=True)


def _move(fs: fsspec.AbstractFileSystem, source: str, target: str) -> None:
    """Locally an atomic rename that replaces `target`; elsewhere the store's move (copy, delete)."""
    if is_local(fs):
        os.replace(source, target)
    else:
        fs.mv(source, target)

