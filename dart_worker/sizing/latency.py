"""What a verify forward costs: a piecewise-linear curve of its rows, measured and kept current.

The curve of one batch size and logits path (`dart_worker.calibration` measures it at start-up;
the sizer refines it online from every round it runs, `TreeSizer.observe`).
"""

from __future__ import annotations

import numpy as np

LATENCY_STEP = 0.3  # weight of one observation in the online latency refinement


class LatencyModel:
    """Seconds of a verify forward as a piecewise-linear function of its rows, kept current online."""

    def __init__(self, rows: list[int], seconds: list[float]):
        if len(rows) < 2 or sorted(set(rows)) != list(rows):
            raise ValueError(f"need >= 2 increasing grid rows, got {rows}")
        self.rows = np.asarray(rows, dtype=np.float64)
        self.seconds = np.maximum(np.asarray(seconds, dtype=np.float64), 1e-6)
        self._make_consistent()

    def _make_consistent(self) -> None:
        """More rows never cost less, and never more per row: a forward over R rows costs at most
        what R/r forwards over r < R rows would (batched matrix products amortise, they do not
        get dearer per row). The second bound caps a size that one burst of load made look dear,
        which the sizer would otherwise avoid for good and never observe again."""
        self.seconds = np.maximum.accumulate(self.seconds)
        per_row = np.minimum.accumulate(self.seconds / self.rows)
        self.seconds = np.minimum(self.seconds, per_row * self.rows)

    def predict(self, rows: float | np.ndarray) -> np.ndarray:
        """Seconds for `rows` (array-friendly); linear beyond the grid along its last segment."""
        r = np.asarray(rows, dtype=np.float64)
        inside = np.interp(r, self.rows, self.seconds)
        slope = max(0.0, (self.seconds[-1] - self.seconds[-2]) / (self.rows[-1] - self.rows[-2]))
        return np.where(r > self.rows[-1], self.seconds[-1] + slope * (r - self.rows[-1]), inside)

    def update(self, rows: int, seconds: float) -> None:
        """Move the grid points around `rows` toward one observed forward (multiplicatively, each by
        its interpolation weight), so drifts (longer contexts, a busy machine) are followed."""
        if seconds <= 0:
            return
        ratio = min(3.0, max(1 / 3, seconds / float(self.predict(rows))))
        upper = int(np.searchsorted(self.rows, rows))
        if upper == 0:
            weights = {0: 1.0}
        elif upper >= len(self.rows):
            weights = {len(self.rows) - 1: 1.0}
        else:
            lo, hi = self.rows[upper - 1], self.rows[upper]
            w = (rows - lo) / (hi - lo)
            weights = {upper - 1: 1.0 - w, upper: w}
        for i, w in weights.items():
            self.seconds[i] *= ratio ** (LATENCY_STEP * w)
        # Keep the curve non-decreasing (more rows never cost less), moving the other points
        # the way the observation pushed: a cheaper forward than thought lowers smaller sizes too.
        if ratio < 1:
            self.seconds = np.minimum.accumulate(self.seconds[::-1])[::-1]
        self._make_consistent()

    def rescale(self, rows: int, seconds: float) -> None:
        """Scale the whole curve so that it passes through one observed forward: its level from
        the observation, its shape (what more rows cost relative to fewer) kept."""
        if seconds > 0:
            self.seconds = self.seconds * (seconds / float(self.predict(rows)))

    def describe(self) -> dict[int, float]:
        return {int(r): round(float(s) * 1e3, 2) for r, s in zip(self.rows, self.seconds)}

