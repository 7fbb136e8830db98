"""How likely a draft node is to be accepted: per-band tables calibrated online, and each row's own record.

`AcceptanceModel`: the probability that a draft node ends up on the accepted path, the product
along its path of each step's probability of being accepted once its parent was, a function of
the drafter's score of that step and of which drafter proposed it, calibrated online from every
verification (prior: exp(step score), a calibrated drafter's probability of the token).
`RowAcceptance`: one sequence's trees against that table, which scales its nodes' probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dart_worker.sampling.params import GREEDY
from ngram_native.trees import SOURCE_HEAD, DraftTree

# Score bins (log scale, path scores are <= 0): finer near 0, where most accepted nodes lie.
SCORE_EDGES = np.array([-12.0, -8.0, -6.0, -5.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.7, -0.5, -0.3, -0.15,
                        -0.05])
PRIOR_WEIGHT = 4.0  # pseudo-observations of the (scaled) exp(score) prior per bin
SCALE_WEIGHT = 2.0  # pseudo-nodes at the unscaled prior in a source's scale (AcceptanceModel)
# `RowAcceptance`: pseudo-nodes at the table's rate, and the weight left to a row's older trees at
# each new one.
ROW_PRIOR_NODES = 2.0
ROW_MEMORY = 0.9


class AcceptanceModel:
    """P(node accepted | its parent accepted; its own score bin, its source bits), calibrated online
    per temperature band (dart_worker.sampling.params.temperature_band) and source. A node is on the
    accepted path with the product of those along its path (`probabilities`).

    Conditional, not marginal: the bin is the node's own step, its path score less its parent's
    (a head's log-probability of its token given the path; 0 for each node of a context-lookup
    continuation that occurred once, whose path score stays ln(1/1) = 0 however deep). Keyed by path
    score, a long lookup chain sat in the top bin at every depth and every node got the bin's rate,
    so deep chains were priced far above what they brought (docs/benchmarks.md). Only nodes whose
    parent was accepted (or is the root) teach the table: the others' fate says nothing about their
    own step.

    Greedy verification accepts a node when it is the target's argmax, sampled verification when
    it is the target's draw: the same drafter score means a much higher rate greedy than at T=1,
    and a job (or one batch) can hold both. One table per band keeps a greedy row's trees from
    being priced by sampled rows' misses and the other way round.

    A bin with few observations leans on its prior, exp(step score) scaled by what the source's
    observed nodes of all bins say about its scores (accepted / the prior's expectation over
    them). Unscaled, the prior made sampled rounds pick exactly the bins nobody had observed yet
    (the head's most confident ones): a winner's curse, which cost sampled batches against `ar`;
    the scale learns a source's overconfidence from its first few rounds."""

    def __init__(self):
        self.accepted: dict[tuple[str, int], np.ndarray] = {}
        self.offered: dict[tuple[str, int], np.ndarray] = {}
        # Per (band, source): nodes accepted and their summed unscaled prior, over all bins.
        self._scale_evidence: dict[tuple[str, int], list[float]] = {}
        self._band_evidence: dict[str, list[float]] = {}  # the same, summed over sources
        centers = np.concatenate([[SCORE_EDGES[0] - 2.0], (SCORE_EDGES[:-1] + SCORE_EDGES[1:]) / 2,
                                  [SCORE_EDGES[-1] / 2]])
        self.prior = np.exp(centers)

    def _table(self, band: str, source: int) -> tuple[np.ndarray, np.ndarray]:
        key = (band, source)
        if key not in self.accepted:
            self.accepted[key] = np.zeros(len(SCORE_EDGES) + 1)
            self.offered[key] = np.zeros(len(SCORE_EDGES) + 1)
        return self.accepted[key], self.offered[key]

    @staticmethod
    def _keys(tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
        return _bins_and_sources(step_scores(tree), node_sources(tree))

    def scale(self, band: str, source: int) -> float:
        """How much more (> 1) or less (< 1) often the source's nodes were accepted in `band` than
        exp(score) says, over all its bins. Shrunk toward the band's scale over every source (a
        source seldom seen, such as nodes both the head and the lookup proposed while the head is
        mostly paused, borrows what the band's other sources showed), and that toward 1."""
        band_accepted, band_expected = self._band_evidence.get(band, (0.0, 0.0))
        band_scale = (band_accepted + SCALE_WEIGHT) / (band_expected + SCALE_WEIGHT)
        accepted, expected = self._scale_evidence.get((band, source), (0.0, 0.0))
        return (accepted + SCALE_WEIGHT * band_scale) / (expected + SCALE_WEIGHT)

    def _rates(self, band: str, source: int) -> np.ndarray:
        """The calibrated rate of every score bin of one (band, source) table."""
        accepted, offered = self._table(band, source)
        prior = np.minimum(self.prior * self.scale(band, source), 1.0)
        return (accepted + PRIOR_WEIGHT * prior) / (offered + PRIOR_WEIGHT)

    def probabilities(self, tree: DraftTree, band: str = GREEDY) -> np.ndarray:
        """Per node, the probability that it is on the accepted path: its step's calibrated rate
        times its parent's probability, so a node never outranks its parent and every prefix of
        the ranking is a tree."""
        if not tree.size:  # most trees of a round where nothing pays (T=1: the head paused, no lookup)
            return np.zeros(0)
        bins, sources = self._keys(tree)
        p = np.empty(tree.size)
        for source in np.unique(sources):
            rows = sources == source
            p[rows] = self._rates(band, int(source))[bins[rows]]
        parents, depths = tree.parents, tree.depths
        for depth in range(2, int(depths.max()) + 1):  # a level at a time: its parents are final
            rows = depths == depth
            p[rows] *= p[parents[rows]]
        return p

    def update(self, tree: DraftTree, accepted_nodes: np.ndarray, band: str = GREEDY) -> None:
        """Learn from a verified tree: which of its nodes were accepted. Nodes under a rejected
        parent are left out (see the class doc)."""
        if not tree.size:
            return
        hit = np.zeros(tree.size, dtype=bool)
        hit[accepted_nodes] = True
        parents = tree.parents
        reached = (parents < 0) | hit[np.maximum(parents, 0)]
        self.update_nodes(step_scores(tree)[reached], node_sources(tree)[reached], hit[reached], band)

    def update_nodes(self, scores: np.ndarray, sources: np.ndarray, hit: np.ndarray, band: str = GREEDY) -> None:
        """Learn from nodes whose parent was accepted (or is the root), given their step scores
        (`step_scores`) and source bits, known to have been accepted (`hit`) or not."""
        if not len(hit):
            return
        bins, sources = _bins_and_sources(scores, sources)
        for source in np.unique(sources):
            accepted, offered = self._table(band, int(source))
            rows = sources == source
            np.add.at(offered, bins[rows], 1.0)
            np.add.at(accepted, bins[rows & hit], 1.0)
            hits, expected = float((rows & hit).sum()), float(self.prior[bins[rows]].sum())
            for evidence in (self._scale_evidence.setdefault((band, int(source)), [0.0, 0.0]),
                             self._band_evidence.setdefault(band, [0.0, 0.0])):
                evidence[0] += hits
                evidence[1] += expected

    def describe(self) -> dict[str, dict[str, list[float]]]:
        """Per band and source bits, the calibrated rate of each score bin (logs, job summary)."""
        out: dict[str, dict[str, list[float]]] = {}
        for key in sorted(self.accepted):
            band, source = key
            out.setdefault(band, {})[str(source)] = [round(float(x), 3) for x in self._rates(band, source)]
        return out



@dataclass
class RowAcceptance:
    """One sequence's own record against the acceptance table: its verified trees' accepted nodes
    over what the table expected of them, recent trees weighing more (ROW_MEMORY), shrunk toward 1
    by ROW_PRIOR_NODES. The engine keeps one per live sequence and hands them to `TreeSizer.fit`,
    which scales that row's probabilities by `scale`.

    The table is shared by every row of a temperature band and source, and rows differ: at T=0.7
    the context lookup of a row that repeats its prompt is right nearly every time, that of a row
    that does not nearly never, and the table's rate is their mix. Priced by it, the lookup nodes of
    a row with nothing to repeat kept being expected to bring tokens after bringing none, and such
    trees cost a small batch several plain steps each (docs/benchmarks.md)."""

    accepted: float = 0.0
    expected: float = 0.0

    def add(self, accepted: int, expected: float) -> None:
        self.accepted = ROW_MEMORY * self.accepted + accepted
        self.expected = ROW_MEMORY * self.expected + expected

    @property
    def scale(self) -> float:
        return (self.accepted + ROW_PRIOR_NODES) / (self.expected + ROW_PRIOR_NODES)



def _scores(tree: DraftTree) -> np.ndarray:
    return tree.scores if tree.scores is not None else np.zeros(tree.size)


def step_scores(tree: DraftTree) -> np.ndarray:
    """Each node's own step: its path score less its parent's (a first-level node's is its path
    score). A drafter's path score never grows along a path, so steps are <= 0."""
    scores = _scores(tree)
    parents = tree.parents
    return scores - np.where(parents >= 0, scores[np.maximum(parents, 0)], 0.0)


def node_sources(tree: DraftTree) -> np.ndarray:
    return tree.sources if tree.sources is not None else np.full(tree.size, SOURCE_HEAD, np.uint8)


def _bins_and_sources(scores: np.ndarray, sources: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(score bin, source bits as int64) of each node: its acceptance table cell."""
    return np.searchsorted(SCORE_EDGES, np.minimum(scores, 0.0)), np.asarray(sources).astype(np.int64)


def cut_first_level(proposed: DraftTree, verified: DraftTree) -> np.ndarray:
    """Indices of `proposed`'s depth-1 nodes that the sizer cut (not among `verified`'s depth-1 tokens)."""
    first = np.flatnonzero(proposed.depths == 1)
    kept = verified.tokens[verified.depths == 1]
    return first[~np.isin(proposed.tokens[first], kept)]
