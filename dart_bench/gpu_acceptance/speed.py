"""Timing at real shapes with random weights: what a round costs on the device under test.

Speed needs no trained weights: a model built from a published config with random weights costs
what the trained one costs per forward (acceptance rates are the one thing random weights cannot
show, so nothing here reports them as figures of merit). Per model shape:

- `ar` per-token time of this engine against transformers' `generate`, batch 1;
- the verify forward over 1..64 tree rows per sequence at several batch sizes, logits computed the
  way the engine computes them on this device (`dart_worker.kernels`);
- the same for each way of running masked attention over grouped K/V heads (`gqa` strategies);
- the draft head and the tree build per round (`dart`, `dart_lookup`), timed with a synchronise at
  every stage boundary;
- device-to-host synchronisations per round, counted (`dart_worker.sync_counter`) as the difference
  between a short and a long generation, so prefill and admission cancel out;
- peak device memory; and throughput of `ar` and `dart_lookup` (cost-model sizing) at a large batch.
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dart_worker.draft_head import DartDraftHead
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.kernels import GQAS, describe, forced, logits_for
from dart_worker.random_models import random_model
from dart_worker.sampling import SamplingParams
from dart_worker.sync_counter import SyncCounter
from dart_worker.target import TargetAdapter
from ngram_native import NgramTrie, TreeParams, build_trie

DRAFT_VOCAB = 32768  # the draft head's vocabulary: the target's first ids (DART's released heads use 32k)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run: Callable[[], Any], device: torch.device, repeats: int,
                   after: Callable[[], Any] | None = None) -> float:
    """Median wall seconds of `run` over `repeats` calls after one warm-up; `after` runs untimed
    after every call (to undo what `run` did)."""
    times = []
    for i in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
        if after is not None:
            after()
    return statistics.median(times)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=length).tolist() for _ in range(count)]


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)


def zipf_trie(vocab: int, path: Path, tokens: int = 400_000, seed: int = 0) -> NgramTrie:
    """A trie over Zipf-distributed token ids: the branching of natural text, no corpus needed."""
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.1, size=tokens) - 1) % vocab
    docs = np.array_split(ids.astype(np.int32), max(1, tokens // 500))
    build_trie(docs, path, order=3, vocab_size=vocab, tokenizer_fingerprint="random")
    return NgramTrie.open(path, verify=True)


# ---------------------------------------------------------------------------- the sections

def per_token_ms(model, parts: EngineParts, device: torch.device, context: int, new_tokens: int,
                 repeats: int) -> dict[str, float]:
    """ms per generated token at batch 1: this engine's `ar` and transformers' `generate`, same prompt."""
    prompt = random_prompts(1, context, parts.target.vocab_size, seed=1)[0]
    engine = build_engine(parts, "ar")
    ours = median_seconds(lambda: engine.generate([prompt], greedy(new_tokens)), device, repeats)
    ids = torch.tensor([prompt], device=device)
    theirs = median_seconds(lambda: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                   do_sample=False, pad_token_id=0), device, repeats)
    return {"ar_ms_per_token": 1e3 * ours / new_tokens, "transformers_ms_per_token": 1e3 * theirs / new_tokens,
            "ar_vs_transformers": theirs / ours}


@torch.no_grad()
def verify_grid(target: TargetAdapter, device: torch.device, batches: Sequence[int], rows: Sequence[int],
                context: int, repeats: int) -> list[dict[str, Any]]:
    """ms of one verify forward (with the logits the engine would compute) per batch x rows."""
    deferred = logits_for(device, target.deferred_logits_pay) == "deferred"
    cells = []
    for batch in batches:
        state = target.new_state(batch)
        target.prefill(state, random_prompts(batch, context, target.vocab_size, seed=batch))
        base = None
        for n in rows:
            tokens = torch.randint(3, target.vocab_size, (batch, n), device=device)
            depth = torch.arange(n, device=device)[None].expand(batch, -1)
            ancestor = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None].expand(batch, -1, -1)

            def verify(state=state, tokens=tokens, depth=depth, ancestor=ancestor):
                out = target.verify(state, tokens, depth, ancestor, defer_logits=deferred)
                if deferred:  # a greedy walk projects at least the root row of every sequence
                    target.logits_at(out.hidden[:, :1])

            def drop_block(state=state, batch=batch):
                target.commit(state, context, [[] for _ in range(batch)])

            seconds = median_seconds(verify, device, repeats, after=drop_block)
            base = base or seconds
            cells.append({"batch": batch, "rows": n, "ms": 1e3 * seconds, "vs_one_row": seconds / base})
    return cells


def gqa_grid(target: TargetAdapter, device: torch.device, batches: Sequence[int], rows: Sequence[int],
             context: int, repeats: int) -> list[dict[str, Any]]:
    """The verify grid once per `gqa` strategy of masked tree attention (`dart_worker.tree_attention`):
    which one this device should use (`dart_worker.kernels.gqa_for`)."""
    cells = []
    for gqa in GQAS:
        with forced(gqa=gqa):
            cells += [{"gqa": gqa, **cell} for cell in verify_grid(target, device, batches, rows, context, repeats)]
    return cells


def drafting_ms(parts: EngineParts, device: torch.device, modes: Sequence[str], batches: Sequence[int],
                context: int, new_tokens: int, budget: int) -> list[dict[str, Any]]:
    """Draft-head and tree-build ms per round, each stage synchronised (`sync_timing`)."""
    cells = []
    for mode in modes:
        engine = build_engine(parts, mode, TreeParams(budget=budget))
        engine.sync_timing = True
        for batch in batches:
            prompts = random_prompts(batch, context, parts.target.vocab_size, seed=7)
            engine.generate(prompts, greedy(4))  # warm-up
            results = engine.generate(prompts, greedy(new_tokens))
            rounds = max(r.stats.rounds for r in results)
            stages = results[0].stats.stage_seconds  # every live sequence is charged each stage's time
            cells.append({"mode": mode, "batch": batch, "rounds": rounds,
                          "draft_head_ms_per_round": 1e3 * stages["draft"] / rounds,
                          "tree_build_ms_per_round": 1e3 * stages["tree"] / rounds,
                          "verify_ms_per_round": 1e3 * stages["verify"] / rounds,
                          "mean_tree_size": float(np.mean([r.stats.mean_tree_size for r in results]))})
    return cells


def syncs_per_round(parts: EngineParts, device: torch.device, modes: Sequence[str], batches: Sequence[int],
                    context: int, budget: int) -> list[dict[str, Any]]:
    """Device-to-host syncs per decoding round: (syncs of a 24-token run - of an 8-token run) /
    (their rounds), so prefill and admission cancel out."""
    cells = []
    for mode in modes:
        engine = build_engine(parts, mode, TreeParams(budget=budget))
        for batch in batches:
            prompts = random_prompts(batch, context, parts.target.vocab_size, seed=11)
            engine.generate(prompts, greedy(4))  # warm-up (one-time measurements, lazy buffers)
            counted = []
            for tokens in (8, 24):
                with SyncCounter(device) as syncs:
                    results = engine.generate(prompts, greedy(tokens))
                counted.append((syncs.count, max(r.stats.rounds for r in results), dict(syncs.by_op)))
            (short, short_rounds, _), (long, long_rounds, by_op) = counted
            per_round = (long - short) / max(1, long_rounds - short_rounds)
            cells.append({"mode": mode, "batch": batch, "syncs_per_round": per_round,
                          "syncs_24_tokens": long, "rounds_24_tokens": long_rounds,
                          **({"by_op_24_tokens": by_op} if by_op else {})})
    return cells


def throughput(parts: EngineParts, device: torch.device, modes: Sequence[str], batch: int, context: int,
               new_tokens: int, budget: int) -> list[dict[str, Any]]:
    """Generated tokens/s of `batch` requests decoded together, trees sized by the cost model."""
    prompts = random_prompts(batch, context, parts.target.vocab_size, seed=13)
    cells = []
    for mode in modes:
        engine = build_engine(parts, mode, TreeParams(budget=budget), sizing="auto")
        engine.generate(prompts[:2], greedy(4))  # warm-up
        synchronize(device)
        start = time.perf_counter()
        results = engine.generate(prompts, greedy(new_tokens))
        synchronize(device)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.token_ids) for r in results)
        cells.append({"mode": mode, "batch": batch, "tokens_per_s": tokens / seconds,
                      "mean_tree_size": float(np.mean([r.stats.mean_tree_size for r in results])),
                      "tau": float(np.mean([r.stats.tau for r in results]))})
    return cells


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: the process's peak RSS


def run_shape(shape: str, device: torch.device, dtype: torch.dtype, cfg, deadline: float) -> dict[str, Any]:
    """Every timing section for one model shape; sections past `deadline` are skipped, not run."""
    if device.type == "cuda":  # the previous shape's model is gone once its run_shape returned
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    model = random_model(shape, device=device, dtype=dtype)
    target = TargetAdapter(model)
    vocab = target.vocab_size
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=7, seed=0,
                                     kept_target_ids=range(min(vocab, DRAFT_VOCAB)), device=device, dtype=dtype)
    out: dict[str, Any] = {"shape": shape, "dtype": str(dtype).removeprefix("torch."),
                           "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9,
                           "kernels": describe(device, dtype), "build_s": time.perf_counter() - started,
                           "skipped": []}
    with tempfile.TemporaryDirectory(prefix="dart-acceptance-") as tmp:
        parts = EngineParts(target=target, head=head, trie=zipf_trie(vocab, Path(tmp) / "zipf.ngram"))
        sections = {
            "per_token": lambda: per_token_ms(model, EngineParts(target=target), device, cfg.context,
                                              cfg.generate_tokens, cfg.repeats),
            "verify": lambda: verify_grid(target, device, cfg.verify_batches, cfg.verify_rows, cfg.context,
                                          cfg.repeats),
            "gqa": lambda: gqa_grid(target, device, cfg.gqa_batches, cfg.gqa_rows, cfg.context, cfg.repeats),
            "drafting": lambda: drafting_ms(parts, device, ("dart", "dart_lookup"), cfg.drafting_batches,
                                            cfg.context, cfg.drafting_tokens, cfg.budget),
            "syncs": lambda: syncs_per_round(parts, device, ("ar", "dart", "dart_lookup"), cfg.drafting_batches,
                                             cfg.context, cfg.budget),
            "throughput": lambda: throughput(parts, device, cfg.throughput_modes, cfg.throughput_batch,
                                             cfg.context, cfg.generate_tokens, cfg.budget),
        }
        for name, section in sections.items():
            if time.perf_counter() > deadline:
                out["skipped"].append(name)
                continue
            t0 = time.perf_counter()
            out[name] = section()
            out[f"{name}_s"] = round(time.perf_counter() - t0, 2)
    out["peak_memory_gib"] = peak_memory_gib(device)
    return out
