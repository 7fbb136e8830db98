"""The job-level cache (earlier rows' finished outputs) against a brute-force Python reference.

The reference keeps the live documents in a list and rescans them for every query, so it states
the rules plainly: eviction of the oldest documents past the token budget (a document longer than
the budget keeps its tail), the longest suffix match in the live documents with a continuation in
the same document, its occurrences most recent first, the continuation trie cut at document ends,
the best `budget` nodes by (count desc, depth asc, most recent occurrence first). Then: the memory
bound, clear errors for bad input, and the engine: greedy output with the cache on equals `ar`, and
a job whose rows repeat each other accepts job-cache drafts (`accepted_job_cache`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.sampling.params import SamplingParams
from dart_worker.target.adapter import TargetAdapter
from ngram_native import ContextIndex, DraftTree, JobCache, TreeParams, build_job_cache_trees
from ngram_native.trees import SOURCE_JOB_CACHE, SOURCE_NAMES
from pipeline.settings.config import ConfigError, load_config
from tests.hypothesis_budget import examples
from tests.test_context_index import assert_same_tree
from tests.tiny_models import tiny_model

VOCAB = 32


class ReferenceCache:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.docs: list[list[int]] = []

    def add(self, doc: list[int]) -> None:
        doc = doc[-self.max_tokens:]
        while self.docs and sum(map(len, self.docs)) + len(doc) > self.max_tokens:
            self.docs.pop(0)
        self.docs.append(list(doc))

    def stream(self) -> list[int]:
        return [t for d in self.docs for t in (*d, -1)]

    def match(self, query: list[int], min_match: int, max_match: int, max_occ: int) -> tuple[int, list[int]]:
        s = self.stream()
        for length in range(min(max_match, len(query)), min_match - 1, -1):
            suffix = query[len(query) - length:]
            ends = [e for e in range(len(s) - 1, length - 1, -1) if s[e - length:e] == suffix and s[e] >= 0]
            if ends:
                return length, ends[:max_occ]
        return 0, []

    def tree(self, query, cap, *, min_match, max_match, budget, depth_factor, max_occ, eos=()) -> DraftTree:
        s = self.stream()
        length, ends = self.match(query, min_match, max_match, max_occ)
        depth = min(cap, math.floor(depth_factor * length))
        nodes: dict[tuple[int, ...], list[int]] = {}  # path -> [count, first occurrence]
        if length and depth > 0:
            for o, e in enumerate(ends):
                path: tuple[int, ...] = ()
                for token in s[e:e + depth]:
                    if token < 0:
                        break
                    path = (*path, token)
                    nodes.setdefault(path, [0, o])[0] += 1
                    if token in eos:
                        break
        kept = sorted(nodes, key=lambda p: (-nodes[p][0], len(p), nodes[p][1]))[:budget]
        index: dict[tuple[int, ...], int] = {}
        out = []
        for d in range(1, max((len(p) for p in kept), default=0) + 1):
            level = sorted((p for p in kept if len(p) == d), key=lambda p: (index.get(p[:-1], -1), -nodes[p][0], p[-1]))
            for p in level:
                index[p] = len(out)
                out.append((p[-1], index.get(p[:-1], -1), d, math.log(nodes[p][0] / len(ends))))
        cols = list(zip(*out)) or [(), (), (), ()]
        return DraftTree(*(np.asarray(c, np.int32) for c in cols[:3]), np.asarray(cols[3], np.float64))


# Few distinct tokens make repeats (and so matches) common; small budgets make eviction common.
docs = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1, max_size=12)
queries = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=3)


@settings(max_examples=examples(150), deadline=None)
@given(documents=docs, queries=queries, max_tokens=st.integers(1, 40), min_match=st.integers(1, 3),
       extra=st.integers(0, 4), max_occ=st.integers(1, 6), budget=st.integers(0, 12), cap=st.integers(0, 9),
       depth_factor=st.sampled_from([0.5, 1.0, 2.5, 4.0]), eos=st.sampled_from([(), (3,)]))
def test_cache_matches_and_trees_equal_the_reference(documents, queries, max_tokens, min_match, extra, max_occ,
                                                     budget, cap, depth_factor, eos):
    max_match = min_match + extra
    cache = JobCache(max_tokens=max_tokens, min_match=min_match, max_match=max_match)
    ref = ReferenceCache(max_tokens)
    for doc in documents:  # queries after every add: adds, evictions and compactions interleave
        cache.add(doc)
        ref.add(doc)
        assert len(cache) == sum(map(len, ref.docs)) <= max_tokens
        assert cache.num_documents == len(ref.docs)
        assert cache.stream().tolist() == ref.stream()
        indexes = [ContextIndex(q) for q in queries]
        for q in queries:
            length, ends = cache.match(q, max_occ)
            assert (length, ends.tolist()) == ref.match(q, min_match, max_match, max_occ)
        knobs = dict(budget=budget, depth_factor=depth_factor, max_occurrences=max_occ, eos_ids=eos)
        trees = build_job_cache_trees(cache, indexes, [cap] * len(queries), **knobs)
        for q, tree in zip(queries, trees):
            assert_same_tree(tree, ref.tree(q, cap, min_match=min_match, max_match=max_match, budget=budget,
                                            depth_factor=depth_factor, max_occ=max_occ, eos=eos))
    assert cache.evicted_documents == len(documents) - len(ref.docs)


def test_a_templated_continuation_is_found_in_an_earlier_row():
    cache = JobCache(max_tokens=100)
    cache.add([10, 11, 12, 13, 14])  # row 1: "... capital of X is Y"
    cache.add([20, 11, 12, 13, 15])  # row 2
    tree, = build_job_cache_trees(cache, [ContextIndex([7, 8, 11, 12])], [4], budget=10)
    # Both rows continue "11 12" with 13, then 14 (row 1) or 15 (row 2).
    assert tree.tokens.tolist() == [13, 14, 15]  # equal counts: token order
    np.testing.assert_allclose(np.exp(tree.scores), [1.0, 0.5, 0.5])
    # Continuations never run into the next document.
    cache2 = JobCache(max_tokens=100)
    cache2.add([1, 2])
    cache2.add([3, 4])
    tree, = build_job_cache_trees(cache2, [ContextIndex([1, 2])], [8], budget=10)
    assert tree.size == 0


def test_memory_is_bounded_by_the_token_budget():
    budget, levels = 2000, 7
    cache = JobCache(max_tokens=budget, min_match=2, max_match=2 + levels - 1)
    rng = np.random.default_rng(0)
    # Worst case for the hash table: random text over a large vocabulary (every n-gram distinct).
    bound = (32 + 224 * levels) * budget + 4096  # documented in csrc/job_cache.h
    peak_early = 0
    for i in range(400):  # 400 x ~100 tokens = 20 x the budget
        cache.add(rng.integers(0, 50_000, size=int(rng.integers(1, 200))))
        assert len(cache) <= budget
        assert cache.memory_bytes <= bound
        if i < 100:
            peak_early = max(peak_early, cache.memory_bytes)
    assert cache.evicted_documents > 300
    assert cache.memory_bytes <= 1.5 * peak_early  # does not keep growing with the tokens added
    # A document longer than the whole budget keeps its tail.
    cache.add(np.arange(budget + 50) % 40_000)
    assert len(cache) == budget and cache.num_documents == 1
    assert cache.stream()[:-1].tolist() == (np.arange(50, budget + 50) % 40_000).tolist()


def test_bad_inputs_are_clear_errors():
    cache = JobCache(max_tokens=10, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="at least one token"):
        cache.add([])
    with pytest.raises(ValueError, match=r"token id 32 outside \[0, 32\)"):
        cache.add([1, 32])
    with pytest.raises(ValueError, match=r"token id -1 outside"):
        cache.add([-1, 3])
    with pytest.raises(ValueError, match="integer token ids"):
        cache.add([1.5, 2.0])
    with pytest.raises(ValueError, match="1-D"):
        cache.add([[1, 2]])
    with pytest.raises(ValueError, match=r"token id 99 outside"):
        cache.match([1, 99])
    assert len(cache) == 0 and cache.num_documents == 0  # nothing half-added
    for kwargs, message in (({"max_tokens": 0}, "max_tokens must be >= 1"),
                            ({"max_tokens": 2**28 + 1}, "max_tokens must be <= 2\\*\\*28"),
                            ({"min_match": 0}, "min_match must be >= 1"),
                            ({"min_match": 3, "max_match": 2}, "max_match must be >= 3")):
        with pytest.raises(ValueError, match=message):
            JobCache(**kwargs)
    with pytest.raises(TypeError, match="cache must be a JobCache"):
        build_job_cache_trees(object(), [ContextIndex([1])], [1])
    with pytest.raises(ValueError, match="max_depths"):
        build_job_cache_trees(cache, [ContextIndex([1])], [1, 2])
    empty, = build_job_cache_trees(cache, [ContextIndex([1, 2])], [4])  # an empty cache drafts nothing
    assert empty.size == 0


@pytest.mark.parametrize(("override", "message"), [
    ("decoding.tree.lookup_cache_tokens=-1", "decoding.tree.lookup_cache_tokens: must be >= 0"),
    ("decoding.tree.lookup_cache_tokens=300000000", "decoding.tree.lookup_cache_tokens: must be <= 2\\*\\*28"),
])
def test_config_validates_the_cache_size(tmp_path, override, message):
    path = tmp_path / "c.yaml"
    path.write_text("input:\n  urls: [prompts.jsonl]\noutput:\n  url: out/\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path, ["decoding.mode=lookup", override])
    cfg = load_config(path, ["decoding.mode=lookup", "decoding.tree.lookup_cache_tokens=0",
                             "decoding.tree.lookup_cache_prompts=true"])
    assert cfg.decoding.tree.lookup_cache_tokens == 0 and cfg.decoding.tree.lookup_cache_prompts is True
    assert TreeParams().lookup_cache_tokens == 262144 and TreeParams().lookup_cache_prompts is False
    with pytest.raises(ConfigError, match="lookup_cache_prompts"):
        load_config(path, ["decoding.mode=lookup", "decoding.tree.lookup_cache_prompts=maybe"])


def test_source_bit_and_name():
    assert SOURCE_NAMES[SOURCE_JOB_CACHE] == "job_cache"
    assert len({*SOURCE_NAMES}) == len(SOURCE_NAMES) and all(b & (b - 1) == 0 for b in SOURCE_NAMES)


# ---------------------------------------------------------------------------------- the engine


def templated_prompts(seed: int, rows: int) -> list[list[int]]:
    """One template with a different slot value per row: the rows' texts repeat each other."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(3, VOCAB, (9,), generator=gen).tolist()
    tail = torch.randint(3, VOCAB, (5,), generator=gen).tolist()
    return [[*head, 3 + (r * 7) % (VOCAB - 3), *tail] for r in range(rows)]


