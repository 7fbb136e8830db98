"""Bucketed verify shapes (the `shapes` kernel strategy) change no result and few shapes are seen.

On CUDA the verify block's rows per sequence and its cached context are rounded up to buckets
(`dart_worker.target.shape_buckets`) so CUDA graphs can capture the forwards; here both strategies run
on CPU tensors: greedy output equals `ar`, seeded sampling commits `ar`'s tokens, the verify
logits of the real rows are the exact ones, and a bucketed job's forwards come from the buckets.
Under continuous batching the live batch shrinks in a job's tail; bucketed, the forward's batch
stays a bucket (capped at max_live): padding sequences after the live ones, which change nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dart_worker.hardware import kernels
from dart_worker.sampling.params import SamplingParams
from dart_worker.sizing.latency import LatencyModel
from dart_worker.sizing.sizer import TreeSizer
from dart_worker.target import shape_buckets
from dart_worker.target.adapter import TargetAdapter
from dart_worker.target.shape_buckets import batch_bucket, context_bucket, rows_bucket, rows_buckets
from ngram_native.trees import DraftTree
from tests.test_engine import greedy, make_engine, random_prompts
from tests.test_kernels import prompts, ragged_trees
from tests.tiny_models import FAMILIES, tiny_model

ROW_BUCKETS = {1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128}
CONTEXT_BUCKETS = {0, 64, 96, 128, 192, 256, 384, 512, 768, 1024}


def test_buckets_round_up_to_a_small_set():
    for n in range(1, 129):
        assert rows_bucket(n) >= n and rows_bucket(n) in ROW_BUCKETS
        assert rows_bucket(n) <= max(8, 1.5 * n)  # padding at most half the real rows (past 8)
    for n in range(0, 1025):
        assert context_bucket(n) >= n and context_bucket(n) in CONTEXT_BUCKETS
    assert [rows_bucket(b) for b in (1, 2, 4, 8, 16, 32)] == [1, 2, 4, 8, 16, 32]  # the calibration grid
    assert context_bucket(128) == 128  # the calibration's context
    assert rows_buckets(np.array([1, 3, 9, 17])).tolist() == [1, 4, 12, 24]
    with pytest.raises(ValueError):
        rows_bucket(0)


def test_batch_buckets_are_the_rows_family_capped_at_max_live():
    for n in range(1, 129):
        assert batch_bucket(n) == rows_bucket(n)
        for max_live in (n, n + 1, 5, 24, 1000):
            if n <= max_live:
                assert n <= batch_bucket(n, max_live) == min(rows_bucket(n), max_live)
    assert [batch_bucket(n, 5) for n in range(1, 6)] == [1, 2, 4, 4, 5]
    assert [batch_bucket(n, 64) for n in (33, 49, 64)] == [48, 64, 64]
    with pytest.raises(ValueError):
        batch_bucket(0)


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_sequences_change_no_logits_and_commit_nothing(family):
    """Verify of 3 sequences, alone and with 2 padding sequences after them (`resize_batch`, a
    root-only tree each): the live rows' logits and cache are the same, the padding stays empty,
    and narrowing back drops it (joiners then take its rows)."""
    model = tiny_model(family)
    outs = {}
    for padding in (0, 2):
        adapter = TargetAdapter(model)
        state = adapter.new_state(3)
        adapter.prefill(state, prompts())
        state.resize_batch(3 + padding)
        assert state.lengths.tolist()[3:] == [0] * padding
        ids, depth, ancestor, _ = ragged_trees(3, seed=3)
        if padding:
            width = ids.shape[1]
            ids = torch.cat([ids, torch.full((padding, width), 7)])
            depth = torch.cat([depth, torch.zeros(padding, width, dtype=depth.dtype)])
            ancestor = torch.cat([ancestor, torch.eye(width, dtype=torch.bool).expand(padding, -1, -1)])
        out = adapter.verify(state, ids, depth, ancestor, bucketed=True)
        assert out.logits.shape[0] == 3 + padding
        adapter.commit(state, state.cache_len() - ids.shape[1], [[0, 1], [0], [0, 2]] + [[]] * padding)
        assert state.lengths.tolist()[3:] == [0] * padding
        state.resize_batch(3)
        follow = adapter.verify(state, ids[:3, :1], depth[:3, :1], ancestor[:3, :1, :1])
        outs[padding] = out.logits[:3].float(), follow.logits.float(), state.lengths.tolist()
    torch.testing.assert_close(outs[2][0], outs[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[2][1], outs[0][1], atol=1e-5, rtol=1e-5)
    assert outs[2][2] == outs[0][2]


@pytest.mark.parametrize("family", FAMILIES)
def test_bucketed_verify_gives_the_exact_logits_of_the_real_rows(family):
    """Verify of ragged trees, exact vs bucketed (context widened, rows padded): the real rows'
    logits and the committed cache are the same; the block starts where the padding ends."""
    model = tiny_model(family)
    outs = {}
    for bucketed in (False, True):
        adapter = TargetAdapter(model)
        state = adapter.new_state(3)
        adapter.prefill(state, prompts())
        ids, depth, ancestor, _ = ragged_trees(3, seed=3)
        width = ids.shape[1]
        if bucketed:
            pad = rows_bucket(width) - width + 3
            ids = torch.nn.functional.pad(ids, (0, pad))
            depth = torch.nn.functional.pad(depth, (0, pad))
            ancestor = torch.nn.functional.pad(ancestor, (0, pad, 0, pad))
            ancestor[:, width:, width:] = torch.eye(pad, dtype=torch.bool)
        before = state.cache_len()
        out = adapter.verify(state, ids, depth, ancestor, bucketed=bucketed)
        start = state.cache_len() - ids.shape[1]
        assert start == (context_bucket(before) if bucketed else before)
        assert context_bucket(before) > before  # the padding did happen (30-token prompt: 64 slots)
        adapter.commit(state, start, [[0, 1], [0], [0, 2]])
        follow = adapter.verify(state, ids[:, :1], depth[:, :1], ancestor[:, :1, :1])
        outs[bucketed] = out.logits[:, :width].float(), follow.logits.float(), state.lengths.tolist()
    torch.testing.assert_close(outs[True][0], outs[False][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[True][1], outs[False][1], atol=1e-5, rtol=1e-5)
    assert outs[True][2] == outs[False][2]


def verify_shapes(engine) -> list[tuple[int, int, int]]:
    """(batch, rows, context slots) of every verify forward `engine` runs from now on."""
    seen = []
    verify = engine.target.verify

    def recording(state, tokens, *args, **kwargs):
        out = verify(state, tokens, *args, **kwargs)
        seen.append((int(tokens.shape[0]), int(tokens.shape[1]), state.cache_len() - int(tokens.shape[1])))
        return out

    engine.target.verify = recording
    return seen


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["ddtree", "dart", "chain"])
def test_bucketed_engine_equals_ar_greedy_and_seeded(family, mode):
    """Greedy (ragged prompts, continuous batching) equals `ar`; seeded sampling commits `ar`'s
    tokens; every verify forward of the bucketed engine has bucket shapes."""
    model = tiny_model(family, vocab_size=32)
    requests = random_prompts(5, seed=11)
    expected = [r.token_ids for r in make_engine(model, "ar").generate(requests, greedy(24))]
    sampled = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_new_tokens=16) for s in range(5)]
    expected_sampled = [r.token_ids for r in make_engine(model, "ar").generate(requests, sampled)]
    for shapes in ("exact", "bucketed"):
        with kernels.forced(shapes=shapes):
            engine = make_engine(model, mode, budget=10)
        assert engine.bucketed == (shapes == "bucketed")
        seen = verify_shapes(engine)
        assert [r.token_ids for r in engine.generate(requests, greedy(24), max_live=3)] == expected
        assert [r.token_ids for r in engine.generate(requests, sampled, max_live=2)] == expected_sampled
        if shapes == "bucketed":
            assert all(rows in ROW_BUCKETS and context in CONTEXT_BUCKETS for _, rows, context in seen)
        else:
            assert any(rows not in ROW_BUCKETS or context not in CONTEXT_BUCKETS for _, rows, context in seen)


def test_bucketed_sizer_prices_a_size_at_its_buckets_cost():
    """With buckets, a size costs its bucket's forward (9 nodes = 10 rows cost 12 rows), so a size
    is only worth choosing at the top of its bucket, where the padding would have been."""
    curve = LatencyModel([1, 2, 4, 8, 16, 32], [0.010, 0.011, 0.012, 0.014, 0.030, 0.060])
    tree = DraftTree(tokens=np.arange(3, 23, dtype=np.int32), parents=np.arange(-1, 19, dtype=np.int32),
                     depths=np.arange(1, 21, dtype=np.int32))
    probs = [np.full(20, 0.5)]
    bucketed = TreeSizer(curve, max_budget=20, rows_bucket=rows_buckets)
    choice = bucketed._best([tree], probs, 0.0)
    size, seconds = choice.size, choice.seconds
    assert seconds == pytest.approx(float(curve.predict(rows_bucket(1 + size))))
    assert rows_bucket(1 + size) == 1 + size or size == 20
    exact = TreeSizer(curve, max_budget=20)
    choice = exact._best([tree], probs, 0.0)
    exact_size, exact_seconds = choice.size, choice.seconds
    assert exact_seconds == pytest.approx(float(curve.predict(1 + exact_size)))  # exact: priced at its own rows
    assert float(bucketed.latency.predict(rows_bucket(10))) > float(curve.predict(10))  # 9 nodes cost 12 rows


MAX_LIVE = 5


def padded_rounds(engine) -> list[tuple[int, int]]:
    """(live sequences, forward batch) of every verify round `engine` runs from now on; checks as
    it goes that padding sequences come after the live ones, hold no context and verify a
    root-only tree of `PADDING_TOKEN`."""
    seen, live_counts = [], []
    verify, tree_batch = engine.target.verify, engine._tree_batch

    def recording_tree_batch(live, trees, batch_size):
        live_counts.append(len(live))
        return tree_batch(live, trees, batch_size)

    def recording_verify(state, tokens, depths, ancestor, *args, **kwargs):
        live = live_counts[-1]
        assert state.batch_size == tokens.shape[0]
        assert (state.lengths[:live] > 0).all() and (state.lengths[live:] == 0).all()
        assert (tokens[live:, 0] == shape_buckets.PADDING_TOKEN).all() and not depths[live:].any()
        seen.append((live, int(tokens.shape[0])))
        return verify(state, tokens, depths, ancestor, *args, **kwargs)

    engine._tree_batch = recording_tree_batch
    engine.target.verify = recording_verify
    return seen


@pytest.mark.parametrize(("family", "mode"), [("llama", "chain"), ("llama", "dart"), ("llama", "lookup"),
                                              ("llama", "dart_lookup"), ("gemma3", "ddtree_lookup")])
def test_bucketed_batch_shrinking_in_the_tail_equals_ar(family, mode, monkeypatch):
    """11 requests of different lengths, at most 5 live: the live batch passes through sizes that
    are no bucket (3); bucketed, every verify forward's batch is a batch bucket capped at 5, and
    greedy output equals `ar`, seeded sampling commits `ar`'s tokens, and another padding token
    changes nothing (padding leaked into no result)."""
    model = tiny_model(family, vocab_size=32)
    requests = random_prompts(11, seed=5)
    greedy_params = [greedy(3 + 5 * (i % 4)) for i in range(11)]
    sampled = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_new_tokens=3 + 4 * (s % 3)) for s in range(11)]
    ar = make_engine(model, "ar")
    expected = [r.token_ids for r in ar.generate(requests, greedy_params, max_live=MAX_LIVE)]
    expected_sampled = [r.token_ids for r in ar.generate(requests, sampled, max_live=MAX_LIVE)]
    with kernels.forced(shapes="bucketed"):
        engine = make_engine(model, mode, budget=10)
    seen = padded_rounds(engine)
    assert [r.token_ids for r in engine.generate(requests, greedy_params, max_live=MAX_LIVE)] == expected
    assert [r.token_ids for r in engine.generate(requests, sampled, max_live=MAX_LIVE)] == expected_sampled
    monkeypatch.setattr(shape_buckets, "PADDING_TOKEN", 31)
    assert [r.token_ids for r in engine.generate(requests, greedy_params, max_live=MAX_LIVE)] == expected
    assert all(batch == batch_bucket(live, MAX_LIVE) for live, batch in seen)
    assert any(batch > live for live, batch in seen)  # the tail did run padded
    assert {batch for _, batch in seen} <= {1, 2, 4, 5}


def test_bucketed_sizer_prices_and_learns_at_the_padded_batch():
    """With a batch bucket, 3 live trees are priced on the curve of the 4 sequences the forward runs
    (at 4 x rows), and the round's cost is learnt there."""
    curve1 = LatencyModel([1, 2, 4, 8, 16, 32], [0.010, 0.011, 0.012, 0.014, 0.030, 0.060])
    curve4 = LatencyModel([4, 8, 16, 32, 64], [0.020, 0.022, 0.040, 0.080, 0.160])
    trees = [DraftTree(tokens=np.arange(3, 7, dtype=np.int32), parents=np.arange(-1, 3, dtype=np.int32),
                       depths=np.arange(1, 5, dtype=np.int32)) for _ in range(3)]
    probs = [np.full(4, 0.5)] * 3
    sizer = TreeSizer(curve1, max_budget=4, batch_bucket=lambda live: batch_bucket(live, 5))
    sizer._latency_by_batch[4] = curve4
    choice = sizer._best(trees, probs, 0.0)
    size, seconds = choice.size, choice.seconds
    assert seconds == pytest.approx(float(curve4.predict(4 * (1 + size))))
    before = float(curve4.predict(20))
    sizer.observe(trees, [np.zeros(0, np.int64)] * 3, rows=4 * 5, verify_seconds=1.0)
    assert set(sizer._latency_by_batch) == {4}  # learnt on the forward's curve, not one of batch 3
    assert float(sizer._latency_by_batch[4].predict(20)) > before
