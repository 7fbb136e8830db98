"""Load benchmark of the job's own machinery: `python -m jobs.bench load [key=value ...]`.

    python -m jobs.bench load                                   # 10k and 100k rows, then a resume of each
    python -m jobs.bench load 'rows=[2000]' mode=ar             # a quick look
    python -m jobs.bench load output=docs/benchmarks/load.json  # keep every figure

Generation is real but small: a tiny random-weight target (tests/tiny_models.py: a 6-layer,
64-wide Llama with its own draft head and trie) and a few new tokens per row, so that what is
measured is what surrounds the engine: reading the inputs and the duplicate-id pass, the output
inspection at start-up, the resume scan of written parts, Ray Data's scheduling of the
generation actors, writing the parts, the driver's tally and the job summary. For each size it
writes N generated rows (varied lengths, some duplicate ids and bad lines) over a few JSONL
files, runs `pipeline.run.run_pipeline` on them, checks that every input row came out exactly
once, then runs it again with `run.resume=true`, which must find everything done.

Each job runs in a process of its own (a fresh driver: its peak memory is that job's alone,
and a fresh local Ray), one after the other. Reported per job: wall time and rows/s end to end;
start-up (call to the first row's decoding, from the rows' own `finished_at - wall_s`); the
driver's stages (each timed around the pipeline.run function that does it); Ray Data's
per-operator figures (rows and wall time per stage, from the dataset's own stats); peak memory
(the driver's RSS; per Ray worker process the largest PSS, by kind); and, between the sizes,
the growth of each figure (x10 rows: 10 is linear).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from dart_worker.defaults import DEFAULT_MODE

VOCAB_WORDS = (4, 96)  # the tiny tokenizer's words w4..w95


@dataclass
class LoadBenchConfig:
    rows: list[int] = field(default_factory=lambda: [10_000, 100_000])
    files: int = 4  # input JSONL files the rows are spread over
    mode: str = DEFAULT_MODE  # the default mode: head, trie, context lookup, job cache and job n-gram
    max_new_tokens: int = 4
    batch_size: int = 64  # rows per engine call (the cluster config's)
    max_live: int = 16
    rows_per_file: int = 256  # output rows per part
    workers: int = 1
    torch_threads: int = 1
    duplicate_fraction: float = 0.01  # rows repeating an earlier id
    bad_fraction: float = 0.01  # malformed JSON, empty prompts, missing ids, non-string prompts
    phases: list[str] = field(default_factory=lambda: ["fresh", "resume"])  # resume needs a fresh run's output
    work_dir: str | None = None  # where inputs, artifacts and outputs go (kept); default: a temporary directory
    output: str | None = None  # JSON with every figure


# ----------------------------------------------------------------------------------- inputs


def write_inputs(directory: Path, rows: int, files: int, duplicate_fraction: float, bad_fraction: float,
                 seed: int = 0) -> dict[str, int]:
    """`rows` JSONL lines over `files` files: prompts of 1-100 tiny-vocabulary words (log-uniform),
    some lines repeating an earlier id, some bad. Returns the counts the job must reproduce."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    kinds = rng.random(rows)
    lengths = np.exp(rng.uniform(0, np.log(100), size=rows)).astype(int) + 1
    words = rng.integers(*VOCAB_WORDS, size=int(lengths.sum()))
    counts = {"lines": rows, "duplicate": 0, "bad": 0}
    lines: list[list[str]] = [[] for _ in range(files)]
    good: list[int] = []  # rows written with their own id: what a duplicate repeats
    offset = 0
    for i in range(rows):
        prompt = " ".join(f"w{w}" for w in words[offset : offset + lengths[i]])
        offset += lengths[i]
        if kinds[i] < bad_fraction:
            counts["bad"] += 1
            line = [f'{{"id": "bad-{i}", "prompt": ', json.dumps({"id": f"e{i}", "prompt": ""}),
                    json.dumps({"prompt": prompt}), json.dumps({"id": f"n{i}", "prompt": 7})][i % 4]
        elif kinds[i] < bad_fraction + duplicate_fraction and good:
            counts["duplicate"] += 1
            line = json.dumps({"id": f"r{good[int(rng.integers(0, len(good)))]}", "prompt": prompt})
        else:
            good.append(i)
            line = json.dumps({"id": f"r{i}", "prompt": prompt})
        lines[i % files].append(line)
    for k, chunk in enumerate(lines):
        (directory / f"prompts-{k:02d}.jsonl").write_text("\n".join(chunk) + "\n")
    return counts


