"""The cost model sizes trees without changing what is decoded.

Unit level: cut trees stay trees (hypothesis), the latency curve interpolates and follows
observations, the acceptance calibration converges to the observed rates, the sizer picks big
trees where rows are free and none where they are dear, and pauses a model that does not pay.
Engine level: `sizing: auto` decodes exactly what `ar` decodes (greedy, every tree drafter,
batched), and a head that was paused catches up to exactly the logits of one that never paused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_worker.calibration import make_sizer
from dart_worker.drafters.base import CommittedBlock
from dart_worker.drafters.head import CATCH_UP_ROWS, DDTreeDrafter
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.head.draft_head import DartDraftHead
from dart_worker.sampling.params import GREEDY, SamplingParams, temperature_band
from dart_worker.sizing import acceptance, latency, pacing
from dart_worker.sizing.acceptance import SCORE_EDGES, AcceptanceModel, RowAcceptance
from dart_worker.sizing.bias import BIAS_RANGE, OnlineBias
from dart_worker.sizing.drain import END_SPREAD, Drain, depth_survival, draining_outlook, row_pace
from dart_worker.sizing.latency import LatencyModel
from dart_worker.sizing.pacing import PROBE_DOUBLINGS, PROBE_EVIDENCE_ROUNDS, PROBE_SHARE
from dart_worker.sizing.sizer import TreeSizer
from dart_worker.target.adapter import TargetAdapter
from ngram_native import DraftTree, TreeParams
from ngram_native.trees import SOURCE_CONTEXT, SOURCE_HEAD, subtree
from tests.hypothesis_budget import examples
from tests.tiny_models import tiny_model

VOCAB = 32


@st.composite
def scored_trees(draw, max_nodes: int = 24) -> DraftTree:
    """Random canonical trees with path scores that never grow along a path, random sources."""
    n = draw(st.integers(0, max_nodes))
    parents, depths, scores, tokens = [], [], [], []
    for i in range(n):
        parent = draw(st.integers(-1, i - 1))
        parents.append(parent)
        depths.append(1 if parent < 0 else depths[parent] + 1)
        base = 0.0 if parent < 0 else scores[parent]
        scores.append(base - draw(st.floats(0, 3)))
        tokens.append(i)  # distinct, so siblings never collide
    order = sorted(range(n), key=lambda i: (depths[i], -scores[i], i))
    # Re-number into canonical order (by depth, then parent's new index, then score).
    new = {}
    ranked = []
    for depth in range(1, max(depths, default=0) + 1):
        level = [i for i in order if depths[i] == depth]
        level.sort(key=lambda i: (new.get(parents[i], -1), -scores[i], tokens[i]))
        for i in level:
            new[i] = len(ranked)
            ranked.append(i)
    sources = draw(st.lists(st.sampled_from([SOURCE_HEAD, SOURCE_CONTEXT, SOURCE_HEAD | SOURCE_CONTEXT]),
                            min_size=n, max_size=n))
    tree = DraftTree(np.array([tokens[i] for i in ranked], np.int32),
                     np.array([new[parents[i]] if parents[i] >= 0 else -1 for i in ranked], np.int32),
                     np.array([depths[i] for i in ranked], np.int32),
                     np.array([scores[i] for i in ranked], np.float64),
                     np.array([sources[i] for i in ranked], np.uint8))
    tree.validate()
    return tree


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return set(paths)


@settings(max_examples=examples(150), deadline=None)
@given(scored_trees(), st.integers(0, 30), st.data())
def test_cut_trees_are_the_best_prefix_closed_nodes(tree, size, data):
    sizer = TreeSizer(LatencyModel([1, 64], [1.0, 1.0 + 1e-9]), max_budget=64)
    # Pre-train the calibration on random outcomes so probabilities are not just the prior.
    for _ in range(data.draw(st.integers(0, 3))):
        hits = np.flatnonzero(np.asarray(data.draw(st.lists(st.booleans(), min_size=tree.size,
                                                            max_size=tree.size)), dtype=bool))
        sizer.acceptance.update(tree, hits)
    probs = sizer.acceptance.probabilities(tree)
    assert all(probs[i] <= probs[p] for i, p in enumerate(tree.parents) if p >= 0)
    # Brute force: the product of the calibrated step rates along each node's path.
    bins = np.searchsorted(SCORE_EDGES, np.minimum(acceptance.step_scores(tree), 0.0))
    sources = acceptance.node_sources(tree)
    for i in range(tree.size):
        path, node = 1.0, i
        while node >= 0:
            rate = sizer.acceptance._rates(GREEDY, int(sources[node]))[bins[node]]
            path, node = path * rate, int(tree.parents[node])
        assert probs[i] == pytest.approx(path, rel=1e-12)
    order = np.lexsort((np.arange(tree.size), -probs))[:size]
    keep = np.zeros(tree.size, dtype=bool)
    keep[order] = True
    cut = subtree(tree, keep)
    cut.validate()
    assert cut.size == min(size, tree.size)
    assert _paths(cut) <= _paths(tree)
    # The kept nodes are the best by calibrated probability: nothing left out beats a kept node.
    if 0 < cut.size < tree.size:
        assert probs[~keep].max() <= probs[keep].min()


def test_latency_interpolates_extrapolates_and_follows_observations():
    model = LatencyModel([1, 4, 16], [0.1, 0.2, 0.5])
    assert model.predict(1) == pytest.approx(0.1)
    assert model.predict(10) == pytest.approx(0.35)
    assert model.predict(32) == pytest.approx(0.5 + 16 * 0.3 / 12)
    for _ in range(40):  # the machine got slower at 16 rows: the curve follows ...
        model.update(16, 0.75)
    assert model.predict(16) == pytest.approx(0.75, rel=0.05)
    assert np.all(np.diff(model.seconds) >= 0)
    for _ in range(40):  # ... but never past four 4-row forwards (0.8 s): more rows never cost more per row
        model.update(16, 2.0)
    assert model.predict(16) == pytest.approx(0.8)
    for _ in range(40):  # ... and cheaper at 4 rows pulls 1 row down with it (never above 4 rows)
        model.update(4, 0.05)
    assert model.predict(4) == pytest.approx(0.05, rel=0.05)
    assert model.predict(1) <= model.predict(4)


def test_a_grid_point_that_a_burst_of_load_made_dear_is_capped_per_row():
    """Measured 8 rows at 0.34 s, then 16 rows at 2.4 s (a burst elsewhere on the machine): 16
    rows cannot cost more than two 8-row forwards, so the sizer still sees trees of 15 nodes as
    affordable instead of never trying (and never re-measuring) them."""
    model = LatencyModel([1, 2, 4, 8, 16, 32], [0.13, 0.22, 0.28, 0.34, 2.4, 2.6])
    assert model.predict(16) == pytest.approx(0.68)
    assert model.predict(32) == pytest.approx(1.36)
    assert np.all(np.diff(model.seconds) >= 0) and np.all(np.diff(model.seconds / model.rows) <= 1e-12)


def test_calibration_line_names_costs_and_the_cheap_tree_size():
    # 100 ms for one row, +10 ms per further row: root + 10 nodes cost 200 ms, two plain steps.
    sizer = TreeSizer(LatencyModel([1, 128], [0.1, 0.1 + 127 * 0.01]), max_budget=32)
    line = sizer.calibration_line()
    assert "{1: 100, 16: 250, 64: 730, 256: 2650}" in line
    assert "trees up to 32 nodes, at most 10 for under two plain steps" in line
    flat = TreeSizer(LatencyModel([1, 128], [0.1, 0.1]), max_budget=32)  # a GPU: rows are free
    assert "at most 32 for under two plain steps" in flat.calibration_line()


def test_acceptance_calibrates_to_the_observed_rate_per_source():
    model = AcceptanceModel()
    tree = DraftTree(np.array([5, 6], np.int32), np.array([-1, -1], np.int32), np.array([1, 1], np.int32),
                     np.array([-0.1, -0.1]), np.array([SOURCE_HEAD, SOURCE_CONTEXT], np.uint8))
    rng = np.random.default_rng(0)
    for _ in range(2000):  # the head's -0.1 nodes are right 20% of the time, the context's 90%
        hits = [i for i, rate in enumerate((0.2, 0.9)) if rng.random() < rate]
        model.update(tree, np.array(hits, dtype=np.int64))
    head, context = model.probabilities(tree)
    assert head == pytest.approx(0.2, abs=0.03)
    assert context == pytest.approx(0.9, abs=0.03)


def _chain(scores: list[float], source: int = SOURCE_HEAD) -> DraftTree:
    n = len(scores)
    return DraftTree(np.arange(n, dtype=np.int32) + 3, np.arange(-1, n - 1, dtype=np.int32),
                     np.arange(1, n + 1, dtype=np.int32), np.array(scores, np.float64),
                     np.full(n, source, np.uint8))


def test_full_logits_rounds_are_priced_and_learnt_on_their_own_curves():
    """Rows are nearly free when only the walk's rows meet the vocabulary head and dear when every
    row does (a sampled round): the same confident chain is verified whole on a greedy round and
    not at all on a sampled one, and each round's forward teaches only its own curve."""
    confident = [_chain([-0.01 * (d + 1) for d in range(8)])]
    deferred = LatencyModel([1, 128], [0.05, 0.0500001])
    full = {1: LatencyModel([1, 2, 128], [0.06, 0.6, 40.0])}
    sizer = TreeSizer(deferred, max_budget=8, _latency_by_batch={1: deferred}, _full_logits_latency_by_batch=full)
    assert sizer.fit(confident, model_ran=False).trees[0].size == 8
    sized = sizer.fit(confident, model_ran=False, full_logits=True)
    assert sized.trees[0].size == 0 and sized.predicted_seconds == pytest.approx(0.06)
    before = deferred.describe()
    sizer.observe(sized.trees, [np.zeros(0, np.int64)], rows=1, verify_seconds=0.09, full_logits=True)
    assert deferred.describe() == before and float(full[1].predict(1)) > 0.06


