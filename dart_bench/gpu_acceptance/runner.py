"""Runs the acceptance run's sections so that a rare GPU window never comes back empty.

A lent GPU machine comes bare, rarely and for one command of about ten minutes. So the run:

- writes its report as it goes: `acceptance.json` and `acceptance.md` exist from the first second
  and are rewritten atomically (a temporary file renamed over the old one) after every result a
  section yields (a correctness case, a timing cell) and at every change of a section's status;
  a killed process leaves the last complete report, its running section marked `running`;
- survives any one failure: each section runs under its own try/except that records the error
  (type, message, the last frames) as `error: <one line>` and goes on with the next; device
  memory is freed after an out-of-memory error;
- has one deadline for the whole run (`Deadline`, counted from process start): a section that
  would start after it is `skipped: time`, a running one stops at its next result (`skipped: time`
  with `cut_off`, its results so far kept), and a watchdog thread, if the section has not
  stopped `grace_s` after the deadline (a long kernel, a hang), marks it so, writes the final
  report and ends the process with the run's exit code.

Exit code: 1 if a correctness section failed or raised, else 0 (a skipped or cut-off section
is no failure: the report says INCOMPLETE and names it).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PENDING, RUNNING, PASSED, FAILED = "pending", "running", "passed", "failed"
SKIPPED_TIME = "skipped: time"
CORRECTNESS, SPEED = "correctness", "speed"


class SkipSection(Exception):
    """Raised by a section that cannot run (its model was never built): `skipped: <message>`."""


@dataclass
class Section:
    """One named part of the run. `steps()` yields its results one at a time (a case, a cell), so a
    section cut off or failing halfway keeps what it measured. A correctness section passes when
    every result has `passed` true; a timing section passes when it ran to its end. `finish` runs
    after the section whatever its status (records peak memory, releases a model)."""

    name: str
    kind: str  # CORRECTNESS | SPEED
    steps: Callable[[], Iterable[dict[str, Any]]]
    finish: Callable[[dict[str, Any]], None] | None = None


def process_started() -> float:
    """`time.monotonic()` at this process's start (Linux: /proc), so the deadline counts the
    interpreter's and torch's start-up too; now where /proc cannot tell."""
    now = time.monotonic()
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, after the command name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        elapsed = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - max(0.0, elapsed)


@dataclass(frozen=True)
class Deadline:
    """The run's one deadline: `budget_s` seconds after `started` (a `time.monotonic()` value)."""

    started: float
    budget_s: float

    @property
    def at(self) -> float:
        return self.started + self.budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def passed(self) -> bool:
        return time.monotonic() >= self.at


def error_record(exc: BaseException, frames: int = 6) -> dict[str, Any]:
    """An exception as the report keeps it: its type, message and last `frames` frames."""
    stack = traceback.extract_tb(exc.__traceback__)[-frames:]
    return {"type": type(exc).__name__, "message": str(exc),
            "frames": [f"{Path(f.filename).name}:{f.lineno} in {f.name}: {f.line or ''}".rstrip() for f in stack]}


