"""min-p and the repetition / presence / frequency penalties (vLLM's meanings), lossless under speculation.

- `apply_penalties` equals a dense brute force of vLLM's formula (count tensors over the whole
  vocabulary), for any history and any tree path;
- min-p equals transformers' MinPLogitsWarper alone, and the documented order (temperature, min-p,
  top-k, top-p) with the other filters;
- greedy decoding with penalties equals a brute-force loop (a full forward per token, penalties
  recomputed from scratch) under `ar` and every registered drafter, batched with other settings;
- sampled: every drafter commits the tokens `ar` commits with the same seed, and the first two
  tokens follow the exact penalised, min-p-filtered distribution (chi-square).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dart_bench.gpu_acceptance.correctness import chi_square_p_value
from dart_worker.drafters import drafter_names
from dart_worker.sampling.logits_processors import path_tokens
from dart_worker.sampling.params import SamplingParams, TokenHistory, apply_penalties, warp_logits_to_probs
from ngram_native.trees import DraftTree
from tests.test_engine import VOCAB, make_engine, random_prompts
from tests.test_sampling import assert_same_distribution
from tests.tiny_models import tiny_model


def dense_penalties(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """vLLM's apply_penalties for one row, as written there: [V] count and mask tensors."""
    vocab = logits.shape[-1]
    row = logits.float().clone()
    prompt_mask = torch.zeros(vocab, dtype=torch.bool)
    prompt_mask[prompt] = True
    counts = torch.zeros(vocab)
    for t in output:
        counts[t] += 1
    output_mask = counts > 0
    rep = torch.where(prompt_mask | output_mask, params.repetition_penalty, 1.0)
    row = torch.where(row > 0, row / rep, row * rep)
    row -= params.frequency_penalty * counts
    row -= params.presence_penalty * output_mask.float()
    return row


penalty_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1.0]),
    repetition_penalty=st.sampled_from([1.0, 0.8, 1.1, 2.0]),
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0]),
    frequency_penalty=st.sampled_from([0.0, 0.3, -0.2, 2.0]),
)


@settings(max_examples=60, deadline=None)
@given(params=penalty_params, data=st.data(), vocab=st.integers(2, 12), num_prompt=st.integers(1, 8))
def test_penalties_of_every_tree_row_equal_the_dense_formula_on_its_path(params, data, vocab, num_prompt):
    history = data.draw(st.lists(st.integers(0, vocab - 1), min_size=num_prompt, max_size=num_prompt + 8))
    n = data.draw(st.integers(0, 6))
    parents = [data.draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    tree = DraftTree(np.asarray(tokens, np.int32), np.asarray(parents, np.int32), np.asarray(depths, np.int32))
    nodes = np.arange(-1, n)
    paths = path_tokens(tree, nodes)
    logits = torch.randn(n + 1, vocab, generator=torch.Generator().manual_seed(len(history))) * 3
    record = TokenHistory(history, num_prompt)
    ours = apply_penalties(logits, [params] * (n + 1), [record] * (n + 1), paths)
    for r, path in enumerate(paths):
        expected = dense_penalties(logits[r], params, history[:num_prompt], history[num_prompt:] + path)
        torch.testing.assert_close(ours[r], expected, rtol=0, atol=0)
    assert torch.equal(logits, logits.clone())  # the input is not modified


def test_path_tokens_spell_each_nodes_path():
    tree = DraftTree(np.array([5, 6, 7, 8]), np.array([-1, 0, 0, 2]), np.array([1, 2, 2, 3]))
    assert path_tokens(tree, [-1, 0, 1, 3]) == [[], [5], [5, 6], [5, 7, 8]]


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_min_p_alone_equals_transformers_min_p_warper(min_p, temperature):
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(3)) * 3
    ours = warp_logits_to_probs(logits, SamplingParams(temperature=temperature, min_p=min_p))
    reference = MinPLogitsWarper(min_p)(None, logits / temperature).softmax(dim=-1)
    assert_same_distribution(ours, reference)


@settings(max_examples=60, deadline=None)
@given(min_p=st.sampled_from([0.02, 0.1, 0.3]), top_k=st.integers(0, 10),
       top_p=st.sampled_from([1.0, 0.9, 0.5]), seed=st.integers(0, 2**31))
