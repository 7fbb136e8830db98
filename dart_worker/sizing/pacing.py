"""When the drafter's model and drafting itself run: back-offs for the rounds where they do not pay.

Two paces, each with its own state, both driven by the tree sizer (`TreeSizer.plan` asks whether
to draft and whether to run the model; `fit` and `observe` report whether they paid):

- `ModelPacing`: the drafter's model forward (the draft head) pauses for 1, 2, 4 ... rounds after
  a round where trees without its nodes would have committed tokens as fast; on a batch of sampled
  rows (where a head's nodes are seldom accepted) its probes are also spaced so that they take at
  most PROBE_SHARE of the decoding time (`probe_pause`), and a probe is judged from what its nodes
  did, not from what the acceptance table expected (`ModelPacing.judge`).
- `DraftingPacing`: a sampled batch whose trees keep being cut to nothing skips drafting for a
  few rounds (plain steps): proposing, pricing and cutting trees nobody keeps costs time too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dart_worker.sizing.acceptance import node_sources
from ngram_native.trees import SOURCE_HEAD, DraftTree, subtree

MAX_PAUSE_ROUNDS = 32
# Probing a model that keeps failing (the draft head at T=1 drafting from its own distribution,
# where its nodes are rarely accepted) costs its forward every probe. Once it has run on sampled
# rows PROBE_EVIDENCE_ROUNDS times, from its second failure in a row a model pauses at least long
# enough that its probes take at most this share of the decoding time; and each failure after that
# halves the share, down to PROBE_SHARE / 2**PROBE_DOUBLINGS (docs/benchmarks.md). Before that, the
# plain back-off: the acceptance table's first verdicts rest on a handful of nodes, and a coupled
# head (issue #48), which pays at T=1, failed its first two rounds often enough to be starved by
# the floor before the table had learnt what its nodes are worth.
PROBE_SHARE = 0.01
PROBE_DOUBLINGS = 3
PROBE_EVIDENCE_ROUNDS = 16
# A sampled batch's model rounds are judged on what its nodes brought over its recent judged rounds,
# not on the last one alone: the weight left to earlier rounds' evidence at each judged round.
JUDGE_MEMORY = 0.8
# Drafting itself (proposals, the sizer's pricing, the lookup's bookkeeping) costs a sampled batch
# time in rounds whose trees are nearly always cut to nothing. After this many such rounds in a
# row, a sampled batch of two or more rows skips drafting for 1, 2, 4 ... DRAFT_PAUSE_MAX rounds
# (plain steps), then drafts again; one round that keeps a node ends the back-off.
DRAFT_IDLE_ROUNDS = 2
DRAFT_PAUSE_MAX = 4


def probe_pause(model_seconds: float, step_seconds: float) -> int:
    """Rounds of plain steps of `step_seconds` over which one probe of the model (`model_seconds`)
    is PROBE_SHARE of the time."""
    return int(np.ceil(model_seconds / (PROBE_SHARE * max(step_seconds, 1e-9))))


@dataclass
class Pause:
    """Rounds left of a back-off; each round asks `wanted` once."""

    pause_left: int = 0

    def wanted(self) -> bool:
        """Run this round? False (and one round fewer left) while paused."""
        if self.pause_left > 0:
            self.pause_left -= 1
            return False
        return True


@dataclass
class ModelPacing(Pause):
    """Whether the drafter's model runs this round (`wanted`; see the module doc)."""

    pause_length: int = 1
    failed_probes: int = 0  # the model's failures in a row on sampled rows
    judge_after_verify: bool = False  # a sampled batch's model round awaits its verdict (`judge`)
    # `judge`'s evidence: head-only accepted nodes and committed tokens of the judged rounds (decayed).
    head_tokens: float = 0.0
    committed_tokens: float = 0.0
    sampled_rounds: int = 0  # rounds the model ran on batches of sampled rows (`ran_sampled`)

    def ran_sampled(self) -> None:
        """The model ran on a batch of sampled rows (its round's fate is known once it is verified)."""
        self.sampled_rounds += 1

    def failed(self, sampled: bool, probe_rounds: int) -> None:
        """The model did not pay this round: pause it for the back-off, and once it has run on
        sampled rows PROBE_EVIDENCE_ROUNDS times, from the second failure in a row there for at
        least `probe_rounds` (`probe_pause`), doubled at each further failure up to
        PROBE_DOUBLINGS times."""
        self.failed_probes = self.failed_probes + 1 if sampled else 0
        floor = 0
        if self.failed_probes >= 2 and self.sampled_rounds >= PROBE_EVIDENCE_ROUNDS:
            floor = probe_rounds << min(self.failed_probes - 2, PROBE_DOUBLINGS)
        self.pause_left = max(self.pause_length, floor)
        self.pause_length = min(2 * self.pause_length, max(MAX_PAUSE_ROUNDS, floor))

    def paid(self) -> None:
        self.pause_length, self.failed_probes = 1, 0

    def judge(self, trees: list[DraftTree], accepted: list, round_seconds: float, model_seconds: float,
              probe_rounds: int, cut_hits: int = 0) -> None:
        """On a batch of sampled rows, whether the model paid is judged from what its nodes did, not
        from what the acceptance table expected of them, over its recent judged rounds.

        The table is least sure exactly where this matters: at T=1 the head's nodes are seldom
        accepted and the head mostly paused, so its bins hold few observations and lean on a prior.
        A probe the table wrongly thought paying reset the back-off to one round, and the next
        probes followed within a few rounds. Here the accepted head-only nodes (which no other
        source proposed: without the model, the accepted path would have stopped before each of
        them) must be worth the model's seconds: h tokens more in (S + m) seconds beats the T - h
        tokens a round would have committed in S seconds without it, i.e. h (S + m) > T m (S:
        `round_seconds`, the verify forward and the round's overhead; m: `model_seconds`).

        h and T are sums over the judged rounds, earlier ones weighing JUDGE_MEMORY less at each new
        one. One round's h is a coin toss: a coupled head at T=1 (issue #48) that brings 0.6 tokens
        a round on average brings none in about half of its rounds, and judged a round at a time it
        failed twice in a row often enough to spend most of a reply paused behind the probing
        floor (docs/benchmarks.md). A head whose nodes are seldom accepted still fails: its misses
        outweigh an occasional hit within a few rounds.

        `cut_hits`: the trees that accepted nothing although their cut left out a head-only
        first-level node equal to the token the round committed; each counts as one head token (the
        head named it; deeper nodes' fate is unknown). Judged by its verified nodes alone, the head
        was worth only what the cut let through: a table still pessimistic from the first rounds kept
        its trees small, those failed the head and it paused before the table learnt (coupled drafting
        at T=1 ran at `ar`'s speed so, and faster with the head never paused: docs/benchmarks.md). And
        the model's first PROBE_EVIDENCE_ROUNDS rounds on sampled rows always count as paid: it runs
        while the table calibrates.
        """
        head_only = sum(int(np.count_nonzero(node_sources(tree)[nodes] == SOURCE_HEAD))
                        for tree, nodes in zip(trees, accepted, strict=True)) + cut_hits
        committed = len(trees) + sum(len(nodes) for nodes in accepted)
        self.head_tokens = JUDGE_MEMORY * self.head_tokens + head_only
        self.committed_tokens = JUDGE_MEMORY * self.committed_tokens + committed
        if (self.head_tokens * (round_seconds + model_seconds) > self.committed_tokens * model_seconds
                or self.sampled_rounds <= PROBE_EVIDENCE_ROUNDS):  # this round is counted already
            self.paid()
        else:
            self.failed(sampled=True, probe_rounds=probe_rounds)


