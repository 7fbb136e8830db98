"""The benchmark report: `python -m jobs.bench report configs/bench.yaml [key=value ...]`.

Every decoding mode runs on the same ShareGPT dev prompts in one process: the engine's `ar`,
`chain`, `ddtree`, `dart`, and transformers' own `generate` (`hf`: greedy at temperature 0,
`do_sample=True` above; `hf_prompt_lookup`: prompt-lookup decoding, greedy only), at every
configured temperature and, for the tree modes, every tree budget. Runs are interleaved prompt
by prompt (the order of the cells rotates from one prompt to the next) and repeated, so a change
in machine load hits every mode alike; figures are medians over runs. The report folder gets a
JSON of every run and summary, PNG plots and a report.md that embeds them (dart_bench/report.py).

The measuring pieces (prompt selection, head/trie loading, transformers baselines, the per-mode
summary) live in dart_bench/common.py and are shared with `python -m jobs.bench engine`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dart_bench.common import (
    CellsBenchConfig,
    load_parts,
    machine_conditions,
    run_hf,
    run_record,
    select_prompts,
    summarize,
)
from dart_bench.modes import GREEDY_ONLY, HF_MODES, all_modes, tree_modes
from dart_worker.drafters import drafter_names, drafter_spec


class BenchConfigError(ValueError):
    """The benchmark config is invalid; the message names the key and what is wrong."""


@dataclass
class BenchReportConfig(CellsBenchConfig):
    threads: int | None = 2
    # OpenMP idle threads sleep instead of spinning. On a machine shared with other jobs, spinning
    # torch threads wait on each other: measured here 1.3 s vs 94 ms per token with 2 threads.
    # Applied only if torch is not imported yet (it is read at OpenMP start-up); null = leave as is.
    omp_wait_policy: str | None = "PASSIVE"
    warmup_tokens: int = 4  # every cell decodes this many tokens once, unrecorded, before measuring
    modes: list[str] = field(default_factory=lambda: list(all_modes()))
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    budgets: list[int] = field(default_factory=lambda: [16, 32, 60])
    # Budgets for some tree modes only, e.g. {chain: [16], ddtree: [16]}; the others use `budgets`.
    mode_budgets: dict[str, list[int]] = field(default_factory=dict)
    headline_budget: int | None = None  # budget shown in the per-mode plots; None = the largest
    output_dir: str = "bench_report"


# ------------------------------------------------------------------------------ config


def validate_config(cfg: BenchReportConfig) -> BenchReportConfig:
    """Raise BenchConfigError naming the first bad key; return cfg (with headline_budget resolved)."""
    known = all_modes()
    unknown = [m for m in cfg.modes if m not in known]
    if unknown:
        raise BenchConfigError(f"modes: unknown mode(s) {unknown}; expected some of {list(known)}")
    if not cfg.modes:
        raise BenchConfigError("modes: empty; expected some of " + str(list(known)))
    if len(set(cfg.modes)) != len(cfg.modes):
        raise BenchConfigError(f"modes: {cfg.modes} lists a mode twice")
    if not cfg.temperatures:
        raise BenchConfigError("temperatures: empty; expected e.g. [0.0, 1.0]")
    bad = [t for t in cfg.temperatures if not t >= 0]
    if bad:
        raise BenchConfigError(f"temperatures: {bad} must be >= 0")
    if len(set(cfg.temperatures)) != len(cfg.temperatures):
        raise BenchConfigError(f"temperatures: {cfg.temperatures} lists a temperature twice")
    if any(m in tree_modes() for m in cfg.modes):
        if not cfg.budgets:
            raise BenchConfigError("budgets: empty, but tree modes are selected; expected e.g. [16, 32, 60]")
        bad = [b for b in cfg.budgets if b < 1]
        if bad:
            raise BenchConfigError(f"budgets: {bad} must be >= 1 (draft nodes per tree)")
        if len(set(cfg.budgets)) != len(cfg.budgets):
            raise BenchConfigError(f"budgets: {cfg.budgets} lists a budget twice")
        for mode, budgets in cfg.mode_budgets.items():
            if mode not in cfg.modes or mode not in tree_modes():
                raise BenchConfigError(f"mode_budgets: {mode!r} is not one of the selected tree modes")
            if not budgets or not set(budgets) <= set(cfg.budgets):
                raise BenchConfigError(f"mode_budgets: {mode}: {budgets} must be a non-empty subset of budgets "
                                       f"{cfg.budgets}")
        if cfg.headline_budget is None:
            cfg.headline_budget = max(cfg.budgets)
        elif cfg.headline_budget not in cfg.budgets:
            raise BenchConfigError(f"headline_budget: {cfg.headline_budget} is not one of budgets {cfg.budgets}")
    if cfg.omp_wait_policy is not None and cfg.omp_wait_policy.upper() not in ("PASSIVE", "ACTIVE"):
        raise BenchConfigError(f"omp_wait_policy: {cfg.omp_wait_policy!r}; expected PASSIVE, ACTIVE or null")
    if cfg.warmup_tokens < 0:
        raise BenchConfigError(f"warmup_tokens: {cfg.warmup_tokens} must be >= 0")
    for key in ("num_prompts", "max_prompt_tokens", "max_new_tokens", "repeats"):
        if getattr(cfg, key) < 1:
            raise BenchConfigError(f"{key}: {getattr(cfg, key)} must be >= 1")
    if cfg.threads is not None and cfg.threads < 1:
        raise BenchConfigError(f"threads: {cfg.threads} must be >= 1 (or null for the process's CPUs)")
    if "ar" not in cfg.modes:
        raise BenchConfigError("modes: `ar` is required (every speedup is measured against it)")
    if not str(cfg.output_dir).strip():
        raise BenchConfigError("output_dir: empty; expected a folder for the report")
    return cfg


def load_bench_config(path: str | os.PathLike | None, overrides: list[str] | None = None,
                      schema: type[BenchReportConfig] = BenchReportConfig) -> BenchReportConfig:
    """YAML file (optional) + dotlist overrides -> a validated config; unknown keys are errors.
    `schema`: BenchReportConfig or a subclass that adds keys (dart_bench.compare_heads)."""
    from pipeline.settings.config import load_structured

    return validate_config(load_structured(schema, path, overrides, BenchConfigError))


# ------------------------------------------------------------------------------ cells


@dataclass(frozen=True)
class Cell:
    """One measured configuration: a mode at a temperature (and a tree budget for tree modes)."""

    mode: str
    temperature: float
    budget: int | None = None

    @property
    def label(self) -> str:
        return self.mode if self.budget is None else f"{self.mode}@{self.budget}"


def cells_of(cfg: BenchReportConfig) -> list[Cell]:
    """Every cell the config asks for, `ar` first at each temperature; greedy-only modes at T=0 only."""
    cells = []
    for t in cfg.temperatures:
        for mode in sorted(cfg.modes, key=all_modes().index):
            if mode in GREEDY_ONLY and t > 0:
                continue
            if mode in tree_modes():
                cells.extend(Cell(mode, t, b) for b in cfg.mode_budgets.get(mode, cfg.budgets))
            else:
                cells.append(Cell(mode, t))
    return cells


# ------------------------------------------------------------------------------ summary math


def summarize_cells(records: list[dict], headline_budget: int | None = None) -> list[dict]:
    """One summary per cell: medians over runs, speedup against `ar` at the same temperature.

    The per-cell math is common.summarize (each run paired with the `ar` run of the same
    prompt and repeat). Agreement with `ar` is only meaningful for greedy runs; it is None above
    temperature 0.
    """
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault((r["mode"], r["temperature"], r.get("budget")), []).append(r)
    out = []
    for (mode, t, budget), rows in cells.items():
        ar_rows = cells.get(("ar", t, None), [])
        entry = summarize({"ar": ar_rows, "cell": rows})["cell"] if mode != "ar" else summarize({"ar": rows})["ar"]
        if t > 0:
            entry["agreement_with_ar"] = None
        entry["tau_per_run"] = [r["tau"] for r in rows if r.get("tau")]
        if rows and "acceptance_histogram" in rows[0]:
            entry["tokens_per_round_histogram"] = tokens_per_round_histogram(rows)
        out.append({"mode": mode, "temperature": t, "budget": budget,
                    "headline": budget is None or budget == headline_budget, **entry})
    return out


def tokens_per_round_histogram(rows: list[dict]) -> list[int]:
    """Rounds by tokens committed (accepted + bonus): index k counts rounds that committed k tokens."""
    width = max(len(r["acceptance_histogram"]) for r in rows)
    hist = [0] * (width + 1)
    for r in rows:
        for accepted, count in enumerate(r["acceptance_histogram"]):
            hist[accepted + 1] += count
    return hist


# ------------------------------------------------------------------------------ conditions


def _head_and_trie_conditions(cfg: BenchReportConfig, tokenizer) -> dict[str, Any]:
    from dart_train.ngram_build import default_trie_path
    from dart_worker.artifacts import default_head
    from dart_worker.artifacts.fingerprint import file_fingerprint, tokenizer_fingerprint
    from pipeline.cluster.ngram_store import check_trie_url

    out: dict[str, Any] = {}
    specs = [drafter_spec(m) for m in cfg.modes if m in drafter_names()]
    if any(s.needs_head for s in specs):
        head_dir = cfg.head or default_head.default_head_dir()
        out["head"] = str(head_dir) if head_dir else f"untrained (random init, seed {cfg.seed})"
        out["head_trained"] = head_dir is not None
        out["head_fingerprint"] = file_fingerprint(Path(head_dir) / "model.safetensors") if head_dir else None
    if any(s.needs_trie for s in specs):
        trie = str(cfg.trie or default_trie_path())
        out["trie"] = trie
        out["trie_fingerprint"] = check_trie_url(trie, tokenizer_fingerprint(tokenizer)).content_key
    return out


# ------------------------------------------------------------------------------ measuring


def measure(cfg: BenchReportConfig) -> dict[str, Any]:
    """Load everything once, run every cell on every prompt (interleaved, repeated); all figures."""
    import time

    if cfg.omp_wait_policy is not None:
        if "torch" in sys.modules and os.environ.get("OMP_WAIT_POLICY", "").upper() != cfg.omp_wait_policy.upper():
            print(f"warning: torch is already imported; omp_wait_policy={cfg.omp_wait_policy} has no effect")
        else:
            os.environ["OMP_WAIT_POLICY"] = cfg.omp_wait_policy.upper()

    from dart_worker.engine_factory import build_engine
    from dart_worker.hardware.device import configure_cpu_threads
    from dart_worker.sampling.params import SamplingParams
    from ngram_native.builders import TreeParams

    threads = configure_cpu_threads(cfg.threads)
    conditions = machine_conditions(threads)
    cells = cells_of(cfg)
    parts = load_parts(cfg, {c.mode for c in cells})
    tokenizer, model, device, eos = parts.tokenizer, parts.target.model, parts.target.device, list(parts.eos_token_ids)
    engines = {}
    for c in cells:
        if c.mode in drafter_names() and (c.mode, c.budget) not in engines:
            engines[c.mode, c.budget] = build_engine(parts, c.mode, TreeParams(budget=c.budget or 1,
                                                                             lookup_cache_tokens=cfg.lookup_cache_tokens,
                                                                             job_ngram_tokens=0))
    prompts = select_prompts(tokenizer, cfg.num_prompts, cfg.max_prompt_tokens)
    if not prompts:
        raise RuntimeError(f"no ShareGPT dev prompt fits max_prompt_tokens={cfg.max_prompt_tokens}")
    conditions |= {"target": cfg.target, "dtype": cfg.dtype, "device": str(device),
                   "prompts": len(prompts), "prompt_ids": [p for p, _ in prompts],
                   "prompt_tokens": [len(ids) for _, ids in prompts],
                   "max_new_tokens": cfg.max_new_tokens, "repeats": cfg.repeats,
                   **_head_and_trie_conditions(cfg, tokenizer)}
    print(f"{len(prompts)} ShareGPT dev prompts x {len(cells)} cells x {cfg.repeats} repeats, "
          f"{cfg.max_new_tokens} new tokens, {cfg.dtype} on {device}, {threads} threads", flush=True)

    def run(c: Cell, pid: str, ids: list[int], n: int, max_new_tokens: int) -> dict:
        seed = cfg.seed + n
        if c.mode in HF_MODES:
            token_ids, seconds = run_hf(model, ids, c.mode, max_new_tokens, eos, c.temperature, seed)
            return {"tokens": len(token_ids), "seconds": seconds, "token_ids": token_ids}
        params = SamplingParams(temperature=c.temperature, seed=seed, max_new_tokens=max_new_tokens)
        result = engines[c.mode, c.budget].generate([ids], params)[0]
        if result.error:
            raise RuntimeError(f"{c.label} at T={c.temperature} on prompt {pid}: {result.error}")
        record = run_record(pid, 0, result)
        return {k: v for k, v in record.items() if k not in ("prompt", "repeat")}

    started = time.perf_counter()
    if cfg.warmup_tokens:  # first calls pay one-time costs (kernel selection, allocations): keep them out
        for c in cells:
            run(c, prompts[0][0], prompts[0][1], 0, cfg.warmup_tokens)
        print(f"  warm-up done ({time.perf_counter() - started:.0f} s)", flush=True)
    records: list[dict] = []
    started = time.perf_counter()
    for repeat in range(cfg.repeats):
        for n, (pid, ids) in enumerate(prompts):
            shift = (n + repeat * len(prompts)) % len(cells)
            for c in cells[shift:] + cells[:shift]:  # rotate so no cell always runs first
                base = {"mode": c.mode, "temperature": c.temperature, "budget": c.budget,
                        "prompt": pid, "repeat": repeat}
                records.append(base | run(c, pid, ids, n, cfg.max_new_tokens))
            print(f"  repeat {repeat + 1}/{cfg.repeats} prompt {n + 1}/{len(prompts)} done "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    conditions["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    conditions["measure_seconds"] = time.perf_counter() - started
    return {"config": asdict(cfg), "conditions": conditions,
            "summary": summarize_cells(records, cfg.headline_budget), "records": records}


def write_report(figures: dict[str, Any], output_dir: str | os.PathLike) -> Path:
    """bench.json + PNGs + report.md under output_dir; returns the report.md path."""
    from dart_bench.report import render_report

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(figures, indent=1))
    return render_report(figures, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench report", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="YAML config (configs/bench.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. num_prompts=4 budgets=[16,32]")
    args = parser.parse_args(argv)
    try:
        cfg = load_bench_config(args.config, args.overrides)
    except BenchConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    figures = measure(cfg)
    figures["command"] = "python -m jobs.bench report " + shlex.join([args.config, *args.overrides])
    from dart_bench.report import print_summary

    print_summary(figures["summary"])
    report = write_report(figures, cfg.output_dir)
    print(f"wrote {report} (figures in {Path(cfg.output_dir) / 'bench.json'})")
    return 0
