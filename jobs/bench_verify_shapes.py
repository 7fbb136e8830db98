"""Verify-forward cost by batch shape: `python -m jobs.bench_verify_shapes [key=value ...]`.

The cost model (dart_worker/cost_model.py) keeps one latency curve per live batch size because
rows cost differently in different shapes: one sequence carrying a 17-row tree is not 16
sequences carrying 2 rows each, although both are "more rows". This prints, for each batch size,
the milliseconds of one `TargetAdapter.verify` forward (deferred logits, one row projected per
sequence, as a greedy round does) with 1, 2, 3, 5, 9, 17 rows per sequence after a `context`-token
prompt: the fastest of `passes` after a warm-up. Then, side by side in the same run, the vocabulary
projection of 1, 4, 16 rows through the model's own head module and through
`TargetAdapter.logits_at` (which picks the faster orientation on a CPU). Keys: target, dtype,
device, threads, context, passes, batch_sizes, rows_per_sequence, max_rows (skip shapes above it),
projection_rows, output.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from omegaconf import OmegaConf

from dart_worker.device import configure_cpu_threads
from dart_worker.engine_factory import load_engine_parts
from dart_worker.target import TargetAdapter
from jobs.bench_engine import write_report


@dataclass
class ShapesConfig:
    target: str = "default"
    dtype: str = "auto"
    device: str = "auto"
    threads: int | None = None
    context: int = 300
    passes: int = 3
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    rows_per_sequence: list[int] = field(default_factory=lambda: [1, 2, 3, 5, 9, 17])
    max_rows: int = 160
    projection_rows: list[int] = field(default_factory=lambda: [1, 4, 16])
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


def _fastest_ms(run, passes: int, device: torch.device) -> float:
    times = []
    for _ in range(passes + 1):  # the first is a warm-up
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times[1:]) * 1e3


@torch.no_grad()
def projection_table(target: TargetAdapter, cfg: ShapesConfig) -> dict[int, dict[str, float]]:
    """Per row count: ms of the head module itself and of `logits_at` on the same random rows."""
    head, table = target.model.get_output_embeddings(), {}
    for rows in cfg.projection_rows:
        hidden = torch.randn(rows, target.hidden_size, dtype=target.dtype, device=target.device)
        ways = {"module": lambda h=hidden: head(h), "logits_at": lambda h=hidden: target.logits_at(h)}
        table[rows] = {name: _fastest_ms(run, cfg.passes, target.device) for name, run in ways.items()}
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
    parts = load_engine_parts(cfg.target, dtype=cfg.dtype, device=cfg.device)
    table = shape_table(parts.target, cfg)
    print(f"verify ms by rows per sequence, {cfg.context}-token context, {parts.target.dtype} on {parts.target.device}")
    for batch, row in table.items():
        print(f"batch {batch:3d}: " + "  ".join(f"{n} rows {ms:.1f}" for n, ms in row.items()))
    projection = projection_table(parts.target, cfg)
    print("vocabulary projection ms by rows: " + "  ".join(
        f"{n} rows module {t['module']:.1f} / logits_at {t['logits_at']:.1f}" for n, t in projection.items()))
    report = {"config": asdict(cfg), "ms_by_batch_and_rows_per_sequence": {str(b): r for b, r in table.items()},
              "projection_ms_by_rows": {str(n): t for n, t in projection.items()}}
    write_report(cfg.output, report)
    return report


if __name__ == "__main__":
    main()
