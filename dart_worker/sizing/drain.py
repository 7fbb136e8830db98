"""What a round's tokens are worth when the batch drains: it ends with its longest row.

When no request waits for a slot, every token is no longer worth the same: tokens of the row with
the most rounds left bring the end of the batch nearer, tokens of the others only free their
places sooner (`draining_outlook` builds the outlook, `Drain.saved_seconds` prices a tree size).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from scipy.special import ndtr

# Rows within this many rounds of the most rounds left are those the batch's last rounds run
# (their cost is what a round saved at the end is worth).
STRAGGLER_SLACK = 4
# `row_pace`: pseudo-rounds of one token each that a row's pace starts from.
PACE_PRIOR_ROUNDS = 4.0
# How uncertain a row's end is beyond this round, in rounds per square root of its rounds left
# (`Drain.spread`): later rounds accept more or fewer tokens than its pace says, so rows level now
# drift apart and any of them may end the batch. A row's tokens a round vary by about a token when
# its trees are verified, ~0.5-0.7 rounds at the paces of sampled rows (docs/benchmarks.md).
END_SPREAD = 0.5
# `Drain.expected_end` with spread: points of the grid its integral over the end's values runs on.
END_GRID = 64


class Drain(NamedTuple):
    """A draining batch's outlook (`draining_outlook`): what its rows' tokens this round save."""

    rounds: np.ndarray  # [B] each row's rounds left: tokens left over its pace
    paces: np.ndarray  # [B] each row's tokens per round (>= 1)
    end_round: float  # seconds of a round at the end, which runs the longest rows alone
    row: float  # seconds a place saves a round when a row finishes sooner (`draining_outlook`)
    # [B] standard deviation of each row's rounds left beyond this round (`END_SPREAD`); None: none
    spread: np.ndarray | None = None

    def saved_seconds(self, survival: np.ndarray) -> np.ndarray:
        """Expected seconds saved, per candidate size, by trees under which each row accepts at
        least j nodes with probability `survival` [B, sizes, D] (j = 1..D, `depth_survival`):
        every row's rounds saved free its place sooner, and the end comes earlier by the rounds
        the longest row after this round gained, a round at the end each (`expected_end`)."""
        gained = survival.sum(axis=2) / self.paces[:, None]
        # Against the end with no trees at all, on the same grid: with spread, the end expected
        # with no trees lies beyond the longest row's rounds (the max of blurred ends is above the
        # max of their centres), and two calls' grids differ by their trees' depths.
        ends = self.expected_end(np.concatenate([np.zeros_like(survival[:, :1]), survival], axis=1))
        nearer = ends[0] - ends[1:]
        return self.end_round * nearer + self.row * gained.sum(axis=0)

    def expected_end(self, survival: np.ndarray) -> np.ndarray:
        """Per candidate size, the expected rounds left of the longest row after this round:
        E[max_b (rounds_b - G_b / pace_b + e_b)], G_b the nodes row b accepts (P(G_b >= j):
        `survival`), e_b what its later rounds bring beyond its pace (normal, `spread`; none: 0).

        Rows level with the longest move the end only as far as the least of them gains, and the
        least of several chances is below the least of their expectations: two level rows, each
        accepting a node with probability 1/2, bring the end a quarter of a round nearer, not half.
        Priced at the least expectation, level rows bought big trees for an end that one row's
        miss kept where it was (docs/benchmarks.md).

        But level rows do not stay level: their later rounds accept more or fewer tokens than
        their paces say, and any of them may end up last. Without that spread, four rows at a
        sampled batch's start (all level: the same tokens left, no record yet) moved the end only
        when all four accepted, so every tree was worth a place's share alone; trees stayed cut,
        the rows stayed level, and the rows that ended the batch ran without the head's nodes that
        fixed 4-node trees gave them (issue #48, docs/benchmarks.md). With it, a level row's tokens
        move the end by its chance of being last, and a row far ahead by nothing."""
        if self.spread is None or not np.any(self.spread > 0):
            return self._expected_end_now(survival)
        return self._expected_end_spread(survival)

    def _expected_end_now(self, survival: np.ndarray) -> np.ndarray:
        """`expected_end` without spread, exactly: rows whose rounds left are below what the
        longest row keeps whatever it accepts (`floor`) cannot end the batch and are left out,
        which keeps this cheap."""
        _, sizes, depth = survival.shape
        reach = np.count_nonzero(survival.max(axis=1, initial=0.0) > 0, axis=1)  # the most nodes a row can accept
        floor = float((self.rounds - reach / self.paces).max())
        rivals = np.flatnonzero(self.rounds > floor + 1e-9)
        if rivals.size == 0:
            return np.full(sizes, floor)
        rounds, paces = self.rounds[rivals], self.paces[rivals]
        values = np.unique(np.concatenate([[floor], (rounds[:, None] - np.arange(depth + 1) / paces[:, None]).ravel()]))
        values = values[values >= floor - 1e-9]
        # P(row's end <= v) = P(G >= k), k = ceil((rounds - v) * pace); index 0: surely, D + 1: never.
        k = np.clip(np.ceil((rounds[:, None] - values[None, :]) * paces[:, None] - 1e-9), 0, depth + 1).astype(int)
        padded = np.concatenate([np.ones((len(rivals), sizes, 1)), survival[rivals],
                                 np.zeros((len(rivals), sizes, 1))], axis=2)
        at_most = np.take_along_axis(padded, np.broadcast_to(k[:, None, :], (len(rivals), sizes, len(values))), axis=2)
        cdf = at_most.prod(axis=0)  # [sizes, values]: P(the longest row's end <= v)
        return (np.diff(cdf, axis=1, prepend=0.0) * values).sum(axis=1)

    def _expected_end_spread(self, survival: np.ndarray) -> np.ndarray:
        """`expected_end` with spread: E[max] = lo + integral from lo of P(max > v) dv, on a grid
        of END_GRID points from below every row's likely end (lo) to above it. Each row's end is a
        mixture over its accepted count j of normals centred at rounds - j / pace, so its CDF on
        the grid is P(G = j) [sizes, j] times the normals' CDFs [j, grid], one matrix product."""
        _, sizes, depth = survival.shape
        sd = np.maximum(self.spread, 1e-6)
        centres = self.rounds[:, None] - np.arange(depth + 1) / self.paces[:, None]  # [B, D + 1]
        lo = float((centres[:, -1] - 6 * sd).max())  # the max is above any row's likely least
        hi = float((self.rounds + 6 * sd).max())
        rivals = self.rounds + 6 * sd > lo  # the others end below lo whatever happens: P(end <= v) = 1
        survival, centres, sd = survival[rivals], centres[rivals], sd[rivals]
        rows = len(sd)
        grid = np.linspace(lo, hi, END_GRID)
        # Bounds applied in place, not with np.clip, whose copies were most of a call at large batches
        # (docs/benchmarks.md, seventeenth session): the sizer calls this up to three times a round,
        # and a GPU round of a large batch is short.
        padded = np.concatenate([np.ones((rows, sizes, 1)), survival, np.zeros((rows, sizes, 1))], axis=2)
        exact = -np.diff(padded, axis=2)  # [B, sizes, D + 1]: P(G = j)
        np.maximum(exact, 0.0, out=exact)  # survival never rises with j: this only drops rounding
        normal = ndtr((grid[None, None, :] - centres[:, :, None]) / sd[:, None, None])  # [B, D + 1, grid]
        cdf = np.matmul(exact, normal).prod(axis=0)  # [sizes, grid]: P(max <= v)
        above = 1.0 - np.minimum(cdf, 1.0, out=cdf)
        return lo + ((above[:, 1:] + above[:, :-1]) / 2 * np.diff(grid)).sum(axis=1)


def draining_outlook(remaining: list[int] | None, batch: int, plain_seconds: Callable[[int], float],
                     overhead: float, paces: list[float] | None = None) -> Drain | None:
    """What a round's tokens are worth in a batch of `batch` rows that drains (`remaining`: each
    row's tokens left; None: rows wait to take a finished row's slot, every token is worth the
    same, and this returns None). `paces`: each row's tokens per round so far (`row_pace`;
    None: 1 each), so a row's rounds left are its tokens left over its pace. `plain_seconds(k)`:
    the verify forward of a plain step of k rows; `overhead`: a round's time outside it.

    A draining batch ends with its longest row, the one with the most rounds left, and tokens
    are worth the seconds they save (`Drain.saved_seconds`): tokens of the longest row bring the
    end nearer, a round at the end each (its k longest rows alone); tokens of any row free its
    place in later rounds sooner (a place: its share of the round's time outside the forward,
    sampling and committing its row). Tokens of a row level with the longest bring the end nearer
    by that row's chance of ending the batch: each row's rounds left are uncertain by END_SPREAD
    x sqrt(rounds left) (`Drain.spread`, `Drain.expected_end`).

    A place's share of the forward is one row, which is what the tree node that frees it costs
    (packed) or less than that (bucketed), so a node of a row that does not end the batch nets
    at most that place's share of the time outside the forward: only that is counted. Priced
    at the forward's share too, the nodes a table was too hopeful about lost more than the rest
    saved, and sampled batches ran slower than with no trees at all (docs/benchmarks.md)."""
    if remaining is None or len(remaining) < 2:
        return None
    pace = np.ones(len(remaining)) if paces is None else np.maximum(np.asarray(paces, dtype=np.float64), 1.0)
    rounds = np.asarray(remaining, dtype=np.float64) / pace
    k = int(np.count_nonzero(rounds > rounds.max() - STRAGGLER_SLACK))
    end_round = plain_seconds(k) + overhead
    spread = END_SPREAD * np.sqrt(rounds)
    return Drain(rounds, pace, end_round, overhead / batch, spread)  # a place: see above


def depth_survival(depths: np.ndarray, probs: np.ndarray, sizes: np.ndarray, depth: int) -> np.ndarray:
    """[sizes, depth]: P(the tree cut to each size accepts at least j nodes), j = 1..depth, from
    each node's probability of being on the accepted path (`probs`; nodes at `depths`, 1-based).
    A size keeps its most likely nodes, as `TreeSizer.fit` cuts; one path is accepted, so the
    kept nodes of one depth are disjoint ways to reach it and their probabilities add."""
    out = np.zeros((len(sizes), depth))
    if len(probs) == 0 or depth == 0:
        return out
    order = np.lexsort((np.arange(len(probs)), -probs))
    weights = np.zeros((len(probs) + 1, depth))
    weights[np.arange(1, len(probs) + 1), np.asarray(depths)[order] - 1] = probs[order]
    kept = np.cumsum(weights, axis=0)[np.minimum(sizes, len(probs))]
    return np.minimum.accumulate(np.clip(kept, 0.0, 1.0), axis=1)



def row_pace(accepted: int, rounds: int) -> float:
    """A row's tokens per round so far (its accepted draft tokens plus one per round), shrunk toward
    one token a round by PACE_PRIOR_ROUNDS: what `TreeSizer.drain` divides its tokens left by."""
    return 1.0 + accepted / (rounds + PACE_PRIOR_ROUNDS)