# ---------------------------------------------------------------------------------- sampling


class MemorySampler:
    """Peak memory while a job runs, sampled every `interval_s`: this (driver) process's RSS and the
    PSS (shared pages split among their users) of the processes of the Ray instance it started,
    only its own descendants (another Ray on the machine is not counted), by kind: the generation
    actor, the other workers (Ray Data's read and write tasks, the trie store, idle workers), and
    Ray's infrastructure (raylet, GCS, dashboard, agents, Ray Data's bookkeeping actors)."""

    INFRASTRUCTURE = ("raylet", "gcs_server", "dashboard", "DashboardAgent", "RuntimeEnvAgent", "_StatsActor",
                      "_AutoscalingCoordinatorActor", "ActorLocationTracker", "log_monitor", "monitor.py",
                      "autoscaler")

    def __init__(self, interval_s: float = 0.5):
        import psutil

        self._psutil = psutil
        self.interval_s = interval_s
        self.driver_peak_rss = 0
        self.peak_by_kind: dict[str, int] = {}
        self.peak_workers_total = 0
        self.peak_infrastructure_total = 0
        self.processes_at_peak: dict[str, int] = {}  # how many processes of each kind made that total
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @classmethod
    def kind(cls, cmdline: str) -> str:
        if "GenerationWorker" in cmdline:
            return "generation_actor"
        if any(name in cmdline for name in cls.INFRASTRUCTURE) or not cmdline.startswith("ray::"):
            return "ray_infrastructure"
        return "other_workers"

    def sample(self) -> None:
        me = self._psutil.Process()
        self.driver_peak_rss = max(self.driver_peak_rss, me.memory_info().rss)
        totals = {"workers": 0, "infrastructure": 0}
        counts: dict[str, int] = {}
        for proc in me.children(recursive=True):
            try:
                kind = self.kind(" ".join(proc.cmdline()))
                pss = proc.memory_full_info().pss
            except (self._psutil.Error, OSError):
                continue
            self.peak_by_kind[kind] = max(self.peak_by_kind.get(kind, 0), pss)
            totals["infrastructure" if kind == "ray_infrastructure" else "workers"] += pss
            counts[kind] = counts.get(kind, 0) + 1
        self.peak_infrastructure_total = max(self.peak_infrastructure_total, totals["infrastructure"])
        if totals["workers"] > self.peak_workers_total:
            self.peak_workers_total = totals["workers"]
            self.processes_at_peak = {k: v for k, v in counts.items() if k != "ray_infrastructure"}

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def figures(self) -> dict[str, Any]:
        mib = 2**20
        return {"driver_peak_rss_mib": self.driver_peak_rss / mib,
                "ray_workers_peak_total_pss_mib": self.peak_workers_total / mib,
                "ray_worker_processes_at_peak": self.processes_at_peak,
                "ray_worker_processes_at_peak_n": sum(self.processes_at_peak.values()),
                "ray_infrastructure_peak_total_pss_mib": self.peak_infrastructure_total / mib,
                **{f"{kind}_peak_pss_mib": value / mib for kind, value in sorted(self.peak_by_kind.items())}}


