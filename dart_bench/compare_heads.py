"""Draft heads side by side: `python -m jobs.bench compare_heads [bench.yaml] 'heads=[default,<dir>]' [key=value ...]`.

A new default head ships only if it beats the current one, so both must be measured on the same
data in the same run. For every head, in one process:

1. **Dev accuracy**: top-1 accuracy against the target's full-vocabulary argmax per draft position,
   per-position KL and the weighted dev loss, on the same `dev_sequences` dev-split sequences of
   `dev_source` (dart_train.trainer.evaluate_dev: the figures training logs, anchors sampled with
   the same fixed seeds for every head).
2. **Tau by replay** (`replay_prompts` > 0): every tree cell's tau on that many dev prompts for
   every head at every configured temperature, from the same target replies (dart_train.replay:
   no verification forwards, so many more prompts than the decoding runs afford), with the
   per-prompt paired difference to the first head and its standard error.
3. **Decoding**: the `jobs.bench report` cells (modes x temperatures x budgets on the same ShareGPT dev
   prompts; tau, tokens/s, speedup against `ar` measured in the same sub-run, per-position
   acceptance).

`heads` are head directories; `default` is the shipped one. All `jobs.bench report` keys apply (use
`dtype=fp32` on CPUs without bf16 units). Writes compare.json and compare.md (side-by-side
tables) under `output_dir` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dart_bench.matrix import BenchConfigError, BenchReportConfig, load_bench_config


@dataclass
class CompareHeadsConfig(BenchReportConfig):
    heads: list[str] = field(default_factory=lambda: ["default"])  # head directories; "default" = shipped
    dev_sequences: int = 32  # dev-split sequences scored per head (0: skip the dev accuracy)
    dev_anchors_per_sequence: int = 64
    dev_source: str = "default"  # corpus whose dev split is scored (any training data.source)
    dev_fraction: float = 0.02  # its train/dev split, as in training
    replay_prompts: int = 0  # dev prompts for the greedy replay tau of every tree cell (0: skip)
    output_dir: str = "compare_heads"


def head_dir(name: str) -> str:
    """A head's directory: "default" is the shipped head (an error if this build ships none)."""
    if name != "default":
        if not (Path(name) / "config.json").is_file():
            raise BenchConfigError(f"heads: {name!r} is not a draft head directory (no config.json)")
        return name
    from dart_worker.artifacts import default_head

    path = default_head.default_head_dir()
    if path is None:
        raise BenchConfigError("heads: 'default' but this build ships no default head")
    return str(path)


def dev_examples(tokenizer, source: str, dev_fraction: float, n: int) -> list:
    """The first `n` usable dev-split examples of `source`, framed as training frames them."""
    from dart_train.trainer import DataConfig, dev_split_examples

    return dev_split_examples(DataConfig(source=source, dev_fraction=dev_fraction), tokenizer, n)


def dev_accuracy(cfg: CompareHeadsConfig, heads: list[str]) -> dict[str, dict]:
    """evaluate_dev of every head on the same examples with one fp32 target (dtype-independent figures)."""
    import torch

    from dart_train.draft_training import TeacherPass
    from dart_train.trainer import EvalConfig, TrainConfig, evaluate_dev, head_vocab
    from dart_worker.artifacts.loading import load_target
    from dart_worker.head.draft_checkpoint import load_draft_head

    model, tokenizer = load_target(cfg.target, dtype="fp32", device="cpu")
    examples = dev_examples(tokenizer, cfg.dev_source, cfg.dev_fraction, cfg.dev_sequences)
    if not examples:
        raise RuntimeError(f"no usable dev sequence in {cfg.dev_source!r}")
    train_cfg = TrainConfig(eval=EvalConfig(dev_anchors_per_sequence=cfg.dev_anchors_per_sequence))
    out = {}
    for path in heads:
        head = load_draft_head(path, model.config, model.get_input_embeddings(), device="cpu", dtype=torch.float32)
        head.eval()
        teacher = TeacherPass(model, head_vocab(head))
        out[path] = {"sequences": len(examples),
                     **evaluate_dev(head, teacher, examples, train_cfg, torch.device("cpu"), batch_size=1)}
        print(f"dev {path}: top-1 per position "
              f"{[round(a, 3) for a in out[path]['dev_accuracy_per_position']]}, loss {out[path]['dev_loss']:.3f}",
              flush=True)
    return out


