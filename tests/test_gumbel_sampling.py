"""The engine's Gumbel-max sampler (issue #48: dart_worker.sampling.gumbel) and the benchmark's
top-64 partitioned draw (dart_bench.gumbel). The noise is a counter-based function of (key,
position, stream, token id) whose int64 torch implementation equals its numpy definition; both
draws are distributed exactly as their weights (chi-square; a biased draw fails the same test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from dart_bench import inverse_cdf
from dart_bench.gumbel import GUMBEL_SINGLES, gumbel_sample
from dart_worker.sampling import gumbel as sampling
from dart_worker.sampling import params as engine_sampling
from dart_worker.sampling.gumbel import (
    BLOCK_STREAM,
    GUMBEL_BLOCK,
    gumbel_noise,
    gumbel_sample_threshold,
    noise_bits,
    pair_gumbel_noise,
    row_seeds,
)
from dart_worker.sampling.params import SamplingParams, request_key
from tests.hypothesis_budget import examples

ALPHA = 1e-4
VOCAB = 32


# ---------------------------------------------------------------------------------- the noise


def test_noise_bits_equal_the_numpy_definition_whatever_is_asked_with_them():
    seeds = row_seeds(request_key(SamplingParams(seed=5)), [0, 3, 3, 1000])
    ids = np.asarray([0, 1, 262_143, 7, 99_999])
    got = noise_bits(torch.from_numpy(seeds), torch.from_numpy(ids)).numpy().view(np.uint64)
    # The id-th output of splitmix64 started at the seed: numpy's unsigned arithmetic, wrapping.
    with np.errstate(over="ignore"):
        offsets = ids.astype(np.uint64) * engine_sampling._GOLDEN
        expected = engine_sampling._splitmix64(seeds.view(np.uint64)[:, None] + offsets)
    np.testing.assert_array_equal(got, expected)
    # An element's noise does not depend on the other elements of its call.
    alone = noise_bits(torch.from_numpy(seeds[1:2]), torch.tensor([7])).numpy().view(np.uint64)
    assert alone[0, 0] == expected[1, 3]
    # Streams and positions give unrelated seeds; the same (key, position, stream) the same seed.
    assert len({*row_seeds(1, [0, 1, 2]).tolist(), *row_seeds(1, [0, 1, 2], BLOCK_STREAM).tolist()}) == 6
    np.testing.assert_array_equal(row_seeds(9, [4, 4]), row_seeds(9, [4, 4]))


def test_gumbel_noise_is_standard_gumbel():
    g = gumbel_noise(torch.from_numpy(row_seeds(3, [11])), torch.arange(200_000))[0].numpy()
    assert stats.kstest(g, stats.gumbel_r.cdf).pvalue > ALPHA


# ------------------------------------------------------------------------------ the draw is exact


def _weights(vocab: int, seed: int) -> torch.Tensor:
    """A distribution with a few heavy tokens, a long tail spread over several blocks, and zeros."""
    rng = np.random.default_rng(seed)
    w = rng.exponential(size=vocab) * (rng.random(vocab) < 0.6)
    w[rng.choice(vocab, 5, replace=False)] += 0.05 * w.sum()
    return torch.from_numpy(w / w.sum()).float()


def _draw_many(weights: torch.Tensor, draws: int, singles: int, key: int = 17) -> np.ndarray:
    rows = weights[None].expand(draws, -1)
    positions = np.arange(draws)
    return gumbel_sample(rows, torch.from_numpy(row_seeds(key, positions)),
                         torch.from_numpy(row_seeds(key, positions, BLOCK_STREAM)), singles).numpy()


def _pvalue(drawn: np.ndarray, weights: torch.Tensor) -> float:
    exact = weights.double().numpy()
    exact = exact / exact.sum()
    counts = np.bincount(drawn, minlength=exact.size)
    assert counts[exact == 0].sum() == 0, "a zero-weight token was drawn"
    # Pool into cells expected >= 5: the heavy tokens alone, the tail by id ranges.
    order = np.argsort(-exact)
    expected, observed, acc_e, acc_o = [], [], 0.0, 0
    for i in order[exact[order] > 0]:
        acc_e += exact[i] * drawn.size
        acc_o += counts[i]
        if acc_e >= 5:
            expected.append(acc_e)
            observed.append(acc_o)
            acc_e, acc_o = 0.0, 0
    expected[-1] += acc_e
    observed[-1] += acc_o
    return float(stats.chisquare(observed, np.asarray(expected) * sum(observed) / sum(expected)).pvalue)


# The draw's exactness does not depend on the block size (any partition decided by the weights
# alone is exact), so besides the real size the cases draw with blocks of 64, over a vocabulary of
# the same shape (3 blocks, a partial last one, singles): the same 40,000 draws, 16x less noise.
SMALL_BLOCK = 64


@pytest.mark.parametrize(("singles", "block"), [(0, SMALL_BLOCK), (4, SMALL_BLOCK),
                                                (GUMBEL_SINGLES, GUMBEL_BLOCK)])
def test_gumbel_sample_is_distributed_as_its_weights(singles, block, monkeypatch):
    monkeypatch.setattr(sampling, "GUMBEL_BLOCK", block)
    weights = _weights(3 * block + 200, seed=singles)  # blocks, a partial last block, singles
    drawn = _draw_many(weights, 40_000, singles)
    assert _pvalue(drawn, weights) > ALPHA
    # Each level decides draws: tail tokens and heavy ones both come out.
    heavy = set(weights.topk(5).indices.tolist())
    assert 0.1 < np.isin(drawn, list(heavy)).mean() < 0.9


def test_a_biased_draw_fails_the_same_test(monkeypatch):
    """The negative control: noise at 0.8 of its scale (a draw at a lower temperature) is caught, at
    the small block size of the exactness cases."""
    real = sampling.gumbel_noise
    monkeypatch.setattr(sampling, "gumbel_noise", lambda seeds, ids: 0.8 * real(seeds, ids))
    monkeypatch.setattr(sampling, "GUMBEL_BLOCK", SMALL_BLOCK)
    weights = _weights(3 * SMALL_BLOCK + 200, seed=4)
    assert _pvalue(_draw_many(weights, 40_000, 4), weights) < ALPHA


def _draw_many_threshold(weights: torch.Tensor, draws: int, alone_above: float, key: int = 17) -> np.ndarray:
    rows = weights[None].expand(draws, -1)
    positions = np.arange(draws)
    return gumbel_sample_threshold(rows, torch.from_numpy(row_seeds(key, positions)),
                                   torch.from_numpy(row_seeds(key, positions, BLOCK_STREAM)), alone_above).numpy()


# (ALONE_BLOCKS, ALONE_TOKENS): the draw's own caps, and caps small enough that some heavy tokens
# of the cases' rows are left to their blocks.
CAPS = [(sampling.ALONE_BLOCKS, sampling.ALONE_TOKENS), (2, 3)]


@pytest.mark.parametrize("caps", CAPS)
@pytest.mark.parametrize("alone_above", [1 / 256, 1 / 32, 1.0])  # heavy tokens alone: several, a few, none
def test_the_threshold_draw_is_distributed_as_its_weights(alone_above, caps, monkeypatch):
    monkeypatch.setattr(sampling, "GUMBEL_BLOCK", SMALL_BLOCK)
    monkeypatch.setattr(sampling, "ALONE_BLOCKS", caps[0])
    monkeypatch.setattr(sampling, "ALONE_TOKENS", caps[1])
    weights = _weights(3 * SMALL_BLOCK + 200, seed=7) * 3.0  # unnormalised: the threshold is a share of the sum
    drawn = _draw_many_threshold(weights, 40_000, alone_above)
    assert _pvalue(drawn, weights) > ALPHA
    alone = (weights > weights.sum() * alone_above).nonzero()[:, 0].tolist()
    assert (len(alone) > 0) == (alone_above < 1)
    if alone:  # the heavy tokens' cells and the blocks both decide draws
        assert 0.05 < np.isin(drawn, alone).mean() < 0.95


def test_a_biased_threshold_draw_fails_the_same_test(monkeypatch):
    """The negative control: noise at 0.8 of its scale is caught."""
    real = sampling.gumbel_noise
    monkeypatch.setattr(sampling, "gumbel_noise", lambda seeds, ids: 0.8 * real(seeds, ids))
    monkeypatch.setattr(sampling, "GUMBEL_BLOCK", SMALL_BLOCK)
    weights = _weights(3 * SMALL_BLOCK + 200, seed=7)
    assert _pvalue(_draw_many_threshold(weights, 40_000, 1 / 256), weights) < ALPHA


def _threshold_reference(weights, token_seeds, block_seeds, alone_above):
    """The threshold draw written plainly, row by row: the cells of their own are the ALONE_TOKENS
    heaviest tokens above the limit in the ALONE_BLOCKS blocks of largest maxima, found by sorting;
    the tail is masked out whole. What `gumbel_sample_threshold`'s fixed-shape version must equal."""
    rows, vocab = weights.shape
    block = min(sampling.GUMBEL_BLOCK, vocab)
    limit = weights.sum(dim=-1) * alone_above
    padded = torch.nn.functional.pad(weights, (0, -vocab % block))
    maxima = padded.reshape(rows, -1, block).amax(dim=-1)
    alone = torch.zeros_like(weights, dtype=torch.bool)
    for r in range(rows):
        in_candidates = torch.zeros(padded.shape[1], dtype=torch.bool)
        for b in np.argsort(-maxima[r].numpy(), kind="stable")[: sampling.ALONE_BLOCKS]:
            in_candidates[b * block : (b + 1) * block] = True
        heavy = np.flatnonzero(((weights[r] > limit[r]) & in_candidates[:vocab]).numpy())
        alone[r, heavy[np.argsort(-weights[r, heavy].numpy(), kind="stable")][: sampling.ALONE_TOKENS]] = True
    tail = torch.nn.functional.pad(weights.masked_fill(alone, 0.0), (0, -vocab % block))
    mass = tail.reshape(rows, -1, block).sum(dim=-1).double()
    block_score, chosen = (mass.log() + gumbel_noise(block_seeds, torch.arange(mass.shape[1]))).max(dim=-1)
    columns = chosen[:, None] * block + torch.arange(block)
    inside = tail.gather(1, columns).double()
    in_block = columns.gather(1, (inside.log() + gumbel_noise(token_seeds, columns)).argmax(-1, keepdim=True))[:, 0]
    scores = torch.where(alone, weights.double().log() + gumbel_noise(token_seeds, torch.arange(vocab)), -torch.inf)
    best, single = scores.max(dim=-1)
    return torch.where(best >= block_score, single, in_block)


