"""Drafting from the request's own text: a per-request context index (prompt lookup decoding).

Chat and editing workloads repeat their prompt (code, quotes, lists) far more than any corpus
model predicts, so the best cheap draft is often "what followed the last time this suffix
appeared". `ContextIndex` indexes one request's prompt and committed tokens incrementally
(C++, O(max_match) per appended token); `build_lookup_trees` turns a batch of indexes into
`DraftTree`s (the shared canonical representation, with scores) with the GIL released.

The tree of one index, given its sequence S of n tokens:

1. Match: the longest L in [min_match, max_match] such that S[n-L:n] also ends at an earlier
   e < n; the occurrences are those e, most recent first, at most `max_occurrences`.
2. Depth: D = min(max_depth of the sequence, floor(depth_factor * L)) - a longer match is
   more trustworthy, so it may draft deeper (SuffixDecoding's rule).
3. Trie: every occurrence adds its continuation S[e:e+D] (cut at n, and after an EOS token);
   a node's count is the number of continuations through it, its score ln(count / occurrences).
4. Budget: the best `budget` nodes by (count desc, depth asc, most recent occurrence first),
   which is prefix-closed because counts never grow along a path.

    index = ContextIndex(prompt_ids)
    index.append([first_token])
    tree, = build_lookup_trees([index], max_depths=[16], budget=32)

`JobCache` is the job-level counterpart: one per worker over the finished outputs of earlier
rows (optionally their prompts), bounded by a token budget (the oldest documents are evicted
first), so a templated job's later rows draft from its earlier ones. `build_job_cache_trees`
builds the same continuation trees (steps 1-4 above) from the cache for a batch of live
sequences (their `ContextIndex`es, whose suffixes are the queries); a continuation stops at the
end of its document. Both share one C++ core (hash chains of n-grams, `NgramChains` in
csrc/context_index.h; the cache's design and memory bound: csrc/job_cache.h, docs/ngram.md).

    cache = JobCache(max_tokens=1 << 18)
    cache.add(finished_output_ids)
    tree, = build_job_cache_trees(cache, [index], max_depths=[16], budget=32)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ngram_native import _core
from ngram_native.builders import (
    DEFAULT_BUDGET,
    TreeParams,
    _check_int,
    _document_array,
    _eos_array,
    _max_depths,
    _split,
    _token_array,
)
from ngram_native.trees import DraftTree

# The lookup knobs users set live in TreeParams (the `decoding.tree` config section).
DEFAULT_MIN_MATCH = TreeParams.lookup_min_match
DEFAULT_MAX_MATCH = 16  # longer matches add little evidence; each extra level costs 4 B/token
DEFAULT_MAX_TOKENS = 1 << 20  # bounds an index's memory (about (levels + 1) * 4 B per token)
DEFAULT_DEPTH_FACTOR = TreeParams.lookup_depth_factor
DEFAULT_MAX_OCCURRENCES = TreeParams.lookup_max_occurrences
# The job cache keeps fewer n-gram levels than a context index: it holds many requests' tokens,
# and each level costs 4 B per token plus up to one hash-table slot (12 B) per token.
DEFAULT_JOB_MAX_MATCH = 8
DEFAULT_JOB_MAX_TOKENS = TreeParams.lookup_cache_tokens
MAX_JOB_TOKENS = 1 << 28  # stream positions stay int32 in C++


class _NativeIndex:
    """What the context index and the job cache both expose of their native object: the match
    lengths they search, their token budget and the tokens they hold (for the cache: live documents)."""

    _native: Any

    def __len__(self) -> int:
        return len(self._native)

    @property
    def min_match(self) -> int:
        return self._native.min_match

    @property
    def max_match(self) -> int:
        return self._native.max_match

    @property
    def max_tokens(self) -> int:
        return self._native.max_tokens


class ContextIndex(_NativeIndex):
    """An incremental index over one request's tokens (prompt, then every committed token).

    Not thread-safe for appends; `build_lookup_trees` may read many indexes at once.
    """

    def __init__(self, tokens: Sequence[int] | np.ndarray = (), *, min_match: int = DEFAULT_MIN_MATCH,
                 max_match: int = DEFAULT_MAX_MATCH, max_tokens: int = DEFAULT_MAX_TOKENS):
        _check_int("min_match", min_match, 1)
        _check_int("max_match", max_match, min_match)
        _check_int("max_tokens", max_tokens, 1)
        if max_match > 1024:
            raise ValueError(f"max_match must be <= 1024, got {max_match}")
        if max_tokens >= 2**31:
            raise ValueError(f"max_tokens must be < 2**31, got {max_tokens}")
        self._native = _core._ContextIndex(int(min_match), int(max_match), int(max_tokens))
        if len(tokens):
            self.append(tokens)

    def append(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Index `tokens` (>= 1 non-negative ids) as the continuation of the sequence so far."""
        a = np.asarray(tokens)
        if a.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {a.shape}")
        if a.shape[0] == 0:
            raise ValueError("append needs at least one token")
        ids = _token_array(a, "tokens", None)
        if len(self) + ids.shape[0] > self.max_tokens:
            raise ValueError(f"context index is full: {len(self)} + {ids.shape[0]} tokens > "
                             f"max_tokens {self.max_tokens}")
        self._native.append(ids)

    def tokens(self) -> np.ndarray:
        """A copy of every indexed token (int32)."""
        return self._native.tokens()

    def match(self, max_occurrences: int = DEFAULT_MAX_OCCURRENCES) -> tuple[int, np.ndarray]:
        """(L, ends): the longest match length (0 = none) and up to `max_occurrences` end
        positions e < len(self) of its earlier occurrences, most recent first; the continuation
        of an occurrence starts at token e."""
        _check_int("max_occurrences", max_occurrences, 1)
        length, ends = self._native.match(int(max_occurrences))
        return int(length), ends


