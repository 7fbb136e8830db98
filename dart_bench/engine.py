"""Side-by-side decoding benchmark of the engine: `python -m jobs.bench engine [key=value ...]`.

Every mode decodes the same ShareGPT dev prompts in one process, interleaved batch by batch in
alternating order (so drift in machine load hits all modes alike) and repeated; figures are medians. Modes:
the engine's `ar`, `chain`, `ddtree`, `dart`, and transformers' own `generate` (greedy and
prompt-lookup decoding) as outside baselines. Reported per mode: tokens/s, the per-prompt
speedup over `ar` (median of ratios), the same speedup with the drafting stages taken out of both
sides ("free": the most cheaper drafting could give this cell's trees), tau, per-stage time per
round and, for greedy runs, the agreement with `ar` (identical outputs; in bf16 multi-token
forwards round differently from one-token forwards, so exact agreement is not expected there -
see docs/DESIGN.md).

With `samples=n` > 1 each prompt gets n seeded completions sharing one prefill, beside "<mode>+separate"
cells decoding the same samples as separate rows: rows (samples) per second, tau, and the prompt
tokens and seconds each cell's prefill took, i.e. what sharing the prefill saves.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from omegaconf import OmegaConf

from dart_bench.common import (
    CellsBenchConfig,
    load_parts,
    run_hf,
    run_record,
    select_prompts,
    summarize,
    write_report,
)
from dart_worker.defaults import DEFAULT_BUDGET
from dart_worker.drafters import drafter_names
from dart_worker.engine_factory import build_engine
from dart_worker.hardware.device import configure_cpu_threads
from dart_worker.hardware.kernels import shapes_for
from dart_worker.sampling.params import SamplingParams, for_sample
from ngram_native.builders import TreeParams
from ngram_native.trees import SOURCE_NAMES

HF_MODES = ("hf_greedy", "hf_prompt_lookup")
FULL_LOGITS = "+full_logits"
FIXED = "+fixed"
JOB_NGRAM = "+job_ngram"


@dataclass
class EngineBenchConfig(CellsBenchConfig):
    modes: list[str] = field(default_factory=lambda: [*drafter_names(), *HF_MODES])
    temperature: float = 0.0
    budget: int = DEFAULT_BUDGET
    # DART's job n-gram (decoding.tree.job_ngram_tokens) learns from finished rows too: off in the
    # cells (as the lookup cache: CellsBenchConfig). `job_ngram_modes` also run with it on (label "<mode>+job_ngram"),
    # first fed the first `warm_rows` outputs of `warm_outputs` (an earlier job's JSONL or Parquet,
    # dart_train.corpus.job_output_documents), as a worker that far into a job; with repeats 1 and one
    # batch size it then also learns from the bench's own finished prompts, as in a job.
    job_ngram_modes: list[str] = field(default_factory=list)
    warm_outputs: str | None = None
    warm_rows: int = 2000
    # Modes also run with logits at every tree row (label "<mode>+full_logits"), side by side with
    # the default (on a CPU: deferred, only the rows the greedy walk reads).
    full_logits_modes: list[str] = field(default_factory=list)
    # Modes also run with the other verify-shape strategy (label "<mode>+bucketed" or "<mode>+exact":
    # dart_worker.hardware.kernels.shapes_for; bucketed on CUDA, exact on a CPU), side by side with the default.
    bucketed_modes: list[str] = field(default_factory=list)
    # Tree sizing of the engine modes: "auto" (the measured cost model, the pipeline's default)
    # or "fixed" (every tree at `budget`); `fixed_modes` also run fixed, labelled "<mode>+fixed".
    sizing: str = "auto"
    fixed_modes: list[str] = field(default_factory=list)
    # Budgets of the fixed cells (labels "<mode>+fixed@<budget>"); empty: `budget` ("<mode>+fixed").
    fixed_budgets: list[int] = field(default_factory=list)
    batch_size: int = 1  # prompts decoded together per generate call (transformers' modes: 1)
    # A batch sweep in one process (same engines, same prompts): every cell at each batch size,
    # with a table of throughput relative to `ar` per batch size. Empty: `batch_size` only.
    batch_sizes: list[int] = field(default_factory=list)
    # Continuous batching (the pipeline's `resources.max_live`): each generate call's prompts decode
    # at most `max_live` at a time, a finished row's slot taken by the call's next prompt, and a
    # call is timed whole (its requests join at different times). None: the call's prompts decode
    # together, a static batch that ends with its slowest row (the pipeline's default).
    max_live: int | None = None
    # Sampling filters and penalties of every cell (vLLM's meanings; dart_worker.sampling.params).
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # n completions per prompt (decoding.n): > 1 decodes each batch of prompts with
    # `generate_samples` (one prefill per prompt, its KV cache copied per sample) and adds, per mode
    # in `separate_modes`, a cell "<mode>+separate" decoding the same n x prompts samples as separate
    # requests (each prefilled), so the report shows the prefill that sharing saves (`prefill`:
    # prompt tokens forwarded and seconds per cell) and rows (samples) per second.
    samples: int = 1
    separate_modes: list[str] = field(default_factory=lambda: ["ar"])
    # On a GPU: synchronise at every stage boundary so the per-stage times are each stage's own
    # (the pipeline's workers do not: only the verification transfer waits there).
    sync_timing: bool = True
    output: str | None = None  # JSON file for all figures


def print_table(summary: dict[str, dict]) -> None:
    print(f"{'mode':<18}{'tok/s':>8}{'total':>8}{'x ar':>7}{'free':>6}{'tau':>6}{'tree':>6}{'agree':>7}"
          f"  ms/round (draft/tree/verify/commit)  accepted from {'/'.join(SOURCE_NAMES.values())}")
    for mode, s in summary.items():
        stages = s.get("ms_per_round")
        stage_text = "/".join(f"{stages[k]:.1f}" for k in ("draft", "tree", "verify", "commit")) if stages else "-"
        agree = "-" if s["agreement_with_ar"] is None else f"{s['agreement_with_ar']:.2f}"
        sources = s.get("accepted_tokens_by_source")
        source_text = "/".join(str(sources.get(s, 0)) for s in SOURCE_NAMES.values()) if sources else "-"
        print(f"{mode:<18}{s['tokens_per_second']:>8.1f}{s.get('throughput', 0):>8.1f}{s['speedup_vs_ar']:>7.2f}"
              f"{_figure(s.get('speedup_if_drafting_free')):>6}"
              f"{s.get('tau', 1.0):>6.2f}{s.get('mean_tree_size', 0):>6.1f}{agree:>7}  {stage_text:<34}{source_text}")


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


class PrefillMeter:
    """Counts what a target's prefill forwards (prompt tokens, calls, seconds), per cell label."""

    def __init__(self, target):
        self.target, self.original = target, target.prefill
        self.label = None
        self.figures: dict[str, dict[str, float]] = {}
        target.prefill = self._prefill

    def _prefill(self, state, prompts, **kwargs):
        started = time.perf_counter()
        out = self.original(state, prompts, **kwargs)
        cell = self.figures.setdefault(self.label, {"calls": 0, "prompt_tokens": 0, "seconds": 0.0})
        cell["calls"] += 1
        cell["prompt_tokens"] += sum(len(p) for p in prompts)
        cell["seconds"] += time.perf_counter() - started
        return out


