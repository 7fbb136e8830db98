"""The job n-gram scorer (ngram_native.job_ngram): exact counts of the live documents, the DART
estimate over them, the interpolation with a static scorer, eviction and its memory bound, and
clear errors; checked against brute-force Python references."""

from __future__ import annotations

import gc
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_native import _core, build_dart_trees
from ngram_native.builders import ngram_probs
from ngram_native.job_ngram import JobNgram
from tests.hypothesis_budget import examples


def live_documents(docs: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Brute force of the eviction rule: each document keeps its last max_tokens tokens; the
    newest documents whose total fits the budget stay."""
    kept, total = [], 0
    for doc in reversed([d[-max_tokens:] for d in docs]):
        if total + len(doc) > max_tokens:
            break
        kept.append(doc)
        total += len(doc)
    return kept[::-1]


def counts_of(docs: list[list[int]], order: int) -> Counter:
    counts: Counter = Counter()
    for doc in docs:
        for n in range(1, order + 1):
            for i in range(len(doc) - n + 1):
                counts[tuple(doc[i : i + n])] += 1
    return counts


def dart_estimate(counts: Counter, order: int, ctx: list[int], candidates: list[int]) -> tuple[list[float], int]:
    """The NgramScorer contract over explicit counts, and the count of the longest seen suffix."""
    probs = [0.0] * len(candidates)
    longest = 0
    for length in range(min(len(ctx), order - 1), 0, -1):
        suffix = tuple(ctx[len(ctx) - length :])
        c = counts.get(suffix, 0)
        if c == 0:
            continue
        longest = longest or c
        for i, t in enumerate(candidates):
            if probs[i] == 0.0 and counts.get((*suffix, t), 0):
                probs[i] = counts[(*suffix, t)] / c
    return probs, longest


token_lists = st.lists(st.integers(0, 5), min_size=1, max_size=30)


@settings(max_examples=examples(200), deadline=None)
@given(docs=st.lists(token_lists, min_size=1, max_size=12), order=st.integers(1, 6),
       max_tokens=st.integers(1, 80), ctx=st.lists(st.integers(0, 6), max_size=7),
       prior=st.sampled_from([0.0, 0.5, 4.0, 100.0]), base_order=st.integers(1, 4),
       base_docs=st.lists(token_lists, max_size=3))
def test_counts_scores_and_mixture_match_brute_force(docs, order, max_tokens, ctx, prior, base_order, base_docs):
    base = _core._DictScorer(base_order, dict(counts_of(base_docs, base_order))) if base_docs else None
    job = JobNgram(order=order, max_tokens=max_tokens, prior=prior, base=base)
    for doc in docs:
        job.add(doc)
    live = live_documents(docs, max_tokens)
    counts = counts_of(live, order)
    assert len(job) == sum(map(len, live)) <= max_tokens
    assert job.num_documents == len(live) and job.evicted_documents == len(docs) - len(live)
    assert job.distinct_ngrams == len(counts)
    for ngram, c in list(counts.items())[:50]:
        assert job.count(ngram) == c
    assert job.count([6]) == 0  # never added

    candidates = list(range(7))
    want_job, c = dart_estimate(counts, order, ctx, candidates)
    got_job, got_c = job.score_job(ctx, candidates)
    np.testing.assert_allclose(got_job, want_job, rtol=1e-6)
    assert got_c == c

    got = ngram_probs(job, ctx, candidates)
    if base is None:
        want = want_job
    else:
        want_base = ngram_probs(base, ctx, candidates)
        lam = c / (c + prior) if c else 0.0
        want = [(1 - lam) * b + lam * j for b, j in zip(want_base, want_job)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert job.order == max(order, base_order if base is not None else 0)


def test_an_empty_job_scores_like_its_base_and_builds_the_same_dart_trees():
    rng = np.random.default_rng(3)
    vocab = 30
    base_docs = [list(rng.integers(0, vocab, 200)) for _ in range(3)]
    base = _core._DictScorer(3, dict(counts_of(base_docs, 3)))
    job = JobNgram(base=base, order=4)
    logits = rng.normal(0, 2, size=(2, 5, vocab)).astype(np.float32)
    contexts = [base_docs[0][:6], base_docs[1][10:12]]
    with_base = build_dart_trees(logits=logits, contexts=contexts, scorer=base, top_k=8, budget=30)
    with_job = build_dart_trees(logits=logits, contexts=contexts, scorer=job, top_k=8, budget=30)
    for a, b in zip(with_base, with_job, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.parents, b.parents)
        np.testing.assert_array_equal(a.scores, b.scores)

    # Once the job has repeated one continuation many times, DART's trees follow it.
    path = [int(t) for t in logits[0].argmin(-1)]  # the head's least likely tokens
    for _ in range(50):
        job.add(contexts[0][-3:] + path)
    learned = build_dart_trees(logits=logits, contexts=contexts, scorer=job, top_k=vocab, budget=30)[0]
    assert not np.array_equal(learned.tokens, with_base[0].tokens)


def test_memory_follows_the_live_tokens_not_the_job_length():
    rng = np.random.default_rng(0)
    job = JobNgram(order=4, max_tokens=5_000)
    sizes = []
    for _round in range(60):
        for _ in range(20):
            job.add(rng.integers(0, 50_000, 100))  # no repeats: the worst case, 4 n-grams per token
        sizes.append(job.memory_bytes)
        assert len(job) <= 5_000
        assert job.distinct_ngrams <= 4 * len(job)
    # 120,000 tokens went through a 5,000-token cache: memory stayed where it was after 4,000.
    assert max(sizes[5:]) <= 1.5 * max(sizes[:5])
    # The design's bound: <= 6 x (live n-grams + 1) table slots of 32 B, plus the live documents.
    assert max(sizes) <= 6 * 32 * (4 * 5_000 + 1) + 20 * (4 * 5_000 + 24 * 50)


def test_the_base_outlives_its_python_reference():
    base = _core._DictScorer(2, {(1,): 2, (1, 3): 2})
    job = JobNgram(base=base)
    del base
    gc.collect()
    np.testing.assert_allclose(ngram_probs(job, [1], [3, 4]), [1.0, 0.0])


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"order": 0}, ValueError, "order must be >= 1"),
    ({"order": 7}, ValueError, "order must be <= 6"),
    ({"order": 2.5}, TypeError, "order must be an integer"),
    ({"max_tokens": 0}, ValueError, "max_tokens must be >= 1"),
    ({"max_tokens": 2**29}, ValueError, "max_tokens must be <= 2"),
    ({"prior": -1.0}, ValueError, "prior must be finite and >= 0"),
    ({"prior": float("nan")}, ValueError, "prior must be finite"),
    ({"base": "trie.bin"}, TypeError, "base must be an NgramScorer"),
])
def test_bad_settings_are_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        JobNgram(**kwargs)


def test_bad_documents_are_clear_errors_and_change_nothing():
    job = JobNgram(vocab_size=10)
    job.add([1, 2, 3])
    for bad, match in (([], "at least one token"), ([1, -1], "outside"), ([1, 10], "outside"),
                       ([[1, 2]], "1-D"), ([1.5], "integer token ids")):
        with pytest.raises(ValueError, match=match):
            job.add(bad)
    assert len(job) == 3 and job.num_documents == 1
    with pytest.raises(ValueError, match=r"1\.\.4 token ids"):
        job.count([1, 2, 3, 4, 5])


@pytest.mark.parametrize(("override", "message"), [
    ("decoding.tree.job_ngram_tokens=-1", r"decoding\.tree\.job_ngram_tokens: must be >= 0"),
    ("decoding.tree.job_ngram_tokens=300000000", r"decoding\.tree\.job_ngram_tokens: must be <= 2\*\*28"),
    ("decoding.tree.job_ngram_order=0", r"decoding\.tree\.job_ngram_order: must be >= 1"),
    ("decoding.tree.job_ngram_order=7", r"decoding\.tree\.job_ngram_order: must be <= 6"),
    ("decoding.tree.job_ngram_prior=-0.5", r"decoding\.tree\.job_ngram_prior: must be >= 0"),
])
def test_the_config_names_a_bad_job_ngram_setting(tmp_path, override, message):
    from pipeline.settings.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text("input:\n  urls: [prompts.jsonl]\noutput:\n  url: out/\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path, [override])
    assert load_config(path, ["decoding.tree.job_ngram_tokens=0"]).decoding.tree.job_ngram_tokens == 0
