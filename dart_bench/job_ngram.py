"""What the job n-gram is worth as a job warms up: `python -m jobs.bench job_ngram [config.yaml] [key=value ...]`.

DART's beam re-scores the head's candidates with an N-gram estimate; `decoding.tree.job_ngram_*`
mixes the counts of the rows a worker has finished into the static trie's (ngram_native.job_ngram).
Its value grows with the rows seen, so this job measures tau (greedy, or at `temperature`) on ShareGPT dev prompts with
the drafter's job n-gram first fed the first N earlier outputs (`earlier_outputs`: what a job wrote
before, e.g. `jobs.distill_data`'s JSONL or a pipeline run's Parquet), for each N in `warm_rows`,
each prior in `priors` and each budget, next to the same drafter with the job n-gram off - all on
the same replies, so every difference is the drafter's.

Tau is measured by replay (`dart_train.replay`: the target's greedy replies and taps computed
once, then only the drafter runs; it equals the engine's fixed-sizing tau, tests/test_replay.py).
The replies are cached in `output_dir`/replies.json as `jobs.bench tune_tree` does (same key), so a
tune_tree output dir can be reused. The first `check_prompts` dev prompts are skipped (the
benchmark's own, kept out of every tuning).

    python -m jobs.bench job_ngram earlier_outputs=outputs/distill/sharegpt_self.jsonl 'warm_rows=[0,300,3000]'

Writes job_ngram.json and job_ngram.md under `output_dir`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dart_bench.replay import (
    ReplayJobConfig,
    TuneConfigError,
    load_structured_config,
    replay_job_main,
    replay_kind,
    reply_sampling,
    setting,
)


@dataclass
class JobNgramBenchConfig(ReplayJobConfig):
    mode: str = "dart"  # dart or dart_lookup (the drafters with a job n-gram)
    base: dict[str, Any] = field(default_factory=dict)  # TreeParams fields besides the budget; {} = defaults
    earlier_outputs: str = ""  # JSONL (conversations or completion) or Parquet (completion) of earlier rows
    warm_rows: list[int] = field(default_factory=lambda: [0, 100, 1000, 6000])
    priors: list[float] = field(default_factory=lambda: [4.0])
    output_dir: str = "bench_job_ngram"


def parse_config(argv: list[str]) -> JobNgramBenchConfig:
    cfg = load_structured_config(JobNgramBenchConfig, argv, TuneConfigError)
    reply_sampling(cfg)
    if cfg.mode not in ("dart", "dart_lookup"):
        raise TuneConfigError(f"mode: {cfg.mode!r}: the job n-gram drafts in dart and dart_lookup only")
    if not cfg.earlier_outputs or not Path(cfg.earlier_outputs).is_file():
        raise TuneConfigError(f"earlier_outputs: {cfg.earlier_outputs!r} is not a file")
    if not cfg.warm_rows or min(cfg.warm_rows) < 0 or not cfg.priors or min(cfg.priors) < 0:
        raise TuneConfigError("warm_rows and priors: one or more values >= 0 each")
    for budget in cfg.budgets:
        setting(cfg.base, budget=budget)  # TuneConfigError naming a bad field
    return cfg


def measure(cfg: JobNgramBenchConfig) -> dict[str, Any]:
    from dart_bench.common import machine_conditions
    from dart_bench.replay import replay_setup
    from dart_train.corpus import job_output_documents
    from dart_train.replay import mean_tau, replay
    from dart_worker.engine_factory import build_drafter

    threads, parts, chosen, refs = replay_setup(cfg, [cfg.mode])
    refs = refs[cfg.check_prompts :]
    documents = job_output_documents(cfg.earlier_outputs, max(cfg.warm_rows), parts.tokenizer)
    print(f"{len(refs)} dev prompts, {len(documents)} earlier outputs ({sum(map(len, documents))} tokens)")

    rows = []
    for budget in cfg.budgets:
        cells = [("off", 0, None)] + [("on", n, p) for p in cfg.priors for n in cfg.warm_rows]
        for state, warm, prior in cells:
            changes = {"budget": budget, "job_ngram_tokens": 0} if state == "off" else \
                {"budget": budget, "job_ngram_prior": prior}
            params = setting(cfg.base, **changes)
            drafter = build_drafter(parts, cfg.mode, params)
            job = drafter.job_stores().get("job_ngram")
            start = time.perf_counter()
            for doc in documents[:warm] if job is not None else []:
                job.add(doc)
            fed = time.perf_counter() - start
            stats = replay(drafter, refs, cfg.max_new_tokens, parts.target.max_positions)
            row = {"budget": budget, "job_ngram": state, "warm_rows": min(warm, len(documents)), "prior": prior,
                   "tau": mean_tau(stats), "per_prompt_tau": [s.tau for s in stats],
                   "warm_tokens": len(job) if job is not None else 0,
                   "memory_bytes": job.memory_bytes if job is not None else 0,
                   "feed_s": fed, "replay_s": time.perf_counter() - start - fed}
            rows.append(row)
            print(summary_lines([row])[-1], flush=True)
    return {"config": OmegaConf.to_container(OmegaConf.structured(cfg)), "conditions": machine_conditions(threads),
            "dtype": str(parts.target.dtype), "prompts": [i for i, _ in chosen[cfg.check_prompts :]],
            "num_earlier_outputs": len(documents), "results": rows}


def summary_lines(rows: list[dict]) -> list[str]:
    from dart_train.replay import paired_difference

    lines = ["| budget | job n-gram | earlier rows fed | prior | tokens held | tau | vs off |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    off = {r["budget"]: r for r in rows if r["job_ngram"] == "off"}
    for r in rows:
        base = off.get(r["budget"])
        diff = ""
        if base is not None and r is not base:
            mean, stderr = paired_difference(r["per_prompt_tau"], base["per_prompt_tau"])
            diff = f"{mean:+.3f} +- {stderr:.3f}" if stderr is not None else f"{mean:+.3f}"
        prior = "" if r["prior"] is None else f"{r['prior']:g}"
        lines.append(f"| {r['budget']} | {r['job_ngram']} | {r['warm_rows']} | {prior} | {r['warm_tokens']} | "
                     f"{r['tau']:.3f} | {diff} |")
    return lines


def _header(cfg: JobNgramBenchConfig, figures: dict) -> str:
    return (f"# Tau with the job n-gram fed N earlier outputs ({cfg.mode}, {replay_kind(cfg)})\n\n"
            f"    {figures['command']}\n\n"
            f"{figures['conditions'].get('cpu', '?')}, {figures['dtype']}; {len(figures['prompts'])} dev prompts, "
            f"{cfg.max_new_tokens} new tokens; 'vs off': mean per-prompt difference +- standard error.\n\n")


def main(argv: list[str] | None = None) -> int:
    return replay_job_main(argv, "jobs.bench job_ngram", __doc__, parse_config, measure, summary_lines,
                           "job_ngram", _header)