def run_sample_cells(cfg, engines, prompts, batch_size: int) -> tuple[dict[str, list[dict]], dict]:
    """n = cfg.samples completions of every prompt per cell: the modes with a shared prefill
    (`generate_samples`), and "<mode>+separate" for `separate_modes` (the same samples as separate
    requests). Records are keyed "<prompt id>#<sample>", so cells pair sample by sample; each
    record's `group_seconds` is the wall time of its generate call. Returns (records, prefill)."""
    separate = [m for m in cfg.separate_modes if m in engines]
    labels = [*cfg.modes, *(f"{m}+separate" for m in separate)]
    records: dict[str, list[dict]] = {m: [] for m in labels}
    meter = PrefillMeter(next(iter(engines.values())).target)  # every engine shares the one target
    groups = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    try:
        for repeat in range(cfg.repeats):
            for g, group in enumerate(groups):
                samples = [[for_sample(p, j) for j in range(cfg.samples)] for p in sampling_params(cfg, group)]
                for label in labels:
                    mode = label.removesuffix("+separate")
                    meter.label = label
                    started = time.perf_counter()
                    if label.endswith("+separate"):
                        flat = engines[mode].generate([prompts[n][1] for n in group for _ in range(cfg.samples)],
                                                      [p for per in samples for p in per])
                        results = [flat[k * cfg.samples:(k + 1) * cfg.samples] for k in range(len(group))]
                    else:
                        results = engines[mode].generate_samples([prompts[n][1] for n in group], samples)
                    wall = time.perf_counter() - started
                    for n, per_prompt in zip(group, results):
                        for j, result in enumerate(per_prompt):
                            record = run_record(f"{prompts[n][0]}#{j}", repeat, result, g)
                            records[label].append({**record, "group_seconds": wall})
                print(f"  batch size {batch_size} x {cfg.samples} samples: repeat {repeat} batch {g + 1}/{len(groups)} "
                      "done", flush=True)
    finally:
        meter.target.prefill = meter.original
    return records, meter.figures


