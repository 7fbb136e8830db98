"""A measured cost model that sizes every round's draft trees (`decoding.sizing: auto`).

Speculation pays only when the tokens a tree adds are worth the time its rows cost, and both
sides differ by machine, dtype, batch and text: a verify forward over 17 rows costs about one
decoding step on a CPU with AMX bf16 or a GPU, but 4-6 steps on a CPU without matrix units;
a draft head that is right half the time on one prompt is useless on the next. So nothing here
is a constant; every round the engine asks:

- `LatencyModel`: seconds of one verify forward carrying R rows (batch x (1 + tree size)),
  measured at start-up over a grid of R and refined online from every round it runs, one curve
  per live batch size (16 sequences x 9 rows cost 1.8x one sequence's 128 rows on a CPU);
- `AcceptanceModel`: the probability that a draft node ends up on the accepted path: the product
  along its path of each step's probability of being accepted once its parent was, a function of
  the drafter's score of that step and of which drafter proposed it, calibrated online from every
  verification (prior: exp(step score), a calibrated drafter's probability of the token);
- `TreeSizer`: from those, the tree size N (every tree cut to its best min(N, size) nodes, so
  the verify block has B x (1 + N) rows with bucketed shapes, and only its real ones, packed, with
  exact shapes) that maximises expected committed tokens per
  second for the whole batch, 0 included (a plain decoding step). It also decides whether the
  drafter's model forward (the draft head) is worth running next round: when trees without it
  would commit tokens faster, the model pauses and is probed again after a back-off.

Expected accepted tokens of a tree = the sum over its nodes of P(node on the accepted path)
(linearity of expectation), which holds for greedy and sampled verification alike.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from dart_worker.sampling import GREEDY
from ngram_native.trees import SOURCE_HEAD, DraftTree, subtree

# Score bins (log scale, path scores are <= 0): finer near 0, where most accepted nodes lie.
SCORE_EDGES = np.array([-12.0, -8.0, -6.0, -5.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.7, -0.5, -0.3, -0.15,
                        -0.05])
PRIOR_WEIGHT = 4.0  # pseudo-observations of the (scaled) exp(score) prior per bin
SCALE_WEIGHT = 2.0  # pseudo-nodes at the unscaled prior in a source's scale (AcceptanceModel)
LATENCY_STEP = 0.3  # weight of one observation in the online latency refinement
_MAX_PAUSE_ROUNDS = 32
# Probing a model that keeps failing (the draft head at T=1, where its nodes are rarely accepted)
# costs its forward every probe: at batch 16 on a 2-core EPYC 234 ms against a 380 ms step, so
# probes every 32 rounds alone took 2-3% of decoding. From its second failure in a row, a model
# pauses at least long enough that its probes take at most this share of the decoding time; and
# each failure after that halves the share, down to PROBE_SHARE / 2**PROBE_DOUBLINGS: at T=1 a head
# that failed its first probes keeps failing (ShareGPT dev, batch 16, fp32 EPYC: 8 probes of ~90 ms
# in 186 rounds, none paid), and its probes were a third of what the sampled cell lost to `ar`.
PROBE_SHARE = 0.01
PROBE_DOUBLINGS = 3
# Drafting itself (proposals, the sizer's pricing, the lookup's bookkeeping) costs a sampled batch
# of 16 about 4-6 ms a round (ShareGPT dev, T=0.7, fp32 EPYC), 1.5-2% of a step, in rounds whose
# trees are nearly always cut to nothing. After this many such rounds in a row, a sampled batch of
# two or more rows skips drafting for 1, 2, 4 ... DRAFT_PAUSE_MAX rounds (plain steps), then drafts
# again; one round that keeps a node ends the back-off.
DRAFT_IDLE_ROUNDS = 2
DRAFT_PAUSE_MAX = 4
# `OnlineBias`: pseudo-rounds at "the model was right" (ratio 1), the weight left to older rounds'
# evidence at each new tree round, and the range of the correction.
BIAS_PRIOR_ROUNDS = 2.0
BIAS_MEMORY = 0.97
BIAS_RANGE = (0.25, 4.0)
# `RowAcceptance`: pseudo-nodes at the table's rate, and the weight left to a row's older trees at
# each new one.
ROW_PRIOR_NODES = 2.0
ROW_MEMORY = 0.9
# A draining batch (`TreeSizer.drain`): rows within this many rounds of the most rounds left are
# those its last rounds run (their cost is what a round saved at the end is worth).
STRAGGLER_SLACK = 4
# `row_pace`: pseudo-rounds of one token each that a row's pace starts from.
PACE_PRIOR_ROUNDS = 4.0


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


class AcceptanceModel:
    """P(node accepted | its parent accepted; its own score bin, its source bits), calibrated online
    per temperature band (dart_worker.sampling.temperature_band) and source. A node is on the
    accepted path with the product of those along its path (`probabilities`).

    Conditional, not marginal: the bin is the node's own step, its path score less its parent's
    (a head's log-probability of its token given the path; 0 for each node of a context-lookup
    continuation that occurred once, whose path score stays ln(1/1) = 0 however deep). Keyed by path
    score, a 24-node lookup chain sat in the top bin at every depth and every node got the bin's
    rate: ShareGPT dev, T=1, batch 4, fp32 EPYC, verified lookup nodes expected to bring 24.7 tokens
    brought 7, and one 100-row forward (five plain steps) expected 13.8 and committed none. Only
    nodes whose parent was accepted (or is the root) teach the table: the others' fate says nothing
    about their own step.

    Greedy verification accepts a node when it is the target's argmax, sampled verification when
    it is the target's draw: the same drafter score means a much higher rate greedy than at T=1,
    and a job (or one batch) can hold both. One table per band keeps a greedy row's trees from
    being priced by sampled rows' misses and the other way round.

    A bin with few observations leans on its prior, exp(step score) scaled by what the source's
    observed nodes of all bins say about its scores (accepted / the prior's expectation over
    them). Unscaled, the prior made sampled rounds pick exactly the bins nobody had observed yet
    (the head's most confident ones, prior 0.9-0.975): a winner's curse. At T=1 (ShareGPT dev,
    batch 4, fp32 EPYC) the sizer expected 34.5 accepted nodes on its tree rounds and got 12,
    and ran 0.89x `ar`; the scale learns a source's overconfidence from its first few rounds."""

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
        return _bins_and_sources(step_scores(tree), _sources(tree))

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
        self.update_nodes(step_scores(tree)[reached], _sources(tree)[reached], hit[reached], band)

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
class OnlineBias:
    """What one side of the cost model is off by on the rounds it chose trees for: observed over
    predicted (accepted nodes over expected, or a tree's extra verify seconds over its predicted
    extra), over recent tree rounds, shrunk toward 1 by BIAS_PRIOR_ROUNDS.

    Both sides are biased exactly where the sizer acts, and neither table sees it alone. A sizer
    verifies the trees it rates highest, so its acceptance estimates on them are too high (a
    winner's curse over bins: ShareGPT dev, T=1, batch 4, fp32 EPYC, 22.5 accepted nodes expected,
    13 accepted). And a tree's extra rows are priced on grid points that only tree rounds correct,
    and those are rare where trees seldom pay: the same run's 16- to 32-row forwards cost 2.6-3.1x
    the extra over a plain step that the curve predicted. One ratio per side carries what every
    tree round shows to every size and bin."""

    observed: float = 0.0
    predicted: float = 0.0
    rounds: float = 0.0

    def add(self, observed: float, predicted: float) -> None:
        self.observed = BIAS_MEMORY * self.observed + observed
        self.predicted = BIAS_MEMORY * self.predicted + predicted
        self.rounds = BIAS_MEMORY * self.rounds + 1.0

    @property
    def ratio(self) -> float:
        if self.predicted <= 0:
            return 1.0
        measured = min(max(self.observed / self.predicted, BIAS_RANGE[0]), BIAS_RANGE[1])
        return (self.rounds * measured + BIAS_PRIOR_ROUNDS) / (self.rounds + BIAS_PRIOR_ROUNDS)


@dataclass
class RowAcceptance:
    """One sequence's own record against the acceptance table: its verified trees' accepted nodes
    over what the table expected of them, recent trees weighing more (ROW_MEMORY), shrunk toward 1
    by ROW_PRIOR_NODES. The engine keeps one per live sequence and hands them to `TreeSizer.fit`,
    which scales that row's probabilities by `scale`.

    The table is shared by every row of a temperature band and source, and rows differ: at T=0.7
    the context lookup of a row that repeats its prompt is right nearly every time, that of a row
    that does not nearly never, and the table's rate is their mix. Priced by it, 8 lookup nodes of a
    row with nothing to repeat were expected to bring 6.4 tokens, and again a few rounds later
    after bringing none (ShareGPT dev, T=0.7, batch 4, fp32 EPYC: trees of 8-16 nodes cost a
    batch of 4 two to three plain steps each, and brought 0, 0 and 1 tokens)."""

    accepted: float = 0.0
    expected: float = 0.0

    def add(self, accepted: int, expected: float) -> None:
        self.accepted = ROW_MEMORY * self.accepted + accepted
        self.expected = ROW_MEMORY * self.expected + expected

    @property
    def scale(self) -> float:
        return (self.accepted + ROW_PRIOR_NODES) / (self.expected + ROW_PRIOR_NODES)


class _Choice(NamedTuple):
    """`TreeSizer._best`'s answer for one common size."""

    rate: float  # what `_best` maximises: tokens per second, or in a draining batch seconds saved (`Drain`)
    size: int
    gain: float  # expected committed tokens (bias-corrected)
    expected_accepted: float  # expected accepted nodes (bias-corrected)
    seconds: float  # the round's predicted seconds (bias-corrected, overhead and extra included)
    nodes: float  # expected accepted nodes, as the acceptance table says
    plain_seconds: float  # the curve's verify seconds of a plain step
    tree_seconds: float  # the curve's extra verify seconds of the trees over a plain step


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


class _Fitted(NamedTuple):
    """What `fit` predicted for the round `observe` learns from next."""

    choice: _Choice
    batch: int
    full_logits: bool
    sampled: bool


@dataclass
class SizedRound:
    """What `TreeSizer.fit` chose for one round."""

    trees: list[DraftTree]
    expected_tokens: float  # committed tokens the batch should gain (bonus tokens included)
    predicted_seconds: float  # verify forward of the chosen size
    without_model_rate: float  # tokens/s of the best trees without model-only nodes (0: none)


@dataclass
class TreeSizer:
    """Chooses each round's tree size from `LatencyModel` x `AcceptanceModel` (see module doc)."""

    latency: LatencyModel  # the calibration at batch 1 (dart_worker.calibration)
    max_budget: int
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    model_seconds: float = 0.0  # EMA of the drafter's model work per round (catch-up + propose)
    overhead_seconds: float = 0.0  # EMA of a round's time outside verify and model drafting
    _pause_left: int = 0
    _pause_length: int = 1
    _failed_probes: int = 0  # the model's failures in a row on sampled rows (see `fit`)
    _judge_after_verify: bool = False  # a sampled batch's model round awaits its verdict (`_judge_model`)
    _idle_rounds: int = 0  # fitted rounds in a row of a sampled batch whose trees were all cut to nothing
    _draft_pause_left: int = 0  # rounds left without drafting (`drafting_wanted`)
    _model_calls: int = 0
    # Per live batch size, its verify cost curve: measured at start-up for the batch sizes the
    # worker runs (calibrated), learnt online from its rounds for the others.
    _latency_by_batch: dict[int, LatencyModel] = field(default_factory=dict)
    # The same for forwards that project every row to the vocabulary (`full_logits` rounds: sampled
    # rows, penalties, logprobs, whose verification reads every node's distribution), where a tree
    # row costs its vocabulary projection on top: Gemma-3-270M's 262k-token head is more than the
    # rest of a row (fp32 EPYC, T=1, batch 4: 32 rows took 476 ms where the deferred curve said
    # 289). None: the engine never defers, and `_latency_by_batch` measures those forwards already.
    _full_logits_latency_by_batch: dict[int, LatencyModel] | None = None
    # Bucketed verify shapes (`dart_worker.shape_buckets`): rows per sequence -> the rows the
    # forward actually runs, so a size is priced at its bucket's cost. None: exact shapes.
    rows_bucket: Callable[[np.ndarray], np.ndarray] | None = None
    # Bucketed verify shapes: live sequences -> the sequences the forward runs (padding included,
    # `DecodingEngine.forward_batch`), whose curve prices and learns the round. None: exact shapes.
    batch_bucket: Callable[[int], int] | None = None
    # Exact shapes: a verify forward runs only its real rows (roots and nodes, packed:
    # `TargetAdapter.verify`'s `packed`), so a block of unequal trees costs its real rows, not
    # B x (1 + N): the curves are then curves of real rows, priced and learnt by them. On a CPU
    # without matrix units a padding row cost as much as a real one (fp32 EPYC, Gemma-3-270M,
    # batch 16: one sequence's 8-node tree made a 144-row forward of 1.42-1.49 s against
    # 0.52-0.55 s packed and 0.43-0.49 s for a plain step). False: bucketed shapes, priced at the
    # padded block's rows.
    packed: bool = False
    # What the model predicted for the rounds it sized against what they did (`describe`'s
    # "predicted_vs_observed"): a miscalibrated cost model shows here before it shows in tokens/s.
    _check: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("rounds", "expected_accepted", "accepted", "predicted_verify_s", "verify_s"), 0.0))
    _last_fit: _Fitted | None = None
    # `OnlineBias` of expected accepted nodes, by whether the batch is all sampled rows, and of a
    # tree's extra verify seconds, by logits path (`full_logits`).
    _gain_bias: dict[bool, OnlineBias] = field(default_factory=dict)
    _tree_seconds_bias: dict[bool, OnlineBias] = field(default_factory=dict)
    _proposed: list[DraftTree] | None = None  # the last fitted round's trees before the cut
    # The last fitted round's `RowAcceptance`s, each with what the table expected of its cut tree.
    _rows: list[tuple[RowAcceptance, float]] | None = None

    def latency_for(self, batch: int, full_logits: bool = False) -> LatencyModel:
        """The verify cost curve of forwards over `batch` sequences (`full_logits`: of forwards that
        project every row to the vocabulary). Batch shapes differ in more than their row count:
        attention reads one cache per sequence and a tree row costs its sequence's context, so a
        curve of batch 1 misprices rows at batch 16 and the other way round. Until a batch size has
        its own curve, the nearest one (in log batch size) stands in."""
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

    # ------------------------------------------------------------- the model

    def drafting_wanted(self) -> bool:
        """Draft this round? False while drafting pauses (DRAFT_IDLE_ROUNDS): the round is a plain
        step, and nothing is proposed, priced or cut. The drafter still observes every committed
        row, so a round after the pause drafts from the whole text, as if it had never paused."""
        if self._draft_pause_left > 0:
            self._draft_pause_left -= 1
            return False
        return True

    def _note_idle(self, idle: bool) -> None:
        """Count a fitted round whose trees were all cut to nothing (`idle`) on a sampled batch of
        two or more rows, and pause drafting after DRAFT_IDLE_ROUNDS of them in a row."""
        self._idle_rounds = self._idle_rounds + 1 if idle else 0
        if self._idle_rounds >= DRAFT_IDLE_ROUNDS:
            self._draft_pause_left = min(1 << (self._idle_rounds - DRAFT_IDLE_ROUNDS), DRAFT_PAUSE_MAX)

    def model_wanted(self) -> bool:
        """Run the drafter's model this round? False while paused (see `fit`)."""
        if self._pause_left > 0:
            self._pause_left -= 1
            return False
        return True

    def probe_pause(self, batch: int, full_logits: bool = False) -> int:
        """Rounds of plain steps at `batch` over which one probe of the model (its forward, at the
        model's measured seconds) is PROBE_SHARE of the time (a step of the forward's padded batch)."""
        forward = self._forward_batch(batch)
        step = float(self.latency_for(forward, full_logits).predict(np.array([forward]))[0]) + self.overhead_seconds
        return int(np.ceil(self.model_seconds / (PROBE_SHARE * max(step, 1e-9))))

    def record_model_seconds(self, seconds: float) -> None:
        """The model's seconds this round, into the EMA; its first call is left out: it pays one-time
        costs (a 2-core EPYC under load: 727 ms where later calls took a fraction), and an EMA
        starting there made a head that pays look dear for its first dozen rounds."""
        self._model_calls += 1
        if self._model_calls == 1:
            return
        self.model_seconds = seconds if not self.model_seconds else 0.8 * self.model_seconds + 0.2 * seconds

    def record_overhead(self, seconds: float) -> None:
        self.overhead_seconds = seconds if not self.overhead_seconds else 0.8 * self.overhead_seconds + 0.2 * seconds

    # ------------------------------------------------------------ the size

    def _best(self, trees: list[DraftTree], probs: list[np.ndarray], extra_seconds: float, full_logits: bool = False,
              sampled: bool = False, drain: Drain | None = None) -> _Choice:
        """The best common size N for these trees, its tables' predictions corrected by what tree
        rounds of the same kind showed (`OnlineBias`): the most expected tokens per second, or with
        `drain` (a batch that ends with its longest row) the most seconds saved net of the trees'
        own (`Drain.saved_seconds`), 0 for a plain step."""
        top = min(self.max_budget, max((t.size for t in trees), default=0))
        sizes = np.arange(top + 1)
        per_row = np.zeros((len(trees), top + 1))  # expected accepted nodes of each row, per size
        for b, p in enumerate(probs):
            cumulative = np.concatenate([[0.0], np.cumsum(np.sort(p)[::-1])])
            per_row[b] = cumulative[np.minimum(sizes, len(p))]
        nodes = per_row.sum(axis=0)
        ratio = self._bias(self._gain_bias, sampled).ratio
        gain = len(trees) + ratio * nodes
        rows = 1 + sizes if self.rows_bucket is None else self.rows_bucket(1 + sizes)
        forward = self._forward_batch(len(trees))
        real = len(trees) + sum(np.minimum(sizes, t.size) for t in trees)  # roots and kept nodes, per size
        verify = self._verify_seconds(forward, forward * rows, real, full_logits)
        tree_seconds = verify - verify[0]
        seconds = (verify[0] + self._bias(self._tree_seconds_bias, full_logits).ratio * tree_seconds
                   + self.overhead_seconds + np.where(sizes > 0, extra_seconds, 0.0))
        if drain is None:
            rate = gain / seconds
        else:
            depth = max((int(t.depths.max()) for t in trees if t.size), default=0)
            survival = np.stack([depth_survival(t.depths, p, sizes, depth) for t, p in zip(trees, probs, strict=True)])
            survival = np.minimum.accumulate(np.minimum(ratio * survival, 1.0), axis=2)
            rate = drain.saved_seconds(survival) - (seconds - seconds[0])
        best = int(np.argmax(rate))
        return _Choice(float(rate[best]), best, float(gain[best]), ratio * float(nodes[best]), float(seconds[best]),
                       float(nodes[best]), float(verify[0]), float(tree_seconds[best]))

    def _verify_seconds(self, forward: int, rows: np.ndarray, real: np.ndarray, full_logits: bool) -> np.ndarray:
        """Seconds of verify forwards over `forward` sequences and `rows` rows in all, `real` of
        them roots or nodes (the others padding): the curve's at the rows the forward runs, its
        real ones where it runs them packed (`packed`)."""
        return self.latency_for(forward, full_logits).predict(real if self.packed else rows)

    def drain(self, remaining: list[int] | None, batch: int, full_logits: bool = False,
              paces: list[float] | None = None) -> Drain | None:
        """What a round's tokens are worth in a batch that drains (`remaining`: each row's tokens left;
        None: rows wait to take a finished row's slot, every token is worth the same, and this
        returns None). `paces`: each row's tokens per round so far (`row_pace`; None: 1 each), so a
        row's rounds left are its tokens left over its pace.

        A draining batch ends with its longest row, the one with the most rounds left, and tokens
        are worth the seconds they save (`Drain.saved_seconds`): tokens of the longest row bring the
        end nearer, a round at the end each (its k longest rows alone); tokens of any row free its
        place in later rounds sooner (a place: its share of the round's time outside the forward,
        sampling and committing its row). Tokens of a row level with the longest do not bring the
        end nearer unless the longest's do too.

        A place's share of the forward is one row, which is what the tree node that frees it costs
        (packed) or less than that (bucketed), so a node of a row that does not end the batch nets
        at most that place's share of the time outside the forward: only that is counted. Priced
        at the forward's share too (from plain steps of the batch against one sequence, 13.5 ms at
        batch 16, or at the slope of the batch's curve, 8-19 ms), the nodes a table was too hopeful
        about lost more than the rest saved: T=0.7, 0.944-0.959x `ar` at batch 4 and 0.957-0.978x
        at batch 16 (ShareGPT dev, fp32 EPYC), where the same batches with no trees ran at 0.98-1.0x."""
        if remaining is None or len(remaining) < 2:
            return None
        pace = np.ones(len(remaining)) if paces is None else np.maximum(np.asarray(paces, dtype=np.float64), 1.0)
        rounds = np.asarray(remaining, dtype=np.float64) / pace
        k = int(np.count_nonzero(rounds > rounds.max() - STRAGGLER_SLACK))
        end_round = self._plain_seconds(k, full_logits) + self.overhead_seconds
        return Drain(rounds, pace, end_round, self.overhead_seconds / batch)  # a place: see above

    def _plain_seconds(self, live: int, full_logits: bool) -> float:
        """The verify forward of a plain step of `live` sequences (one row each)."""
        forward = self._forward_batch(live)
        return float(self.latency_for(forward, full_logits).predict(np.array([forward]))[0])

    @staticmethod
    def _bias(biases: dict[bool, OnlineBias], key: bool) -> OnlineBias:
        return biases.setdefault(key, OnlineBias())

    def _model_failed(self, sampled: bool, batch: int, full_logits: bool) -> None:
        """The model did not pay this round: pause it for the back-off (see `fit`)."""
        self._failed_probes = self._failed_probes + 1 if sampled else 0
        floor = 0
        if self._failed_probes >= 2:
            floor = self.probe_pause(batch, full_logits) << min(self._failed_probes - 2, PROBE_DOUBLINGS)
        self._pause_left = max(self._pause_length, floor)
        self._pause_length = min(2 * self._pause_length, max(_MAX_PAUSE_ROUNDS, floor))

    def _model_paid(self) -> None:
        self._pause_length, self._failed_probes = 1, 0

    def _judge_model(self, trees: list[DraftTree], accepted: list[np.ndarray], verify_seconds: float,
                     full_logits: bool) -> None:
        """On a batch of sampled rows, whether the model paid is judged from what its nodes did, not
        from what the acceptance table expected of them.

        The table is least sure exactly where this matters: at T=1 the head's nodes are seldom
        accepted and the head mostly paused, so its bins hold few observations and lean on a prior
        (ShareGPT dev, T=1, fp32 EPYC: 9.7 accepted nodes expected where 3 were). A probe the
        table wrongly thought paying reset the back-off to one round, and the next probes followed
        within a few rounds. Here the round's accepted head-only nodes (which no other source
        proposed: without the model, the accepted path would have stopped before each of them) must
        be worth the model's seconds: h tokens more in (S + m) seconds beats the T - h tokens the
        round would have committed in S seconds without it, i.e. h (S + m) > T m.
        """
        head_only = sum(int(np.count_nonzero(_sources(tree)[nodes] == SOURCE_HEAD))
                        for tree, nodes in zip(trees, accepted, strict=True))
        committed = len(trees) + sum(len(nodes) for nodes in accepted)
        seconds = verify_seconds + self.overhead_seconds
        if head_only * (seconds + self.model_seconds) > committed * self.model_seconds:
            self._model_paid()
        else:
            self._model_failed(sampled=True, batch=len(trees), full_logits=full_logits)

    def _forward_batch(self, live: int) -> int:
        """Sequences the verify forward of `live` live ones runs (its batch bucket, when bucketed)."""
        return live if self.batch_bucket is None else self.batch_bucket(live)

    def fit(self, trees: list[DraftTree], model_ran: bool, bands: list[str] | None = None,
            full_logits: bool = False, remaining: list[int] | None = None,
            paces: list[float] | None = None, rows: list[RowAcceptance] | None = None) -> SizedRound:
        """Cut every tree to the size that maximises the batch's expected tokens per second.
        `bands`: each tree's sequence's temperature band (its acceptance table; default greedy).
        `full_logits`: the verify forward will project every row to the vocabulary (priced on
        those forwards' curves). `remaining`: each row's tokens left when the batch drains (no
        request waits for a slot; None otherwise), which values its tokens (`drain`, with each
        row's `paces`). `rows`: each sequence's `RowAcceptance`, which scales its nodes' probabilities
        and learns, in `observe`, what its verified tree brought against what the table expected.

        The model's seconds are sunk this round (it ran); they count in the decision whether it
        should run next round: if trees without its nodes would have been as fast, it pauses for
        a back-off of 1, 2, 4 ... 32 rounds, and after a round where it paid the back-off resets.
        From the second failure in a row on a batch of sampled rows only (T > 0, where a head's
        nodes are seldom accepted), the pause is also at least `probe_pause(batch)` rounds, so
        probing a model that keeps failing there costs at most PROBE_SHARE of the decoding time,
        and twice as many rounds at each further failure (up to PROBE_DOUBLINGS times);
        and there a round the table expects to pay is judged again from its verification
        (`_judge_model`, in `observe`) before it counts as paying.
        """
        bands = bands or [GREEDY] * len(trees)
        table = [self.acceptance.probabilities(t, band) for t, band in zip(trees, bands, strict=True)]
        probs = table if rows is None else [np.minimum(p * row.scale, 1.0) for p, row in zip(table, rows, strict=True)]
        sampled = all(band != GREEDY for band in bands)
        drain = self.drain(remaining, len(trees), full_logits, paces)
        choice = self._best(trees, probs, 0.0, full_logits, sampled, drain)
        size, seconds = choice.size, choice.seconds
        self._note_idle(sampled and len(trees) > 1 and size == 0)
        out, expected = [], []
        for tree, p, q in zip(trees, probs, table):
            if tree.size <= size:
                out.append(tree)
                expected.append(float(q.sum()))
                continue
            order = np.lexsort((np.arange(tree.size), -p))[:size]  # best first, parents before children
            keep = np.zeros(tree.size, dtype=bool)
            keep[order] = True
            out.append(subtree(tree, keep))
            expected.append(float(q[keep].sum()))
        self._rows = None if rows is None else list(zip(rows, expected, strict=True))
        without = 0.0
        if model_ran:
            with_model = self._best(trees, probs, self.model_seconds, full_logits, sampled, drain).rate
            others = [_without_model_nodes(t, p) for t, p in zip(trees, probs)]
            without = self._best([o[0] for o in others], [o[1] for o in others], 0.0, full_logits, sampled, drain).rate
            # Only sampled rows: greedy text is where a head is usually right and a miss is a
            # passing one (a loop the lookup drafts better), so greedy keeps the short back-off.
            if without >= with_model:
                self._model_failed(sampled, len(trees), full_logits)
            elif sampled:
                self._judge_after_verify = True  # see `_judge_model`
            else:
                self._model_paid()
        self._last_fit = _Fitted(choice, len(trees), full_logits, sampled)
        self._proposed = trees
        return SizedRound(out, len(trees) + choice.expected_accepted, seconds - self.overhead_seconds, without)

    def observe(self, trees: list[DraftTree], accepted: list[np.ndarray], rows: int, verify_seconds: float,
                bands: list[str] | None = None, first_tokens: list[int] | None = None,
                full_logits: bool = False, real_rows: int | None = None) -> None:
        """Learn from one verified round: which nodes were accepted, what the forward of `rows`
        rows, `real_rows` of them roots or nodes (None: all), cost (on the curve of this batch size
        and logits path, `full_logits` as in `fit`, at the rows it ran: its real ones where it
        runs them packed (`packed`); a batch size without one gets a copy of the
        nearest curve, its level set by this first round and its shape kept until rounds of other
        sizes correct it).

        `first_tokens` (each sequence's first token committed this round) also grades the first-level
        nodes the cut left out of the fitted round's trees: verification commits the target's own
        token (its argmax, or its coupled draw: `dart_worker.verification`) whatever the tree, so a
        first-level node would have been accepted exactly when its token is that one. Learning only
        from verified nodes made a winner's curse: the nodes a table is too hopeful about are the
        ones it keeps verifying, but the nodes it is too gloomy about, or has hardly seen (a head
        that is mostly paused, at T=1), are cut and never corrected (ShareGPT dev, T=1, batch 16,
        fp32 EPYC: a probe's 16 head nodes expected to bring 7.7 tokens, 4 accepted in 190 rounds).
        Deeper cut nodes are not graded: whether one would have been accepted needs tokens that
        only later rounds commit, and rounds that commit more are those whose trees were right."""
        if self._judge_after_verify:
            self._judge_after_verify = False
            self._judge_model(trees, accepted, verify_seconds, full_logits)
        fitted, self._last_fit = self._last_fit, None
        records, self._rows = self._rows, None
        if records is not None and len(records) == len(trees):
            for (row, expected), tree, nodes in zip(records, trees, accepted):
                if tree.size:
                    row.add(len(nodes), expected)
        if fitted is not None:  # the round `fit` sized last
            choice, hits = fitted.choice, sum(len(a) for a in accepted)
            for key, value in (("rounds", 1), ("expected_accepted", choice.expected_accepted),
                               ("predicted_verify_s", choice.seconds - self.overhead_seconds),
                               ("accepted", hits), ("verify_s", verify_seconds)):
                self._check[key] += value
            if choice.size > 0:
                self._bias(self._gain_bias, fitted.sampled).add(hits, choice.nodes)
                self._bias(self._tree_seconds_bias, fitted.full_logits).add(
                    verify_seconds - choice.plain_seconds, choice.tree_seconds)
        bands = bands or [GREEDY] * len(trees)
        for tree, nodes, band in zip(trees, accepted, bands, strict=True):
            self.acceptance.update(tree, nodes, band)
        proposed, self._proposed = self._proposed, None
        if first_tokens is not None and proposed is not None and len(proposed) == len(trees):
            for tree, cut, token, band in zip(proposed, trees, first_tokens, bands, strict=True):
                if cut is tree:  # nothing was cut (`fit` keeps such trees as they are)
                    continue
                graded = cut_first_level(tree, cut)
                self.acceptance.update_nodes(step_scores(tree)[graded], _sources(tree)[graded],
                                             tree.tokens[graded] == token, band)
        if self.packed and real_rows is not None:  # the rows the forward ran
            rows = real_rows
        batch = self._forward_batch(len(trees))
        curves = self._curves(full_logits)
        curve = curves.get(batch)
        if curve is None:
            curve = curves[batch] = copy.deepcopy(self.latency_for(batch, full_logits))
            curve.rescale(rows, verify_seconds)
        else:
            curve.update(rows, verify_seconds)

    def calibration_line(self) -> str:
        """One line for a worker's log: the measured forward costs and where trees stop paying
        double (the most nodes one sequence's tree can carry for under two plain steps)."""
        shown = ", ".join(f"{r}: {float(self.latency.predict(r)) * 1e3:.0f}" for r in (1, 16, 64, 256))
        one = float(self.latency.predict(1))
        sizes = np.arange(self.max_budget + 1)
        cheap = int(sizes[self.latency.predict(1 + sizes) <= 2 * one].max(initial=0))
        return (f"verify forward ms by rows {{{shown}}} (grid up to {int(self.latency.rows[-1])}, linear beyond); "
                f"trees up to {self.max_budget} nodes, at most {cheap} for under two plain steps at batch 1")

    def describe(self) -> dict:
        return {"latency_ms_by_rows": self.latency.describe(),
                "latency_ms_by_batch_and_rows": {b: c.describe() for b, c in sorted(self._latency_by_batch.items())},
                "latency_ms_by_batch_and_rows_full_logits": {
                    b: c.describe() for b, c in sorted((self._full_logits_latency_by_batch or {}).items())},
                "acceptance_by_band_and_source": self.acceptance.describe(),
                "model_ms": round(self.model_seconds * 1e3, 2), "overhead_ms": round(self.overhead_seconds * 1e3, 2),
                "packed": self.packed,
                "predicted_vs_observed": {k: round(v, 3) for k, v in self._check.items()},
                "bias": {"accepted_nodes": {("sampled" if k else "greedy"): round(b.ratio, 3)
                                            for k, b in self._gain_bias.items()},
                         "tree_seconds": {("full_logits" if k else "deferred"): round(b.ratio, 3)
                                          for k, b in self._tree_seconds_bias.items()}}}


