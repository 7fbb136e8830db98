"""SamplingParams validation, the warp (== transformers' warpers) and the per-request, per-position uniforms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dart_worker.hardware import kernels
from dart_worker.sampling import params as sampling
from dart_worker.sampling.gumbel import BLOCK_STREAM, TOKEN_STREAM, gumbel_noise, row_seeds
from dart_worker.sampling.params import SamplingParams, request_key, warp_logits_to_probs
from tests.hypothesis_budget import examples


def transformers_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What `generate(do_sample=True)` samples from: its warpers in its order, then softmax."""
    scores = logits.float()
    if params.temperature != 1.0:
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_k != 0:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores.softmax(dim=-1)


@pytest.fixture(params=kernels.WARPS)
def warp_path(request):
    """Run a test through both `warp` strategies: the CPU candidate path and the dense
    (accelerator) path, forced on CPU tensors. They must implement the same distribution."""
    with kernels.forced(warp=request.param):
        yield request.param


def assert_same_distribution(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Identical support, probabilities equal to float32 rounding (the two softmaxes may sum
    the kept terms in a different order)."""
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    temperature=st.sampled_from([1.0, 0.3, 0.7, 1.5, 2.0]),
    top_k=st.integers(0, 12),
    top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1, 0.01]),
    vocab=st.integers(1, 10),
    seed=st.integers(0, 2**31),
)
def test_warp_equals_transformers_warpers(warp_path, temperature, top_k, top_p, vocab, seed):
    """On continuous logits (where ties have probability 0)."""
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = warp_logits_to_probs(logits, params)
    assert ours.dtype == torch.float32
    assert_same_distribution(ours, transformers_probs(logits, params))


def reference_top_p_support(scores: torch.Tensor, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """float64 brute force of the documented rule: keep x iff P(score > score(x)) < top_p.
    Also returns each token's distance of that mass from the cut (to skip rounding-close cases)."""
    s = scores.double()
    probs = s.softmax(-1)
    above = ((s[:, None, :] > s[:, :, None]) * probs[:, None, :]).sum(-1)  # [R, V]
    return (above < top_p).numpy(), (above - top_p).abs().numpy()


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    temperature=st.sampled_from([1.0, 0.5, 2.0]),
    top_k=st.integers(0, 12),
    top_p=st.sampled_from([0.95, 0.8, 0.5, 0.3, 0.1]),
    vocab=st.integers(1, 12),
    seed=st.integers(0, 2**31),
)
def test_top_p_keeps_or_drops_tied_tokens_together(warp_path, temperature, top_k, top_p, vocab, seed):
    """Integer logits: many ties. Support = the float64 reference rule after top-k."""
    logits = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(seed)) * 2).round()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = warp_logits_to_probs(logits, params).numpy()
    after_top_k = transformers_probs(logits, SamplingParams(temperature=temperature, top_k=top_k))
    scores = torch.where(after_top_k > 0, logits / temperature, -torch.inf)
    keep, distance = reference_top_p_support(scores, top_p)
    decided = distance > 1e-6
    np.testing.assert_array_equal((ours > 0)[decided], keep[decided])
    np.testing.assert_allclose(ours.sum(-1), 1.0, rtol=1e-6)