@pytest.mark.parametrize("cache_prompts", [False, True])
def test_job_cache_equals_ar_greedy_and_accepts_on_templated_rows(cache_prompts):
    parts = EngineParts(target=TargetAdapter(tiny_model("llama", vocab_size=VOCAB)), eos_token_ids=(2,))
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    prompts = templated_prompts(0, 8)
    ar = build_engine(parts, "ar")
    tree = TreeParams(budget=16, max_depth=8, lookup_cache_prompts=cache_prompts)
    on = build_engine(parts, "lookup", tree, sizing="fixed")
    off = build_engine(parts, "lookup", TreeParams(budget=16, max_depth=8, lookup_cache_tokens=0), sizing="fixed")
    expected = [ar.generate([p], params)[0] for p in prompts]
    got = [on.generate([p], params)[0] for p in prompts]  # one row at a time: each sees the earlier ones
    got_off = [off.generate([p], params)[0] for p in prompts]
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.token_ids for r in got_off] == [r.token_ids for r in expected]
    assert on.drafter.context.job_cache.num_documents == len(prompts)
    assert off.drafter.context.job_cache is None
    rows = [r.stats.to_row() for r in got]
    assert rows[0]["accepted_job_cache"] == 0  # nothing finished before the first row
    assert sum(r["accepted_job_cache"] for r in rows) > 0
    assert all(r["accepted_job_cache"] == 0 for r in (x.stats.to_row() for x in got_off))
    for r in rows:  # each accepted token is credited to a lookup source
        accepted = sum(r["acceptance_histogram"][k] * k for k in range(len(r["acceptance_histogram"])))
        assert accepted <= r["accepted_context"] + r["accepted_job_cache"]
    tau_on = sum(r.stats.tau for r in got[1:])
    tau_off = sum(r.stats.tau for r in got_off[1:])
    assert tau_on > tau_off


def test_job_cache_spans_batches_and_continuous_batching_in_the_hybrid():
    from dart_worker.head.draft_head import DartDraftHead

    model = tiny_model("qwen3", vocab_size=VOCAB)
    torch.manual_seed(123)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4)
    parts = EngineParts(target=TargetAdapter(model), head=head, eos_token_ids=(2,))
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    prompts = templated_prompts(1, 6)
    expected = build_engine(parts, "ar").generate(prompts, params)
    engine = build_engine(parts, "ddtree_lookup", TreeParams(budget=12), sizing="fixed")
    got = engine.generate(prompts, params, max_live=2)  # rows finish and later ones join
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert engine.drafter.context.job_cache.num_documents == len(prompts)
    assert sum(r.stats.to_row()["accepted_job_cache"] for r in got) > 0