def _without_model_nodes(tree: DraftTree, p: np.ndarray) -> tuple[DraftTree, np.ndarray]:
    """The part of `tree` a drafter proposes without its model: nodes some other source proposed
    (context lookup, the job cache); nothing for a tree of head nodes only."""
    if tree.sources is None:
        return DraftTree(tree.tokens[:0], tree.parents[:0], tree.depths[:0]), p[:0]
    keep = (tree.sources & ~np.uint8(SOURCE_HEAD)) != 0
    # A kept node's ancestors were proposed by the same source (sources are prefix-closed), so
    # the kept set is a tree.
    return subtree(tree, keep), p[keep]


def _scores(tree: DraftTree) -> np.ndarray:
    return tree.scores if tree.scores is not None else np.zeros(tree.size)


def step_scores(tree: DraftTree) -> np.ndarray:
    """Each node's own step: its path score less its parent's (a first-level node's is its path
    score). A drafter's path score never grows along a path, so steps are <= 0."""
    scores = _scores(tree)
    parents = tree.parents
    return scores - np.where(parents >= 0, scores[np.maximum(parents, 0)], 0.0)


def _sources(tree: DraftTree) -> np.ndarray:
    return tree.sources if tree.sources is not None else np.full(tree.size, SOURCE_HEAD, np.uint8)


def _bins_and_sources(scores: np.ndarray, sources: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(score bin, source bits as int64) of each node: its acceptance table cell."""
    return np.searchsorted(SCORE_EDGES, np.minimum(scores, 0.0)), np.asarray(sources).astype(np.int64)


def row_pace(accepted: int, rounds: int) -> float:
    """A row's tokens per round so far (its accepted draft tokens plus one per round), shrunk toward
    one token a round by PACE_PRIOR_ROUNDS: what `TreeSizer.drain` divides its tokens left by."""
    return 1.0 + accepted / (rounds + PACE_PRIOR_ROUNDS)


def cut_first_level(proposed: DraftTree, verified: DraftTree) -> np.ndarray:
    """Indices of `proposed`'s depth-1 nodes that the sizer cut (not among `verified`'s depth-1 tokens)."""
    first = np.flatnonzero(proposed.depths == 1)
    kept = verified.tokens[verified.depths == 1]
    return first[~np.isin(proposed.tokens[first], kept)]