def sample_table(records: dict[str, list[dict]], prefill: dict, summary: dict) -> dict[str, dict]:
    """Per cell: samples (rows) per second over the wall time of its generate calls, tau, and the
    prefill it ran; printed, and returned for the report."""
    table = {}
    print(f"{'cell':<22}{'rows/s':>8}{'tok/s':>8}{'tau':>6}{'prefill tokens':>16}{'prefill s':>11}")
    for label, rows in records.items():
        walls = {(r["group"], r["repeat"]): r["group_seconds"] for r in rows}
        wall = sum(walls.values())
        p = prefill.get(label, {})
        table[label] = {"rows": len(rows), "rows_per_s": len(rows) / wall if wall else 0.0,
                        "tokens_per_s": sum(r["tokens"] for r in rows) / wall if wall else 0.0,
                        "tau": summary[label].get("tau"), "prefill_tokens": p.get("prompt_tokens", 0),
                        "prefill_calls": p.get("calls", 0), "prefill_seconds": p.get("seconds", 0.0),
                        "agreement_with_ar": summary[label]["agreement_with_ar"]}
        t = table[label]
        print(f"{label:<22}{t['rows_per_s']:>8.2f}{t['tokens_per_s']:>8.1f}{t['tau'] or 1.0:>6.2f}"
              f"{t['prefill_tokens']:>16}{t['prefill_seconds']:>11.2f}")
    return table


def sampling_params(cfg, group: list[int]) -> list[SamplingParams]:
    """The cells' sampling settings for the prompts of `group` (prompt n seeded cfg.seed + n)."""
    return [SamplingParams(temperature=cfg.temperature, seed=cfg.seed + n, max_new_tokens=cfg.max_new_tokens,
                           min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty) for n in group]


def run_cells(cfg, engines, model, eos, prompts, batch_size: int) -> dict[str, list[dict]]:
    """Every cell on every prompt, `batch_size` prompts per generate call, cells interleaved
    batch by batch (so drift in machine load hits all cells alike), `cfg.repeats` times, in
    `cell_order` (A B, then B A: a cell is not always the one that runs second)."""
    records: dict[str, list[dict]] = {m: [] for m in cfg.modes}
    groups = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    for repeat in range(cfg.repeats):
        for g, group in enumerate(groups):
            params = sampling_params(cfg, group)
            for mode in cell_order(cfg.modes, repeat * len(groups) + g):
                if mode in HF_MODES:
                    (n,) = group
                    token_ids, seconds = run_hf(model, prompts[n][1], mode, cfg.max_new_tokens, eos,
                                                cfg.temperature, cfg.seed + n)
                    records[mode].append({"prompt": prompts[n][0], "repeat": repeat, "group": g,
                                          "tokens": len(token_ids), "seconds": seconds, "token_ids": token_ids})
                    continue
                started = time.perf_counter()
                results = engines[mode].generate([prompts[n][1] for n in group], params, max_live=cfg.max_live)
                call = {} if cfg.max_live is None else {"group_seconds": time.perf_counter() - started}
                records[mode].extend({**run_record(prompts[n][0], repeat, result, g), **call}
                                     for n, result in zip(group, results))
            print(f"  batch size {batch_size}: repeat {repeat} batch {g + 1}/{len(groups)} done", flush=True)
    return records


