"""The tree sizer: each round's tree size from the verify cost curves and the acceptance tables.

`TreeSizer` finds the tree size N (every tree cut to its best min(N, size) nodes, so the verify
block has B x (1 + N) rows with bucketed shapes, and only its real ones, packed, with exact
shapes) that maximises expected committed tokens per second for the whole batch, 0 included (a
plain decoding step), or in a draining batch the seconds saved (`dart_worker.sizing.drain`). It is
the engine's sizing policy (`plan`, `learn`: `dart_worker.sizing.policy`), and paces the drafter's
model and drafting itself (`dart_worker.sizing.pacing`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from dart_worker.sampling.params import GREEDY
from dart_worker.sizing.acceptance import AcceptanceModel, RowAcceptance, cut_first_level, node_sources, step_scores
from dart_worker.sizing.bias import OnlineBias
from dart_worker.sizing.drain import Drain, depth_survival, draining_outlook
from dart_worker.sizing.pacing import DraftingPacing, ModelPacing, probe_pause, without_model_nodes
from dart_worker.sizing.verify_costs import VerifyCosts
from ngram_native.trees import SOURCE_HEAD, DraftTree, subtree

if TYPE_CHECKING:
    from dart_worker.decode_round import Draft, RoundRecord


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
class TreeSizer(VerifyCosts):
    """Chooses each round's tree size from `VerifyCosts` x `AcceptanceModel` (see module doc)."""

    max_budget: int = field(kw_only=True)
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    model_seconds: float = 0.0  # EMA of the drafter's model work per round (catch-up + propose)
    overhead_seconds: float = 0.0  # EMA of a round's time outside verify and model drafting
    model_pacing: ModelPacing = field(default_factory=ModelPacing)  # whether the model runs (`fit`)
    drafting: DraftingPacing = field(default_factory=DraftingPacing)  # whether the drafter drafts
    _model_calls: int = 0
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

    # ------------------------------------------------------------- the paces

    def drafting_wanted(self) -> bool:
        """Draft this round? (`DraftingPacing.wanted`)"""
        return self.drafting.wanted()

    def model_wanted(self) -> bool:
        """Run the drafter's model this round? False while paused (see `fit`)."""
        return self.model_pacing.wanted()

    def probe_pause(self, batch: int, full_logits: bool = False) -> int:
        """Rounds of plain steps at `batch` over which one probe of the model (its forward, at the
        model's measured seconds) is PROBE_SHARE of the time (a step of the forward's padded batch)."""
        return probe_pause(self.model_seconds, self._plain_seconds(batch, full_logits) + self.overhead_seconds)

    def record_model_seconds(self, seconds: float) -> None:
        """The model's seconds this round, into the EMA; its first call is left out: it pays one-time
        costs (many times a later call's), and an EMA starting there made a head that pays look
        dear for its first dozen rounds."""
        self._model_calls += 1
        if self._model_calls == 1:
            return
        self.model_seconds = seconds if not self.model_seconds else 0.8 * self.model_seconds + 0.2 * seconds

    def record_overhead(self, seconds: float) -> None:
        self.overhead_seconds = seconds if not self.overhead_seconds else 0.8 * self.overhead_seconds + 0.2 * seconds

    # ----------------------------------------------------------- the policy

    def plan(self, record: RoundRecord, draft: Draft) -> list[DraftTree]:
        """The round's trees (`SizingPolicy.plan`): none while drafting pauses (`drafting_wanted`),
        the model's only while it pays (`model_wanted`), every tree cut to the size `fit` chooses
        for the round's live sequences (their bands, rows' records and, when the batch drains,
        tokens left and paces)."""
        if not self.drafting_wanted():
            return draft(None)
        trees = draft(self.model_wanted())
        if record.model_ran:
            self.record_model_seconds(record.model_seconds)
        return self.fit(trees, model_ran=record.model_ran, bands=record.bands, full_logits=record.full_logits,
                        remaining=record.tokens_left(), paces=record.paces(), rows=record.row_acceptances).trees

    def learn(self, record: RoundRecord) -> None:
        """`observe` the verified round, then its time outside the verify forward and the model."""
        batch = record.batch
        self.observe(record.trees, record.accepted, batch.batch_size * batch.seq_len, record.verified_seconds,
                     bands=record.bands, first_tokens=record.first_tokens, full_logits=record.full_logits,
                     real_rows=batch.num_real_rows)
        self.record_overhead(record.elapsed() - record.verified_seconds - record.model_seconds)

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

    def drain(self, remaining: list[int] | None, batch: int, full_logits: bool = False,
              paces: list[float] | None = None) -> Drain | None:
        """What a round's tokens are worth in a batch that drains (`draining_outlook`, with a round
        at the end priced at this sizer's plain steps; None when rows wait for a slot)."""
        return draining_outlook(remaining, batch, lambda k: self._plain_seconds(k, full_logits),
                                self.overhead_seconds, paces)

    @staticmethod
    def _bias(biases: dict[bool, OnlineBias], key: bool) -> OnlineBias:
        return biases.setdefault(key, OnlineBias())

    def _model_failed(self, sampled: bool, batch: int, full_logits: bool) -> None:
        """The model did not pay this round: pause it for the back-off (see `fit`)."""
        self.model_pacing.failed(sampled, self.probe_pause(batch, full_logits))

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
        (`ModelPacing.judge`, in `observe`) before it counts as paying.
        """
        bands = bands or [GREEDY] * len(trees)
        table = [self.acceptance.probabilities(t, band) for t, band in zip(trees, bands, strict=True)]
        probs = table if rows is None else [np.minimum(p * row.scale, 1.0) for p, row in zip(table, rows, strict=True)]
        sampled = all(band != GREEDY for band in bands)
        drain = self.drain(remaining, len(trees), full_logits, paces)
        choice = self._best(trees, probs, 0.0, full_logits, sampled, drain)
        size, seconds = choice.size, choice.seconds
        self.drafting.note(sampled and len(trees) > 1 and size == 0)
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
        if model_ran and sampled:
            self.model_pacing.ran_sampled()
        if model_ran:
            with_model = self._best(trees, probs, self.model_seconds, full_logits, sampled, drain).rate
            others = [without_model_nodes(t, p) for t, p in zip(trees, probs)]
            without = self._best([o[0] for o in others], [o[1] for o in others], 0.0, full_logits, sampled, drain).rate
            # A batch of sampled rows judges the model by what its nodes bring once verified, over
            # its recent rounds (`ModelPacing.judge`), not by the table: at T > 0 the table learns the
            # head's rates on the few rounds it runs, and a head it thought worthless from its first
            # rounds was paused for good though it paid (coupled drafting at T=1, docs/benchmarks.md).
            # Greedy text is where a head is usually right and a miss is a passing one (a loop the
            # lookup drafts better): there the table decides, with the short back-off.
            if sampled:
                self.model_pacing.judge_after_verify = True
            elif without >= with_model:
                self._model_failed(sampled, len(trees), full_logits)
            else:
                self.model_pacing.paid()
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
        token (its argmax, or its coupled draw: `dart_worker.sampling.verification`) whatever the tree, so a
        first-level node would have been accepted exactly when its token is that one. Learning only
        from verified nodes made a winner's curse: the nodes a table is too hopeful about are the
        ones it keeps verifying, but the nodes it is too gloomy about, or has hardly seen (a head
        that is mostly paused, at T=1), are cut and never corrected (docs/benchmarks.md).
        Deeper cut nodes are not graded: whether one would have been accepted needs tokens that
        only later rounds commit, and rounds that commit more are those whose trees were right."""
        if self.model_pacing.judge_after_verify:
            self.model_pacing.judge_after_verify = False
            cut_hits = 0  # trees whose cut left out a head-only first-level node equal to the committed token
            if first_tokens is not None and self._proposed is not None and len(self._proposed) == len(trees):
                for tree, cut, token, nodes in zip(self._proposed, trees, first_tokens, accepted, strict=True):
                    if cut is tree or len(nodes):
                        continue
                    graded = cut_first_level(tree, cut)  # the cut first-level nodes `observe` grades below
                    named = (node_sources(tree)[graded] == SOURCE_HEAD) & (tree.tokens[graded] == token)
                    cut_hits += int(named.any())
            self.model_pacing.judge(trees, accepted, verify_seconds + self.overhead_seconds, self.model_seconds,
                                    self.probe_pause(len(trees), full_logits), cut_hits)
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
                self.acceptance.update_nodes(step_scores(tree)[graded], node_sources(tree)[graded],
                                             tree.tokens[graded] == token, band)
        self.learn_forward(len(trees), rows, real_rows, verify_seconds, full_logits)

    def calibration_line(self) -> str:
        """One line for a worker's log (`VerifyCosts.calibration_line` at this sizer's budget)."""
        return super().calibration_line(self.max_budget)

    def describe(self) -> dict:
        return {**self.describe_latency(),
                "acceptance_by_band_and_source": self.acceptance.describe(),
                "model_ms": round(self.model_seconds * 1e3, 2), "overhead_ms": round(self.overhead_seconds * 1e3, 2),
                "packed": self.packed,
                "predicted_vs_observed": {k: round(v, 3) for k, v in self._check.items()},
                "bias": {"accepted_nodes": {("sampled" if k else "greedy"): round(b.ratio, 3)
                                            for k, b in self._gain_bias.items()},
                         "tree_seconds": {("full_logits" if k else "deferred"): round(b.ratio, 3)
                                          for k, b in self._tree_seconds_bias.items()}}}
