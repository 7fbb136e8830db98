"""SamplingParams validation, the warp (== transformers' warpers) and per-request generators."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dart_worker.sampling import SamplingParams, make_generator, warp_logits_to_probs


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


@settings(max_examples=200, deadline=None)
@given(
    temperature=st.sampled_from([1.0, 0.3, 0.7, 1.5, 2.0]),
    top_k=st.integers(0, 12),
    top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1, 0.01]),
    vocab=st.integers(1, 10),
    ties=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_warp_equals_transformers_warpers(temperature, top_k, top_p, vocab, ties, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab, generator=gen) * 3
    if ties:  # few distinct values: exercises tie handling of top-k and of the top-p sort
        logits = logits.round()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = warp_logits_to_probs(logits, params)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, transformers_probs(logits, params), rtol=0, atol=0)


def test_warp_bf16_logits_are_computed_in_float32():
    logits = (torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
    ours = warp_logits_to_probs(logits, params)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, transformers_probs(logits.float(), params), rtol=0, atol=0)


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


def test_generator_seeded_reproducible_and_independent_of_global_rng():
    params = SamplingParams(seed=1234)
    first = torch.rand(5, generator=make_generator(params, "cpu"))
    torch.manual_seed(999)  # the global RNG must not matter
    torch.rand(100)
    second = torch.rand(5, generator=make_generator(params, "cpu"))
    assert torch.equal(first, second)
    other = torch.rand(5, generator=make_generator(SamplingParams(seed=1235), "cpu"))
    assert not torch.equal(first, other)


def test_generator_unseeded_is_nondeterministic_and_leaves_global_rng_alone():
    torch.manual_seed(7)
    expected_global = torch.rand(3)
    torch.manual_seed(7)
    a = torch.rand(4, generator=make_generator(SamplingParams(), "cpu"))
    b = torch.rand(4, generator=make_generator(SamplingParams(), "cpu"))
    assert not torch.equal(a, b)
    assert torch.equal(torch.rand(3), expected_global)
    assert make_generator(SamplingParams(), torch.device("cpu")).device == torch.device("cpu")