@pytest.mark.parametrize("caps", CAPS)
@pytest.mark.parametrize("vocab", [3 * SMALL_BLOCK + 200, 4 * SMALL_BLOCK, 40])  # a partial last block, none, one
def test_the_threshold_draw_equals_its_plain_definition(vocab, caps, monkeypatch):
    monkeypatch.setattr(sampling, "GUMBEL_BLOCK", SMALL_BLOCK)
    monkeypatch.setattr(sampling, "ALONE_BLOCKS", caps[0])
    monkeypatch.setattr(sampling, "ALONE_TOKENS", caps[1])
    rng = np.random.default_rng(vocab)
    temperature = rng.uniform(0.3, 3.0, size=(300, 1))
    weights = torch.from_numpy(np.exp(rng.normal(size=(300, vocab)) * 3 / temperature)).float()
    weights[::7, rng.choice(vocab, min(40, vocab // 2))] = 0.0  # zeros (a top-k or top-p cut) among them
    seeds, block_seeds = (torch.from_numpy(row_seeds(3, np.arange(300), stream)) for stream in (0, BLOCK_STREAM))
    for alone_above in (1 / 256, 1 / 16, 1.0):
        drawn = gumbel_sample_threshold(weights, seeds, block_seeds, alone_above)
        assert torch.equal(drawn, _threshold_reference(weights, seeds, block_seeds, alone_above))
        assert (weights.gather(1, drawn[:, None]) > 0).all()


def test_the_threshold_draw_shares_the_token_noise_of_gumbel_sample():
    """A heavy token's cell uses the noise `gumbel_noise` gives it (so drafters couple to either
    draw alike), and a row whose mass sits on heavy tokens draws argmax(log w + g) over them."""
    seeds = torch.from_numpy(row_seeds(5, [0, 1, 2, 3]))
    ids = torch.tensor([3, 70_000, 12, 262_143])
    torch.testing.assert_close(pair_gumbel_noise(seeds, ids), gumbel_noise(seeds, ids[:, None])[:, 0])
    weights = torch.zeros(4, 2 * GUMBEL_BLOCK)
    heavy = torch.tensor([5, 900, 1500])
    weights[:, heavy] = torch.tensor([0.5, 0.3, 0.2])
    expected = heavy[(weights[:, heavy].double().log() + gumbel_noise(seeds, heavy)).argmax(-1)]
    drawn = gumbel_sample_threshold(weights, seeds, torch.from_numpy(row_seeds(5, [0, 1, 2, 3], BLOCK_STREAM)))
    assert drawn.tolist() == expected.tolist()


def test_gumbel_sample_never_draws_zero_weight_tokens_and_follows_one_hot_rows():
    weights = torch.zeros(3, 2 * GUMBEL_BLOCK + 5)
    weights[0, 7] = 1.0
    weights[1, GUMBEL_BLOCK + 3] = 2.0
    weights[2, [1, 2 * GUMBEL_BLOCK + 4]] = 1.0
    for singles in (0, 1, 64):
        for t in range(20):
            drawn = gumbel_sample(weights, torch.from_numpy(row_seeds(1, [t] * 3)),
                                  torch.from_numpy(row_seeds(1, [t] * 3, BLOCK_STREAM)), singles).tolist()
            assert drawn[:2] == [7, GUMBEL_BLOCK + 3] and drawn[2] in (1, 2 * GUMBEL_BLOCK + 4)


# ------------------------------------------- the inverse-CDF draw of before #48 (the benchmark's)


def test_inverse_cdf_sample_never_draws_zero_weight_tokens():
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 2.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 3.0]])
    for u, expected in [(0.0, [1, 2, 0]), (0.2, [1, 2, 0]), (0.25, [1, 2, 4]), (0.49, [1, 2, 4]), (0.5, [3, 2, 4])]:
        drawn = inverse_cdf.inverse_cdf_sample(weights, torch.full((3,), u, dtype=torch.float64))
        assert drawn.tolist() == expected, u
    # u * total rounding up to the total still lands on the last token of positive weight
    just_below_one = torch.full((3,), 1.0 - 2**-53, dtype=torch.float64)
    assert inverse_cdf.inverse_cdf_sample(weights, just_below_one).tolist() == [3, 2, 4]
    assert inverse_cdf.inverse_cdf_sample(weights, torch.ones(3, dtype=torch.float64)).tolist() == [3, 2, 4]


