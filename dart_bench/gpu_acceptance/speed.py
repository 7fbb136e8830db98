"""Timing at real shapes with random weights: what a round costs on the device under test.

Speed needs no trained weights: a model built from a published config with random weights costs
what the trained one costs per forward (acceptance rates are the one thing random weights cannot
show, so nothing here reports them as figures of merit). Per model shape:

- `ar` per-token time of this engine against transformers' `generate`, batch 1;
- the verify forward over 1..64 tree rows per sequence at several batch sizes, logits computed the
  way the engine computes them on this device (`dart_worker.hardware.kernels`);
- the same for each way of running masked attention over grouped K/V heads (`gqa` strategies);
- the draft head and the tree build per round (`dart`, `dart_lookup`), timed with a synchronise at
  every stage boundary;
- device-to-host synchronisations per round, counted (`dart_worker.hardware.sync_counter`) as the difference
  between a short and a long generation, so prefill and admission cancel out;
- peak device memory; and throughput of `ar` and `dart_lookup` (cost-model sizing) at a large batch.

Each measurement yields its cells one at a time (`dart_bench.gpu_acceptance.runner` writes the
report after each), and `ShapeBench` builds a shape's model once for all of its sections and
releases it after the last one, so the run can order sections by value across shapes
(`dart_bench.gpu_acceptance.plan`).
"""

from __future__ import annotations

import gc
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dart_bench.gpu_acceptance.runner import SkipSection
from dart_worker.artifacts.random_models import random_model
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.hardware.kernels import GQAS, describe, forced, logits_for
from dart_worker.hardware.sync_counter import SyncCounter
from dart_worker.head.draft_head import DartDraftHead
from dart_worker.sampling.params import SamplingParams
from dart_worker.target.adapter import TargetAdapter
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
                 repeats: int) -> Iterator[dict[str, float]]:
    """ms per generated token at batch 1: this engine's `ar` and transformers' `generate`, same prompt."""
    prompt = random_prompts(1, context, parts.target.vocab_size, seed=1)[0]
    engine = build_engine(parts, "ar")
    ours = median_seconds(lambda: engine.generate([prompt], greedy(new_tokens)), device, repeats)
    ids = torch.tensor([prompt], device=device)
    theirs = median_seconds(lambda: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                   do_sample=False, pad_token_id=0), device, repeats)
    yield {"ar_ms_per_token": 1e3 * ours / new_tokens, "transformers_ms_per_token": 1e3 * theirs / new_tokens,
           "ar_vs_transformers": theirs / ours}


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc)