def test_a_packed_block_is_priced_and_learnt_at_its_real_rows():
    """Exact shapes: a verify forward runs its real rows only (packed). One sequence of four has a
    confident 4-node chain: priced as a padded block of 4 x 5 rows it does not pay; priced at its
    8 real rows it does. Such a round teaches the curve at the rows it ran (8), not at the padded
    block's 20, on either logits path."""
    def curve() -> LatencyModel:
        return LatencyModel([4, 8, 16, 32], [0.2, 0.28, 0.44, 0.76])
    trees = [_chain([-0.01, -0.02, -0.03, -0.04], SOURCE_CONTEXT)] + [_chain([])] * 3
    padded = TreeSizer(LatencyModel([1, 2], [0.1, 0.11]), max_budget=4, _latency_by_batch={4: curve()})
    assert padded.fit(trees, model_ran=False, full_logits=True).trees[0].size == 0
    for full_logits in (False, True):
        learnt = curve()
        packed = TreeSizer(LatencyModel([1, 2], [0.1, 0.11]), max_budget=4, _latency_by_batch={4: learnt},
                           packed=True)
        sized = packed.fit(trees, model_ran=False, full_logits=full_logits)
        assert sized.trees[0].size == 4 and sized.predicted_seconds == pytest.approx(0.28)
        accepted = [np.arange(4)] + [np.zeros(0, np.int64)] * 3
        before = learnt.describe()
        packed.observe(sized.trees, accepted, rows=20, verify_seconds=0.28, full_logits=full_logits, real_rows=8)
        assert learnt.describe() == pytest.approx(before)
        packed.observe(sized.trees, accepted, rows=20, verify_seconds=0.4, full_logits=full_logits, real_rows=8)
        assert float(learnt.predict(8)) > 0.28 and float(learnt.predict(20)) < 0.6
        assert packed.describe()["packed"] is True


def test_online_bias_is_observed_over_predicted_shrunk_toward_one():
    bias = OnlineBias()
    assert bias.ratio == 1.0
    bias.add(1.0, 2.0)
    assert bias.ratio == pytest.approx((0.5 + 2.0) / 3.0)  # one round against BIAS_PRIOR_ROUNDS = 2
    for _ in range(300):
        bias.add(1.0, 2.0)
    assert bias.ratio == pytest.approx(0.5, abs=0.05)
    for _ in range(300):  # recent rounds outweigh old ones, and the ratio stays in range
        bias.add(50.0, 1.0)
    assert bias.ratio == pytest.approx(BIAS_RANGE[1], abs=0.2)


def test_tree_rounds_dearer_than_predicted_reprice_the_next_trees(monkeypatch):
    """One-node trees whose forwards cost 5x the extra over a plain step that the curve predicts
    (a curve that has not learnt it yet: its online step is switched off here): the bias learns
    the ratio (capped at BIAS_RANGE) and a tree that would pay at the predicted price, not at
    the real one, is no longer verified; with the bias held at 1 it still is."""
    monkeypatch.setattr(latency, "LATENCY_STEP", 0.0)

    def trained() -> TreeSizer:
        curve = LatencyModel([1, 2, 4, 8], [0.1, 0.11, 0.12, 0.14])
        sizer = TreeSizer(curve, max_budget=3, _latency_by_batch={1: curve})
        for _ in range(30):
            sized = sizer.fit([_chain([-0.01])], model_ran=False)
            assert sized.trees[0].size == 1
            sizer.observe(sized.trees, [np.array([0])], rows=2, verify_seconds=0.15)
        return sizer
    doubtful = [_chain([-1.2, -2.4, -3.6])]
    sizer = trained()
    assert sizer.describe()["bias"]["tree_seconds"]["deferred"] == pytest.approx(BIAS_RANGE[1], rel=0.15)
    assert sizer.fit(doubtful, model_ran=False).trees[0].size == 0
    monkeypatch.setattr(OnlineBias, "ratio", property(lambda self: 1.0))
    assert trained().fit(doubtful, model_ran=False).trees[0].size >= 1