def sorted_top_p_reference(scores: torch.Tensor, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """float64 rule for tie-free rows (O(V log V)): mass above x = exclusive cumsum, descending."""
    s = scores.double()
    order = s.argsort(dim=-1, descending=True)
    probs = s.softmax(-1).gather(-1, order)
    above = torch.empty_like(probs).scatter_(-1, order, probs.cumsum(-1) - probs)
    return (above < top_p).numpy(), (above - top_p).abs().numpy()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_top_p_on_a_large_vocabulary(warp_path, temperature, monkeypatch):
    """Peaked to flat rows (nuclei of a few tokens up to most of the vocabulary), so the
    candidate set must grow; the result must not depend on the candidate count, must equal
    the float64 rule and transformers except within rounding of the cut."""
    vocab = 30_000
    gen = torch.Generator().manual_seed(int(temperature * 10))
    logits = torch.randn(6, vocab, generator=gen) * torch.tensor([[8.0], [4.0], [2.0], [1.0], [0.5], [0.1]])
    for top_p in (0.5, 0.9, 0.99):
        params = SamplingParams(temperature=temperature, top_p=top_p)
        ours = warp_logits_to_probs(logits, params)
        keep, distance = sorted_top_p_reference(logits / temperature, top_p)
        np.testing.assert_array_equal((ours > 0).numpy()[distance > 1e-7], keep[distance > 1e-7])
        theirs = transformers_probs(logits, params)  # float32 cumsum over the whole vocabulary
        np.testing.assert_array_equal((ours > 0).numpy()[distance > 1e-5], (theirs > 0).numpy()[distance > 1e-5])
        if warp_path == "candidates":
            for candidates in (1, 7, vocab):
                monkeypatch.setattr(sampling, "_TOP_P_CANDIDATES", candidates)
                assert torch.equal(warp_logits_to_probs(logits, params), ours)
            monkeypatch.setattr(sampling, "_TOP_P_CANDIDATES", 1024)


def test_warp_bf16_logits_are_computed_in_float32(warp_path):
    logits = (torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    for params in (SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=1.3, top_p=0.95)):
        ours = warp_logits_to_probs(logits, params)
        assert ours.dtype == torch.float32
        assert torch.equal(ours, warp_logits_to_probs(logits.float(), params))
    # bf16 logits tie often; top-p at a tie is covered by the tie test, top-k keeps ties like transformers
    params = SamplingParams(temperature=0.7, top_k=20)
    assert_same_distribution(warp_logits_to_probs(logits, params), transformers_probs(logits.float(), params))


def test_warp_filters_really_filter():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert (warp_logits_to_probs(logits, SamplingParams(top_k=2))[0, 2:] == 0).all()
    probs = warp_logits_to_probs(logits, SamplingParams(top_p=0.5))
    assert probs[0, 0] == 1.0  # p(token 0) = 0.64 >= 0.5 on its own
    torch.testing.assert_close(
        warp_logits_to_probs(logits, SamplingParams(temperature=0.5)), (logits * 2).softmax(-1)
    )


def test_warp_greedy_is_one_hot_argmax_first_maximum():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    probs = warp_logits_to_probs(logits, SamplingParams(temperature=0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_warp_rejects_bad_shape():
    with pytest.raises(ValueError, match=r"\[rows, vocab\]"):
        warp_logits_to_probs(torch.zeros(2, 3, 4), SamplingParams())


def test_params_defaults_and_normalisation():
    params = SamplingParams(temperature=1, stop_token_ids=[3, 4])
    assert params.stop_token_ids == (3, 4)
    assert isinstance(params.temperature, float)
    assert not params.is_greedy
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=5, seed=1).warp_key == SamplingParams(
        temperature=0.7, top_k=5, seed=2
    ).warp_key
    hash(params)  # frozen and hashable
    with pytest.raises(AttributeError):
        params.temperature = 2.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"temperature": -0.1}, ValueError, "temperature must be finite and >= 0"),
        ({"temperature": math.nan}, ValueError, "temperature must be finite"),
        ({"temperature": math.inf}, ValueError, "temperature must be finite"),
        ({"temperature": "1"}, TypeError, "temperature must be a number"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_p": math.nan}, ValueError, "top_p must be in"),
        ({"top_k": -1}, ValueError, "top_k must be >= 0"),
        ({"top_k": 2.5}, TypeError, "top_k must be an int"),
        ({"top_k": True}, TypeError, "top_k must be an int"),
        ({"seed": -1}, ValueError, "seed must be >= 0"),
        ({"seed": 2**64}, ValueError, "seed must be <="),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
        ({"stop_token_ids": "12"}, TypeError, "stop_token_ids must be a sequence"),
        ({"stop_token_ids": (1, -2)}, ValueError, "stop_token_ids entry must be >= 0"),
    ],
)
def test_params_validation(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def _noise(key, positions, token=0):
    """The engine's Gumbel noise of token `token` at generated indices `positions` under `key`."""
    return gumbel_noise(torch.from_numpy(row_seeds(key, positions)), torch.tensor([token]))[:, 0].numpy()


def test_seeded_keys_are_reproducible_and_distinct_and_leave_global_rngs_alone():
    torch.manual_seed(7)
    expected_global = torch.rand(3)
    torch.manual_seed(7)
    first = _noise(request_key(SamplingParams(seed=1234)), np.arange(5))
    again = _noise(request_key(SamplingParams(seed=1234)), np.arange(5))
    np.testing.assert_array_equal(first, again)
    assert torch.equal(torch.rand(3), expected_global)  # torch's global RNG untouched
    others = [_noise(request_key(SamplingParams(seed=s)), np.arange(5)) for s in (0, 1, 1235, 2**63 - 1)]
    assert len({tuple(u) for u in [first, *others]}) == 5
    # unseeded: fresh entropy each time
    assert request_key(SamplingParams()) != request_key(SamplingParams())


def test_a_positions_noise_does_not_depend_on_which_positions_are_asked_together():
    key = request_key(SamplingParams(seed=5))
    together = row_seeds(key, [3, 0, 17, 3])
    alone = [row_seeds(key, [t])[0] for t in (3, 0, 17, 3)]
    np.testing.assert_array_equal(together, alone)
    # Several requests' rows in one call (one key per position, keys past 2**63 too) equal each alone.
    keys = [key, request_key(SamplingParams(seed=6)), 2**64 - 1, 2**63 + 5]
    for stream in (TOKEN_STREAM, BLOCK_STREAM):
        mixed = row_seeds(np.asarray(keys, dtype=np.uint64), [3, 3, 0, 9], stream)
        np.testing.assert_array_equal(mixed, [row_seeds(k, [t], stream)[0] for k, t in zip(keys, [3, 3, 0, 9])])


def test_position_noise_is_uniform_and_independent_across_positions_and_keys():
    """The noise's uniforms (u = exp(-exp(-g))): Kolmogorov-Smirnov on the marginal, and chi-square
    on 10 x 10 bins of consecutive pairs (same key) and of same-position pairs (consecutive
    seeds): no structure at 200,000 draws."""
    n = 200_000
    u = np.exp(-np.exp(-_noise(request_key(SamplingParams(seed=1)), np.arange(n))))
    assert ((u > 0) & (u < 1)).all()
    assert scipy_stats.kstest(u, "uniform").pvalue > 1e-4
    pairs = [(u[:-1], u[1:])]
    keys = np.asarray([request_key(SamplingParams(seed=s)) for s in range(20_000)], dtype=np.uint64)
    across = np.exp(-np.exp(-_noise(keys, np.full(keys.size, 7))))
    pairs.append((across[:-1], across[1:]))
    for a, b in pairs:
        counts = np.histogram2d(a, b, bins=10, range=[[0, 1], [0, 1]])[0].ravel()
        assert scipy_stats.chisquare(counts).pvalue > 1e-4