def free_device_memory(device: torch.device) -> None:
    """What an out-of-memory error left behind, given back (the failed step's tensors are
    garbage once its frames are gone)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.no_grad()
def verify_grid(target: TargetAdapter, device: torch.device, batches: Sequence[int], rows: Sequence[int],
                context: int, repeats: int) -> Iterator[dict[str, Any]]:
    """ms of one verify forward (with the logits the engine would compute) per batch x rows. A
    batch that runs out of device memory yields one cell saying so, and the grid goes on."""
    deferred = logits_for(device, target.deferred_logits_pay) == "deferred"
    for batch in batches:
        cells, failure = [], None
        try:
            cells = _verify_batch(target, device, batch, rows, context, repeats, deferred)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise
            failure = {"batch": batch, "rows": None, "error": f"out of memory: {' '.join(str(exc).split())[:160]}"}
        if failure is not None:
            free_device_memory(device)
            yield failure
        else:
            yield from cells


def _verify_batch(target: TargetAdapter, device: torch.device, batch: int, rows: Sequence[int], context: int,
                  repeats: int, deferred: bool) -> list[dict[str, Any]]:
    state = target.new_state(batch)
    target.prefill(state, random_prompts(batch, context, target.vocab_size, seed=batch))
    base, cells = None, []
    for n in rows:
        tokens = torch.randint(3, target.vocab_size, (batch, n), device=device)
        depth = torch.arange(n, device=device)[None].expand(batch, -1)
        ancestor = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None].expand(batch, -1, -1)

        def verify(state=state, tokens=tokens, depth=depth, ancestor=ancestor):
            out = target.verify(state, tokens, depth, ancestor, defer_logits=deferred)
            if deferred:  # a greedy walk projects at least the root row of every sequence
                target.logits_at(out.hidden[:, :1])

        def drop_block(state=state):
            target.commit(state, context, [[] for _ in range(batch)])

        seconds = median_seconds(verify, device, repeats, after=drop_block)
        base = base or seconds
        cells.append({"batch": batch, "rows": n, "ms": 1e3 * seconds, "vs_one_row": seconds / base})
    return cells


def gqa_grid(target: TargetAdapter, device: torch.device, batches: Sequence[int], rows: Sequence[int],
             context: int, repeats: int) -> Iterator[dict[str, Any]]:
    """The verify grid once per `gqa` strategy of masked tree attention (`dart_worker.target.tree_attention`):
    which one this device should use (`dart_worker.hardware.kernels.gqa_for`)."""
    for gqa in GQAS:
        with forced(gqa=gqa):
            cells = list(verify_grid(target, device, batches, rows, context, repeats))
        yield from ({"gqa": gqa, **cell} for cell in cells)


def drafting_ms(parts: EngineParts, device: torch.device, modes: Sequence[str], batches: Sequence[int],
                context: int, new_tokens: int, budget: int) -> Iterator[dict[str, Any]]:
    """Draft-head and tree-build ms per round, each stage synchronised (`sync_timing`)."""
    for mode in modes:
        engine = build_engine(parts, mode, TreeParams(budget=budget))
        engine.sync_timing = True
        for batch in batches:
            prompts = random_prompts(batch, context, parts.target.vocab_size, seed=7)
            engine.generate(prompts, greedy(4))  # warm-up
            results = engine.generate(prompts, greedy(new_tokens))
            rounds = max(r.stats.rounds for r in results)
            stages = results[0].stats.stage_seconds  # every live sequence is charged each stage's time
            yield {"mode": mode, "batch": batch, "rounds": rounds,
                   "draft_head_ms_per_round": 1e3 * stages["draft"] / rounds,
                   "tree_build_ms_per_round": 1e3 * stages["tree"] / rounds,
                   "verify_ms_per_round": 1e3 * stages["verify"] / rounds,
                   "mean_tree_size": float(np.mean([r.stats.mean_tree_size for r in results]))}


def syncs_per_round(parts: EngineParts, device: torch.device, modes: Sequence[str], batches: Sequence[int],
                    context: int, budget: int) -> Iterator[dict[str, Any]]:
    """Device-to-host syncs per decoding round: (syncs of a 24-token run - of an 8-token run) /
    (their rounds), so prefill and admission cancel out."""
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
            yield {"mode": mode, "batch": batch, "syncs_per_round": per_round,
                   "syncs_24_tokens": long, "rounds_24_tokens": long_rounds,
                   **({"by_op_24_tokens": by_op} if by_op else {})}


def throughput(parts: EngineParts, device: torch.device, modes: Sequence[str], batch: int, context: int,
               new_tokens: int, budget: int) -> Iterator[dict[str, Any]]:
    """Generated tokens/s of `batch` requests decoded together, trees sized by the cost model."""
    prompts = random_prompts(batch, context, parts.target.vocab_size, seed=13)
    for mode in modes:
        engine = build_engine(parts, mode, TreeParams(budget=budget), sizing="auto")
        engine.generate(prompts[:2], greedy(4))  # warm-up
        synchronize(device)
        start = time.perf_counter()
        results = engine.generate(prompts, greedy(new_tokens))
        synchronize(device)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.token_ids) for r in results)
        yield {"mode": mode, "batch": batch, "tokens_per_s": tokens / seconds,
               "mean_tree_size": float(np.mean([r.stats.mean_tree_size for r in results])),
               "tau": float(np.mean([r.stats.tau for r in results]))}


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: the process's peak RSS


# ---------------------------------------------------------------------------- one shape

MEASUREMENTS = ("per_token", "verify", "gqa", "drafting", "syncs", "throughput")


class ShapeBench:
    """One random-weight model of `shape`, built by the `build` section and shared by the shape's
    timing sections (`measure(name)`); `release()` drops it (after the shape's last section, so
    the next shape has the device's memory)."""

    def __init__(self, shape: str, device: torch.device, dtype: torch.dtype, cfg):
        self.shape, self.device, self.dtype, self.cfg = shape, device, dtype, cfg
        self.model = self.target = self.head = None
        self._parts: EngineParts | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    def build(self) -> Iterator[dict[str, Any]]:
        """The model, its adapter and a random draft head; yields what was built."""
        self.release()  # the previous shape's model is gone once its last section finished
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        started = time.perf_counter()
        model = random_model(self.shape, device=self.device, dtype=self.dtype)
        target = TargetAdapter(model)
        vocab = target.vocab_size
        self.head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=7, seed=0,
                                              kept_target_ids=range(min(vocab, DRAFT_VOCAB)), device=self.device,
                                              dtype=self.dtype)
        self.model, self.target = model, target
        yield {"shape": self.shape, "dtype": str(self.dtype).removeprefix("torch."),
               "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9,
               "kernels": describe(self.device, self.dtype), "build_s": time.perf_counter() - started}

    def drafting_parts(self) -> EngineParts:
        """Target, head and a Zipf trie over the target's vocabulary (built on first use)."""
        if self._parts is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="dart-acceptance-")
            trie = zipf_trie(self.target.vocab_size, Path(self._tmp.name) / "zipf.ngram")
            self._parts = EngineParts(target=self.target, head=self.head, trie=trie)
        return self._parts

    def measure(self, name: str) -> Iterator[dict[str, Any]]:
        """The cells of measurement `name` (one of MEASUREMENTS) on this shape's model."""
        if self.model is None:
            raise SkipSection(f"no model (speed/{self.shape}/build did not finish)")
        cfg, device, target = self.cfg, self.device, self.target
        if name == "per_token":
            return per_token_ms(self.model, EngineParts(target=target), device, cfg.context, cfg.generate_tokens,
                                cfg.repeats)
        if name == "verify":
            return verify_grid(target, device, cfg.verify_batches, cfg.verify_rows, cfg.context, cfg.repeats)
        if name == "gqa":
            return gqa_grid(target, device, cfg.gqa_batches, cfg.gqa_rows, cfg.context, cfg.repeats)
        if name == "drafting":
            return drafting_ms(self.drafting_parts(), device, ("dart", "dart_lookup"), cfg.drafting_batches,
                               cfg.context, cfg.drafting_tokens, cfg.budget)
        if name == "syncs":
            return syncs_per_round(self.drafting_parts(), device, ("ar", "dart", "dart_lookup"),
                                   cfg.drafting_batches, cfg.context, cfg.budget)
        if name == "throughput":
            return throughput(self.drafting_parts(), device, cfg.throughput_modes, cfg.throughput_batch,
                              cfg.context, cfg.generate_tokens, cfg.budget)
        raise ValueError(f"unknown measurement {name!r}; expected one of {MEASUREMENTS}")

    def release(self) -> None:
        self.model = self.target = self.head = self._parts = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        free_device_memory(self.device)