def test_a_draining_batch_drafts_for_its_longest_row_and_for_others_only_where_their_place_pays():
    """Row 0 has a confident lookup chain; row 1 has nothing to draft. Here a second row per
    sequence costs 10% of a plain step of the batch: while rows wait for slots every token counts
    alike and row 0's tree pays. Once the batch drains, its end is row 1's: if row 0 is far ahead
    its token only frees its place a round sooner, which saves that place's share of the round's
    time outside the forward (none here: no tree; its forward row is what the tree's node costs);
    if row 0 is the longest its token brings the end a round nearer (a round of row 0 alone:
    0.19 s), and the tree pays. Level with row 1, row 0 is last about half the time (their later
    rounds spread them apart: `END_SPREAD`), so its token brings the end half a round nearer in
    expectation, and the tree pays too. Where the time outside the forward is dear, a place is
    worth its share of it, and the tree pays again."""
    confident = _chain([-0.01], SOURCE_CONTEXT)
    curve = LatencyModel([2, 4, 8], [0.2, 0.22, 0.26])
    sizer = TreeSizer(LatencyModel([1, 2], [0.19, 0.2]), max_budget=1, _latency_by_batch={2: curve})
    trees = [confident, _chain([])]
    assert sizer.drain(None, 2) is None and sizer.drain([40], 1) is None
    drain = sizer.drain([10, 40], 2)
    assert drain.row == pytest.approx(0.0) and drain.end_round == pytest.approx(0.19)
    assert sizer.drain([40, 38], 2).end_round == pytest.approx(0.2)  # within STRAGGLER_SLACK: both run to the end
    assert sizer.fit(trees, model_ran=False).trees[0].size == 1
    assert sizer.fit(trees, model_ran=False, remaining=[10, 40]).trees[0].size == 0
    assert sizer.fit(trees, model_ran=False, remaining=[40, 40]).trees[0].size == 1
    assert sizer.fit(trees, model_ran=False, remaining=[40, 10]).trees[0].size == 1
    sizer.overhead_seconds = 0.02  # a round's time outside the forward: half of it each sequence's
    assert sizer.drain([10, 40], 2).row == pytest.approx(0.01)
    assert sizer.fit(trees, model_ran=False, remaining=[10, 40]).trees[0].size == 0  # 0.01 against 0.02
    sizer.overhead_seconds = 0.2  # a place now saves 0.1 a round against the tree's 0.02
    assert sizer.drain([10, 40], 2).row == pytest.approx(0.1)
    assert sizer.fit(trees, model_ran=False, remaining=[10, 40]).trees[0].size == 1


def test_a_draining_batch_ends_with_the_row_of_most_rounds_left_and_moves_only_with_it():
    """Both rows have 40 tokens left, but row 0 has committed three tokens a round: it has about 13
    rounds left against row 1's 40, so row 1 alone sets the end. The end comes nearer by what the
    longest row after the round gains: a row level with the longest brings it nearer only as far
    as the other's tokens do too; every row's rounds gained free its place sooner."""
    curve = LatencyModel([2, 4, 8], [0.2, 0.22, 0.26])
    sizer = TreeSizer(LatencyModel([1, 2], [0.1, 0.11]), max_budget=1, _latency_by_batch={2: curve})
    assert sizer.drain([40, 40], 2, paces=[3.0, 1.0]).rounds == pytest.approx([40 / 3, 40])
    assert sizer.drain([40, 40], 2, paces=[3.0, 1.0]).end_round == pytest.approx(0.1)  # row 1 alone
    three = TreeSizer(LatencyModel([1, 2], [0.1, 0.11]), max_budget=1,
                      _latency_by_batch={3: LatencyModel([3, 6], [0.3, 0.33]), 2: LatencyModel([2, 4], [0.15, 0.2])})
    three.overhead_seconds = 0.03
    drain = three.drain([40, 40, 10], 3)
    assert drain.end_round == pytest.approx(0.15 + 0.03)  # two rows at the end, and the time outside
    assert drain.row == pytest.approx(0.01)  # a place's share of the time outside the forward
    apart = Drain(np.array([10.0, 12.0]), np.ones(2), end_round=0.1, row=0.01)
    accepted = _surely(np.array([[5, 0, 5], [0, 1, 3]]), depth=6)  # rows x candidate sizes, accepted for sure
    assert apart.saved_seconds(accepted) == pytest.approx([0.01 * 5, 0.1 * 1 + 0.01, 0.1 * 3 + 0.01 * 8])
    level = Drain(np.array([12.0, 12.0]), np.array([1.0, 2.0]), end_round=0.1, row=0.01)
    assert level.saved_seconds(accepted) == pytest.approx([0.01 * 5, 0.01 * 0.5, 0.1 * 1.5 + 0.01 * 6.5])
    assert row_pace(0, 10) == 1.0 and row_pace(8, 4) == pytest.approx(2.0)
    assert row_pace(8, 0) > row_pace(8, 12) > 1.0  # a short record leans on one token a round


def _surely(counts: np.ndarray, depth: int) -> np.ndarray:
    """[rows, sizes, depth] survival of rows that accept exactly `counts` [rows, sizes] nodes."""
    return (np.arange(1, depth + 1) <= counts[..., None]).astype(float)


def test_level_rows_move_the_end_by_the_least_of_their_chances_not_the_least_expectation():
    """Two rows level at 12 rounds left, each accepting one node with probability 1/2: the end
    comes nearer only when both do, a quarter of a round, where each expects half a node. One row
    ahead by a round: the level one alone sets the end."""
    half = np.array([[[0.5]], [[0.5]]])  # rows x one size x depth 1
    level = Drain(np.array([12.0, 12.0]), np.ones(2), end_round=0.1, row=0.01)
    assert level.expected_end(half) == pytest.approx([11.75])
    assert level.saved_seconds(half) == pytest.approx([0.1 * 0.25 + 0.01 * 1.0])
    ahead = Drain(np.array([12.0, 11.0]), np.ones(2), end_round=0.1, row=0.01)
    assert ahead.expected_end(half) == pytest.approx([11.5])
    sure = Drain(np.array([12.0, 12.0]), np.ones(2), end_round=0.1, row=0.01)
    assert sure.expected_end(np.array([[[0.5]], [[0.0]]])) == pytest.approx([12.0])  # the other row has no tree


@st.composite
def _outlooks(draw):
    rows, sizes, depth = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(0, 3))
    rounds = np.array([draw(st.integers(0, 8)) for _ in range(rows)], dtype=float)
    paces = np.array([draw(st.sampled_from([1.0, 1.5, 2.0, 3.0])) for _ in range(rows)])
    survival = np.array([[[draw(st.sampled_from([0.0, 0.2, 0.5, 0.9, 1.0])) for _ in range(depth)]
                          for _ in range(sizes)] for _ in range(rows)]).reshape(rows, sizes, depth)
    return rounds / paces, paces, np.minimum.accumulate(survival, axis=2)


@settings(max_examples=examples(200), deadline=None)
@given(_outlooks())
def test_expected_end_equals_brute_force_over_every_outcome(outlook):
    """E[max_b (rounds_b - G_b / pace_b)] against enumerating every combination of the rows'
    accepted counts, each with its probability (P(G = j) = P(G >= j) - P(G >= j + 1))."""
    rounds, paces, survival = outlook
    rows, sizes, depth = survival.shape
    drain = Drain(rounds, paces, end_round=1.0, row=0.0)
    padded = np.concatenate([np.ones((rows, sizes, 1)), survival, np.zeros((rows, sizes, 1))], axis=2)
    exact = -np.diff(padded, axis=2)  # [rows, sizes, depth + 1]: P(G = j)
    for size in range(sizes):
        expected = 0.0
        for counts in np.ndindex(*([depth + 1] * rows)):
            chance = np.prod([exact[b, size, j] for b, j in enumerate(counts)])
            expected += chance * max(rounds[b] - j / paces[b] for b, j in enumerate(counts))
        assert drain.expected_end(survival)[size] == pytest.approx(expected, abs=1e-9)


def _end_by_sampling(drain: Drain, survival: np.ndarray, size: int, draws: int, seed: int) -> float:
    """E[max_b (rounds_b - G_b / pace_b + e_b)] by sampling G_b (from `survival`) and e_b (normal,
    `drain.spread`) for one candidate size."""
    rng = np.random.default_rng(seed)
    rows, _, depth = survival.shape
    padded = np.concatenate([np.ones((rows, 1)), survival[:, size], np.zeros((rows, 1))], axis=1)
    exact = np.clip(-np.diff(padded, axis=1), 0.0, 1.0)
    accepted = np.stack([rng.choice(depth + 1, size=draws, p=p / p.sum()) for p in exact])
    later = drain.spread[:, None] * rng.standard_normal((rows, draws))
    ends = drain.rounds[:, None] - accepted / drain.paces[:, None] + later
    return float(ends.max(axis=0).mean())


