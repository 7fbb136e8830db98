"""Pipeline benchmark: `python -m jobs.bench pipeline [key=value ...]`.

Measures, in one run on the same ShareGPT dev prompts:
- rows/s and tokens/s of the whole pipeline (`python -m pipeline.run` in-process) per cell: a
  mode, or `mode/batch/max_live` for a continuously batched worker (Ray Data hands `batch` rows
  to the engine, which decodes `max_live` at a time and refills finished slots), with the tail
  time (the last 10% of rows to finish) reported separately;
- the pipeline's overhead against calling the engine directly on the same prompts, with the
  same batch size and prompt formatting (aim: under 10%), twice: end to end (the pipeline's wall
  time against the direct worker's construction plus decoding) and in steady state (the span
  from the first row's start to the last row's end, from the rows' `finished_at` and
  `wall_s`, against the direct decoding time: what start-up costs aside, Ray Data's reading,
  scheduling and writing add between batches);
- start-up: from the job's launch to its first row's decoding (the earliest `finished_at - wall_s`
  of its rows): Ray, the driver's checks, the worker's target, head, trie and calibration; the
  median over the repeats, and its difference to the first cell (a drafting job against `ar`);
- resident memory per node with 1 and 2 workers (sum of the workers' PSS, and the trie's
  share of it, which should be counted once however many workers map it).

Whole jobs run one after another, and on a small machine the later of two back-to-back jobs can
run measurably slower (a 2-core EPYC: 5-9% in the target's forwards, docs/ngram.md), which would
favour whichever cell runs first. So with `repeats` > 1 the cells run forward on even repeats and
backward on odd ones (A B B A ...: `run_order`), and every pipeline figure is the median over
the repeats, with each repeat's rows/s kept in the report.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import pyarrow as pa
import ray
from omegaconf import OmegaConf

from dart_bench.common import machine_conditions, write_report
from dart_train.corpus import sharegpt_dev_prompts, write_prompts_jsonl
from dart_worker.hardware.device import resolve_device, resolve_dtype
from pipeline.cluster.ngram_store import trie_memory_usage
from pipeline.data.outputs import read_output
from pipeline.run import run_pipeline
from pipeline.settings.config import load_config


@dataclass
class PipelineBenchConfig:
    num_prompts: int = 64
    max_new_tokens: int = 128
    # cells: "mode" (a static batch of batch_size) or "mode/batch/max_live" (continuous batching)
    modes: list[str] = field(default_factory=lambda: ["ar", "dart_lookup", "ar/16/4", "dart_lookup/16/4"])
    batch_size: int = 4
    budget: int = 32
    sizing: str = "auto"  # decoding.sizing of the speculative cells
    repeats: int = 1  # whole jobs per cell, in alternating order (run_order); figures are medians
    direct: bool = True  # also time the engine without Ray Data, for the pipeline's overhead
    memory_workers: list[int] = field(default_factory=lambda: [1, 2])  # worker counts for the memory figure
    memory_prompts: int = 8
    output: str | None = None  # JSON with all figures


def write_prompts(path: Path, n: int) -> int:
    return write_prompts_jsonl(sharegpt_dev_prompts(n, max_chars=2000), path)


def parse_cell(cell: str, default_batch: int) -> tuple[str, int, int | None]:
    """"mode" -> (mode, default_batch, None); "mode/batch/max_live" -> a continuously batched cell."""
    parts = cell.split("/")
    if len(parts) == 1:
        return cell, default_batch, None
    if len(parts) != 3:
        raise ValueError(f"cell {cell!r}: want 'mode' or 'mode/batch/max_live'")
    return parts[0], int(parts[1]), int(parts[2])


def run_order(cells: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, cell) in the order to run them: forward on even repeats, backward on odd ones, so a
    drift over the run weighs on every cell alike instead of on the later ones."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    return [(r, c) for r in range(repeats) for c in (cells if r % 2 == 0 else cells[::-1])]


def median_run(runs: list[dict]) -> dict:
    """The run of median rows/s (the lower middle one for an even count), with every run's rows/s."""
    ranked = sorted(runs, key=lambda run: run["rows_per_s"])
    startups = sorted(run["startup_s"] for run in runs)
    return {**ranked[(len(ranked) - 1) // 2], "repeats_rows_per_s": [run["rows_per_s"] for run in runs],
            "repeats_startup_s": [run["startup_s"] for run in runs],
            "startup_s_median": startups[(len(startups) - 1) // 2]}


def pipeline_config(work: Path, cell: str, cfg: PipelineBenchConfig, workers: int, threads: int, tag: str):
    mode, batch, max_live = parse_cell(cell, cfg.batch_size)
    return load_config("configs/local.yaml", [
        f"input.urls=[{work / 'prompts.jsonl'}]", f"output.url={work / ('out-' + tag)}",
        f"decoding.mode={mode}", f"decoding.max_new_tokens={cfg.max_new_tokens}", f"decoding.tree.budget={cfg.budget}",
        f"decoding.sizing={cfg.sizing}",
        # Reserve at most one CPU for all workers: the read and write stages need the other.
        f"resources.num_workers={workers}", f"resources.num_cpus_per_worker={1 / workers}",
        f"resources.torch_threads={threads}", f"resources.batch_size={batch}",
        f"resources.max_live={'null' if max_live is None else max_live}",
        f"run.run_id=bench-{tag}", "run.progress_interval_s=60",
    ])


def engine_direct(pcfg, prompts_path: Path) -> dict:
    """The same work without Ray Data: one worker object (one engine) called on the same batches,
    so prompt formatting, decoding and row building are identical; only the dataflow is missing."""
    from pipeline.settings.config import to_dict
    from pipeline.startup.preflight import resolve_artifacts
    from pipeline.worker import GenerationWorker

    started = time.perf_counter()
    worker = GenerationWorker(to_dict(pcfg), resolve_artifacts(pcfg, "direct"))
    construct_s = time.perf_counter() - started
    rows = [json.loads(line) for line in prompts_path.read_text().splitlines()]
    inputs = [{"row_key": f"id:{r['id']}", "id": r["id"], "prompt": r["prompt"], "prompt_kind": "text",
               "source": str(prompts_path), "error": None} for r in rows]
    started = time.perf_counter()
    tokens = 0
    for k in range(0, len(inputs), pcfg.resources.batch_size):
        out = worker(pa.Table.from_pylist(inputs[k : k + pcfg.resources.batch_size]))
        tokens += sum(out["num_generated_tokens"].to_pylist())
    wall = time.perf_counter() - started
    return {"rows": len(rows), "tokens": tokens, "construct_s": construct_s, "wall_s": wall,
            "rows_per_s": len(rows) / wall, "tokens_per_s": tokens / wall}


def steady_state(output_url: str) -> dict:
    """Decoding span of a pipeline run from its rows (each row's own start and finish): first start
    to last finish, and the tail: from the moment 90% of the rows were done to the last finish."""
    table = read_output(output_url, columns=["finished_at", "wall_s", "num_generated_tokens"]).to_pylist()
    timed = [(r["finished_at"].timestamp(), r["wall_s"]) for r in table
             if r["finished_at"] is not None and r["wall_s"] is not None]
    first_start = min(end - wall for end, wall in timed)
    ends = sorted(end for end, _ in timed)
    span = ends[-1] - first_start
    tokens = sum(r["num_generated_tokens"] or 0 for r in table)
    tail = ends[-1] - ends[max(0, math.ceil(0.9 * len(ends)) - 1)]
    return {"span_s": span, "tokens_per_s": tokens / span, "rows_per_s": len(table) / span,
            "tail_s": tail, "tail_share": tail / span if span > 0 else 0.0,
            "first_batch_start_unix": first_start}


def mapped_tries(pid: int) -> set[str]:
    """Trie files (a store's copy in shared memory, or a local trie opened in place) that process
    `pid` has mapped."""
    with open(f"/proc/{pid}/maps") as f:
        paths = {parts[5].strip() for parts in (line.split(None, 5) for line in f) if len(parts) == 6}
    return {p for p in paths if p.endswith((".trie", ".ngram"))}


class PssSampler:
    """Samples, every 0.5 s, the summed PSS of the Ray worker processes running our actors and the
    part of it that is their mappings of trie files; keeps the sample with the largest total.
    With N workers sharing one trie file the trie part stays at most one file's size; N private
    copies would make it N times that."""

    def __init__(self):
        self.peak_pss = 0
        self.trie_pss_at_peak = 0
        self.trie_file_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = trie_total = 0
            tries: set[str] = set()
            for proc in psutil.process_iter(["cmdline"]):
                cmd = " ".join(proc.info["cmdline"] or [])
                if "GenerationWorker" in cmd or "MapWorker" in cmd:
                    with contextlib.suppress(psutil.Error, OSError):
                        total += proc.memory_full_info().pss
                        mapped = mapped_tries(proc.pid)
                        trie_total += sum(trie_memory_usage(t, proc.pid).pss for t in mapped)
                        tries |= mapped
            if total > self.peak_pss:
                self.peak_pss, self.trie_pss_at_peak = total, trie_total
                self.trie_file_bytes = sum(os.path.getsize(t) for t in tries if os.path.exists(t))
            self._stop.wait(0.5)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> dict:
    cfg: PipelineBenchConfig = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(PipelineBenchConfig), OmegaConf.from_cli(argv)))
    run_order(list(cfg.modes), cfg.repeats)  # a bad repeats fails before any job runs
    device = resolve_device("auto")
    conditions = machine_conditions(threads=2) | {"device": str(device), "dtype": str(resolve_dtype("auto", device))}
    print(f"conditions: {conditions}", flush=True)
    report: dict = {"config": asdict(cfg), "conditions": conditions, "pipeline": {}, "engine_direct": {}, "memory": {}}
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        work = Path(tmp)
        n = write_prompts(work / "prompts.jsonl", cfg.num_prompts)
        print(f"{n} ShareGPT dev prompts, {cfg.max_new_tokens} new tokens, batch {cfg.batch_size}")
        runs: dict[str, list[dict]] = {mode: [] for mode in cfg.modes}
        for repeat, mode in run_order(list(cfg.modes), cfg.repeats):
            tag = mode.replace("/", "-") + (f"-r{repeat}" if cfg.repeats > 1 else "")
            pcfg = pipeline_config(work, mode, cfg, workers=1, threads=2, tag=tag)
            launched = time.time()
            summary = run_pipeline(pcfg)
            ray.shutdown()
            this = summary["this_run"]
            steady = steady_state(pcfg.output.url)
            runs[mode].append({"rows": this["rows"], "tokens": this["generated_tokens"],
                               "wall_s": summary["wall_s"], "rows_per_s": this["rows_per_s"],
                               "tokens_per_s": this["tokens_per_s"], "mean_tau": this["tau"].get("mean"),
                               "startup_s": steady.pop("first_batch_start_unix") - launched,
                               "steady": steady, "repeat": repeat})
            print(mode, f"pipeline (repeat {repeat})", runs[mode][-1], flush=True)
            if cfg.direct and repeat == 0:
                report["engine_direct"][mode] = engine_direct(pcfg, work / "prompts.jsonl")
                print(mode, "engine", report["engine_direct"][mode], flush=True)
        report["pipeline"] = {mode: median_run(runs[mode]) for mode in cfg.modes}
        base = report["pipeline"][cfg.modes[0]]
        for mode in cfg.modes:
            p = report["pipeline"][mode]
            print(f"{mode}: {p['rows_per_s']:.3f} rows/s end to end ({p['rows_per_s'] / base['rows_per_s']:.2f}x "
                  f"{cfg.modes[0]}), {p['steady']['rows_per_s']:.3f} steady, tau {p['mean_tau'] or 0:.2f}, "
                  f"tail {p['steady']['tail_s']:.1f} s ({p['steady']['tail_share']:.0%} of the span); "
                  f"rows/s per repeat {[round(v, 3) for v in p['repeats_rows_per_s']]}", flush=True)
            extra = p["startup_s_median"] - base["startup_s_median"]
            print(f"{mode}: start-up (launch to the first row's decoding) {p['startup_s_median']:.1f} s "
                  f"({extra:+.1f} s vs {cfg.modes[0]}), per repeat {[round(v, 1) for v in p['repeats_startup_s']]}",
                  flush=True)
        for mode in report["engine_direct"]:
            p, e = report["pipeline"][mode], report["engine_direct"][mode]
            p["overhead_end_to_end"] = p["wall_s"] / (e["construct_s"] + e["wall_s"]) - 1
            p["overhead_steady_state"] = p["steady"]["span_s"] / e["wall_s"] - 1
            print(f"{mode}: pipeline {p['tokens_per_s']:.1f} tok/s end to end, {p['steady']['tokens_per_s']:.1f} "
                  f"steady; direct {e['tokens_per_s']:.1f}; overhead {p['overhead_end_to_end']:+.1%} end to end, "
                  f"{p['overhead_steady_state']:+.1%} steady state", flush=True)
        write_prompts(work / "prompts.jsonl", cfg.memory_prompts)
        for workers in cfg.memory_workers:
            pcfg = pipeline_config(work, "dart_lookup", cfg, workers=workers, threads=max(1, 2 // workers),
                                   tag=f"mem{workers}")
            with PssSampler() as sampler:
                run_pipeline(pcfg)
            ray.shutdown()
            report["memory"][f"{workers}_workers"] = {
                "peak_workers_pss_mb": sampler.peak_pss / 2**20,
                "trie_pss_mb_at_peak": sampler.trie_pss_at_peak / 2**20,
                "trie_file_mb": sampler.trie_file_bytes / 2**20}
    print(json.dumps({k: report[k] for k in ("pipeline", "engine_direct", "memory")}, indent=1))
    write_report(cfg.output, report)
    return report
