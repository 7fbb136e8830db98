"""Training throughput live vs from the teacher cache: `python -m jobs.bench teacher_cache config.yaml [key=value]`.

    python -m jobs.bench teacher_cache configs/train_default_head.yaml bench.steps=30
    python -m jobs.bench teacher_cache my.yaml bench.steps=10 bench.work_dir=/tmp/btc target=/models/x

Takes a training config (dart_train.trainer.TrainConfig) plus `bench.*` keys, loads the target
once, then
  1. builds a teacher cache of `bench.examples` examples (default: steps x batch_size, so both
     runs see the same examples: the cache's epoch 0 is the training stream's) under work_dir,
  2. trains `bench.steps` steps live (the target runs every step),
  3. trains `bench.steps` steps from the cache,
  4. times `bench.projection_steps` cached batches' forward + backward with every row projected
     onto the draft vocabulary and with only the loss's rows (alternating; `projection` in the
     output: medians and the largest loss difference between the two),
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

from dart_train.teacher_cache_build import build_teacher_cache
from dart_train.trainer import WorkerContext, parse_config, train_loop
from dart_worker.hardware.device import configure_cpu_threads, resolve_device, resolve_dtype


@dataclass
class BenchConfig:
    steps: int = 20
    examples: int | None = None  # null: steps x trainer.batch_size
    projection_steps: int = 8  # cached batches timed with the dense vs the row-selected projection (0: skip)
    work_dir: str | None = None  # null: a temporary directory, removed afterwards
    keep: bool = False  # keep work_dir (the cache and both runs)


def split_args(argv: list[str]) -> tuple[BenchConfig, list[str]]:
    bench_args = [a.removeprefix("bench.") for a in argv if a.startswith("bench.")]
    rest = [a for a in argv if not a.startswith("bench.")]
    bench = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(BenchConfig), OmegaConf.from_dotlist(bench_args)))
    return bench, rest


def time_row_selection(cfg, model, device, steps: int) -> dict:
    """Forward + backward of the same cached batches with every row projected onto the draft
    vocabulary (dense) and with only the loss's rows (`loss_rows`), alternating which goes first;
    medians in seconds, and the largest loss difference (the two must agree)."""
    import statistics
    import time

    import torch

    from dart_train.draft_training import dart_kl_loss, draft_training_logits, loss_rows, sample_anchors
    from dart_train.teacher_cache import CachedExampleStream, TeacherCache, collate_teacher
    from dart_train.trainer import collate, make_head

    cache = TeacherCache(cfg.data.teacher_cache)
    head = make_head(cfg, model, cache.kept_target_ids, device)
    m = head.config.draft_length
    stream = CachedExampleStream(cache, cfg.trainer.seed)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    worst = 0.0
    for step in range(steps + 1):  # step 0 warms both up, unrecorded
        examples = [stream.next_example() for _ in range(cfg.trainer.batch_size)]
        batch = collate(examples, cfg.data.loss_on_prompt)
        ids = batch.input_ids.to(device)
        taps, teacher = collate_teacher(examples, ids.shape[1])
        taps, teacher = taps.to(device), teacher.to(device)
        anchors, valid = sample_anchors(batch.lengths, batch.loss_starts, cfg.loss.anchors_per_sequence,
                                        torch.Generator().manual_seed(step))
        anchors, valid = anchors.to(device), valid.to(device)
        losses = {}
        for selected in ((False, True) if step % 2 else (True, False)):
            head.zero_grad(set_to_none=True)
            started = time.perf_counter()
            rows = loss_rows(batch.lengths, batch.loss_starts, anchors, valid, ids.shape[1], m) if selected else None
            real, masked = draft_training_logits(head, taps, ids, anchors, rows)
            terms = dart_kl_loss(teacher, real, masked, batch.lengths, batch.loss_starts, anchors, valid,
                                 cfg.loss.gamma, draft_length=m)
            terms.loss.backward()
            if step:
                seconds[selected].append(time.perf_counter() - started)
            losses[selected] = terms.loss.item()
        worst = max(worst, abs(losses[True] - losses[False]))
    dense, selected = statistics.median(seconds[False]), statistics.median(seconds[True])
    return {"dense_step_s": dense, "selected_step_s": selected, "selected_speedup": dense / selected,
            "max_loss_difference": worst}


def main(argv: list[str] | None = None) -> dict:
    from dart_worker.artifacts.loading import load_target

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
        if bench.projection_steps > 0:
            report["projection"] = time_row_selection(cfg, model, device, bench.projection_steps)
        print("bench_teacher_cache " + json.dumps(report), flush=True)
        return report
    finally:
        if not bench.keep and not bench.work_dir:
            shutil.rmtree(work, ignore_errors=True)