@settings(max_examples=examples(30), deadline=None)
@given(_outlooks(), st.sampled_from([0.3, 1.0, 3.0]))
def test_expected_end_with_spread_equals_sampling_the_rows_and_their_later_rounds(outlook, spread):
    """With spread, each row's end is its rounds left less what it accepts, plus a normal of its
    spread: the grid integral against 200k sampled outcomes."""
    rounds, paces, survival = outlook
    drain = Drain(rounds, paces, end_round=1.0, row=0.0, spread=np.full(len(rounds), spread))
    ends = drain.expected_end(survival)
    for size in range(survival.shape[1]):
        assert ends[size] == pytest.approx(_end_by_sampling(drain, survival, size, 200_000, seed=size), abs=0.02)


def test_level_rows_drift_apart_so_each_moves_the_end_by_its_chance_of_being_last():
    """Four rows at a sampled batch's start: the same tokens left, no record (pace 1). Without
    spread the end moves only when all four accept: a row's sure token is worth nothing to the end.
    With the rows' later rounds spreading them apart, each is last a quarter of the time, so one
    row's sure token brings the end about a quarter of a round nearer; a row 10 rounds behind the
    others (spread 0.5 x sqrt(86) ~ 4.6 rounds) far less, and the row 10 rounds ahead of them most."""
    start = draining_outlook([96, 96, 96, 96], 4, lambda k: 0.1, 0.0)
    assert start.spread == pytest.approx(END_SPREAD * np.sqrt([96] * 4))
    one_sure = _surely(np.array([[0, 1], [0, 0], [0, 0], [0, 0]]), depth=1)  # row 0 accepts for sure at size 1
    nearer = start.expected_end(one_sure)[0] - start.expected_end(one_sure)[1]
    assert nearer == pytest.approx(0.25, abs=0.03)
    assert start._replace(spread=None).expected_end(one_sure)[1] == pytest.approx(96.0)  # the snapshot: not at all
    apart = draining_outlook([86, 96, 96, 106], 4, lambda k: 0.1, 0.0)
    moved = [apart.expected_end(_surely(np.eye(4, dtype=int)[b][:, None] * np.array([[0, 1]]), 1)) for b in range(4)]
    behind, level, ahead = (m[0] - m[1] for m in (moved[0], moved[1], moved[3]))
    assert behind < 0.05 < level < ahead and ahead > 0.5


def test_with_spread_no_tree_saves_nothing_whatever_the_trees_depth():
    """With spread the end expected with no trees lies beyond the longest row's rounds; a size
    without nodes must still save exactly nothing, and two calls whose trees differ in depth (the
    sizer's with-model and without-model trees) must price the same outcome alike."""
    drain = draining_outlook([60, 64, 64, 50], 4, lambda k: 0.1, 0.02)
    for depth in (1, 3, 7):
        none = np.zeros((4, 2, depth))
        assert drain.saved_seconds(none) == pytest.approx([0.0, 0.0], abs=1e-12)
    shallow = _surely(np.array([[0, 1], [0, 1], [0, 1], [0, 0]]), depth=1)
    deep = np.concatenate([shallow, np.zeros((4, 2, 5))], axis=2)  # the same outcome, deeper trees
    assert drain.saved_seconds(deep) == pytest.approx(drain.saved_seconds(shallow), abs=1e-4)


def test_depth_survival_adds_the_kept_nodes_of_each_depth():
    """A root with two children (0.5, 0.3) and a grandchild under the first (0.4): cut to 1 node
    the tree keeps the 0.5 child, to 2 the grandchild (0.4) before the 0.3 child."""
    depths, probs = np.array([1, 1, 2]), np.array([0.5, 0.3, 0.4])
    survival = depth_survival(depths, probs, np.arange(4), 2)
    assert survival == pytest.approx(np.array([[0, 0], [0.5, 0], [0.5, 0.4], [0.8, 0.4]]))
    assert depth_survival(depths[:0], probs[:0], np.arange(2), 2) == pytest.approx(np.zeros((2, 2)))


def test_a_row_whose_trees_were_not_accepted_gets_none_where_the_table_would_give_one():
    """Two rows with the same confident lookup node: the table expects it accepted, and it was,
    on row 1, every time; on row 0 never. Each row's record scales its own probabilities: row 0
    stops getting its node, row 1 keeps it. The record learns what the table expected of the
    verified (cut) tree, and forgets old trees (ROW_MEMORY)."""
    record = RowAcceptance()
    assert record.scale == 1.0
    record.add(0, 6.0)
    assert record.scale == pytest.approx(acceptance.ROW_PRIOR_NODES / (6.0 + acceptance.ROW_PRIOR_NODES))
    for _ in range(200):
        record.add(1, 1.0)
    assert record.scale == pytest.approx(1.0, abs=1e-6)

    def sizer():
        return TreeSizer(LatencyModel([1, 2], [0.1, 0.11]), max_budget=1,
                         _latency_by_batch={2: LatencyModel([2, 4], [0.2, 0.24])})

    confident = _chain([-0.01], SOURCE_CONTEXT)
    rows = [RowAcceptance(), RowAcceptance()]
    fitted = sizer()
    for _ in range(6):
        sized = fitted.fit([confident, confident], model_ran=False, rows=rows)
        accepted = [np.zeros(0, np.int64), np.arange(sized.trees[1].size)]
        fitted.observe(sized.trees, accepted, rows=2 * (1 + sized.trees[0].size), verify_seconds=0.24)
    assert rows[0].scale < 0.5 < 1.0 < rows[1].scale
    sized = sizer().fit([confident, confident], model_ran=False, rows=rows)
    assert [t.size for t in sized.trees] == [1, 1]  # a common size: row 1's node pays for both
    alone = TreeSizer(LatencyModel([1, 2], [0.1, 0.15]), max_budget=1)  # a node pays when p > 0.5
    assert alone.fit([confident], model_ran=False).trees[0].size == 1
    assert alone.fit([confident], model_ran=False, rows=[rows[0]]).trees[0].size == 0
    assert alone.fit([confident], model_ran=False, rows=[rows[1]]).trees[0].size == 1


def test_the_engine_hands_the_sizer_each_sequences_own_acceptance_record(model):
    """One `RowAcceptance` per request, the same object every round whatever its place in the batch
    (finished sequences leave holes that the last ones fill), and it learns from its trees."""
    engine = build_engine(_parts(model, with_head=False), "lookup", TreeParams(budget=4), sizing="auto")
    seen, live_prompts = [], []
    fit, propose = engine.sizer.fit, engine.drafter.propose
    engine.sizer.fit = lambda *a, rows=None, **k: seen.append(list(rows)) or fit(*a, rows=rows, **k)
    engine.drafter.propose = lambda tokens, caps: live_prompts.append([tuple(t[:12]) for t in tokens]) or propose(
        tokens, caps)
    prompts = [[5, 6, 7, 8] * 3, [9, 3, 4] * 4, [4, 4, 5] * 4, [7, 8, 9, 10] * 3]
    lengths = [6, 20, 14, 9]
    engine.generate(prompts, [SamplingParams(temperature=0.0, max_new_tokens=n) for n in lengths])
    assert len(seen) == len(live_prompts) and len(seen[-1]) < len(prompts)  # some finished before others
    owner = {}
    for rows, prompts_of_round in zip(seen, live_prompts, strict=True):
        assert len(rows) == len(prompts_of_round) == len({id(r) for r in rows})
        for record, prompt in zip(rows, prompts_of_round, strict=True):
            assert owner.setdefault(id(record), prompt) == prompt
    assert len(owner) == len(prompts)
    assert any(r.expected > 0 for rows in seen for r in rows)  # trees were verified and learnt from