def test_min_p_comes_before_top_k_and_top_p(min_p, top_k, top_p, seed):
    """vLLM's order: the top-p mass is measured over what min-p kept."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(seed)) * 3
    ours = warp_logits_to_probs(logits, SamplingParams(temperature=0.8, min_p=min_p, top_k=top_k, top_p=top_p))
    scores = MinPLogitsWarper(min_p)(None, logits / 0.8)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    assert_same_distribution(ours, scores.softmax(dim=-1))


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(min_p=-0.1), "min_p must be in [0, 1]"), (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be a finite number"),
    (dict(min_p="0.1"), "min_p must be a finite number"),
])
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises((TypeError, ValueError)) as raised:
        SamplingParams(**kwargs)
    assert message in str(raised.value)


# ------------------------------------------------------------------------------------ the engine


MODEL = tiny_model("llama", vocab_size=VOCAB)
ENGINES = {mode: make_engine(MODEL, mode) for mode in drafter_names()}


def brute_force_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """A full forward per token, penalties recomputed from scratch (no cache, no trees)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(params.max_new_tokens):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(dense_penalties(logits, params, prompt, tokens[len(prompt):]).argmax()))
    return tokens[len(prompt):]


PENALTY_SETTINGS = [dict(repetition_penalty=1.3), dict(presence_penalty=1.0, frequency_penalty=0.5),
                    dict(repetition_penalty=1.1, frequency_penalty=2.0), dict(repetition_penalty=0.7), dict()]


@pytest.mark.parametrize("mode", drafter_names())
def test_greedy_with_penalties_equals_brute_force_under_every_drafter(mode):
    prompts = random_prompts(len(PENALTY_SETTINGS), seed=21)
    params = [SamplingParams(temperature=0.0, max_new_tokens=24, **kw) for kw in PENALTY_SETTINGS]
    expected = [brute_force_greedy(MODEL, p, sp) for p, sp in zip(prompts, params)]
    assert expected[1] != brute_force_greedy(MODEL, prompts[1], SamplingParams(temperature=0.0, max_new_tokens=24))
    results = ENGINES[mode].generate(prompts, params, max_live=3)
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("mode", [m for m in drafter_names() if m != "ar"])
def test_seeded_sampling_with_penalties_and_min_p_commits_the_tokens_of_ar(mode):
    prompts = random_prompts(4, seed=5)
    params = [SamplingParams(temperature=t, min_p=mp, seed=s, max_new_tokens=30, **kw)
              for (t, mp, s), kw in zip(((1.0, 0.05, 1), (0.8, 0.0, 2), (1.0, 0.2, 3), (0.7, 0.1, 4)),
                                        PENALTY_SETTINGS)]
    expected = [r.token_ids for r in ENGINES["ar"].generate(prompts, params)]
    assert [r.token_ids for r in ENGINES[mode].generate(prompts, params, max_live=2)] == expected


def exact_first_two(model, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """P(y1, y2) with the dense penalties: y1 sees the prompt, y2 the prompt and y1."""
    with torch.no_grad():
        first_logits = model(torch.tensor([prompt])).logits[0, -1]
        first = warp_logits_to_probs(dense_penalties(first_logits, params, prompt, [])[None], params)[0]
        vocab = first.shape[0]
        second_logits = model(torch.tensor([[*prompt, y] for y in range(vocab)])).logits[:, -1]
        second = torch.cat([warp_logits_to_probs(dense_penalties(second_logits[y], params, prompt, [y])[None], params)
                            for y in range(vocab)])
    return (first[:, None] * second).double().numpy()


@pytest.mark.parametrize("mode", ["ar", "dart_lookup"])
def test_sampled_tokens_with_penalties_follow_the_penalised_distribution(mode):
    vocab = 8
    model = tiny_model("llama", vocab_size=vocab, initializer_range=0.1)
    prompt = [3, 5, 1, 6, 3, 5, 1, 6, 2, 4, 7, 0, 2]
    draws = 4000
    base = dict(temperature=1.0, min_p=0.1, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.4)
    params = [SamplingParams(**base, seed=i, max_new_tokens=3) for i in range(draws)]
    engine = make_engine(model, mode, top_k=vocab, budget=12, beam_width=4, lookup_min_match=1)
    results = engine.generate([prompt] * draws, params)
    expected = exact_first_two(model, prompt, params[0]) * draws
    counts = np.zeros_like(expected)
    for r in results:
        counts[r.token_ids[0], r.token_ids[1]] += 1
    assert counts[~(expected > 0)].sum() == 0  # nothing min-p removed was ever drawn
    keep = expected >= 5
    p_value = chi_square_p_value(np.append(counts[keep], counts[~keep].sum()),
                                 np.append(expected[keep], expected[~keep].sum()))
    assert p_value > 1e-3, p_value
    # the penalties matter here: without them the distribution is a different one
    plain = exact_first_two(model, prompt, SamplingParams(temperature=1.0, min_p=0.1))
    assert np.abs(plain - expected / draws).max() > 0.02
