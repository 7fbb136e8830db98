"""Verify-forward cost by batch shape: `python -m jobs.bench verify_shapes [key=value ...]`.

The cost model (dart_worker/sizing/verify_costs.py) keeps one latency curve per live batch size because
rows cost differently in different shapes: one sequence carrying a 17-row tree is not 16
sequences carrying 2 rows each, although both are "more rows". This prints, for each batch size,
the milliseconds of one `TargetAdapter.verify` forward (deferred logits, one row projected per
sequence, as a greedy round does) with 1, 2, 3, 5, 9, 17 rows per sequence after a `context`-token
prompt: the fastest of `passes` after a warm-up. Then, side by side in the same run, the vocabulary
projection of 1, 4, 16 rows through the model's own head module and through
`TargetAdapter.logits_at` (which picks the faster orientation on a CPU), and the same for a
`draft_vocab`-wide head of the draft head's shape (random weights; its read-out projects D rows per
sequence). Last, the KV cache: transformers' `DynamicCache` against `kv_cache.GrowingCache`, two
states side by side, `cache_steps` one-row decoding steps (verify + commit) alternating between
them, median ms per step, and whether their logits were identical. Keys: target, dtype, device,
threads, context, passes, batch_sizes, rows_per_sequence, max_rows (skip shapes above it),
projection_rows, draft_vocab, cache_batch_sizes, cache_steps, gqa_batch_sizes, gqa_rows_per_sequence,
output. `target=random:<shape>` times a random-weight model of a shape in dart_worker.artifacts.random_models.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from dart_bench.common import write_report
from dart_worker.artifacts.random_models import random_model
from dart_worker.defaults import DEFAULT_DTYPE
from dart_worker.engine_factory import EngineParts, load_engine_parts
from dart_worker.hardware.device import configure_cpu_threads, resolve_device, resolve_dtype
from dart_worker.hardware.kernels import GQAS, forced
from dart_worker.target.adapter import TargetAdapter
from dart_worker.target.kv_cache import GrowingCache
from dart_worker.target.projection import project
from dart_worker.target.target_state import TargetState


@dataclass
class ShapesConfig:
    target: str = "default"
    dtype: str = DEFAULT_DTYPE
    device: str = "auto"
    threads: int | None = None
    context: int = 300
    passes: int = 3
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    rows_per_sequence: list[int] = field(default_factory=lambda: [1, 2, 3, 5, 9, 17])
    max_rows: int = 160
    projection_rows: list[int] = field(default_factory=lambda: [1, 4, 16])
    draft_vocab: int = 16384
    cache_batch_sizes: list[int] = field(default_factory=lambda: [1, 16])
    cache_steps: int = 30
    # The `gqa` strategies of masked tree attention side by side (dart_worker.target.tree_attention):
    # verify ms per strategy, batch size and rows per sequence, strategies interleaved per pass.
    gqa_batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    gqa_rows_per_sequence: list[int] = field(default_factory=lambda: [1, 5, 17])
    output: str | None = None


def verify_ms(target: TargetAdapter, batch: int, rows: int, context: int, passes: int, seed: int = 0) -> float:
    """Fastest of `passes` verify forwards of `batch` sequences x `rows` chain rows (ms)."""
    generator = torch.Generator().manual_seed(seed)
    device = target.device
    state = target.new_state(batch)
    target.prefill(state, [torch.randint(0, target.vocab_size, (context,), generator=generator).tolist()
                           for _ in range(batch)])
    depth = torch.arange(rows, device=device)[None].expand(batch, -1)
    ancestor = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()[None].expand(batch, -1, -1)
    times = []
    for _ in range(passes + 1):  # the first is a warm-up
        tokens = torch.randint(0, target.vocab_size, (batch, rows), generator=generator).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = target.verify(state, tokens, depth, ancestor, defer_logits=True)
        target.logits_at(out.hidden[:, :1])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        target.commit(state, context, [[] for _ in range(batch)])  # drop the block again
    return min(times[1:]) * 1e3


def _synchronized_now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _fastest_ms(run, passes: int, device: torch.device) -> float:
    times = []
    for _ in range(passes + 1):  # the first is a warm-up
        start = _synchronized_now(device)
        run()
        times.append(_synchronized_now(device) - start)
    return min(times[1:]) * 1e3


@torch.no_grad()
def projection_table(target: TargetAdapter, cfg: ShapesConfig) -> dict[str, dict[int, dict[str, float]]]:
    """Per head and row count: ms of the head module itself and through `projection.project` (the
    target's via `logits_at`) on the same random rows."""
    heads = {"target": (target.model.get_output_embeddings(), target.logits_at)}
    if cfg.draft_vocab:
        draft = torch.nn.Linear(target.hidden_size, cfg.draft_vocab, bias=False).to(target.device, target.dtype)
        heads["draft"] = (draft, lambda h, d=draft: project(h, d))
    table: dict[str, dict[int, dict[str, float]]] = {}
    for name, (module, projected) in heads.items():
        table[name] = {}
        for rows in cfg.projection_rows:
            hidden = torch.randn(rows, target.hidden_size, dtype=target.dtype, device=target.device)
            ways = {"module": lambda h=hidden, m=module: m(h), "project": lambda h=hidden, f=projected: f(h)}
            table[name][rows] = {way: _fastest_ms(run, cfg.passes, target.device) for way, run in ways.items()}
    return table


@torch.no_grad()
def cache_table(target: TargetAdapter, cfg: ShapesConfig) -> dict[int, dict[str, float | bool]]:
    """Per batch size: median ms of a one-row step (verify + commit) on a `DynamicCache` and on a
    `GrowingCache`, steps alternating between the two states, and whether all logits matched."""
    table: dict[int, dict[str, float | bool]] = {}
    device = target.device
    for batch in cfg.cache_batch_sizes:
        generator = torch.Generator().manual_seed(batch)
        prompt = torch.randint(0, target.vocab_size, (cfg.context,), generator=generator).tolist()
        states = {}
        for name, cache in (("dynamic", DynamicCache()), ("growing", GrowingCache())):
            states[name] = TargetState(cache, torch.zeros(batch, dtype=torch.long, device=device))
            target.prefill(states[name], [prompt] * batch)  # equal lengths: one block, this cache
        depth = torch.zeros(batch, 1, dtype=torch.long, device=device)
        ancestor = torch.ones(batch, 1, 1, dtype=torch.bool, device=device)
        times: dict[str, list[float]] = {name: [] for name in states}
        identical = True
        for step in range(cfg.cache_steps):
            tokens = torch.randint(0, target.vocab_size, (batch, 1), generator=generator).to(device)
            logits = {}
            for name in (("dynamic", "growing") if step % 2 else ("growing", "dynamic")):
                state = states[name]
                started = _synchronized_now(device)
                block_start = state.cache_len()
                logits[name] = target.verify(state, tokens, depth, ancestor).logits
                target.commit(state, block_start, [[0]] * batch)
                times[name].append((_synchronized_now(device) - started) * 1e3)
            identical = identical and torch.equal(logits["dynamic"], logits["growing"])
        table[batch] = {name: round(statistics.median(t), 1) for name, t in times.items()} | {"identical": identical}
    return table


def gqa_table(target: TargetAdapter, cfg: ShapesConfig) -> dict[str, dict[int, dict[int, float]]]:
    """Per `gqa` strategy, batch size and rows per sequence: the fastest verify ms over `passes`
    rounds in which every strategy runs once, in rotating order (load hits all alike)."""
    table: dict[str, dict[int, dict[int, float]]] = {g: {} for g in GQAS}
    for batch in cfg.gqa_batch_sizes:
        for rows in cfg.gqa_rows_per_sequence:
            if batch * rows > cfg.max_rows:
                continue
            best = dict.fromkeys(GQAS, float("inf"))
            for k in range(cfg.passes):
                for gqa in GQAS[k % len(GQAS):] + GQAS[: k % len(GQAS)]:
                    with forced(gqa=gqa):
                        best[gqa] = min(best[gqa], verify_ms(target, batch, rows, cfg.context, 1, seed=k))
            for gqa, ms in best.items():
                table[gqa].setdefault(batch, {})[rows] = round(ms, 2)
    return table


def shape_table(target: TargetAdapter, cfg: ShapesConfig) -> dict[int, dict[int, float]]:
    return {b: {n: round(verify_ms(target, b, n, cfg.context, cfg.passes), 1)
                for n in cfg.rows_per_sequence if b * n <= cfg.max_rows}
            for b in cfg.batch_sizes}


def main(argv: list[str] | None = None) -> dict:
    cfg: ShapesConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ShapesConfig),
                                                            OmegaConf.from_cli(argv)))
    if cfg.threads:
        configure_cpu_threads(cfg.threads)
    if cfg.target.startswith("random:"):  # a random-weight model of a named shape (dart_worker.artifacts.random_models)
        device = resolve_device(cfg.device)
        model = random_model(cfg.target.removeprefix("random:"), device=device, dtype=resolve_dtype(cfg.dtype, device))
        parts = EngineParts(target=TargetAdapter(model))
    else:
        parts = load_engine_parts(cfg.target, dtype=cfg.dtype, device=cfg.device)
    table = shape_table(parts.target, cfg)
    print(f"verify ms by rows per sequence, {cfg.context}-token context, {parts.target.dtype} on {parts.target.device}")
    for batch, row in table.items():
        print(f"batch {batch:3d}: " + "  ".join(f"{n} rows {ms:.1f}" for n, ms in row.items()))
    projection = projection_table(parts.target, cfg)
    for name, rows in projection.items():
        print(f"{name} vocabulary projection ms by rows: " + "  ".join(
            f"{n} rows module {t['module']:.1f} / project {t['project']:.1f}" for n, t in rows.items()))
    gqa = gqa_table(parts.target, cfg)
    for strategy, rows in gqa.items():
        print(f"gqa {strategy:<10} verify ms: " + "  ".join(
            f"B{b}x{n} {ms:.1f}" for b, by_rows in rows.items() for n, ms in by_rows.items()))
    caches = cache_table(parts.target, cfg)
    print(f"one-row step ms (verify + commit), steps alternating, median of {cfg.cache_steps}: " + "  ".join(
        f"batch {b} DynamicCache {t['dynamic']} / GrowingCache {t['growing']} (logits identical: {t['identical']})"
        for b, t in caches.items()))
    report = {"config": asdict(cfg), "ms_by_batch_and_rows_per_sequence": {str(b): r for b, r in table.items()},
              "projection_ms_by_head_and_rows": {h: {str(n): t for n, t in r.items()} for h, r in projection.items()},
              "cache_step_ms_by_batch": {str(b): t for b, t in caches.items()},
              "verify_ms_by_gqa_batch_and_rows": {g: {str(b): r for b, r in t.items()} for g, t in gqa.items()}}
    write_report(cfg.output, report)
    return report
