"""What a verify forward costs: one latency curve per batch size and logits path, and the shapes it runs.

Batch shapes differ in more than their row count: attention reads one cache per sequence and a
tree row costs its sequence's context, so a curve of batch 1 misprices rows at batch 16 and the
other way round. The curves of the batch sizes a worker runs are measured at start-up
(`dart_worker.calibration`); the others are learnt online from the rounds, starting from the
nearest one. How many rows a forward runs depends on the verify block's shapes: bucketed, a tree
size costs its bucket's rows and a batch its bucket's sequences; exact, only the real rows
(packed). `VerifyCosts` is the tree sizer's half that knows all this (`TreeSizer` extends it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dart_worker.sizing.latency import LatencyModel


@dataclass
class VerifyCosts:
    """Seconds of verify forwards by batch size, rows and logits path, kept current online."""

    latency: LatencyModel  # the calibration at batch 1 (dart_worker.calibration)
    # Per live batch size, its verify cost curve: measured at start-up for the batch sizes the
    # worker runs (calibrated), learnt online from its rounds for the others.
    _latency_by_batch: dict[int, LatencyModel] = field(default_factory=dict)
    # The same for forwards that project every row to the vocabulary (`full_logits` rounds: sampled
    # rows, penalties, logprobs, whose verification reads every node's distribution), where a tree
    # row costs its vocabulary projection on top (with a large vocabulary more than the rest of a
    # row). None: the engine never defers, and `_latency_by_batch` measures those forwards already.
    _full_logits_latency_by_batch: dict[int, LatencyModel] | None = None
    # Bucketed verify shapes (`dart_worker.target.shape_buckets`): rows per sequence -> the rows the
    # forward actually runs, so a size is priced at its bucket's cost. None: exact shapes.
    rows_bucket: Callable[[np.ndarray], np.ndarray] | None = None
    # Bucketed verify shapes: live sequences -> the sequences the forward runs (padding included,
    # `DecodingEngine.forward_batch`), whose curve prices and learns the round. None: exact shapes.
    batch_bucket: Callable[[int], int] | None = None
    # Exact shapes: a verify forward runs only its real rows (roots and nodes, packed:
    # `TargetAdapter.verify`'s `packed`), so a block of unequal trees costs its real rows, not
    # B x (1 + N): the curves are then curves of real rows, priced and learnt by them (on a CPU
    # without matrix units a padding row costs as much as a real one). False: bucketed shapes,
    # priced at the padded block's rows.
    packed: bool = False

    def latency_for(self, batch: int, full_logits: bool = False) -> LatencyModel:
        """The verify cost curve of forwards over `batch` sequences (`full_logits`: of forwards that
        project every row to the vocabulary). Until a batch size has its own curve, the nearest one
        (in log batch size) stands in."""
        curves = self._curves(full_logits)
        curve = curves.get(batch)
        if curve is not None:
            return curve
        known = [*curves, 1]
        nearest = min(known, key=lambda b: (abs(np.log(b / batch)), b))
        return curves.get(nearest, self.latency)

    def _curves(self, full_logits: bool) -> dict[int, LatencyModel]:
        if full_logits and self._full_logits_latency_by_batch is not None:
            return self._full_logits_latency_by_batch
        return self._latency_by_batch

    def _forward_batch(self, live: int) -> int:
        """Sequences the verify forward of `live` live ones runs (its batch bucket, when bucketed)."""
        return live if self.batch_bucket is None else self.batch_bucket(live)

    def _verify_seconds(self, forward: int, rows: np.ndarray, real: np.ndarray, full_logits: bool) -> np.ndarray:
        """Seconds of verify forwards over `forward` sequences and `rows` rows in all, `real` of
        them roots or nodes (the others padding): the curve's at the rows the forward runs, its
        real ones where it runs them packed (`packed`)."""
        return self.latency_for(forward, full_logits).predict(real if self.packed else rows)

    def _plain_seconds(self, live: int, full_logits: bool) -> float:
        """The verify forward of a plain step of `live` sequences (one row each)."""
        forward = self._forward_batch(live)
        return float(self.latency_for(forward, full_logits).predict(np.array([forward]))[0])

    def learn_forward(self, live: int, rows: int, real_rows: int | None, seconds: float, full_logits: bool) -> None:
        """One verify forward of `live` sequences took `seconds`: `rows` rows, `real_rows` of them
        roots or nodes (None: all). It moves the curve of its batch size and logits path at the rows
        it ran (its real ones where it runs them packed); a batch size without a curve gets a copy
        of the nearest one, its level set by this forward and its shape kept until forwards of
        other sizes correct it."""
        if self.packed and real_rows is not None:  # the rows the forward ran
            rows = real_rows
        batch = self._forward_batch(live)
        curves = self._curves(full_logits)
        curve = curves.get(batch)
        if curve is None:
            curve = curves[batch] = copy.deepcopy(self.latency_for(batch, full_logits))
            curve.rescale(rows, seconds)
        else:
            curve.update(rows, seconds)

    def calibration_line(self, max_budget: int) -> str:
        """One line for a worker's log: the measured forward costs and where trees stop paying
        double (the most nodes, up to `max_budget`, one sequence's tree can carry for under two
        plain steps)."""
        shown = ", ".join(f"{r}: {float(self.latency.predict(r)) * 1e3:.0f}" for r in (1, 16, 64, 256))
        one = float(self.latency.predict(1))
        sizes = np.arange(max_budget + 1)
        cheap = int(sizes[self.latency.predict(1 + sizes) <= 2 * one].max(initial=0))
        return (f"verify forward ms by rows {{{shown}}} (grid up to {int(self.latency.rows[-1])}, linear beyond); "
                f"trees up to {max_budget} nodes, at most {cheap} for under two plain steps at batch 1")

    def describe_latency(self) -> dict:
        return {"latency_ms_by_rows": self.latency.describe(),
                "latency_ms_by_batch_and_rows": {b: c.describe() for b, c in sorted(self._latency_by_batch.items())},
                "latency_ms_by_batch_and_rows_full_logits": {
                    b: c.describe() for b, c in sorted((self._full_logits_latency_by_batch or {}).items())}}
