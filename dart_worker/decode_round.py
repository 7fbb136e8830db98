"""One decoding round's record, and the engine's one clock.

The engine's round (`DecodingEngine._round`) fills a `RoundRecord` as it goes: the live
sequences' trees, the verify block and its outputs, the acceptances, the rows committed and the
stage times. The sizing policy reads it twice and only there: `plan` sizes the trees while the
round drafts, and `learn` takes the whole record once the round has committed
(`dart_worker.sizing.policy`). Every duration the engine records comes from `StageClock`: a
stage is timed by `with record.stage(name):` around the step, and charged to each live
sequence's statistics (`RequestStats.stage_seconds`) as it ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from dart_worker.drafters.base import empty_tree
from dart_worker.live_sequence import LiveSequence
from dart_worker.sampling.verification import Acceptance, VerifyRow
from dart_worker.sizing.acceptance import RowAcceptance
from dart_worker.sizing.drain import row_pace
from dart_worker.stats import STAGES
from dart_worker.target.adapter import ForwardOutput
from dart_worker.target.target_state import TargetState
from dart_worker.target.tree_batch import TreeBatch
from ngram_native.trees import DraftTree

# How the engine drafts for the policy (`SizingPolicy.plan`): called with whether to run the
# drafter's model (True / False), or None for no drafting at all (a plain step, save a grammar's
# forced text); returns the round's trees as proposed. It sets the record's `model_ran` and
# `model_seconds`.
Draft = Callable[[bool | None], list[DraftTree]]


class StageClock:
    """The engine's clock: every time it records is read here (`time.perf_counter`).

    `sync`: on a GPU, synchronise at every reading so each stage's time is its own (a benchmark
    asks for it); off, a stage's queued GPU work is charged where the host next waits."""

    def __init__(self, device: torch.device, sync: bool = False):
        self.device, self.sync = device, sync

    def now(self) -> float:
        if self.sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @staticmethod
    def wall() -> float:
        """A reading that never waits for the device: where a request's wall time starts."""
        return time.perf_counter()

    @contextmanager
    def stage(self, sequences: Sequence[LiveSequence], name: str,
              seconds: dict[str, float] | None = None) -> Iterator[None]:
        """Time the block as stage `name` of `sequences` (each sequence's statistics get it); add it
        to `seconds` (a round's own record) when given."""
        started = self.now()
        yield
        elapsed = self.now() - started
        for seq in sequences:
            seq.stats.stage_seconds[name] += elapsed
        if seconds is not None:
            seconds[name] += elapsed


@dataclass(eq=False)  # one round's record: equal only to itself
class RoundRecord:
    """What one round did, in the order it did it (see the module doc)."""

    live: list[LiveSequence]
    state: TargetState
    clock: StageClock
    draining: bool  # no request waits for a slot: the batch ends with its longest row
    deferred: bool  # the verify forward projects only the rows the greedy walk reads
    started: float = 0.0  # the clock when the round began
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))  # per stage
    trees: list[DraftTree] = field(default_factory=list)  # as verified (sized, constrained)
    model_ran: bool = False  # the drafter's model ran for this round's trees
    model_seconds: float = 0.0  # its forward and the proposal, when it ran
    batch: TreeBatch | None = None  # the verify block
    rows: list[VerifyRow] = field(default_factory=list)  # per live sequence: tree, controls, key, position
    out: ForwardOutput | None = None  # the verify forward's outputs (live sequences' part)
    block_start: int = 0  # where the verify block starts in the target's cache
    acceptances: list[Acceptance] = field(default_factory=list)
    verified_seconds: float = 0.0  # the verify forward until its verdict is on the host
    committed_rows: list[list[int]] = field(default_factory=list)  # per live sequence, block rows kept

    def __post_init__(self) -> None:
        self.started = self.clock.now()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage `name` of this round (`StageClock.stage`)."""
        with self.clock.stage(self.live, name, self.seconds):
            yield

    def elapsed(self) -> float:
        return self.clock.now() - self.started

    def empty_trees(self) -> list[DraftTree]:
        return [empty_tree() for _ in self.live]

    # What the sizing policy reads: the live sequences' settings and records, the round's outcome.

    @property
    def full_logits(self) -> bool:
        return not self.deferred

    @property
    def bands(self) -> list[str]:
        return [s.params.band for s in self.live]

    @property
    def row_acceptances(self) -> list[RowAcceptance]:
        return [s.acceptance for s in self.live]

    def tokens_left(self) -> list[int] | None:
        """Each row's tokens left, when the batch drains (None otherwise)."""
        return [s.params.max_new_tokens - len(s.generated) for s in self.live] if self.draining else None

    def paces(self) -> list[float] | None:
        """Each row's tokens per round so far (`row_pace`), when the batch drains (None otherwise)."""
        return [row_pace(s.stats.accepted_tokens, s.stats.rounds) for s in self.live] if self.draining else None

    @property
    def accepted(self) -> list[np.ndarray]:
        return [acc.accepted for acc in self.acceptances]

    @property
    def first_tokens(self) -> list[int]:
        """The first token the round committed per sequence: its first accepted node's, or the bonus."""
        return [int(acc.accepted_tokens[0]) if acc.num_accepted else int(acc.bonus) for acc in self.acceptances]
