"""Logprobs of generated tokens, read from the verify forward.

Every drafter reports, per generated token, the log-probability `ar` reports for it (fp32: equal to
float rounding between a tree forward and a one-token forward) and the same top-k alternatives;
`ar`'s equal a brute-force computation from a full forward per position. Greedy rows report the
penalised logits' log-softmax, sampled rows the log of the distribution the token was drawn from.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dart_worker.drafters import drafter_names
from dart_worker.sampling.params import SamplingParams, warp_logits_to_probs
from tests.test_engine import VOCAB, make_engine, random_prompts
from tests.test_penalties import dense_penalties
from tests.tiny_models import tiny_model

MODEL = tiny_model("gemma3", vocab_size=VOCAB)
SETTINGS = [dict(temperature=0.0), dict(temperature=1.0, seed=3),
            dict(temperature=0.7, top_p=0.9, min_p=0.05, seed=4), dict(temperature=0.0, repetition_penalty=1.2),
            dict(temperature=0.9, top_k=5, frequency_penalty=0.3, seed=5)]


def reference_logprobs(prompt: list[int], tokens: list[int], params: SamplingParams, k: int):
    """A full forward over prompt + tokens; each position's distribution from scratch."""
    with torch.no_grad():
        logits = MODEL(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    chosen, top_ids, top_values = [], [], []
    for t, token in enumerate(tokens):
        row = dense_penalties(logits[t], params, prompt, tokens[:t])[None]
        logp = row.log_softmax(-1) if params.is_greedy else warp_logits_to_probs(row, params).log()
        chosen.append(float(logp[0, token]))
        top = logp[0].topk(k)
        top_ids.append(top.indices.tolist())
        top_values.append(top.values.tolist())
    return chosen, top_ids, top_values


def params_list(k: int) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=20, logprobs=k, **kw) for kw in SETTINGS]


def test_ar_logprobs_equal_a_brute_force_forward():
    prompts = random_prompts(len(SETTINGS), seed=8)
    params = params_list(3)
    results = make_engine(MODEL, "ar").generate(prompts, params)
    for prompt, p, r in zip(prompts, params, results, strict=True):
        chosen, top_ids, top_values = reference_logprobs(prompt, r.token_ids, p, 3)
        assert len(r.logprobs) == len(r.token_ids) == len(r.top_logprobs) == len(r.top_logprob_ids)
        np.testing.assert_allclose(r.logprobs, chosen, rtol=0, atol=1e-5)
        np.testing.assert_allclose(r.top_logprobs, top_values, rtol=0, atol=1e-5)
        assert r.top_logprob_ids == top_ids
        assert all(np.isfinite(r.logprobs))  # a drawn token is never one the filters removed
        if p.is_greedy:
            assert all(ids[0] == t for ids, t in zip(r.top_logprob_ids, r.token_ids))


@pytest.mark.parametrize("mode", [m for m in drafter_names() if m != "ar"])
def test_every_drafter_reports_the_logprobs_of_ar(mode):
    prompts = random_prompts(len(SETTINGS), seed=9)
    params = params_list(2)
    expected = make_engine(MODEL, "ar").generate(prompts, params)
    results = make_engine(MODEL, mode).generate(prompts, params, max_live=3)
    for e, r in zip(expected, results, strict=True):
        assert r.token_ids == e.token_ids
        np.testing.assert_allclose(r.logprobs, e.logprobs, rtol=0, atol=1e-5)
        np.testing.assert_allclose(r.top_logprobs, e.top_logprobs, rtol=0, atol=1e-5)
        assert r.top_logprob_ids == e.top_logprob_ids


def test_logprobs_follow_the_stop_cut_and_are_off_by_default():
    prompt = random_prompts(1, seed=2)[0]
    engine = make_engine(MODEL, "dart")
    free = engine.generate([prompt], [SamplingParams(temperature=0.0, max_new_tokens=12, logprobs=1)])[0]
    stop = free.token_ids[4]
    cut = engine.generate([prompt], [SamplingParams(temperature=0.0, max_new_tokens=12, logprobs=1,
                                                    stop_token_ids=(stop,))])[0]
    assert cut.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]
    assert cut.logprobs == pytest.approx(free.logprobs[: len(cut.token_ids)], abs=1e-5)
    off = engine.generate([prompt], [SamplingParams(temperature=0.0, max_new_tokens=12)])[0]
    assert off.logprobs is None and off.top_logprobs is None