def replay_taus(cfg: CompareHeadsConfig, heads: list[str]) -> dict[str, Any]:
    """Tau per head and tree cell on `replay_prompts` dev prompts (the same replies for all), at
    every configured temperature (sampled replies seeded with cfg.seed: dart_train.replay)."""
    import statistics

    from dart_bench.common import load_parts, select_prompts
    from dart_bench.matrix import cells_of
    from dart_train.replay import paired_difference, replay, target_references
    from dart_worker.engine_factory import build_drafter
    from dart_worker.head.draft_checkpoint import load_draft_head
    from dart_worker.sampling.params import SamplingParams
    from ngram_native.builders import TreeParams

    cells = [c for c in cells_of(cfg) if c.budget is not None]
    parts = load_parts(replace(cfg, head=heads[0]), {c.mode for c in cells})
    prompts = [ids for _, ids in select_prompts(parts.tokenizer, cfg.replay_prompts, cfg.max_prompt_tokens)]
    refs = {t: target_references(parts, prompts, cfg.max_new_tokens,
                                 params=SamplingParams(temperature=t, seed=cfg.seed))
            for t in sorted({c.temperature for c in cells})}
    model = parts.target.model
    per_prompt: dict[str, dict[str, list[float]]] = {}
    for path in heads:
        parts.head = load_draft_head(path, model.config, model.get_input_embeddings(), device=parts.target.device,
                                     dtype=parts.target.dtype, tap_layers=parts.target.tap_layers)
        for c in cells:
            tree = TreeParams(budget=c.budget, lookup_cache_tokens=cfg.lookup_cache_tokens, job_ngram_tokens=0)
            stats = replay(build_drafter(parts, c.mode, tree), refs[c.temperature], cfg.max_new_tokens,
                           parts.target.max_positions)
            label = c.label if c.temperature == 0 else f"{c.label} T={c.temperature:g}"
            per_prompt.setdefault(label, {})[path] = [s.tau for s in stats]
    out = {}
    for label, by_head in per_prompt.items():
        first = by_head[heads[0]]
        out[label] = {}
        for path, taus in by_head.items():
            diff, stderr = paired_difference(taus, first)
            out[label][path] = {"tau": statistics.mean(taus), "per_prompt": taus, "diff_vs_first": diff,
                                "diff_stderr": stderr}
        print(f"replay {label}: " + ", ".join(f"{out[label][h]['tau']:.3f}" for h in heads), flush=True)
    return {"prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens, "dtype": str(parts.target.dtype),
            "cells": out}