def test_drafting_pauses_after_sampled_rounds_that_keep_nothing_and_resumes_at_a_kept_node():
    """A sampled batch of two rows whose trees are cut to nothing: after DRAFT_IDLE_ROUNDS such
    rounds drafting pauses 1, then 2, then 4 rounds (and no longer), and one round that keeps a
    node ends the back-off. Greedy batches and a single sampled row never pause."""
    hopeless, confident = _chain([-9.0]), _chain([-0.01], SOURCE_CONTEXT)
    sizer = TreeSizer(LatencyModel([1, 2, 4], [0.1, 0.1001, 0.1002]), max_budget=1)  # tree rows nearly free
    sampled = [temperature_band(0.8)] * 2

    def pauses(trees, bands):
        sizer.fit(trees, model_ran=False, bands=bands)
        skipped = 0
        while not sizer.drafting_wanted():
            skipped += 1
        return skipped

    idle = [hopeless, hopeless]
    assert [pauses(idle, sampled) for _ in range(pacing.DRAFT_IDLE_ROUNDS + 4)] == [0] * (
        pacing.DRAFT_IDLE_ROUNDS - 1) + [1, 2, 4, 4, pacing.DRAFT_PAUSE_MAX]
    assert pauses([confident, confident], sampled) == 0
    assert [pauses(idle, sampled) for _ in range(pacing.DRAFT_IDLE_ROUNDS)][-1] == 1  # counted afresh
    assert all(pauses(idle, [GREEDY, GREEDY]) == 0 for _ in range(8))
    assert all(pauses([hopeless], sampled[:1]) == 0 for _ in range(8))


@pytest.mark.parametrize("mode", ["lookup", "dart_lookup", "dart"])
def test_a_batch_that_pauses_drafting_still_commits_the_tokens_of_plain_sampling(model, monkeypatch, mode):
    """With drafting paused after every drafted round (1-4 plain steps), seeded sampled rows commit
    exactly what `ar` samples, and rounds both with and without trees ran."""
    monkeypatch.setattr(pacing, "DRAFT_IDLE_ROUNDS", 0)
    prompts = [[5, 6, 7, 8] * 3, [9, 3, 4] * 4, [4, 4, 5] * 4]
    params = [SamplingParams(temperature=0.8, seed=s, max_new_tokens=24) for s in range(3)]
    expected = [r.token_ids for r in build_engine(_parts(model, with_head=False), "ar").generate(prompts, params)]
    engine = build_engine(_parts(model, with_head=mode != "lookup"), mode, TreeParams(budget=4), sizing="auto")
    drafted = []
    wanted = engine.sizer.drafting_wanted
    engine.sizer.drafting_wanted = lambda: drafted.append(wanted()) or drafted[-1]
    assert [r.token_ids for r in engine.generate(prompts, params)] == expected
    assert True in drafted and False in drafted


def test_the_engine_hands_the_sizer_tokens_left_only_while_its_batch_drains(model):
    """Three requests, two slots: while the third waits, every token counts alike (None); once it
    has joined and nothing waits, the sizer gets each row's tokens left."""
    engine = build_engine(_parts(model, with_head=False), "lookup", TreeParams(budget=4), sizing="auto")
    seen = []
    fit = engine.sizer.fit
    engine.sizer.fit = lambda *a, remaining=None, **k: seen.append(remaining) or fit(*a, remaining=remaining, **k)
    prompts = [[5, 6, 7, 8] * 3, [9, 3, 4] * 4, [4, 4, 5] * 4]
    lengths = [6, 20, 20]
    engine.generate(prompts, [SamplingParams(temperature=0.0, max_new_tokens=n) for n in lengths], max_live=2)
    assert seen[0] is None and seen[-1] is not None
    first_draining = next(i for i, r in enumerate(seen) if r is not None)
    assert all(r is None for r in seen[:first_draining]) and all(r is not None for r in seen[first_draining:])
    assert all(len(r) >= 1 and max(r) <= 20 for r in seen[first_draining:])


def test_a_chain_of_equal_path_scores_is_priced_by_the_product_of_its_steps():
    """A context-lookup continuation that occurred once scores ln(1/1) = 0 at every depth. Each of
    its steps here is accepted half the time once its parent was, so depth d is on the accepted
    path with probability 0.5 ** d; a table keyed by path score prices every depth alike (the
    bin's average, ~0.16), the deep nodes far too high and the first far too low. Nodes under a
    rejected parent teach nothing."""
    chain = _chain([0.0] * 6, source=SOURCE_CONTEXT)
    model = AcceptanceModel()
    rng = np.random.default_rng(0)
    for _ in range(3000):
        depth = 0
        while depth < chain.size and rng.random() < 0.5:
            depth += 1
        model.update(chain, np.arange(depth), "1.0")
    assert model.probabilities(chain, "1.0") == pytest.approx(0.5 ** np.arange(1, 7), rel=0.15)
    untaught = AcceptanceModel()
    untaught.update(chain, np.zeros(0, np.int64), "1.0")
    assert untaught.offered[("1.0", SOURCE_CONTEXT)].sum() == 1


def test_sizer_drafts_deep_where_rows_are_free_and_not_at_all_where_they_are_dear():
    confident = [_chain([-0.05 * (d + 1) for d in range(16)])]
    free = TreeSizer(LatencyModel([1, 128], [0.05, 0.0500001]), max_budget=16)
    assert free.fit(confident, model_ran=True).trees[0].size == 16
    dear = TreeSizer(LatencyModel([1, 2, 128], [0.05, 0.5, 30.0]), max_budget=16)
    sized = dear.fit(confident, model_ran=True)
    assert sized.trees[0].size == 0
    # The model's trees never paid: it pauses with a growing back-off, then is probed again.
    pauses = []
    for _ in range(4):
        waited = 0
        while not dear.model_wanted():
            waited += 1
        pauses.append(waited)
        dear.fit(confident, model_ran=True)
    assert pauses == [1, 2, 4, 8]


def _sampled_round(sizer, trees, accepted=None, first_token=0):
    """One round of a sampled batch: fit, then observe it verified with `accepted` nodes (none by
    default) and `first_token` committed first."""
    sized = sizer.fit(trees, model_ran=True, bands=["1.0"] * len(trees))
    kept = [np.zeros(0, np.int64) for _ in trees] if accepted is None else accepted
    sizer.observe(sized.trees, kept, rows=1 + sum(t.size for t in sized.trees), verify_seconds=0.05,
                  bands=["1.0"] * len(trees), first_tokens=[first_token] * len(trees))
    return sized