@dataclass
class DraftingPacing(Pause):
    """Whether the drafter drafts this round (`wanted`; see the module doc). While drafting pauses
    the round is a plain step, and nothing is proposed, priced or cut. The drafter still observes
    every committed row, so a round after the pause drafts from the whole text, as if it had never
    paused."""

    idle_rounds: int = 0  # fitted rounds in a row of a sampled batch whose trees were all cut to nothing

    def note(self, idle: bool) -> None:
        """Count a fitted round whose trees were all cut to nothing (`idle`) on a sampled batch of
        two or more rows, and pause drafting after DRAFT_IDLE_ROUNDS of them in a row."""
        self.idle_rounds = self.idle_rounds + 1 if idle else 0
        if self.idle_rounds >= DRAFT_IDLE_ROUNDS:
            self.pause_left = min(1 << (self.idle_rounds - DRAFT_IDLE_ROUNDS), DRAFT_PAUSE_MAX)


def without_model_nodes(tree: DraftTree, p: np.ndarray) -> tuple[DraftTree, np.ndarray]:
    """The part of `tree` a drafter proposes without its model: nodes some other source proposed
    (context lookup, the job cache); nothing for a tree of head nodes only."""
    if tree.sources is None:
        return DraftTree(tree.tokens[:0], tree.parents[:0], tree.depths[:0]), p[:0]
    keep = (tree.sources & ~np.uint8(SOURCE_HEAD)) != 0
    # A kept node's ancestors were proposed by the same source (sources are prefix-closed), so
    # the kept set is a tree.
    return subtree(tree, keep), p[keep]