class StageTimer:
    """Wall time of the driver's stages: wraps the named functions of a module (pipeline.run's own
    names, so the job runs its ordinary code) and adds up the seconds spent in each."""

    def __init__(self, module: Any, names: list[str]):
        self.module, self.seconds, self.results, self.ended = module, {}, {}, {}
        self._originals = {name: getattr(module, name) for name in names if hasattr(module, name)}

    def __enter__(self) -> StageTimer:
        for name, function in self._originals.items():
            setattr(self.module, name, self._timed(name, function))
        return self

    def _timed(self, name: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                result = function(*args, **kwargs)
                self.results[name] = result
                return result
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
                self.ended[name] = time.time()
        return wrapper

    def __exit__(self, *exc) -> None:
        for name, function in self._originals.items():
            setattr(self.module, name, function)


_OPERATOR = re.compile(r"^Operator \d+ (?P<name>.+?): (?P<tasks>\d+) tasks executed, (?P<blocks>\d+) blocks "
                       r"produced in (?P<seconds>[\d.]+)s", re.MULTILINE)
_ROWS = re.compile(r"\* Output num rows per block: .*?(?P<rows>\d+) total")
_BUSY = re.compile(r"\* Remote wall time: .*?(?P<value>[\d.]+)(?P<unit>us|ms|s) total")
_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def operator_figures(stats: str) -> list[dict[str, Any]]:
    """Per Ray Data operator (from the dataset's stats text): its name, tasks, blocks, rows out, its
    span (first task start to last end, overlapping the other operators), its busy time (the sum of
    its tasks' wall times) and rows per second of each."""
    out = []
    for match in _OPERATOR.finditer(stats):
        rest = stats[match.end():]
        nxt = _OPERATOR.search(rest)
        body = rest[: nxt.start()] if nxt else rest
        rows, busy = _ROWS.search(body), _BUSY.search(body)
        entry = {"operator": match["name"], "tasks": int(match["tasks"]), "blocks": int(match["blocks"]),
                 "rows": int(rows["rows"]) if rows else 0, "span_s": float(match["seconds"]),
                 "busy_s": float(busy["value"]) * _UNIT[busy["unit"]] if busy else None}
        if entry["rows"] and entry["span_s"] > 0:
            entry["rows_per_s_span"] = entry["rows"] / entry["span_s"]
        if entry["rows"] and entry["busy_s"]:
            entry["rows_per_busy_s"] = entry["rows"] / entry["busy_s"]
        out.append(entry)
    return out


# ------------------------------------------------------------------------------ one job


def job_config(spec: dict[str, Any]):
    from pipeline.settings.config import load_config

    a = spec["artifacts"]
    return load_config(None, [
        f"input.urls=[{spec['inputs']}/*.jsonl]", f"output.url={spec['output']}",
        f"model.target={a['target']}", f"model.draft_head={a['head']}", f"model.trie={a['trie']}",
        "model.dtype=fp32", "model.device=cpu",
        f"decoding.mode={spec['mode']}", f"decoding.max_new_tokens={spec['max_new_tokens']}",
        f"resources.num_workers={spec['workers']}", f"resources.num_cpus_per_worker={1 / spec['workers']}",
        f"resources.torch_threads={spec['torch_threads']}", f"resources.batch_size={spec['batch_size']}",
        f"resources.max_live={spec['max_live']}", f"output.rows_per_file={spec['rows_per_file']}",
        "run.run_id=load", f"run.resume={str(spec['resume']).lower()}", "run.progress_interval_s=30",
    ])


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One job in this process: the figures of `run_pipeline` on the spec's inputs."""
    import ray

    import pipeline.run as run_module
    from pipeline.data.outputs import read_output

    cfg = job_config(spec)
    captured: dict[str, Any] = {}
    original_build = run_module.build_dataset

    def build_and_keep(*args: Any, **kwargs: Any):
        ds, duplicates = original_build(*args, **kwargs)
        captured["dataset"] = ds
        return ds, duplicates

    stages = ["resolve_artifacts", "open_output", "remove_temp_files", "resume_progress", "check_cpu_budget",
              "start_probe", "build_dataset", "await_device",
              "output_totals", "build_summary", "commit_output", "shutdown_ngram_stores"]
    started = time.time()
    run_module.build_dataset = build_and_keep
    try:
        with MemorySampler() as memory, StageTimer(run_module, stages) as timer:
            summary = run_module.run_pipeline(cfg)
            wall = time.time() - started
        stats = captured["dataset"].stats() if captured.get("dataset") is not None else ""
    finally:
        run_module.build_dataset = original_build
    ray.shutdown()
    this = summary["this_run"]
    result: dict[str, Any] = {
        "phase": "resume" if spec["resume"] else "fresh", "wall_s": wall, "rows_written": this["rows"],
        "rows_skipped_as_done": this["rows_skipped_as_done"], "generated_tokens": this["generated_tokens"],
        "driver_stages_s": timer.seconds, "memory": memory.figures(), "operators": operator_figures(stats),
        "output_totals": summary["output"],
    }
    table = read_output(spec["output"], ["finished_at", "wall_s"])
    if not spec["resume"] and table.num_rows:
        starts = [f.timestamp() - w for f, w in zip(table["finished_at"].to_pylist(), table["wall_s"].to_pylist())
                  if f is not None and w is not None]
        ends = [f.timestamp() for f in table["finished_at"].to_pylist() if f is not None]
        result["startup_s"] = min(starts) - started
        # start-up = the driver's checks, Ray, the duplicate pass, then the generation actor's start
        result["startup_after_duplicate_pass_s"] = min(starts) - timer.ended.get("build_dataset", started)
        result["generation_span_s"] = max(ends) - min(starts)
        result["rows_per_s_generation_span"] = table.num_rows / result["generation_span_s"]
    result["rows_per_s_end_to_end"] = (this["rows"] + this["rows_skipped_as_done"]) / wall
    result["stage_rows_per_s"] = stage_rates(result, spec["rows"])
    result["ray_data_stats"] = stats
    return result


def stage_rates(result: dict[str, Any], rows: int) -> dict[str, float | None]:
    """Rows per second of each stage of the job: the driver's (rows over the stage's wall time) and
    Ray Data's operators (rows over the sum of their tasks' wall times: what one CPU does)."""
    stages = result["driver_stages_s"]

    def per(seconds: float | None) -> float | None:
        return rows / seconds if seconds else None

    resume = result["phase"] == "resume"  # only then does the output hold the rows to check and scan
    rates = {"duplicate pass (driver)": per(stages.get("build_dataset")),
             "output check (driver)": per(stages.get("open_output")) if resume else None,
             "resume scan (driver)": per(stages.get("resume_progress")) if resume else None,
             "summary totals (driver)": per(stages.get("output_totals"))}
    ops = result["operators"]
    generation = next((i for i, o in enumerate(ops) if "GenerationWorker" in o["operator"]), None)
    # The read side is every operator before generation: Ray Data fuses read, mark and repartition
    # into one operator for small inputs and splits them in two for large ones.
    read_busy = sum(o["busy_s"] or 0.0 for o in ops[:generation]) if generation else 0.0
    rates["read (per busy CPU)"] = ops[0]["rows"] / read_busy if read_busy and ops[0]["rows"] else None
    for label, marker in (("generation", "GenerationWorker"), ("write", "write_rows")):
        op = next((o for o in ops if marker in o["operator"]), None)
        rates[f"{label} (per busy CPU)"] = op.get("rows_per_busy_s") if op else None
    return rates


def run_in_subprocess(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """`run_one` in a fresh Python process (its own driver memory, its own local Ray)."""
    path = work / f"spec-{spec['rows']}-{'resume' if spec['resume'] else 'fresh'}.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run([sys.executable, "-m", "jobs.bench", "load", "--one", str(path)], check=True, env=env)
    return json.loads(path.with_suffix(".result.json").read_text())


def check_exactly_once(output: str, lines: int) -> dict[str, int]:
    """Every input line has exactly one output row (ok or error)."""
    from pipeline.data.outputs import read_output

    keys = read_output(output, ["row_key"])["row_key"]
    distinct = len(set(keys.to_pylist()))
    if distinct != lines or len(keys) != lines:
        raise AssertionError(f"{output}: {len(keys)} rows, {distinct} distinct keys for {lines} input lines")
    return {"rows": len(keys), "distinct_row_keys": distinct}


# ------------------------------------------------------------------------------ report


GROWTH_FIGURES = {  # (phase, path in the result): how each grows with the rows
    "wall_s": ("fresh", ("wall_s",)),
    "startup_s": ("fresh", ("startup_s",)),
    "generation_span_s": ("fresh", ("generation_span_s",)),
    "dup_pass_s (build_dataset)": ("fresh", ("driver_stages_s", "build_dataset")),
    "output_check_s (open_output)": ("fresh", ("driver_stages_s", "open_output")),
    "summary_s (output_totals)": ("fresh", ("driver_stages_s", "output_totals")),
    "driver_peak_rss_mib": ("fresh", ("memory", "driver_peak_rss_mib")),
    "generation_actor_peak_pss_mib": ("fresh", ("memory", "generation_actor_peak_pss_mib")),
    "ray_workers_peak_total_pss_mib": ("fresh", ("memory", "ray_workers_peak_total_pss_mib")),
    "ray_infrastructure_peak_total_pss_mib": ("fresh", ("memory", "ray_infrastructure_peak_total_pss_mib")),
    "resume wall_s": ("resume", ("wall_s",)),
    "resume scan_s (resume_progress)": ("resume", ("driver_stages_s", "resume_progress")),
    "resume driver_peak_rss_mib": ("resume", ("memory", "driver_peak_rss_mib")),
}


def _get(result: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(result, dict) or key not in result:
            return None
        result = result[key]
    return result


def growth(runs: dict[int, dict[str, dict]]) -> dict[str, dict[str, float | None]]:
    """Each figure at the smallest and largest size and their ratio (rows ratio for reference)."""
    sizes = sorted(runs)
    if len(sizes) < 2:
        return {}
    small, large = sizes[0], sizes[-1]
    out = {"rows": {"small": small, "large": large, "ratio": large / small}}
    for name, (phase, path) in GROWTH_FIGURES.items():
        a, b = _get(runs[small][phase], path), _get(runs[large][phase], path)
        out[name] = {"small": a, "large": b, "ratio": (b / a) if a and b is not None else None}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--one"]:
        spec_path = Path(argv[1])
        result = run_one(json.loads(spec_path.read_text()))
        spec_path.with_suffix(".result.json").write_text(json.dumps(result, default=str))
        return result
    cfg: LoadBenchConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LoadBenchConfig),
                                                               OmegaConf.from_dotlist(argv)))
    from dart_bench.common import machine_conditions, write_report
    from tests.tiny_models import save_tiny_artifacts

    conditions = machine_conditions(threads=cfg.torch_threads) | {"dtype": "fp32", "device": "cpu"}
    print(f"conditions: {conditions}", flush=True)
    report: dict[str, Any] = {"config": asdict(cfg), "conditions": conditions, "runs": {}}
    with contextlib.ExitStack() as stack:
        work = Path(cfg.work_dir) if cfg.work_dir else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="bench-load-")))
        work.mkdir(parents=True, exist_ok=True)
        artifacts = (json.loads((work / "artifacts.json").read_text()) if (work / "artifacts.json").is_file()
                     else save_tiny_artifacts(work / "artifacts"))
        (work / "artifacts.json").write_text(json.dumps(artifacts))
        for rows in cfg.rows:
            started = time.time()
            counts_file = work / f"in-{rows}.counts.json"
            if counts_file.is_file():  # the same inputs as the run that wrote them (a later resume phase)
                counts = json.loads(counts_file.read_text())
            else:
                counts = write_inputs(work / f"in-{rows}", rows, cfg.files, cfg.duplicate_fraction, cfg.bad_fraction)
                counts_file.write_text(json.dumps(counts))
            print(f"{rows} rows: inputs ready in {time.time() - started:.1f} s ({counts})", flush=True)
            spec = {"rows": rows, "inputs": str(work / f"in-{rows}"), "output": str(work / f"out-{rows}"),
                    "artifacts": artifacts, **{k: getattr(cfg, k) for k in (
                        "mode", "max_new_tokens", "batch_size", "max_live", "rows_per_file", "workers",
                        "torch_threads")}}
            runs = {}
            for phase in cfg.phases:
                if phase == "fresh" and Path(spec["output"]).exists():
                    shutil.rmtree(spec["output"])
                result = run_in_subprocess({**spec, "resume": phase == "resume"}, work)
                result["exactly_once"] = check_exactly_once(spec["output"], counts["lines"])
                runs[result["phase"]] = result
                shown = {k: v for k, v in result.items() if k not in ("ray_data_stats", "operators")}
                print(f"{rows} rows, {result['phase']}: {json.dumps(shown, default=str)}", flush=True)
                for op in result["operators"]:
                    print(f"    {op}", flush=True)
            report["runs"][rows] = {"inputs": counts, **runs}
        if set(cfg.phases) == {"fresh", "resume"}:
            report["growth"] = growth({rows: report["runs"][rows] for rows in cfg.rows})
    print("\n".join(markdown_table(report)))
    write_report(cfg.output, report)
    return report


