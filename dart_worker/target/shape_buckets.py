"""Bucketed shapes for the verify forward (the `shapes` kernel strategy, `dart_worker.hardware.kernels`).

A CUDA graph replays one captured shape; a verify block whose batch (live sequences), rows (1 +
tree size per sequence) and cached context change every round can never be replayed. With
`bucketed` shapes all three are rounded up to a small set of sizes, so a worker sees a few dozen
distinct forwards in a job:

- sequences: 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, ... capped at the engine's `max_live`
  (`batch_bucket`: the rows' family; under continuous batching a job's tail shrinks the live
  batch one finished sequence at a time, and without buckets every size would be a new shape);
- rows per sequence: 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, ... (`rows_bucket`: powers of two, with
  1.5x steps from 8 on, so padding never exceeds half the real rows; the calibration's grid of
  1, 2, 4, ... rows per sequence lands on buckets, so its curve prices bucketed forwards);
- cached context slots: 64, 96, 128, 192, 256, 384, ... (`context_bucket`: the same 1.5x steps).

Padding changes no result: padding rows (`TreeBatch(pad_to=...)`) attend only to themselves and
no real row attends to them, padded context slots lie past every sequence's length and are masked
out, and both are dropped when the round commits its accepted rows. Padding sequences
(`TargetState.resize_batch`) come after the live ones and hold no context (length 0: the cache
rows they occupy, a finished sequence's or zeros, are never read); each round they verify a
root-only tree of `PADDING_TOKEN`, commit nothing, and only the live sequences' outputs are read
(the drafter and the tree sizer's acceptance never see them). Joiners take their rows first.
"""

from __future__ import annotations

import numpy as np

MIN_CONTEXT_BUCKET = 64
PADDING_TOKEN = 0  # the root token of a padding sequence's tree (any id: nothing reads its outputs)


def _bucket(n: int, floor: int) -> int:
    """The smallest of floor, 2^k and 1.5 x 2^k (2^k >= 8) that is >= n."""
    if n <= floor:
        return floor
    power = 1 << (int(n) - 1).bit_length()  # smallest power of two >= n
    middle = power // 4 * 3  # 1.5 x the power below
    return middle if power >= 16 and n <= middle else power


def rows_bucket(rows: int) -> int:
    """Verify rows per sequence (1 + tree size) rounded up to its bucket."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    return _bucket(int(rows), 1)


def rows_buckets(rows: np.ndarray) -> np.ndarray:
    """`rows_bucket` of every entry (the tree sizer prices whole arrays of sizes)."""
    return np.array([rows_bucket(int(r)) for r in np.asarray(rows).reshape(-1)],
                    dtype=np.int64).reshape(np.shape(rows))


def batch_bucket(batch: int, max_live: int | None = None) -> int:
    """Sequences a bucketed verify forward runs for `batch` live ones: their bucket, but never more
    than `max_live` (the engine's slots: padding past them would cost a forward more sequences
    than a full batch, and a cache more rows than its memory bound, `dart_worker.target.kv_budget`)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    bucket = _bucket(int(batch), 1)
    return bucket if max_live is None else max(int(batch), min(bucket, int(max_live)))


def context_bucket(slots: int) -> int:
    """Cached context slots rounded up to their bucket (0 stays 0: a cache not yet filled)."""
    return 0 if slots <= 0 else _bucket(int(slots), MIN_CONTEXT_BUCKET)