def _reference_inverse_cdf(weights: np.ndarray, u: float) -> int:
    """Brute force: the first token whose float64 cumulative weight exceeds u * total, else the
    last token of positive weight."""
    cdf = np.cumsum(weights.astype(np.float64))
    hit = np.flatnonzero(cdf > u * cdf[-1])
    last_positive = int(np.flatnonzero(weights > 0)[-1])
    return min(int(hit[0]), last_positive) if hit.size else last_positive


@settings(max_examples=examples(60), deadline=None)
@given(data=st.data(), vocab=st.sampled_from([1, 7, 1023, 1024, 1025, 3000, 4096]),
       zeros=st.floats(0.0, 0.999))
def test_two_level_inverse_cdf_equals_the_brute_force_draw(data, vocab, zeros):
    """Integer weights (sums exact in any order), many zeros, uniforms on exact boundaries of the
    cumulative weights (block edges included) and at the ends: the block-then-token draw picks
    exactly the token of one float64 scan over the row."""
    rows = data.draw(st.integers(1, 4))
    gen = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    weights = gen.integers(1, 4, size=(rows, vocab)).astype(np.float32) * (gen.random((rows, vocab)) >= zeros)
    weights[np.arange(rows), gen.integers(0, vocab, size=rows)] = 1.0  # every row has mass
    totals = weights.sum(axis=1, dtype=np.float64)
    # Cumulative weight at the end of each block: a uniform landing exactly there must pass on
    # to the next block's first token of positive weight, as the scan does.
    edges = [np.cumsum(w, dtype=np.float64)[inverse_cdf._CDF_BLOCK - 1 :: inverse_cdf._CDF_BLOCK] for w in weights]
    picks = [data.draw(st.one_of(st.sampled_from([0.0, 1.0, 1.0 - 2**-53]), st.floats(0.0, 1.0),
                                 st.integers(0, int(t)).map(lambda k, t=t: k / t),
                                 st.sampled_from([*e.tolist(), 0.0]).map(lambda k, t=t: k / t)))
             for t, e in zip(totals, edges)]
    uniforms = torch.tensor(picks, dtype=torch.float64)
    drawn = inverse_cdf.inverse_cdf_sample(torch.from_numpy(weights), uniforms).tolist()
    assert drawn == [_reference_inverse_cdf(weights[r], picks[r]) for r in range(rows)]
    assert all(weights[r, t] > 0 for r, t in enumerate(drawn))