def cell_order(modes: list[str], turn: int) -> list[str]:
    """The order the cells run in on their `turn`-th batch: as listed on even turns, reversed on
    odd ones. Run always in one order, the second cell of a pair met the machine as the first
    left it (on a 2-core EPYC the same `ar` batch took 309 ms a step in one place and 380 in
    another, minutes apart), and a ratio carried that as if it were the cell's own cost."""
    return list(modes) if turn % 2 == 0 else list(reversed(modes))


def print_sweep(sweeps: dict[int, dict[str, dict]]) -> None:
    """Whole-run throughput of every cell relative to `ar` at each batch size, with tau and the
    mean (chosen) tree size."""
    modes = list(next(iter(sweeps.values())))
    print(f"{'mode':<22}" + "".join(f"{'B=' + str(b):>22}" for b in sweeps))
    print(f"{'':<22}" + "".join(f"{'tok/s  x ar  tau  tree':>22}" for _ in sweeps))
    for mode in modes:
        cells = []
        for summary in sweeps.values():
            s, ar = summary[mode], summary.get("ar")
            ratio = s["throughput"] / ar["throughput"] if ar and ar["throughput"] else 0.0
            tau, tree = s.get("tau", 1.0), s.get("mean_tree_size", 0)
            cells.append(f"{s['throughput']:>8.1f}{ratio:>6.2f}{tau:>5.2f}{tree:>5.1f}")
        print(f"{mode:<22}" + "".join(f"{c:>22}" for c in cells))


