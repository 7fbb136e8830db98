"""`lookup`: drafts from the request's own text (prompt lookup / suffix matching), no model.

Each live sequence owns an `ngram_native.ContextIndex` over its prompt and committed tokens. A
round proposes the continuation trie of the longest earlier match of the sequence's suffix
(`build_lookup_trees`, one C++ call for the batch), so repetitive requests (code edits, quotes,
summaries that copy) get long accepted drafts while a draft costs no forward pass at all. A
sequence with no match proposes an empty tree: that round is a plain decoding step.

The job-level cache (`ngram_native.JobCache`, `decoding.tree.lookup_cache_tokens`, 0 = off) spans
batches: every finished row's output (and its prompt, with `lookup_cache_prompts`) is added in
`retire`, and each round the same suffix is also matched against those earlier rows. Its tree
(nodes marked `SOURCE_JOB_CACHE`) is grafted into the context tree of the round
(`ngram_native.trees.graft`: prefix-merged, unique siblings, the best `budget` nodes by
score, ln(count / occurrences) for both), so a templated job's later rows draft from its earlier
ones. `ContextIndexes` is the per-batch state plus the cache, a part of this drafter and of the
hybrid drafters (`hybrid.py`); one drafter serves one engine, so the cache is per worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from dart_worker.drafters.base import CommittedBlock, Composite, Finished, Part, PerSequence, add_documents
from ngram_native.builders import TreeParams
from ngram_native.context import (
    DEFAULT_JOB_MAX_MATCH,
    DEFAULT_MAX_MATCH,
    ContextIndex,
    JobCache,
    build_job_cache_trees,
    build_lookup_trees,
)
from ngram_native.trees import SOURCE_CONTEXT, SOURCE_JOB_CACHE, DraftTree, graft


class ContextIndexes(Part):
    """One `ContextIndex` per live sequence, kept in step with the engine's batch, and the job
    cache of this drafter's engine (None when `tree.lookup_cache_tokens` is 0)."""

    def __init__(self, tree: TreeParams, eos_token_ids: Sequence[int]):
        self.tree = tree
        self.eos_ids = sorted(int(t) for t in eos_token_ids)
        self.indexes: PerSequence = PerSequence(self._new_index)
        self.job_cache: JobCache | None = None
        if tree.lookup_cache_tokens:
            self.job_cache = JobCache(max_tokens=int(tree.lookup_cache_tokens), min_match=tree.lookup_min_match,
                                      max_match=max(tree.lookup_min_match, DEFAULT_JOB_MAX_MATCH))

    def job_stores(self) -> dict[str, JobCache]:
        return {} if self.job_cache is None else {"job_cache": self.job_cache}

    def _new_index(self) -> ContextIndex:
        return ContextIndex(min_match=self.tree.lookup_min_match,
                            max_match=max(self.tree.lookup_min_match, DEFAULT_MAX_MATCH))

    def observe(self, block: CommittedBlock) -> None:
        # block.tokens[b] is all of sequence b so far; the index holds a prefix of it (a newcomer's
        # empty index gets its prompt + first token, a live one's the tokens committed since).
        first = self.indexes.observe(block)
        for index, tokens in zip(self.indexes[first:], block.tokens, strict=True):
            if len(tokens) > len(index):
                index.append(tokens[len(index):])

    def retire(self, finished: Finished, keep: Sequence[int]) -> None:
        """Finished sequences go into the job cache (`cache_finished`), then leave the batch."""
        if self.job_cache is not None and len(finished.tokens):
            self.cache_finished(finished)
        self.indexes.retire(finished, keep)

    def cache_finished(self, finished: Finished) -> None:
        """Add finished rows to the job cache: their outputs (tokens after the first num_prompt[b]),
        or prompt + output with `lookup_cache_prompts` (one document, so a later row whose prompt
        ends alike drafts the start of this row's output)."""
        add_documents(self.job_cache, finished.tokens if self.tree.lookup_cache_prompts else finished.outputs())

    def propose(self, tokens: Sequence[Sequence[int]], max_depths: Sequence[int]) -> list[DraftTree]:
        """Each sequence's context tree, with the job cache's tree grafted in when the cache holds
        anything."""
        cap = self.tree.max_depth
        caps = [min(c, cap) if cap else c for c in max_depths]
        trees = self.context_trees(caps)
        if self.job_cache is None or not len(self.job_cache):
            return trees
        return self.graft_job_cache(trees, self.job_cache_trees(caps))

    def context_trees(self, caps: Sequence[int]) -> list[DraftTree]:
        """Per sequence, the continuation trie of the longest earlier match of its suffix in its own text."""
        return [t.from_source(SOURCE_CONTEXT) for t in build_lookup_trees(self.indexes, caps, **self._knobs())]

    def job_cache_trees(self, caps: Sequence[int]) -> list[DraftTree]:
        """Per sequence, the continuation trie of its suffix's matches in earlier rows (the job cache)."""
        return build_job_cache_trees(self.job_cache, self.indexes, caps, **self._knobs())

    def graft_job_cache(self, trees: list[DraftTree], cached: list[DraftTree]) -> list[DraftTree]:
        budget = self.tree.budget
        return [graft(t, c.from_source(SOURCE_JOB_CACHE), budget) for t, c in zip(trees, cached, strict=True)]

    def _knobs(self) -> dict:
        return dict(budget=self.tree.budget, eos_ids=self.eos_ids, depth_factor=self.tree.lookup_depth_factor,
                    max_occurrences=self.tree.lookup_max_occurrences)


class LookupDrafter(Composite):
    name = "lookup"

    def __init__(self, tree: TreeParams, eos_token_ids: Sequence[int]):
        self.context = ContextIndexes(tree, eos_token_ids)
        self.parts = (self.context,)

    def propose(self, tokens: Sequence[Sequence[int]], max_depths: Sequence[int]) -> list[DraftTree]:
        return self.context.propose(tokens, max_depths)