def test_a_model_that_keeps_failing_on_sampled_rows_is_probed_at_most_a_share_of_the_time():
    """A model (a probe costs 3 plain steps) whose nodes bring nothing on sampled rows: it runs its
    first PROBE_EVIDENCE_ROUNDS rounds there whatever they bring (the table calibrates), then its
    first pause is the usual one round, then every pause is long enough that probes take at most
    PROBE_SHARE of the time, and each further failure doubles it (PROBE_DOUBLINGS times at most).
    On greedy rows the same failures keep the short back-off (a head that is usually right there
    misses only passingly), and one round where the model pays resets both."""
    confident = [_chain([-0.05 * (d + 1) for d in range(16)])]
    step = 0.05

    def waited(sizer):
        rounds = 0
        while not sizer.model_wanted():
            rounds += 1
        return rounds

    def dear_sizer():
        sizer = TreeSizer(LatencyModel([1, 2, 128], [step, 0.5, 30.0]), max_budget=16)
        for _ in range(2):  # the first call (one-time costs) is left out of the model's seconds
            sizer.record_model_seconds(3 * step)
        return sizer

    sampled = dear_sizer()
    explored = []
    for _ in range(PROBE_EVIDENCE_ROUNDS):
        _sampled_round(sampled, confident, first_token=99)  # nothing accepted, no cut node was right
        explored.append(waited(sampled))
    assert explored == [0] * PROBE_EVIDENCE_ROUNDS
    floor = sampled.probe_pause(1)
    assert abs(floor - 3 / PROBE_SHARE) <= 1  # ~300 rounds: a probe of 3 steps is 1% of 300 steps
    pauses = []
    for _ in range(7):
        _sampled_round(sampled, confident, first_token=99)
        pauses.append(waited(sampled))
    assert pauses == [1, floor, 2 * floor, 4 * floor, 8 * floor, 8 * floor, 8 * floor]
    assert PROBE_DOUBLINGS == 3
    greedy = dear_sizer()
    greedy_pauses = []
    for _ in range(3):
        greedy.fit(confident, model_ran=True, bands=[GREEDY])
        greedy_pauses.append(waited(greedy))
    assert greedy_pauses == [1, 2, 4]

    cheap = TreeSizer(LatencyModel([1, 128], [step, step * 1.0000001]), max_budget=16)
    for _ in range(2):
        cheap.record_model_seconds(3 * step)
    cheap.model_pacing.sampled_rounds = PROBE_EVIDENCE_ROUNDS
    cheap.model_pacing.failed_probes, cheap.model_pacing.pause_length = 5, 8
    sized = cheap.fit(confident, model_ran=True, bands=["1.0"])  # free rows: the model's deep tree pays
    cheap.observe(sized.trees, [np.arange(4)], rows=17, verify_seconds=step, bands=["1.0"])  # and it did
    assert cheap.model_wanted() and cheap.model_pacing.failed_probes == 0 and cheap.model_pacing.pause_length == 1


def test_a_sampled_round_credits_the_head_with_the_right_first_level_node_its_cut_left_out():
    """A cut tree that accepted nothing, where a head-only first-level node the cut left out was the
    committed token: the head named it, so the round counts one head token (and the model pays where
    one token is worth its seconds); with another token committed it fails."""
    siblings = DraftTree(np.array([3, 4, 5], np.int32), np.array([-1, -1, -1], np.int32),
                         np.array([1, 1, 1], np.int32), np.array([-0.1, -1.0, -2.0]), np.full(3, SOURCE_HEAD, np.uint8))

    def judged(first_token):
        dear = TreeSizer(LatencyModel([1, 2, 128], [0.05, 0.5, 30.0]), max_budget=8)
        for _ in range(2):
            dear.record_model_seconds(0.005)  # a tenth of a plain step
        dear.model_pacing.sampled_rounds = PROBE_EVIDENCE_ROUNDS
        sized = _sampled_round(dear, [siblings], first_token=first_token)
        assert sized.trees[0].size == 0  # the cut left every node out
        return dear.model_pacing

    named = judged(first_token=5)
    assert named.pause_left == 0 and named.failed_probes == 0
    missed = judged(first_token=7)
    assert missed.pause_left >= 1 and missed.failed_probes == 1


def test_a_sampled_round_the_table_expects_to_pay_counts_only_if_its_head_nodes_were_accepted():
    """At T=1 the acceptance table can be optimistic about the head's rarely observed bins; a
    probe it expects to pay counts as paying only if the round's head-only nodes were accepted
    enough to be worth the model's seconds (h (S + m) > T m). Nodes another source also proposed
    do not count: without the model they would have been drafted anyway."""
    step = 0.05

    def sizer_after_probe(sources: int, accepted: int, band: str = "1.0"):
        sizer = TreeSizer(LatencyModel([1, 128], [step, step * 1.0000001]), max_budget=16)
        for _ in range(2):
            sizer.record_model_seconds(step)  # the model costs a plain step
        sizer.model_pacing.failed_probes, sizer.model_pacing.pause_length = 1, 4
        sizer.model_pacing.sampled_rounds = PROBE_EVIDENCE_ROUNDS  # past the rounds it runs whatever they bring
        tree = _chain([-0.05 * (d + 1) for d in range(16)], sources)
        sized = sizer.fit([tree], model_ran=True, bands=[band])
        assert sized.trees[0].size == 16  # the table expects the deep head tree to pay
        sizer.observe(sized.trees, [np.arange(accepted)], rows=17, verify_seconds=step, bands=[band])
        return sizer

    # One head node accepted: 2 tokens in 2 steps' time against 1 token in 1 step: not worth it.
    missed = sizer_after_probe(SOURCE_HEAD, accepted=1)
    assert not missed.model_wanted() and missed.model_pacing.failed_probes == 2
    # The second failure: the probing floor.
    assert missed.model_pacing.pause_left + 1 >= 0.9 * missed.probe_pause(1) > 32
    # Three: 4 tokens in 2 steps against 1 in 1: it paid, the back-off resets.
    paid = sizer_after_probe(SOURCE_HEAD, accepted=3)
    assert paid.model_wanted() and paid.model_pacing.failed_probes == 0 and paid.model_pacing.pause_length == 1
    # The same three nodes, also proposed by the context lookup: the model added nothing.
    shared = sizer_after_probe(SOURCE_HEAD | SOURCE_CONTEXT, accepted=3)
    assert not shared.model_wanted() and shared.model_pacing.failed_probes == 2
    # Greedy rows keep the table's verdict (and their short back-off).
    greedy = sizer_after_probe(SOURCE_HEAD, accepted=0, band=GREEDY)
    assert greedy.model_wanted() and greedy.model_pacing.pause_length == 1


def test_the_models_first_call_is_left_out_of_its_seconds():
    sizer = TreeSizer(LatencyModel([1, 128], [0.05, 0.1]), max_budget=16)
    sizer.record_model_seconds(5.0)  # the first call: one-time costs, a whole prompt's rows
    assert sizer.model_seconds == 0.0
    sizer.record_model_seconds(0.02)
    sizer.record_model_seconds(0.03)
    assert sizer.model_seconds == pytest.approx(0.8 * 0.02 + 0.2 * 0.03)


def test_sizer_keeps_context_nodes_when_only_they_pay():
    head_only = _chain([-3.0 - d for d in range(8)])
    context = _chain([-0.01 * (d + 1) for d in range(8)], SOURCE_CONTEXT)
    sizer = TreeSizer(LatencyModel([1, 2, 128], [0.1, 0.11, 2.0]), max_budget=8)
    for _ in range(2):  # (the first call is left out as warm-up)
        sizer.record_model_seconds(0.2)  # the head costs twice a step: not worth it for its nodes
    merged = sizer.fit([context], model_ran=True)
    assert merged.trees[0].size >= 4 and set(merged.trees[0].sources.tolist()) == {SOURCE_CONTEXT}
    sizer.fit([head_only], model_ran=True)
    assert not sizer.model_wanted()


