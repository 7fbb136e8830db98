"""Bucketed verify shapes (the `shapes` kernel strategy) change no result and few shapes are seen.

On CUDA the verify block's rows per sequence and its cached context are rounded up to buckets
(`dart_worker.shape_buckets`) so CUDA graphs can capture the forwards; here both strategies run
on CPU tensors: greedy output equals `ar`, seeded sampling commits `ar`'s tokens, the verify
logits of the real rows are the exact ones, and a bucketed job's forwards come from the buckets.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dart_worker import kernels
from dart_worker.cost_model import LatencyModel, TreeSizer
from dart_worker.sampling import SamplingParams
from dart_worker.shape_buckets import context_bucket, rows_bucket, rows_buckets
from dart_worker.target import TargetAdapter
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
    _, size, _, seconds = bucketed._best([tree], probs, 0.0)
    assert seconds == pytest.approx(float(curve.predict(rows_bucket(1 + size))))
    assert rows_bucket(1 + size) == 1 + size or size == 20
    exact = TreeSizer(curve, max_budget=20)
    _, exact_size, _, exact_seconds = exact._best([tree], probs, 0.0)
    assert exact_seconds == pytest.approx(float(curve.predict(1 + exact_size)))  # exact: priced at its own rows
    assert float(bucketed.latency.predict(rows_bucket(10))) > float(curve.predict(10))  # 9 nodes cost 12 rows
