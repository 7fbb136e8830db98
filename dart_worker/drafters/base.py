"""The drafter protocol: the engine owns the loop, a drafter owns its proposal state.

One batch of decoding drives a drafter like this (see `DecodingEngine._decode`):

    drafter.start(batch_size)
    drafter.observe(prefill block)                 # the prompts' rows, committed by prefill
    loop:
        drafter.join(prefill block of newcomers)   # continuous batching: they join at the end
        drafter.finish(tokens, num_prompt of finished ones)  # sequences that ended, before they leave
        drafter.select(keep)                       # finished sequences leave the batch
        drafter.pause_model(...); drafter.catch_up()  # the cost model: is the model worth running?
        trees = drafter.propose(tokens, depth_caps)  # one DraftTree per live sequence
        ... the target verifies the trees, the engine commits the accepted rows ...
        drafter.observe(verify block)              # the rows just committed

Trees come back in the shared flat representation (`ngram_native.DraftTree`: tokens, parents,
depths in topological order) and are checked once, where they enter the engine
(`TreeBatch.from_trees`); verification does not care where a node came from, so any proposal
is lossless. A drafter never sees logits of the target.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ngram_native.trees import DraftTree


@dataclass(frozen=True)
class CommittedBlock:
    """Rows of one target forward that are now committed, for drafters that learn from them.

    taps: [B, S, F] hidden states tapped in that forward (prefill: the prompt rows; verify: the
    root and tree rows). rows[b]: the rows of `taps` that sequence b committed, in order.
    tokens[b]: every token of sequence b so far (prompt + generated, the new ones included), so
    row rows[b][k] is followed by token tokens[b][len(tokens[b]) - len(rows[b]) + k].
    """

    taps: torch.Tensor
    rows: Sequence[Sequence[int]]
    tokens: Sequence[Sequence[int]]


class Drafter(ABC):
    """Proposes draft trees for a batch; one instance serves one engine (one batch at a time)."""

    name: str = "?"
    # True when proposing costs a model forward (a draft head) that the engine's cost model may
    # pause for rounds where drafting does not pay (`pause_model`, `catch_up`).
    has_model: bool = False
    # The n-gram counts of the rows this drafter's engine finished (ngram_native.JobNgram), for
    # drafters that score with them (dart, dart_lookup); None for the others.
    job_ngram = None

    def warm(self, documents: Sequence[Sequence[int]], kinds: Sequence[str] = ("job_ngram",)) -> None:
        """Load earlier outputs (token ids) into the job-level state of the `kinds` named
        ("job_ngram", "job_cache"), as if this drafter's engine had finished those rows."""
        if "job_ngram" in kinds and self.job_ngram is not None:
            for doc in documents:
                if len(doc):
                    self.job_ngram.add(doc)

    def job_state(self) -> dict[str, tuple[int, int]]:
        """What this drafter learnt from finished rows, by kind ("job_cache", "job_ngram"):
        (tokens held, bytes of memory). Empty for drafters without job-level state."""
        return {} if self.job_ngram is None else {"job_ngram": (len(self.job_ngram), self.job_ngram.memory_bytes)}

    def start(self, batch_size: int) -> None:  # noqa: B027 - optional hook, stateless drafters skip it
        """A new batch of `batch_size` sequences begins: forget any earlier batch."""

    def observe(self, block: CommittedBlock) -> None:  # noqa: B027
        """Rows the target just committed (the prompts after prefill, then every round's)."""

    def join(self, block: CommittedBlock) -> None:  # noqa: B027 - stateless drafters need nothing
        """New sequences join the running batch, after the live ones (continuous batching);
        `block` is their prefill block, as `observe` gets it after `start` for a first batch.
        A drafter with per-sequence state must override this."""

    def finish(self, tokens: Sequence[Sequence[int]], num_prompt: Sequence[int]) -> None:  # noqa: B027
        """Sequences that ended (each one's prompt + generated tokens, and num_prompt[b]: how many
        of tokens[b] are its prompt), called once per sequence before `select` drops it: a drafter
        that learns from finished outputs (the lookup drafters' job cache) reads them here. Errors
        never reach it: only rows that decoded."""

    def select(self, keep: Sequence[int]) -> None:  # noqa: B027
        """Keep only the sequences at indices `keep` (host ints; the others finished), in that order."""

    def catch_up(self) -> None:  # noqa: B027
        """Run model work deferred since the last proposal (the engine times it as drafting)."""

    def pause_model(self, paused: bool) -> None:  # noqa: B027
        """While paused, `propose` must not run the model: it returns what it can draft without
        it (empty trees, or a hybrid's context trees) and catches up on the rows when resumed."""

    @abstractmethod
    def propose(self, tokens: Sequence[Sequence[int]], max_depths: Sequence[int]) -> list[DraftTree]:
        """One tree per live sequence; tree b holds no node deeper than max_depths[b].

        tokens[b] is everything sequence b committed so far (its last token is the tree's root).
        """


def empty_tree() -> DraftTree:
    """A tree with no nodes: the round verifies the root alone (a plain decoding step)."""
    empty = np.zeros(0, dtype=np.int32)
    return DraftTree(tokens=empty, parents=empty, depths=empty)