class JobCache(_NativeIndex):
    """A bounded index over the finished outputs (documents) of a job's earlier rows.

    `add` one document per finished row; once the documents hold more than `max_tokens` tokens,
    the oldest are evicted first (a single document longer than the budget keeps its last
    `max_tokens` tokens). `vocab_size` (optional) bounds the token ids `add` accepts. Not
    thread-safe for adds; `build_job_cache_trees` only reads it.
    """

    def __init__(self, *, max_tokens: int = DEFAULT_JOB_MAX_TOKENS, min_match: int = DEFAULT_MIN_MATCH,
                 max_match: int = DEFAULT_JOB_MAX_MATCH, vocab_size: int | None = None):
        _check_int("min_match", min_match, 1)
        _check_int("max_match", max_match, min_match)
        _check_int("max_tokens", max_tokens, 1)
        if max_match > 1024:
            raise ValueError(f"max_match must be <= 1024, got {max_match}")
        if max_tokens > MAX_JOB_TOKENS:
            raise ValueError(f"max_tokens must be <= 2**28, got {max_tokens}")
        if vocab_size is not None:
            _check_int("vocab_size", vocab_size, 1)
        self.vocab_size = vocab_size
        self._native = _core._JobCache(int(min_match), int(max_match), int(max_tokens))

    def add(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Index one finished document (>= 1 token ids in [0, vocab_size)), evicting the oldest
        documents as the token budget requires."""
        self._native.add(_document_array(tokens, "job-cache", self.vocab_size))

    @property
    def num_documents(self) -> int:
        return self._native.num_documents

    @property
    def evicted_documents(self) -> int:
        return self._native.evicted_documents

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the index's buffers (their capacities)."""
        return self._native.memory_bytes

    def stream(self) -> np.ndarray:
        """The live documents, oldest first, each followed by a -1 separator (int32 copy)."""
        return self._native.stream()

    def match(self, query: Sequence[int] | np.ndarray,
              max_occurrences: int = DEFAULT_MAX_OCCURRENCES) -> tuple[int, np.ndarray]:
        """(L, ends): the longest L in [min_match, max_match] such that the last L tokens of
        `query` occur in a live document followed by another token of it (0 = none), and up to
        `max_occurrences` end positions e in `stream()`, most recent first; the continuation of an
        occurrence starts at stream()[e]."""
        _check_int("max_occurrences", max_occurrences, 1)
        q = np.asarray(query)
        if q.ndim != 1:
            raise ValueError(f"query must be 1-D, got shape {q.shape}")
        length, ends = self._native.match(_token_array(q, "query", self.vocab_size), int(max_occurrences))
        return int(length), ends


def _check_tree_args(caps_in, batch: int, budget: int, depth_factor: float, max_occurrences: int) -> np.ndarray:
    if caps_in is None:
        raise ValueError("max_depths is required: one depth limit per index")
    caps = _max_depths(caps_in, batch)
    if caps is None or caps.shape[0] == 0:
        caps = np.zeros(batch, dtype=np.int64)
    _check_int("budget", budget, 0)
    _check_int("max_occurrences", max_occurrences, 1)
    if isinstance(depth_factor, bool) or not isinstance(depth_factor, (int, float, np.number)) \
            or not math.isfinite(float(depth_factor)) or depth_factor <= 0:
        raise ValueError(f"depth_factor must be finite and > 0, got {depth_factor!r}")
    return caps


def _check_indexes(indexes: Sequence[ContextIndex]) -> list[ContextIndex]:
    indexes = list(indexes)
    for b, index in enumerate(indexes):
        if not isinstance(index, ContextIndex):
            raise TypeError(f"indexes[{b}] must be a ContextIndex, got {type(index).__name__}")
    return indexes


def build_job_cache_trees(
    cache: JobCache,
    indexes: Sequence[ContextIndex],
    max_depths: Sequence[int] | np.ndarray,
    *,
    budget: int = DEFAULT_BUDGET,
    depth_factor: float = DEFAULT_DEPTH_FACTOR,
    max_occurrences: int = DEFAULT_MAX_OCCURRENCES,
    eos_ids: int | Iterable[int] = (),
) -> list[DraftTree]:
    """One candidate tree per live sequence from the job cache, built in C++ without the GIL.

    The query of sequence b is the suffix of `indexes[b]` (its context index: prompt + committed
    tokens, the tree's root last); its tree is the continuation trie of the longest match among
    the cached documents (the module docstring's steps, continuations cut at document ends).
    Arguments as `build_lookup_trees`.
    """
    if not isinstance(cache, JobCache):
        raise TypeError(f"cache must be a JobCache, got {type(cache).__name__}")
    indexes = _check_indexes(indexes)
    caps = _check_tree_args(max_depths, len(indexes), budget, depth_factor, max_occurrences)
    out = _core._build_job_cache_trees(cache._native, [i._native for i in indexes], caps, _eos_array(eos_ids),
                                       int(budget), float(depth_factor), int(max_occurrences))
    return _split(*out)


def build_lookup_trees(
    indexes: Sequence[ContextIndex],
    max_depths: Sequence[int] | np.ndarray,
    *,
    budget: int = DEFAULT_BUDGET,
    depth_factor: float = DEFAULT_DEPTH_FACTOR,
    max_occurrences: int = DEFAULT_MAX_OCCURRENCES,
    eos_ids: int | Iterable[int] = (),
) -> list[DraftTree]:
    """One candidate tree per index (see the module docstring), built in C++ without the GIL.

    Args:
        indexes: the batch's `ContextIndex`es; each tree's root is its index's last token.
        max_depths: per-sequence depth limit (>= 0; 0 = empty tree), e.g. tokens left to generate.
        budget: nodes per tree (root excluded), >= 0.
        depth_factor: > 0; a match of L tokens drafts at most floor(depth_factor * L) deep.
        max_occurrences: >= 1; the most recent occurrences of the match that vote.
        eos_ids: token id(s) whose nodes get no children.
    """
    indexes = _check_indexes(indexes)
    caps = _check_tree_args(max_depths, len(indexes), budget, depth_factor, max_occurrences)
    out = _core._build_lookup_trees([i._native for i in indexes], caps, _eos_array(eos_ids), int(budget),
                                    float(depth_factor), int(max_occurrences))
    return _split(*out)