def markdown_table(report: dict[str, Any]) -> list[str]:
    """The figures per size, and their growth, as the rows of a Markdown table."""
    sizes = sorted(report["runs"], key=int)
    figures: dict[str, list[Any]] = {}

    def add(name: str, phase: str, path: tuple[str, ...], fmt: str) -> None:
        values = [_get(report["runs"][n].get(phase, {}), path) for n in sizes]
        figures[name] = [("-" if v is None else format(v, fmt)) for v in values] + [
            "-" if None in (values[0], values[-1]) or not values[0] or len(values) < 2
            else f"{values[-1] / values[0]:.1f}x"]

    add("job wall time, s", "fresh", ("wall_s",), ".0f")
    add("rows/s end to end", "fresh", ("rows_per_s_end_to_end",), ".1f")
    add("start-up (call to first row decoding), s", "fresh", ("startup_s",), ".1f")
    add("... of which after the duplicate pass (workers start), s", "fresh", ("startup_after_duplicate_pass_s",), ".1f")
    add("... of which the wait for the device probe after the duplicate pass (a Ray task, started before it), s",
        "fresh", ("driver_stages_s", "await_device"), ".1f")
    for stage in ("duplicate pass (driver)", "summary totals (driver)",
                  "read (per busy CPU)", "generation (per busy CPU)", "write (per busy CPU)"):
        add(f"{stage}, rows/s", "fresh", ("stage_rows_per_s", stage), ".0f")
    add("duplicate pass, s", "fresh", ("driver_stages_s", "build_dataset"), ".1f")
    add("driver peak RSS, MiB", "fresh", ("memory", "driver_peak_rss_mib"), ".0f")
    add("generation actor peak PSS, MiB", "fresh", ("memory", "generation_actor_peak_pss_mib"), ".0f")
    add("largest other Ray worker peak PSS, MiB", "fresh", ("memory", "other_workers_peak_pss_mib"), ".0f")
    add("Ray workers peak total PSS, MiB", "fresh", ("memory", "ray_workers_peak_total_pss_mib"), ".0f")
    add("... summed over this many Ray worker processes", "fresh", ("memory", "ray_worker_processes_at_peak_n"), "d")
    add("Ray's own processes peak total PSS, MiB", "fresh", ("memory", "ray_infrastructure_peak_total_pss_mib"),
        ".0f")
    add("resume: job wall time, s", "resume", ("wall_s",), ".0f")
    add("resume: scan of written parts, s", "resume", ("driver_stages_s", "resume_progress"), ".2f")
    add("resume: scan, rows/s", "resume", ("stage_rows_per_s", "resume scan (driver)"), ".0f")
    add("resume: output check (every part's footer), s", "resume", ("driver_stages_s", "open_output"), ".2f")
    add("resume: duplicate pass, s", "resume", ("driver_stages_s", "build_dataset"), ".1f")
    add("resume: driver peak RSS, MiB", "resume", ("memory", "driver_peak_rss_mib"), ".0f")
    header = ["| figure | " + " | ".join(f"{int(n):,} rows" for n in sizes) + " | growth |",
              "|---|" + "---:|" * (len(sizes) + 1)]
    return header + [f"| {name} | " + " | ".join(values) + " |" for name, values in figures.items()]