def test_each_batch_size_learns_its_own_curve_from_the_calibrations_shape():
    """One sequence: 1 row 100 ms, 2 rows 110 ms (a 1-node tree nearly free). At batch 16 the
    plain step costs 400 ms and 2 rows per sequence 800 ms: the sizer must learn that there
    without forgetting that one sequence's tree is still nearly free."""
    confident = _chain([-0.3])  # accepted about 3 times in 4
    sizer = TreeSizer(LatencyModel([1, 2, 16, 32, 64], [0.10, 0.11, 0.20, 0.28, 0.40]), max_budget=1)
    assert sizer.fit([confident], model_ran=False).trees[0].size == 1
    batch = [confident] * 16
    nothing = [np.zeros(0, np.int64)] * 16
    sizer.observe([_chain([])] * 16, nothing, rows=16, verify_seconds=0.40)  # first round at 16: the level
    assert sizer.latency_for(16).predict(16) == pytest.approx(0.40)
    assert sizer.latency_for(16).predict(32) == pytest.approx(0.56)  # the calibration's shape, x2
    assert sizer.latency_for(1) is sizer.latency  # batch 1 has not run: still the calibration
    for _ in range(30):  # rounds of 1-node trees at 16: the real cost of 32 rows is 800 ms
        sizer.observe(batch, [np.array([0])] * 12 + [np.zeros(0, np.int64)] * 4, rows=32, verify_seconds=0.80)
    assert sizer.latency_for(16).predict(32) == pytest.approx(0.80, rel=0.05)
    assert all(t.size == 0 for t in sizer.fit(batch, model_ran=False).trees)
    assert sizer.fit([confident], model_ran=False).trees[0].size == 1  # batch 1 untouched
    assert set(sizer.describe()["latency_ms_by_batch_and_rows"]) == {16}


def _parts(model, with_head: bool = True) -> EngineParts:
    head = None
    if with_head:
        torch.manual_seed(7)
        head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4)
    return EngineParts(target=TargetAdapter(model), head=head, eos_token_ids=())


@pytest.fixture(scope="module")
def model():
    return tiny_model("gemma3", vocab_size=VOCAB)


@pytest.mark.parametrize("mode", ["chain", "ddtree", "dart", "lookup", "dart_lookup", "ddtree_lookup"])
def test_auto_sizing_decodes_what_ar_decodes(model, mode):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (7, 19, 12)]
    prompts.append([5, 6, 7, 8] * 5)  # repeats: lookup drafts, context nodes are sized too
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    parts = _parts(model)
    expected = [r.token_ids for r in build_engine(parts, "ar").generate(prompts, params)]
    engine = build_engine(parts, mode, TreeParams(budget=12), sizing="auto")
    assert engine.sizer is not None
    for _ in range(2):  # the second call starts from a calibrated model
        assert [r.token_ids for r in engine.generate(prompts, params)] == expected


def test_a_deferring_engine_fits_and_learns_sampled_rounds_on_full_logits_curves(model):
    """A greedy round of an engine that defers the vocabulary projection projects only the rows its
    walk reads, a sampled round every row: each is priced and learnt on the curves of its own forwards."""
    engine = build_engine(_parts(model, with_head=False), "lookup", TreeParams(budget=4), defer_logits=True,
                          sizing="auto")
    sizer = engine.sizer
    paths = []
    fit, observe = sizer.fit, sizer.observe
    sizer.fit = lambda *a, full_logits, **k: paths.append(("fit", full_logits)) or fit(*a, full_logits=full_logits, **k)
    sizer.observe = lambda *a, full_logits, **k: (paths.append(("observe", full_logits)),
                                                  observe(*a, full_logits=full_logits, **k))[1]
    prompt = [[5, 6, 7, 8] * 4]

    def curves() -> tuple[dict, dict]:
        described = sizer.describe()
        return described["latency_ms_by_batch_and_rows"], described["latency_ms_by_batch_and_rows_full_logits"]

    deferred, full = curves()
    engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=12))
    assert paths and {flag for _, flag in paths} == {False}
    assert curves()[1] == full and curves()[0] != deferred
    paths.clear()
    deferred = curves()[0]
    engine.generate(prompt, SamplingParams(temperature=1.0, seed=3, max_new_tokens=12))
    assert paths and {flag for _, flag in paths} == {True}
    assert curves()[0] == deferred and curves()[1] != full


def test_paused_engine_still_decodes_what_ar_decodes(model):
    """A sizer that pauses the head every other round: the head catches up, outputs stay exact."""
    prompts = [[3, 4, 5, 9, 11, 3, 4], [7] * 9]
    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    parts = _parts(model)
    expected = [r.token_ids for r in build_engine(parts, "ar").generate(prompts, params)]
    engine = build_engine(parts, "dart", TreeParams(budget=8), sizing="auto")
    flips = iter(range(10_000))
    engine.sizer.model_wanted = lambda: next(flips) % 2 == 0
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == expected
    assert all(r.stats.stage_seconds["draft"] > 0 for r in results)


def test_sizing_fixed_or_zero_budget_has_no_sizer(model):
    parts = _parts(model)
    assert build_engine(parts, "dart", TreeParams(budget=8), sizing="fixed").sizer is None
    assert build_engine(parts, "ar", sizing="auto").sizer is None
    with pytest.raises(ValueError, match="sizing"):
        make_sizer(parts.target, "sometimes", 8, False)


def test_a_paused_head_catches_up_to_the_logits_of_one_that_never_paused(model):
    target = TargetAdapter(model)
    torch.manual_seed(11)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4)
    eager, lazy = (DDTreeDrafter(head, TreeParams(budget=8), ()) for _ in range(2))
    state = target.new_state(2)
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7]]
    out = target.prefill(state, prompts)
    tokens = [[*p, 1] for p in prompts]
    for drafter in (eager, lazy):
        drafter.observe(CommittedBlock(out.taps, [range(5), range(3)], tokens, joined=True))
    eager.run_model(True)
    # Three rounds of committed rows (random taps stand in for verify forwards).
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        taps = torch.randn(2, 4, out.taps.shape[-1], generator=gen)
        rows = [[0, 1], [0]] if step % 2 == 0 else [[0], [0, 2, 3]]
        for b, r in enumerate(rows):
            tokens[b] = tokens[b] + [10 + step] * len(r)
        for drafter in (eager, lazy):
            drafter.observe(CommittedBlock(taps, rows, [list(t) for t in tokens]))
        eager.run_model(True)
    lazy.run_model(True)  # one call over everything since the prefill
    torch.testing.assert_close(lazy.logits, eager.logits, rtol=1e-4, atol=1e-4)
    assert np.array_equal(lazy.cache.lengths, eager.cache.lengths)


def test_first_level_nodes_the_cut_left_out_are_graded_by_the_committed_token():
    """Verification commits the target's own first token whatever the tree, so a cut first-level
    node counts as accepted exactly when its token is that one; verified nodes are counted once,
    deeper cut nodes not at all (their fate needs tokens later rounds commit)."""
    siblings = DraftTree(np.array([3, 4, 5, 6], np.int32), np.array([-1, -1, -1, 0], np.int32),
                         np.array([1, 1, 1, 2], np.int32), np.array([-0.1, -1.0, -2.0, -0.2]),
                         np.full(4, SOURCE_HEAD, np.uint8))
    dear = TreeSizer(LatencyModel([1, 2, 128], [0.05, 0.5, 30.0]), max_budget=8)
    sized = dear.fit([siblings], model_ran=False, bands=["1.0"])
    assert sized.trees[0].size == 0
    dear.observe(sized.trees, [np.zeros(0, np.int64)], rows=1, verify_seconds=0.05, bands=["1.0"], first_tokens=[5])
    accepted, offered = dear.acceptance.accepted[("1.0", SOURCE_HEAD)], dear.acceptance.offered[("1.0", SOURCE_HEAD)]
    assert offered.sum() == 3 and accepted.sum() == 1  # the three first-level nodes, token 5 was committed
    assert accepted[np.searchsorted(SCORE_EDGES, -2.0)] == 1

    free = TreeSizer(LatencyModel([1, 128], [0.05, 0.0500001]), max_budget=8)
    sized = free.fit([siblings], model_ran=False, bands=["1.0"])
    assert sized.trees[0].size == 4
    free.observe(sized.trees, [np.array([0, 3])], rows=5, verify_seconds=0.05, bands=["1.0"], first_tokens=[3])
    assert free.acceptance.offered[("1.0", SOURCE_HEAD)].sum() == 4  # verified only, none graded twice
    assert free.acceptance.accepted[("1.0", SOURCE_HEAD)].sum() == 2


