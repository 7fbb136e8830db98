"""The drafter protocol: the engine owns the loop and the batch, a drafter owns its proposal state.

A drafter has three hooks, and a drafter with a model one more:

    observe(block)          rows the target just committed: a verify block of every live sequence,
                            or the prefill block of sequences joining after the live ones
                            (`block.joined`; the first batch joins an empty one)
    retire(finished, keep)  sequences ended: `finished` holds their tokens (to learn from), then
                            the batch keeps only the sequences at `keep`, in that order
    read_dice(dice)         before a proposal: each live sequence's `Dice` (the key and position of
                            its sampled draws; None for a greedy one), so a drafter may propose
                            the tokens that randomness will select (coupled drafting, issue #48)
    propose(tokens, caps)   one DraftTree per live sequence, no node deeper than caps[b]
    run_model(on)           `ModelDrafter` only, before each proposal: on, run the model over the
                            rows observed since its last run (the engine times it as "draft",
                            building trees as "tree"); off, the cost model paused it this round:
                            `propose` drafts what it can without it

so one batch of decoding (`DecodingEngine._decode`) reads:

    drafter.observe(prefill block, joined)         # the prompts' rows
    loop:
        drafter.retire(finished, keep)             # sequences that ended leave the batch
        drafter.observe(prefill block, joined)     # continuous batching: newcomers join at the end
        drafter.run_model(on)                      # model drafters: is the model worth running?
        trees = drafter.propose(tokens, caps)
        ... the target verifies the trees, the engine commits the accepted rows ...
        drafter.observe(verify block)              # the rows just committed

Every hook but `propose` (and a model drafter's `run_model`) does nothing by default, so a drafter
overrides what it uses (`ar` is one method). The batch order is the engine's: what a drafter keeps per
sequence lives in a `PerSequence` list, which follows joins and retirements in one place (so no
drafter checks for a missed block). A drafter made of parts (`Composite`: the lookup drafter, the
hybrids) hands every change to each part; a part is anything with these hooks and no `propose`
(`Part`).

Job-level state - what a drafter learns from finished rows and keeps across batches, per worker -
is a drafter's own: `job_stores()` names its stores by kind ("job_ngram": DART's n-gram counts,
"job_cache": the lookup drafters' earlier outputs), each with `add(tokens)`, `len()` and
`memory_bytes`. The drafter fills them in `retire`; the engine warms them with earlier outputs
and reports them (`DecodingEngine.warm`, `job_state`) without knowing what they are.

Trees come back in the shared flat representation (`ngram_native.DraftTree`: tokens, parents,
depths in topological order) and are checked once, where they enter the engine
(`TreeBatch.from_trees`); verification does not care where a node came from, so any proposal
is lossless. A drafter never sees logits of the target.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ngram_native.trees import DraftTree


@dataclass(frozen=True)
class CommittedBlock:
    """Rows of one target forward that are now committed, for drafters that learn from them.

    taps: [B, S, F] hidden states tapped in that forward (prefill: the prompt rows; verify: the
    root and tree rows). rows[b]: the rows of `taps` that sequence b of the block committed, in
    order. tokens[b]: every token of that sequence so far (prompt + generated, the new ones
    included), so row rows[b][k] is followed by token tokens[b][len(tokens[b]) - len(rows[b]) + k].

    joined: False for a verify block, whose sequences are the live batch in order; True for the
    prefill block of sequences that join the batch: they are appended after the live ones (after
    none, for a first batch). Either way the block's sequences are the batch's last len(rows).
    """

    taps: torch.Tensor
    rows: Sequence[Sequence[int]]
    tokens: Sequence[Sequence[int]]
    joined: bool = False


@dataclass(frozen=True)
class Dice:
    """What a sampled sequence's next draws are made of: its noise key (`sampling.params.request_key`),
    the generated index its next round's root row draws (`position`: how many tokens it has
    generated; a node at depth d is drawn at position + d - 1) and its temperature. A committed
    token is a fixed function of the key, the position and the target's distribution there, so a
    drafter reading these changes which drafts are accepted, never which tokens are committed."""

    key: int
    position: int
    temperature: float


@dataclass(frozen=True)
class Finished:
    """Sequences that ended, before they leave the batch: tokens[b] is one's prompt + generated
    tokens, num_prompt[b] how many of them are its prompt. Only rows that decoded: errors never
    reach a drafter."""

    tokens: Sequence[Sequence[int]]
    num_prompt: Sequence[int]

    def outputs(self) -> list[Sequence[int]]:
        """Each one's generated tokens."""
        return [seq[int(p):] for seq, p in zip(self.tokens, self.num_prompt, strict=True)]


