"""Training throughput live vs from the teacher cache: `python -m jobs.bench_teacher_cache config.yaml [key=value]`.

    python -m jobs.bench_teacher_cache configs/train_default_head.yaml bench.steps=30
    python -m jobs.bench_teacher_cache my.yaml bench.steps=10 bench.work_dir=/tmp/btc target=/models/x

Takes a training config (jobs.train_draft.TrainConfig) plus `bench.*` keys, loads the target
once, then
  1. builds a teacher cache of `bench.examples` examples (default: steps x batch_size, so both
     runs see the same examples: the cache's epoch 0 is the training stream's) under work_dir,
  2. trains `bench.steps` steps live (the target runs every step),
  3. trains `bench.steps` steps from the cache,
with evaluation, tau, checkpoints and export off, and prints one JSON line: the build's tokens/s
(target forwards and shard writes, the draft-vocabulary count excluded), each run's steady
tokens/s (the steps after the first: `steady_tokens_per_s` of the training summary) and the
cache's bytes per token. Each run counts its draft vocabulary outside the timed steps, as
training does.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from dart_worker.device import configure_cpu_threads, resolve_device, resolve_dtype
from jobs.build_teacher_cache import build_teacher_cache
from jobs.train_draft import WorkerContext, parse_config, train_loop


@dataclass
class BenchConfig:
    steps: int = 20
    examples: int | None = None  # null: steps x trainer.batch_size
    work_dir: str | None = None  # null: a temporary directory, removed afterwards
    keep: bool = False  # keep work_dir (the cache and both runs)


def split_args(argv: list[str]) -> tuple[BenchConfig, list[str]]:
    bench_args = [a.removeprefix("bench.") for a in argv if a.startswith("bench.")]
    rest = [a for a in argv if not a.startswith("bench.")]
    bench = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(BenchConfig), OmegaConf.from_dotlist(bench_args)))
    return bench, rest


def main(argv: list[str] | None = None) -> dict:
    from dart_worker.loading import load_target

    bench, rest = split_args(list(sys.argv[1:] if argv is None else argv))
    cfg = parse_config(rest)
    configure_cpu_threads(cfg.trainer.threads)
    work = Path(bench.work_dir or tempfile.mkdtemp(prefix="bench_teacher_cache-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg.export_dir = None
    cfg.eval.dev_sequences, cfg.eval.tau_prompts = 0, 0
    cfg.trainer.max_steps, cfg.trainer.checkpoint_every, cfg.trainer.max_minutes = bench.steps, 0, None
    cfg.trainer.resume = False
    cfg.trainer.log_every = max(cfg.trainer.log_every, 1)
    cfg.cache.max_examples = bench.examples or bench.steps * cfg.trainer.batch_size
    cfg.data.teacher_cache = str(work / "cache")
    device = resolve_device(cfg.trainer.device)
    model, tokenizer = load_target(cfg.target, dtype=resolve_dtype(cfg.trainer.target_dtype, device), device=device)
    try:
        manifest = build_teacher_cache(cfg, model=model, tokenizer=tokenizer)
        results = {}
        for name in ("live", "cached"):
            run_cfg = copy.deepcopy(cfg)
            run_cfg.output_dir = str(work / name)
            shutil.rmtree(run_cfg.output_dir, ignore_errors=True)
            if name == "live":
                run_cfg.data.teacher_cache = None
            summary = train_loop(run_cfg, WorkerContext(device=device), model=model, tokenizer=tokenizer)
            results[name] = summary["steady_tokens_per_s"]
        report = {"device": str(device), "target": cfg.target, "steps": bench.steps,
                  "batch_size": cfg.trainer.batch_size, "cache_examples": manifest["examples"],
                  "cache_tokens": manifest["tokens"], "top_k": manifest["build"]["top_k"],
                  "tap_dtype": manifest["build"]["tap_dtype"],
                  "cache_bytes_per_token": manifest["bytes"] / max(manifest["tokens"], 1),
                  "mean_rest_mass": manifest["mean_rest_mass"],
                  "build_tokens_per_s": manifest.get("last_run", {}).get("tokens_per_s"),
                  "live_tokens_per_s": results["live"], "cached_tokens_per_s": results["cached"],
                  "speedup": (results["cached"] / results["live"]) if results["live"] and results["cached"] else None}
        print("bench_teacher_cache " + json.dumps(report), flush=True)
        return report
    finally:
        if not bench.keep and not bench.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