def compare(cfg: CompareHeadsConfig) -> dict[str, Any]:
    from dart_bench.matrix import measure

    heads = [head_dir(h) for h in cfg.heads]
    if cfg.omp_wait_policy is not None and "torch" not in sys.modules:  # read once, when torch starts OpenMP
        os.environ["OMP_WAIT_POLICY"] = cfg.omp_wait_policy.upper()
    dev = dev_accuracy(cfg, heads) if cfg.dev_sequences > 0 else {}
    replayed = replay_taus(cfg, heads) if cfg.replay_prompts > 0 else {}
    runs = {}
    for path in heads:  # one `jobs.bench report` measurement per head, each with its own `ar` baseline
        print(f"decoding with head {path}", flush=True)
        base = {k: v for k, v in asdict(cfg).items() if k in BenchReportConfig.__dataclass_fields__}
        runs[path] = measure(replace(BenchReportConfig(**base), head=path))
    return {"config": asdict(cfg), "heads": heads, "dev": dev, "replay": replayed,
            "decoding": {p: {"conditions": r["conditions"], "summary": r["summary"]} for p, r in runs.items()}}


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def comparison_tables(figures: dict[str, Any]) -> list[str]:
    """Markdown: dev accuracy per position, then tau / speedup per cell, one column pair per head."""
    heads = figures["heads"]
    names = [f"`{h}`" for h in heads]
    lines: list[str] = []
    if figures["dev"]:
        depth = max(len(d["dev_accuracy_per_position"]) for d in figures["dev"].values())
        lines += ["| head | " + " | ".join(f"pos {i + 1}" for i in range(depth)) + " | dev loss | anchors |",
                  "|---|" + "---:|" * (depth + 2)]
        for h, name in zip(heads, names, strict=True):
            d = figures["dev"][h]
            acc = d["dev_accuracy_per_position"]
            lines.append(f"| {name} | " + " | ".join(_fmt(acc[i] if i < len(acc) else None, ".3f")
                                                      for i in range(depth))
                         + f" | {d['dev_loss']:.3f} | {d['dev_anchors']} |")
        lines.append("")
    if figures.get("replay"):
        r = figures["replay"]
        lines += [f"Tau by replay (greedy, and sampled where a cell says T=), {r['prompts']} dev prompts x "
                  f"{r['max_new_tokens']} new tokens "
                  f"({r['dtype']}); the difference to the first head is the mean of per-prompt differences "
                  "+- its standard error.", "",
                  "| cell | " + " | ".join(f"{n} tau" for n in names) + " | " +
                  " | ".join(f"{n} - first" for n in names[1:]) + " |",
                  "|---|" + "---:|" * (2 * len(heads) - 1)]
        for label, by_head in r["cells"].items():
            diffs = [f"{by_head[h]['diff_vs_first']:+.3f} +- {_fmt(by_head[h]['diff_stderr'], '.3f')}"
                     for h in heads[1:]]
            lines.append(f"| {label} | " + " | ".join(f"{by_head[h]['tau']:.3f}" for h in heads) + " | "
                         + " | ".join(diffs) + " |")
        lines.append("")
    cells: dict[tuple, dict[str, dict]] = {}
    for h in heads:
        for entry in figures["decoding"][h]["summary"]:
            cells.setdefault((entry["temperature"], entry["mode"], entry["budget"]), {})[h] = entry
    lines += ["| T | cell | " + " | ".join(f"{n} tau | {n} speedup" for n in names) + " |",
              "|---|---|" + "---:|---:|" * len(heads)]
    for (t, mode, budget), by_head in cells.items():
        label = mode if budget is None else f"{mode}@{budget}"
        row = [f"{_fmt(by_head[h].get('tau')) if h in by_head else '-'} | "
               f"{_fmt(by_head[h].get('speedup_vs_ar')) + 'x' if h in by_head else '-'}" for h in heads]
        lines.append(f"| {t:g} | {label} | " + " | ".join(row) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench compare_heads", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", help="YAML config (e.g. configs/bench.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. 'heads=[default,out/export]'")
    args = parser.parse_args(argv)
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:
        config, overrides = None, [config, *overrides]
    try:
        cfg = load_bench_config(config, overrides, schema=CompareHeadsConfig)
        if not cfg.heads:
            raise BenchConfigError("heads: empty; expected one or more head directories or 'default'")
        if cfg.dev_sequences < 0:
            raise BenchConfigError(f"dev_sequences: {cfg.dev_sequences} must be >= 0")
        for h in cfg.heads:
            head_dir(h)
    except BenchConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    figures = compare(cfg)
    figures["command"] = "python -m jobs.bench compare_heads " + shlex.join([a for a in (config, *overrides) if a])
    tables = comparison_tables(figures)
    print("\n".join(tables))
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(figures, indent=1))
    header = f"# Draft heads compared\n\n    {figures['command']}\n\n"
    (out / "compare.md").write_text(header + "\n".join(tables) + "\n")
    print(f"wrote {out / 'compare.md'} and {out / 'compare.json'}")
    return 0