NOTHING_FINISHED = Finished((), ())


class Part:
    """Drafting state that follows the engine's batch; every hook is optional."""

    def observe(self, block: CommittedBlock) -> None:
        """Rows the target just committed (see `CommittedBlock`: a verify block, or newcomers)."""

    def retire(self, finished: Finished, keep: Sequence[int]) -> None:
        """`finished` sequences ended (learn from them here); then only the sequences at indices
        `keep` (host ints) stay, in that order. `keep` may be empty: the batch is over (the
        engine also says so before a batch starts, so state left by a batch that raised goes)."""

    def job_stores(self) -> dict[str, Any]:
        """Job-level stores by kind ("job_ngram", "job_cache"), each with add(tokens), len() and
        memory_bytes; empty when this holds nothing across batches (or it is turned off)."""
        return {}

    def read_dice(self, dice: Sequence[Dice | None]) -> None:
        """Before a proposal: the live sequences' `Dice` in batch order (None: greedy). Ignored by
        default; a head drafter with a coupler drafts from them (`HeadDrafter.coupler`)."""


class Drafter(Part, ABC):
    """Proposes draft trees for a batch; one instance serves one engine (one batch at a time)."""

    name: str = "?"
    # True for a `ModelDrafter`: proposing costs a model forward the engine's cost model may pause.
    has_model: bool = False
    # False for `ar` alone: its rounds verify the root only, so the engine adds no drafts of its own
    # (a grammar's forced text) to them and `ar` stays the plain baseline.
    speculates: bool = True

    @abstractmethod
    def propose(self, tokens: Sequence[Sequence[int]], max_depths: Sequence[int]) -> list[DraftTree]:
        """One tree per live sequence; tree b holds no node deeper than max_depths[b].

        tokens[b] is everything sequence b committed so far (its last token is the tree's root).
        """


class ModelDrafter(Drafter):
    """A drafter whose proposals cost a model forward (a draft head), which the engine's cost
    model may pause for rounds where drafting does not pay."""

    has_model = True

    @abstractmethod
    def run_model(self, on: bool) -> None:
        """Called before each proposal. on: run the model over every row observed since its last
        run (one batched forward; the engine times it as drafting). Off: `propose` must not run
        the model until it is on again (it returns what it can draft without it, e.g. empty trees
        or a hybrid's context trees); the rows it missed are read when it resumes."""


class Composite(Drafter):
    """A drafter made of parts (`parts`, in order): each change goes to every part, and the job
    stores are theirs; the subclass proposes from them."""

    parts: tuple[Part, ...] = ()

    def observe(self, block: CommittedBlock) -> None:
        for part in self.parts:
            part.observe(block)

    def retire(self, finished: Finished, keep: Sequence[int]) -> None:
        for part in self.parts:
            part.retire(finished, keep)

    def job_stores(self) -> dict[str, Any]:
        return {kind: store for part in self.parts for kind, store in part.job_stores().items()}

    def read_dice(self, dice: Sequence[Dice | None]) -> None:
        for part in self.parts:
            part.read_dice(dice)


class PerSequence(list, Part):
    """One entry per live sequence, in the engine's batch order: what a drafter keeps per sequence.

    `observe` appends `new()` for each sequence that joins and returns the batch index of the
    block's first sequence (0 for a verify block); `retire` keeps the survivors. Every per-sequence
    list follows the batch here, so it is the one place that checks a block fits the batch."""

    def __init__(self, new: Callable[[], Any]):
        super().__init__()
        self.new = new

    def observe(self, block: CommittedBlock) -> int:
        if block.joined:
            self.extend(self.new() for _ in block.rows)
        elif len(block.rows) != len(self):
            raise ValueError(f"a verify block of {len(block.rows)} sequences for a batch of {len(self)}: "
                             "a join or a retirement was missed")
        return len(self) - len(block.rows)

    def retire(self, finished: Finished, keep: Sequence[int]) -> None:
        self[:] = [self[b] for b in keep]


def add_documents(store, documents: Sequence[Sequence[int]]) -> None:
    """Add every non-empty document (token ids) to a job store."""
    for doc in documents:
        if len(doc):
            store.add(doc)


def empty_tree() -> DraftTree:
    """A tree with no nodes: the round verifies the root alone (a plain decoding step)."""
    empty = np.zeros(0, dtype=np.int32)
    return DraftTree(tokens=empty, parents=empty, depths=empty)
