"""Side-by-side decoding benchmark of the engine: `python -m jobs.bench_engine [key=value ...]`.

Every mode decodes the same ShareGPT dev prompts in one process, interleaved prompt by prompt
(so drift in machine load hits all modes alike) and repeated; figures are medians. Modes:
the engine's `ar`, `chain`, `ddtree`, `dart`, and transformers' own `generate` (greedy and
prompt-lookup decoding) as outside baselines. Reported per mode: tokens/s, the per-prompt
speedup over `ar` (median of ratios), tau, per-stage time per round and, for greedy runs, the
agreement with `ar` (identical outputs; in bf16 multi-token forwards round differently from
one-token forwards, so exact agreement is not expected there - see docs/DESIGN.md).

With `samples=n` > 1 each prompt gets n seeded completions sharing one prefill, beside "<mode>+separate"
cells decoding the same samples as separate rows: rows (samples) per second, tau, and the prompt
tokens and seconds each cell's prefill took, i.e. what sharing the prefill saves.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dart_train.corpus import sharegpt_dev_prompts
from dart_worker.defaults import DEFAULT_BUDGET, DEFAULT_DTYPE
from dart_worker.device import configure_cpu_threads, resolve_device, resolve_dtype
from dart_worker.draft_head import DartDraftHead
from dart_worker.drafters import drafter_names, drafter_spec
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.kernels import shapes_for
from dart_worker.loading import load_target
from dart_worker.prompt_format import format_user_prompt
from dart_worker.sampling import SamplingParams, for_sample
from dart_worker.stats import STAGES
from ngram_native.trees import SOURCE_NAMES, TreeParams

HF_MODES = ("hf_greedy", "hf_prompt_lookup")
FULL_LOGITS = "+full_logits"
FIXED = "+fixed"
JOB_NGRAM = "+job_ngram"


@dataclass
class BenchConfig:
    target: str = "default"
    head: str | None = None  # None: the shipped default head if any, else an untrained head
    trie: str | None = None  # None: the default trie (built and cached on first use)
    dtype: str = DEFAULT_DTYPE
    device: str = "auto"
    threads: int | None = None
    modes: list[str] = field(default_factory=lambda: [*drafter_names(), *HF_MODES])
    num_prompts: int = 8
    max_prompt_tokens: int = 512
    max_new_tokens: int = 128
    temperature: float = 0.0
    repeats: int = 1
    budget: int = DEFAULT_BUDGET
    # The lookup modes' job cache: off, because the cells decode the same prompts at every batch
    # size and repeat, so a cache would draft each prompt from its own earlier answer
    # (jobs.bench_templated measures the cache on distinct rows).
    lookup_cache_tokens: int = 0
    # DART's job n-gram (decoding.tree.job_ngram_tokens) learns from finished rows too: off in the
    # cells for the same reason. `job_ngram_modes` also run with it on (label "<mode>+job_ngram"),
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
    # dart_worker.kernels.shapes_for; bucketed on CUDA, exact on a CPU), side by side with the default.
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
    seed: int = 0
    # Sampling filters and penalties of every cell (vLLM's meanings; dart_worker.sampling).
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


def load_parts(cfg, modes) -> EngineParts:
    """The target of `cfg` (target, dtype, device, head, trie), with the head and the trie loaded
    only if one of `modes` needs them. Shared by jobs.bench_engine and jobs.bench."""
    device = resolve_device(cfg.device)
    model, tokenizer = load_target(cfg.target, dtype=resolve_dtype(cfg.dtype, device), device=device)
    specs = [drafter_spec(m) for m in modes if m in drafter_names()]
    head = head_of(cfg, model) if any(s.needs_head for s in specs) else None
    trie = trie_path_of(cfg) if any(s.needs_trie for s in specs) else None
    return EngineParts.from_model(model, tokenizer, head=head, trie=trie)


def head_of(cfg, model):
    """The head directory to load: cfg.head, else the shipped default; else an untrained head."""
    from dart_worker import default_head

    path = cfg.head or default_head.default_head_dir()
    if path is not None:
        return path
    print("no trained draft head available: using an untrained (random) head; tau will be low")
    torch.manual_seed(cfg.seed)
    return DartDraftHead.random_init(model.config, model.get_input_embeddings(),
                                     draft_length=7).to(model.device, model.dtype)


def trie_path_of(cfg) -> str:
    from dart_train.ngram_build import default_trie_path

    return cfg.trie or str(default_trie_path())


def run_hf(model, prompt_ids: list[int], mode: str, max_new_tokens: int, eos: list[int],
           temperature: float = 0.0, seed: int = 0) -> tuple[list[int], float]:
    """transformers' own generate on one prompt: (generated ids, seconds).

    temperature 0 is greedy; above 0 it samples (`do_sample=True`, plain temperature sampling with
    top-k/top-p off, like the engine's defaults). Prompt lookup (`hf_prompt_lookup`) is greedy only.
    """
    extra: dict = {"prompt_lookup_num_tokens": 10} if mode == "hf_prompt_lookup" else {}
    if temperature > 0:
        if mode == "hf_prompt_lookup":
            raise ValueError("hf_prompt_lookup is greedy only; run it at temperature 0")
        torch.manual_seed(seed)
        extra |= {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    else:
        extra["do_sample"] = False
    ids = torch.tensor([prompt_ids], device=model.device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0, **extra)
    elapsed = time.perf_counter() - start
    return out[0, len(prompt_ids):].tolist(), elapsed


def select_prompts(tokenizer, num_prompts: int, max_prompt_tokens: int) -> list[tuple[str, list[int]]]:
    """The first `num_prompts` ShareGPT dev prompts that fit `max_prompt_tokens`: (id, token ids)."""
    prompts = []
    for p in sharegpt_dev_prompts(num_prompts * 3, max_chars=4 * max_prompt_tokens):
        ids = tokenizer(format_user_prompt(tokenizer, p.text))["input_ids"]
        if len(ids) <= max_prompt_tokens:
            prompts.append((p.id, ids))
        if len(prompts) == num_prompts:
            break
    return prompts


def run_record(prompt_id: str, repeat: int, result, group: int = 0) -> dict:
    """One engine run as a benchmark record: the request's stats row plus what the summary pairs on.
    `seconds` is the wall time of the whole batch the prompt was decoded in (`group`)."""
    return {"prompt": prompt_id, "repeat": repeat, "group": group, "tokens": len(result.token_ids),
            "seconds": result.stats.wall_seconds, "token_ids": result.token_ids, **result.stats.to_row()}


def summarize(records: dict[str, list[dict]]) -> dict[str, dict]:
    """Medians per mode; speedup = median over runs of (ar seconds per token / mode seconds per token).

    Each run is paired with the `ar` run of the same prompt and repeat (runs of one repeat are
    interleaved, so they saw the same machine load).
    """
    ar = {_run_key(r): r for r in records.get("ar", [])}
    summary = {}
    for mode, rows in records.items():
        tps = [r["tokens"] / r["seconds"] for r in rows if r["seconds"] > 0]
        ratios = [(ar[_run_key(r)]["seconds"] / ar[_run_key(r)]["tokens"]) / (r["seconds"] / r["tokens"])
                  for r in rows if _run_key(r) in ar and r["tokens"] and r["seconds"] > 0
                  and ar[_run_key(r)]["tokens"]]
        agree = [r["token_ids"] == ar[_run_key(r)]["token_ids"] for r in rows if _run_key(r) in ar]
        walls = {(r.get("group", 0), r.get("repeat", 0)): r["seconds"] for r in rows}
        entry = {
            "tokens_per_second": statistics.median(tps) if tps else 0.0,
            # Whole-run throughput: every token over the wall time of every batch.
            "throughput": sum(r["tokens"] for r in rows) / sum(walls.values()) if sum(walls.values()) else 0.0,
            "speedup_vs_ar": statistics.median(ratios) if ratios else 0.0,
            "agreement_with_ar": sum(agree) / len(agree) if agree else None,
            "runs": len(rows),
        }
        taus = [r["tau"] for r in rows if r.get("tau")]
        if taus:
            entry["tau"] = statistics.mean(taus)
            rounds = sum(r["rounds"] for r in rows)
            entry["ms_per_round"] = {
                stage: 1000 * sum(r[f"{stage}_s"] for r in rows) / max(rounds, 1) for stage in STAGES
            }
            entry["mean_tree_size"] = statistics.mean(r["mean_tree_size"] for r in rows)
            # Accepted draft tokens by the source that proposed them (records of older runs lack them).
            entry["accepted_tokens_by_source"] = {
                source: sum(r.get(f"accepted_{source}", 0) for r in rows) for source in SOURCE_NAMES.values()}
            depth = max(len(r["per_position_acceptance"]) for r in rows)
            entry["per_position_acceptance"] = [
                statistics.mean(r["per_position_acceptance"][d] for r in rows if len(r["per_position_acceptance"]) > d)
                for d in range(depth)
            ]
        summary[mode] = entry
    return summary


def _run_key(record: dict) -> tuple:
    return record["prompt"], record.get("repeat", 0)


def print_table(summary: dict[str, dict]) -> None:
    print(f"{'mode':<18}{'tok/s':>8}{'total':>8}{'x ar':>7}{'tau':>6}{'tree':>6}{'agree':>7}"
          "  ms/round (draft/tree/verify/commit)  accepted from head/context/job_cache")
    for mode, s in summary.items():
        stages = s.get("ms_per_round")
        stage_text = "/".join(f"{stages[k]:.1f}" for k in ("draft", "tree", "verify", "commit")) if stages else "-"
        agree = "-" if s["agreement_with_ar"] is None else f"{s['agreement_with_ar']:.2f}"
        sources = s.get("accepted_tokens_by_source")
        source_text = "/".join(str(sources.get(s, 0)) for s in SOURCE_NAMES.values()) if sources else "-"
        print(f"{mode:<18}{s['tokens_per_second']:>8.1f}{s.get('throughput', 0):>8.1f}{s['speedup_vs_ar']:>7.2f}"
              f"{s.get('tau', 1.0):>6.2f}{s.get('mean_tree_size', 0):>6.1f}{agree:>7}  {stage_text:<34}{source_text}")


class PrefillMeter:
    """Counts what a target's prefill forwards (prompt tokens, calls, seconds), per cell label."""

    def __init__(self, target):
        self.target, self.original = target, target.prefill
        self.label = None
        self.figures: dict[str, dict[str, float]] = {}
        target.prefill = self._prefill

    def _prefill(self, state, prompts):
        started = time.perf_counter()
        out = self.original(state, prompts)
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
    batch by batch (so drift in machine load hits all cells alike), `cfg.repeats` times."""
    records: dict[str, list[dict]] = {m: [] for m in cfg.modes}
    groups = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    for repeat in range(cfg.repeats):
        for g, group in enumerate(groups):
            params = sampling_params(cfg, group)
            for mode in cfg.modes:
                if mode in HF_MODES:
                    (n,) = group
                    token_ids, seconds = run_hf(model, prompts[n][1], mode, cfg.max_new_tokens, eos,
                                                cfg.temperature, cfg.seed + n)
                    records[mode].append({"prompt": prompts[n][0], "repeat": repeat, "group": g,
                                          "tokens": len(token_ids), "seconds": seconds, "token_ids": token_ids})
                    continue
                results = engines[mode].generate([prompts[n][1] for n in group], params)
                records[mode].extend(run_record(prompts[n][0], repeat, result, g) for n, result in zip(group, results))
            print(f"  batch size {batch_size}: repeat {repeat} batch {g + 1}/{len(groups)} done", flush=True)
    return records


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
    cfg: BenchConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(BenchConfig),
                                                           OmegaConf.from_cli(argv)))
    if cfg.temperature > 0 and "hf_prompt_lookup" in cfg.modes:
        print("hf_prompt_lookup is greedy only: skipped at temperature > 0")
        cfg.modes = [m for m in cfg.modes if m != "hf_prompt_lookup"]
    configure_cpu_threads(cfg.threads)
    parts = load_parts(cfg, cfg.modes)
    tokenizer, eos, model, device = parts.tokenizer, list(parts.eos_token_ids), parts.target.model, parts.target.device
    tree = TreeParams(budget=cfg.budget, lookup_cache_tokens=cfg.lookup_cache_tokens, job_ngram_tokens=0)
    live = (1, *(cfg.batch_sizes or [cfg.batch_size]))  # the batch sizes the sizer calibrates at
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
            job = engine.drafter.job_ngram
            if job is None:
                raise ValueError(f"job_ngram_modes: {mode!r} has no job n-gram (dart and dart_lookup with a trie do)")
            for doc in documents:
                job.add(doc)
            print(f"{mode}{JOB_NGRAM}: {job!r}")
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
        sizer = getattr(engines.get(mode), "sizer", None)
        if sizer is not None:
            print(f"{mode} cost model after the run: {json.dumps(sizer.describe())}")
    for batch_size in batch_sizes:
        print(f"batch {batch_size}:")
        print_table(sweep[batch_size]["summary"])
    if len(batch_sizes) > 1:
        print_sweep({b: v["summary"] for b, v in sweep.items()})
    report = {"config": asdict(cfg), "summary": summary, "records": records,
              "sweep": {str(b): v["summary"] for b, v in sweep.items()}}
    write_report(cfg.output, report)
    return report


def write_report(output: str | None, report: dict) -> None:
    """The benchmarks' JSON report at `output` (a local path; nothing when None)."""
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=1))
        print(f"wrote {output}")


if __name__ == "__main__":
    main()
