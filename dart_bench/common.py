"""What the benchmarks share: the target-and-prompts config, loading, prompts, transformers'
baselines, run records and their summary against `ar`, the machine's conditions, the JSON report.

The benchmarks behind `python -m jobs.bench KIND` that decode ShareGPT dev prompts on a target
read their target, draft artifacts and prompts through `TargetBenchConfig`: the two that run the
same cells of modes (`report`, with `compare_heads` on top, and `engine`) through
`CellsBenchConfig`, the replay jobs (`tune_tree`, `job_ngram`, `context_bound`) through
dart_bench.replay.ReplayJobConfig.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dart_worker.defaults import DEFAULT_DTYPE
from dart_worker.drafters import drafter_names, drafter_spec
from dart_worker.hardware.device import cpu_model_name, resolve_device, resolve_dtype
from dart_worker.stats import STAGES
from ngram_native.trees import SOURCE_NAMES

# The stages of a round that are the drafter's (`dart_worker.stats.STAGES`): the model's forward and
# the proposal with the verify block's assembly. `summarize` reports each cell's speedup without them.
DRAFTING_STAGES = ("draft", "tree")

if TYPE_CHECKING:  # the loading modules pull in transformers: imported where they are used
    from dart_worker.engine_factory import EngineParts


@dataclass
class TargetBenchConfig:
    """The target, its draft artifacts and the ShareGPT dev prompts a benchmark decodes (each
    benchmark's config subclasses this, changing defaults where it always has)."""

    target: str = "default"
    head: str | None = None  # None: the shipped default head if any, else an untrained head (said so)
    trie: str | None = None  # None: the default trie (built and cached on first use)
    dtype: str = DEFAULT_DTYPE  # configs/bench.yaml sets bf16, the dtype of the figures the docs quote
    device: str = "auto"
    threads: int | None = None
    seed: int = 0
    num_prompts: int = 8
    max_prompt_tokens: int = 512
    max_new_tokens: int = 128


@dataclass
class CellsBenchConfig(TargetBenchConfig):
    """A benchmark of decoding modes side by side (`report` and `engine`)."""

    modes: list[str] = field(default_factory=list)
    repeats: int = 1
    # The lookup modes' job cache: off, because every cell decodes the same prompts (at each
    # temperature, batch size and repeat), so a cache would draft each prompt from its own earlier
    # answer. `templated` measures the cache on distinct rows. DART's job n-gram is off in every
    # cell for the same reason (`job_ngram`, and `engine`'s job_ngram_modes, measure it).
    lookup_cache_tokens: int = 0


def load_parts(cfg, modes) -> EngineParts:
    """The target of `cfg` (target, dtype, device, head, trie), with the head and the trie loaded
    only if one of `modes` needs them."""
    from dart_worker.artifacts.loading import load_target
    from dart_worker.engine_factory import EngineParts

    device = resolve_device(cfg.device)
    model, tokenizer = load_target(cfg.target, dtype=resolve_dtype(cfg.dtype, device), device=device)
    specs = [drafter_spec(m) for m in modes if m in drafter_names()]
    head = head_of(cfg, model) if any(s.needs_head for s in specs) else None
    trie = trie_path_of(cfg) if any(s.needs_trie for s in specs) else None
    return EngineParts.from_model(model, tokenizer, head=head, trie=trie)


def head_of(cfg, model):
    """The head directory to load: cfg.head, else the shipped default; else an untrained head."""
    from dart_worker.artifacts import default_head
    from dart_worker.head.draft_head import DartDraftHead

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
    from dart_train.corpus import sharegpt_dev_prompts
    from dart_worker.prompt_format import format_user_prompt

    prompts = []
    for p in sharegpt_dev_prompts(num_prompts * 3, max_chars=4 * max_prompt_tokens):
        ids = tokenizer(format_user_prompt(tokenizer, p.text))["input_ids"]
        if len(ids) <= max_prompt_tokens:
            prompts.append((p.id, ids))
        if len(prompts) == num_prompts:
            break
    return prompts


def run_record(prompt_id: str, repeat: int, result, group: int | None = None) -> dict:
    """One engine run as a benchmark record: the request's stats row plus what the summary pairs on.
    `seconds` is the request's own wall time, from joining its batch (`group`; None: it ran alone)
    to finishing; the batch's wall time is the longest of its requests' (`summarize`)."""
    return {"prompt": prompt_id, "repeat": repeat, "group": group, "tokens": len(result.token_ids),
            "seconds": result.stats.wall_seconds, "token_ids": result.token_ids, **result.stats.to_row()}


def summarize(records: dict[str, list[dict]]) -> dict[str, dict]:
    """Medians per mode; speedup = median over batches of (ar seconds per token / mode seconds per
    token), each batch's seconds its longest request's (`batch_walls`).

    Each batch is paired with the `ar` batch of the same prompts and repeat (runs of one repeat are
    interleaved, so they saw the same machine load). A run without a batch (`group` None or absent)
    is a batch of its own, so at batch 1 this is the median of per-prompt ratios. Pairing requests
    instead compared each request's own wall time: at T=0.7, batch 4 a per-request median of 1.09
    stood beside a whole-run throughput of 0.90x `ar`, the requests that finish early counted as if
    their batch had finished with them.
    """
    ar = {_run_key(r): r for r in records.get("ar", [])}
    ar_batches = batch_walls(records.get("ar", []))
    ar_bounds = batch_walls(records.get("ar", []), without=DRAFTING_STAGES)
    summary = {}
    for mode, rows in records.items():
        tps = [r["tokens"] / r["seconds"] for r in rows if r["seconds"] > 0]
        batches = batch_walls(rows)
        ratios = _paired_ratios(ar_batches, batches)
        bound = _paired_ratios(ar_bounds, batch_walls(rows, without=DRAFTING_STAGES))
        agree = [r["token_ids"] == ar[_run_key(r)]["token_ids"] for r in rows if _run_key(r) in ar]
        wall = sum(seconds for seconds, _ in batches.values())
        entry = {
            "tokens_per_second": statistics.median(tps) if tps else 0.0,
            # Whole-run throughput: every token over the wall time of every batch.
            "throughput": sum(r["tokens"] for r in rows) / wall if wall else 0.0,
            "speedup_vs_ar": statistics.median(ratios) if ratios else 0.0,
            # The same ratio with every batch's drafting stages taken out of both sides (its
            # longest request's `draft` and `tree` seconds): what this cell's trees and verify
            # forwards would give if drafting cost nothing, the most cheaper drafting can reach.
            "speedup_if_drafting_free": statistics.median(bound) if bound else None,
            "agreement_with_ar": sum(agree) / len(agree) if agree else None,
            "runs": len(rows),
        }
        taus = [r["tau"] for r in rows if r.get("tau")]
        if taus:
            entry["tau"] = statistics.mean(taus)
            rounds = sum(r["rounds"] for r in rows)
            entry["ms_per_round"] = {
                # (records of runs before a stage existed lack it: 0 there)
                stage: 1000 * sum(r.get(f"{stage}_s", 0.0) for r in rows) / max(rounds, 1) for stage in STAGES
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


def batch_walls(rows: list[dict], without: Sequence[str] = ()) -> dict[tuple, tuple[float, int]]:
    """Per batch (its `group` and repeat; a run without a group is a batch of its own), its wall
    seconds and tokens. A batch's wall time is its longest request's: the requests of one batch join
    together and finish apart (one whose trees were accepted, or that stopped at end-of-text, first).

    `without`: stages (`dart_worker.stats.STAGES`) whose seconds come off each request's wall time
    first. A request records every round it was live in, and the batch's drafting is done once a
    round for all of its live requests, so the longest request's stage seconds are the batch's.

    A batch decoded with continuous batching (records with `group_seconds`: requests joined as
    others finished) is timed whole, by its call's wall time; no request was live in all of its
    rounds, so it has no figure `without` stages (left out)."""
    out: dict[tuple, tuple[float, int]] = {}
    for r in rows:
        if without and "group_seconds" in r:
            continue
        group = r.get("group")
        key = ("group", group, r.get("repeat", 0)) if group is not None else ("run", *_run_key(r))
        seconds, tokens = out.get(key, (0.0, 0))
        own = r.get("group_seconds", r["seconds"]) - sum(r.get(f"{stage}_s", 0.0) for stage in without)
        out[key] = (max(seconds, own), tokens + r["tokens"])
    return out


def _paired_ratios(ar: dict[tuple, tuple[float, int]], mode: dict[tuple, tuple[float, int]]) -> list[float]:
    """Per batch that `ar` ran too: ar's seconds per token over the mode's (`batch_walls` of each)."""
    return [(ar[key][0] / ar[key][1]) / (seconds / tokens) for key, (seconds, tokens) in mode.items()
            if key in ar and tokens and seconds > 0 and ar[key][1]]


def _run_key(record: dict) -> tuple:
    return record["prompt"], record.get("repeat", 0)




def write_report(output: str | None, report: dict) -> None:
    """The benchmarks' JSON report at `output` (a local path; nothing when None)."""
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=1))
        print(f"wrote {output}")




def machine_conditions(threads: int) -> dict[str, Any]:
    """Where the figures were measured; load averages show how shared the machine was."""
    import torch
    import transformers

    cpu = cpu_model_name()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "cpu": cpu,
        "cpus_visible": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "threads": threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": commit,
    }