def test_a_head_paused_for_long_reads_only_its_latest_rows(model):
    """A probe after a long pause reads at most CATCH_UP_ROWS of a sequence's missed rows (its cost
    must not grow with the pause), a prompt that joined while it was paused included; a head that
    runs every round reads a joiner's whole prompt."""
    target = TargetAdapter(model)
    torch.manual_seed(11)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4)
    drafter = DDTreeDrafter(head, TreeParams(budget=8), ())
    state = target.new_state(1)
    prompt = [3 + i % 20 for i in range(CATCH_UP_ROWS + 9)]  # longer than the window
    out = target.prefill(state, [prompt])
    tokens = [*prompt, 1]
    drafter.observe(CommittedBlock(out.taps, [range(len(prompt))], [tokens], joined=True))
    drafter.run_model(True)
    assert drafter.cache.lengths.tolist() == [len(prompt)] and drafter.cache.skipped.tolist() == [0]
    drafter.run_model(False)
    gen = torch.Generator().manual_seed(0)
    missed = CATCH_UP_ROWS + 7
    for _ in range(missed):
        tokens = [*tokens, 5]
        drafter.observe(CommittedBlock(torch.randn(1, 2, out.taps.shape[-1], generator=gen), [[0]], [tokens]))
    drafter.run_model(True)
    assert drafter.cache.lengths.tolist() == [len(prompt) + CATCH_UP_ROWS]
    assert drafter.cache.skipped.tolist() == [7] and drafter.cache.next_positions().tolist() == [len(tokens) - 1]
    # A sequence joins while the head is paused: the probe reads the latest rows of its prompt.
    drafter.run_model(False)
    tokens = [*tokens, 5]  # a round commits a row, then a sequence joins
    drafter.observe(CommittedBlock(torch.randn(1, 2, out.taps.shape[-1], generator=gen), [[0]], [tokens]))
    joined = target.new_state(1)
    out = target.prefill(joined, [prompt])
    drafter.observe(CommittedBlock(out.taps, [range(len(prompt))], [[*prompt, 1]], joined=True))
    drafter.run_model(True)
    assert drafter.cache.lengths.tolist() == [len(prompt) + CATCH_UP_ROWS + 1, CATCH_UP_ROWS]
    assert drafter.cache.next_positions().tolist() == [len(tokens) - 1, len(prompt)]


def test_acceptance_is_calibrated_per_temperature_band():
    """The same confident chain: accepted 9 times in 10 greedy, about never at T=1. A batch with
    one row of each keeps the greedy row's tree and drops the sampled row's; with one table for
    both, the sampled misses would have cut the greedy tree too (or the greedy hits kept both)."""
    chain = _chain([-0.05 * (d + 1) for d in range(4)])
    sizer = TreeSizer(LatencyModel([1, 2, 128], [0.1, 0.12, 1.4]), max_budget=4)
    rng = np.random.default_rng(0)
    for _ in range(60):
        greedy_hits = np.arange(4) if rng.random() < 0.9 else np.zeros(0, np.int64)
        sizer.observe([chain, chain], [greedy_hits, np.zeros(0, np.int64)], rows=10, verify_seconds=0.21,
                      bands=["greedy", "1.0"])
    greedy_p = sizer.acceptance.probabilities(chain, "greedy")
    sampled_p = sizer.acceptance.probabilities(chain, "1.0")
    assert greedy_p[0] > 0.8 and sampled_p[0] < 0.1
    alone = [sizer.fit([chain], model_ran=False, bands=[band]).trees[0].size for band in ("greedy", "1.0")]
    assert alone[0] >= 2 and alone[1] == 0
    assert set(sizer.acceptance.describe()) == {"greedy", "1.0"}
    # A band never seen starts from the prior, not from another band's table.
    assert sizer.acceptance.probabilities(chain, "0.7")[0] == pytest.approx(
        AcceptanceModel().probabilities(chain, "greedy")[0])


def test_a_sources_misses_in_observed_bins_lower_its_unobserved_bins():
    """The winner's curse: a sizer picks the nodes it rates highest, and unobserved bins are rated
    by their prior. A source whose -1.2 nodes (prior ~0.29) are right one time in ten is
    overconfident; its unobserved most confident bin must not keep the unscaled 0.975, nor must a
    source not seen yet in that band; another band's table is untouched."""
    model = AcceptanceModel()
    middling = _chain([-1.2])
    confident = _chain([-0.02])
    rng = np.random.default_rng(0)
    for _ in range(200):
        hits = np.array([0] if rng.random() < 0.1 else [], dtype=np.int64)
        model.update(middling, hits, "1.0")
    assert model.probabilities(middling, "1.0")[0] == pytest.approx(0.1, abs=0.04)
    assert model.scale("1.0", SOURCE_HEAD) == pytest.approx(0.1 / np.exp(-1.25), rel=0.25)
    assert model.probabilities(confident, "1.0")[0] < 0.45
    untouched = AcceptanceModel().probabilities(confident, "1.0")[0]
    assert untouched > 0.95
    assert model.probabilities(confident, "greedy")[0] == pytest.approx(untouched)
    # A source never seen in the band borrows the band's scale (pooled over its sources).
    other = _chain([-0.02], source=SOURCE_CONTEXT)
    assert model.probabilities(other, "1.0")[0] < 0.45
    # Evidence in the bin itself still wins over the scaled prior.
    for _ in range(400):
        model.update(confident, np.array([0], dtype=np.int64), "1.0")
    assert model.probabilities(confident, "1.0")[0] > 0.95


def test_describe_compares_what_the_sizer_predicted_with_what_its_rounds_did():
    """Each sized round adds its expected accepted nodes and predicted verify seconds, and the
    round's observation what happened: a model that expects more accepted nodes than it gets shows it."""
    sizer = TreeSizer(LatencyModel([1, 2, 128], [0.1, 0.12, 1.4]), max_budget=4)
    chain = _chain([-0.01, -0.02])
    expected = predicted = 0.0
    for _ in range(3):
        sized = sizer.fit([chain], model_ran=False)
        expected += sized.expected_tokens - 1
        predicted += sized.predicted_seconds
        accepted = np.arange(min(1, sized.trees[0].size))  # the first node right, the second never
        sizer.observe(sized.trees, [accepted], rows=1 + sized.trees[0].size, verify_seconds=0.2)
    sizer.observe([chain], [np.arange(2)], rows=3, verify_seconds=0.2)  # not sized by fit: not counted
    check = sizer.describe()["predicted_vs_observed"]
    assert check["rounds"] == 3 and check["verify_s"] == pytest.approx(0.6)
    assert check["expected_accepted"] == pytest.approx(expected, abs=1e-3) and expected > 3 * 0.9
    assert check["predicted_verify_s"] == pytest.approx(predicted, abs=1e-3)
    assert 1 <= check["accepted"] <= 3