def main(argv: list[str] | None = None) -> dict:
    cfg: EngineBenchConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EngineBenchConfig),
                                                           OmegaConf.from_cli(argv)))
    if cfg.temperature > 0 and "hf_prompt_lookup" in cfg.modes:
        print("hf_prompt_lookup is greedy only: skipped at temperature > 0")
        cfg.modes = [m for m in cfg.modes if m != "hf_prompt_lookup"]
    configure_cpu_threads(cfg.threads)
    parts = load_parts(cfg, cfg.modes)
    tokenizer, eos, model, device = parts.tokenizer, list(parts.eos_token_ids), parts.target.model, parts.target.device
    tree = TreeParams(budget=cfg.budget, lookup_cache_tokens=cfg.lookup_cache_tokens, job_ngram_tokens=0)
    # the batch sizes the sizer calibrates at (a call's live sequences: at most max_live)
    live = (1, *sorted({min(b, cfg.max_live or b) for b in (cfg.batch_sizes or [cfg.batch_size])}))
    engines = {mode: build_engine(parts, mode, tree, sizing=cfg.sizing, batches=live)
               for mode in cfg.modes if mode in drafter_names()}
    for mode in cfg.full_logits_modes:
        engines[f"{mode}{FULL_LOGITS}"] = build_engine(parts, mode, tree, defer_logits=False, sizing=cfg.sizing,
                                                       batches=live)
    default_shapes = shapes_for(device)
    other_shapes = "exact" if default_shapes == "bucketed" else "bucketed"
    for mode in cfg.bucketed_modes:
        engines[f"{mode}+{other_shapes}"] = build_engine(parts, mode, tree, sizing=cfg.sizing, batches=live,
                                                         shapes=other_shapes)
    fixed = [(f"{mode}{FIXED}@{b}" if cfg.fixed_budgets else f"{mode}{FIXED}", mode, b)
             for mode in cfg.fixed_modes for b in (cfg.fixed_budgets or [cfg.budget])]
    for label, mode, budget in fixed:
        sized = TreeParams(budget=budget, lookup_cache_tokens=cfg.lookup_cache_tokens, job_ngram_tokens=0)
        engines[label] = build_engine(parts, mode, sized, sizing="fixed")
    if cfg.job_ngram_modes:
        from dart_train.corpus import job_output_documents

        if cfg.repeats > 1 or len(cfg.batch_sizes) > 1:
            print("warning: with repeats or several batch sizes, the +job_ngram cells draft repeated prompts "
                  "from their own earlier answers")
        documents = job_output_documents(cfg.warm_outputs, cfg.warm_rows, tokenizer) if cfg.warm_outputs else []
        for mode in cfg.job_ngram_modes:
            on = TreeParams(budget=cfg.budget, lookup_cache_tokens=cfg.lookup_cache_tokens)
            engine = build_engine(parts, mode, on, sizing=cfg.sizing, batches=live)
            if "job_ngram" not in engine.job_state():
                raise ValueError(f"job_ngram_modes: {mode!r} has no job n-gram (dart and dart_lookup with a trie do)")
            engine.warm(documents, ("job_ngram",))
            tokens, nbytes = engine.job_state()["job_ngram"]
            print(f"{mode}{JOB_NGRAM}: job n-gram warmed with {len(documents)} outputs: {tokens} tokens, {nbytes} B")
            engines[f"{mode}{JOB_NGRAM}"] = engine
    cfg.modes = [*cfg.modes, *(f"{m}{FULL_LOGITS}" for m in cfg.full_logits_modes),
                 *(f"{m}+{other_shapes}" for m in cfg.bucketed_modes), *(f[0] for f in fixed),
                 *(f"{m}{JOB_NGRAM}" for m in cfg.job_ngram_modes)]
    for engine in engines.values():
        engine.sync_timing = cfg.sync_timing
    batch_sizes = cfg.batch_sizes or [cfg.batch_size]
    if max(batch_sizes) > 1 and any(m in HF_MODES for m in cfg.modes):
        print("transformers' modes run one prompt at a time: skipped at batch sizes > 1")
        cfg.modes = [m for m in cfg.modes if m not in HF_MODES]

    prompts = select_prompts(tokenizer, cfg.num_prompts, cfg.max_prompt_tokens)
    print(f"{len(prompts)} ShareGPT dev prompts, {cfg.max_new_tokens} new tokens, {cfg.dtype} on {device}, "
          f"batch {batch_sizes}, sizing {cfg.sizing}, modes {cfg.modes}, repeats {cfg.repeats}")
    sweep = {}
    if cfg.samples > 1:
        if any(m in HF_MODES for m in cfg.modes):
            print("transformers' modes have no shared-prefill samples: skipped with samples > 1")
            cfg.modes = [m for m in cfg.modes if m not in HF_MODES]
        for batch_size in batch_sizes:
            records, prefill = run_sample_cells(cfg, engines, prompts, batch_size)
            summary = summarize(records)
            print(f"batch {batch_size} prompts x {cfg.samples} samples:")
            sweep[batch_size] = {"summary": summary, "records": records,
                                 "samples": sample_table(records, prefill, summary)}
        report = {"config": asdict(cfg), "records": sweep[batch_sizes[-1]]["records"],
                  "sweep": {str(b): {"summary": v["summary"], "samples": v["samples"]} for b, v in sweep.items()}}
        write_report(cfg.output, report)
        return report
    for batch_size in batch_sizes:
        records = run_cells(cfg, engines, model, eos, prompts, batch_size)
        sweep[batch_size] = {"summary": summarize(records), "records": records}
    records, summary = sweep[batch_sizes[-1]]["records"], sweep[batch_sizes[-1]]["summary"]
    for mode in cfg.modes:
        cost_model = engines[mode].cost_model() if mode in engines else None
        if cost_model is not None:
            print(f"{mode} cost model after the run: {json.dumps(cost_model)}")
    for batch_size in batch_sizes:
        print(f"batch {batch_size}:")
        print_table(sweep[batch_size]["summary"])
    if len(batch_sizes) > 1:
        print_sweep({b: v["summary"] for b, v in sweep.items()})
    report = {"config": asdict(cfg), "summary": summary, "records": records,
              "sweep": {str(b): v["summary"] for b, v in sweep.items()}}
    write_report(cfg.output, report)
    return report
