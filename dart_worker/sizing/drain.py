"""What a round's tokens are worth when the batch drains: it ends with its longest row.

When no request waits for a slot, every token is no longer worth the same: tokens of the row with
the most rounds left bring the end of the batch nearer, tokens of the others only free their
places sooner (`TreeSizer.drain` builds the outlook, `Drain.saved_seconds` prices a tree size).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# Rows within this many rounds of the most rounds left are those the batch's last rounds run
# (their cost is what a round saved at the end is worth).
STRAGGLER_SLACK = 4
# `row_pace`: pseudo-rounds of one token each that a row's pace starts from.
PACE_PRIOR_ROUNDS = 4.0


class Drain(NamedTuple):
    """A draining batch's outlook (`TreeSizer.drain`): what its rows' tokens this round save."""

    rounds: np.ndarray  # [B] each row's rounds left: tokens left over its pace
    paces: np.ndarray  # [B] each row's tokens per round (>= 1)
    end_round: float  # seconds of a round at the end, which runs the longest rows alone
    row: float  # seconds a place saves a round when a row finishes sooner (`TreeSizer.drain`)

    def saved_seconds(self, survival: np.ndarray) -> np.ndarray:
        """Expected seconds saved, per candidate size, by trees under which each row accepts at
        least j nodes with probability `survival` [B, sizes, D] (j = 1..D, `depth_survival`):
        every row's rounds saved free its place sooner, and the end comes earlier by the rounds
        the longest row after this round gained, a round at the end each (`expected_end`)."""
        gained = survival.sum(axis=2) / self.paces[:, None]
        nearer = self.rounds.max() - self.expected_end(survival)
        return self.end_round * nearer + self.row * gained.sum(axis=0)

    def expected_end(self, survival: np.ndarray) -> np.ndarray:
        """Per candidate size, the expected rounds left of the longest row after this round:
        E[max_b (rounds_b - G_b / pace_b)], G_b the nodes row b accepts (P(G_b >= j): `survival`).

        Rows level with the longest move the end only as far as the least of them gains, and the
        least of several chances is below the least of their expectations: two level rows, each
        accepting a node with probability 1/2, bring the end a quarter of a round nearer, not half.
        Priced at the least expectation, four level rows of a T=0.7 batch of 4 bought 13-node
        trees expecting 8 nodes each; three rows took 6-13 and the fourth, the end, 1 (ShareGPT
        dev, fp32 EPYC). Rows whose rounds left are below what the longest row keeps whatever it
        accepts (`floor`) cannot end the batch and are left out, which keeps this cheap."""
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
