"""The job's own n-grams as a second N-gram model for DART's beam search.

DART re-scores the draft head's candidates with an N-gram estimate q(t | context). The shipped
trie counts human ShareGPT text; a trie over the target's *own* replies drafts markedly better
(docs/ngram.md), but it is generated data and cannot ship. A batch job produces that data as it
runs, so `JobNgram` counts every 1..n-gram of the rows a worker has finished (bounded by a token
budget, oldest rows evicted first, counts always exactly those of the live rows) and scores as

    q(t | ctx) = (1 - lambda) * q_static(t | ctx) + lambda * q_job(t | ctx),
    lambda = c / (c + prior),

with q_job the DART estimate over the job's counts (longest matching suffix of ctx first,
count(suffix + t) / count(suffix)) and c the job count of the longest suffix of ctx it has seen.
An empty `JobNgram` scores exactly like its static scorer; without one (`base=None`) it scores
with the job's counts alone. It is an `NgramScorer`: pass it wherever a trie goes
(`build_dart_trees`), add finished outputs between rounds. C++ (csrc/job_ngram.h): one
open-addressing table of exact n-gram counts, O(order) per added token.

    job = JobNgram(base=trie, order=4, max_tokens=1 << 18, prior=4.0)
    job.add(finished_output_ids)
    trees = build_dart_trees(ids, values, contexts, job, params=params)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ngram_native import _core
from ngram_native.builders import NgramScorer, _check_int, _document_array, _token_array

MAX_ORDER = 6  # csrc/job_ngram.h kMaxOrder
MAX_TOKENS = 1 << 28


class JobNgram(_core._JobNgram):
    """Exact n-gram counts of a job's finished outputs, mixed into `base` (see the module doc).

    `order`: the job counts' n-gram order (1..6); the scorer's order is the larger of it and the
    base's. `max_tokens`: the live documents' token budget (a single document longer than it keeps
    its last `max_tokens`). `prior` >= 0: the job context count at which job and base weigh the
    same (0: the job's estimate replaces the base's wherever the job has seen the context).
    `vocab_size` (optional) bounds the ids `add` accepts. `add` must not run while trees are
    being built from this scorer; scoring itself is thread-safe.
    """

    def __init__(self, *, base: NgramScorer | None = None, order: int = 4, max_tokens: int = 1 << 18,
                 prior: float = 4.0, vocab_size: int | None = None):
        _check_int("order", order, 1)
        if order > MAX_ORDER:
            raise ValueError(f"order must be <= {MAX_ORDER}, got {order}")
        _check_int("max_tokens", max_tokens, 1)
        if max_tokens > MAX_TOKENS:
            raise ValueError(f"max_tokens must be <= 2**28, got {max_tokens}")
        if isinstance(prior, bool) or not isinstance(prior, (int, float, np.number)) \
                or not math.isfinite(float(prior)) or prior < 0:
            raise ValueError(f"prior must be finite and >= 0, got {prior!r}")
        if base is not None and not isinstance(base, NgramScorer):
            raise TypeError(f"base must be an NgramScorer (e.g. an NgramTrie), got {type(base).__name__}")
        if vocab_size is not None:
            _check_int("vocab_size", vocab_size, 1)
        self.vocab_size = vocab_size
        self.base = base
        super().__init__(int(order), int(max_tokens), base, float(prior))

    def add(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Count one finished document (>= 1 token ids in [0, vocab_size)), evicting the oldest
        documents as the token budget requires."""
        super().add(_document_array(tokens, "job n-gram", self.vocab_size))

    def count(self, ngram: Sequence[int] | np.ndarray) -> int:
        """How often `ngram` (1..own_order tokens) occurs in the live documents."""
        a = _token_array(np.asarray(ngram), "ngram", None)
        if a.ndim != 1 or not 1 <= a.shape[0] <= self.own_order:
            raise ValueError(f"an n-gram holds 1..{self.own_order} token ids, got shape {a.shape}")
        return int(super().count(a))

    def score_job(self, context: Sequence[int] | np.ndarray,
                  candidates: Sequence[int] | np.ndarray) -> tuple[np.ndarray, int]:
        """(q_job for every candidate, c): the job's own estimate, without the base, and the job
        count of the longest suffix of `context` seen (0: the job has not seen its last token)."""
        probs, count = super().score_job(_token_array(context, "context", None),
                                         _token_array(candidates, "candidates", None))
        return probs, int(count)

    def __repr__(self) -> str:
        return (f"JobNgram(order={self.own_order}, base={type(self.base).__name__ if self.base else None}, "
                f"prior={self.prior}, documents={self.num_documents}, tokens={len(self)}/{self.max_tokens}, "
                f"ngrams={self.distinct_ngrams}, memory={self.memory_bytes} B)")