def one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file in the same folder renamed over it: a reader
    (or a process killed mid-write) sees the old report or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class AcceptanceRun:
    """Runs `sections` in order against `deadline`, keeping `report` (its `sections` list holds one
    record per section, in run order) written under `out_dir` as `acceptance.json` and, through
    `render`, `acceptance.md`. `free_memory` runs after a section that ran out of device memory;
    `exit` ends the process when the watchdog fires (os._exit: the main thread may be stuck in a
    kernel)."""

    def __init__(self, report: dict[str, Any], sections: list[Section], out_dir: Path, deadline: Deadline,
                 grace_s: float, render: Callable[[dict[str, Any]], str],
                 free_memory: Callable[[], None] = lambda: None, exit: Callable[[int], Any] = os._exit,
                 log: Callable[[str], None] = lambda line: print(line, flush=True)):
        self.report, self.sections, self.out_dir, self.deadline = report, sections, out_dir, deadline
        self.grace_s, self.render, self.free_memory, self.exit, self.log = grace_s, render, free_memory, exit, log
        self.records = [{"name": s.name, "kind": s.kind, "status": PENDING} for s in sections]
        report.update(state="running", deadline_s=deadline.budget_s, sections=self.records)
        self._lock = threading.RLock()
        self._closed = False  # set once the final report is written: nothing may overwrite it
        self._section_started: float | None = None

    # ------------------------------------------------------------------ the report

    def exit_code(self) -> int:
        return int(any(r["kind"] == CORRECTNESS and (r["status"] == FAILED or r["status"].startswith("error"))
                       for r in self.records))

    def write(self) -> None:
        with self._lock:
            if self._closed:
                return
            self.report["seconds"] = round(self.deadline.elapsed(), 1)
            self.report["exit_code"] = self.exit_code()
            write_atomically(self.out_dir / "acceptance.json", json.dumps(self.report, indent=1, default=str))
            write_atomically(self.out_dir / "acceptance.md", self.render(self.report))

    def _close(self, state: str) -> int:
        with self._lock:
            if self._closed:  # the watchdog wrote the final report already
                return self.report["exit_code"]
            self.report["state"] = state
            self.write()
            self._closed = True
            return self.report["exit_code"]

    # ------------------------------------------------------------------ running

    def run(self) -> int:
        """Every section in order; the exit code (module docstring)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.write()
        watchdog = threading.Timer(max(0.0, self.deadline.at + self.grace_s - time.monotonic()), self._watchdog)
        watchdog.daemon = True
        watchdog.start()
        try:
            for section, record in zip(self.sections, self.records):
                self._run_section(section, record)
        except BaseException as exc:  # KeyboardInterrupt: the report still says what ran
            with self._lock:
                for record in self.records:
                    if record["status"] in (PENDING, RUNNING):
                        record["status"] = f"error: interrupted ({type(exc).__name__})"
            self._close("interrupted")
            raise
        finally:
            watchdog.cancel()
        return self._close("finished")

    def _run_section(self, section: Section, record: dict[str, Any]) -> None:
        if self.deadline.passed():
            with self._lock:
                record["status"] = SKIPPED_TIME
            self.write()
            self.log(f"[{self.deadline.elapsed():6.1f} s] {section.name}: {SKIPPED_TIME}")
            return
        started = time.monotonic()
        with self._lock:
            record.update(status=RUNNING, started_s=round(started - self.deadline.started, 1), results=[])
            self._section_started = started
        self.write()
        status, out_of_memory = None, False
        steps = iter(())
        try:
            steps = iter(section.steps())
            for result in steps:
                with self._lock:
                    record["results"].append(result)
                    record["seconds"] = round(time.monotonic() - started, 2)
                self.write()
                if self.deadline.passed():
                    status = SKIPPED_TIME
                    record["cut_off"] = True
                    break
        except SkipSection as exc:
            status = f"skipped: {exc}"
        except Exception as exc:
            status = f"error: {one_line(exc)}"
            record["error"] = error_record(exc)
            out_of_memory = "OutOfMemoryError" in type(exc).__name__ or "out of memory" in str(exc)
        finally:
            close = getattr(steps, "close", None)
            if close is not None:
                close()  # a generator cut off runs its cleanup (temporary files, float32 precision) now
        if status is None:
            passed = section.kind != CORRECTNESS or all(r.get("passed", False) for r in record["results"])
            status = PASSED if passed else FAILED
        if out_of_memory:
            self.free_memory()
        with self._lock:
            record["status"] = status
            record["seconds"] = round(time.monotonic() - started, 2)
            self._section_started = None
        if section.finish is not None:
            try:
                section.finish(record)
            except Exception as exc:
                record["finish_error"] = error_record(exc)
        self.write()
        self.log(f"[{self.deadline.elapsed():6.1f} s] {section.name}: {status} ({record['seconds']} s)")

    def _watchdog(self) -> None:
        """The deadline passed `grace_s` ago and the run is still going: the running section is cut
        off where it is, the rest skipped, the final report written, the process ended."""
        with self._lock:
            if self._closed:
                return
            for record in self.records:
                if record["status"] == RUNNING:
                    record.update(status=SKIPPED_TIME, cut_off=True, cut_off_by="watchdog",
                                  seconds=round(time.monotonic() - (self._section_started or time.monotonic()), 2))
                elif record["status"] == PENDING:
                    record["status"] = SKIPPED_TIME
            code = self._close("cut off by the watchdog")
        self.log(f"[{self.deadline.elapsed():6.1f} s] watchdog: the deadline ({self.deadline.budget_s:.0f} s) "
                 f"passed {self.grace_s:.0f} s ago; report written to {self.out_dir}, exiting {code}")
        sys.stdout.flush()
        sys.stderr.flush()
        self.exit(code)
