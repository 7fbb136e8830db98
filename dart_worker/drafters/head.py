"""Drafters over the DART draft head: `chain`, `ddtree` and `dart`.

They share the head's work (`HeadDrafter`): after each committed block the head reads the
committed rows (fused target taps paired with the next token's embedding, the shifted
pairing) into its own KV cache and predicts logits for the next D positions in one forward.
They differ only in how those per-position distributions become a tree:

- `chain`: the top-1 token per position (plain speculative decoding with a parallel drafter);
- `ddtree`: DDTree's best-first heap over per-position log-probs under the node budget;
- `dart`: DART's N-gram-guided beam search (the corpus trie re-scores the head's top-k).

Coupled drafting (issue #48): a sampled token is a fixed function of its request's noise at its
position and the target's distribution there; a drafter told that noise (`read_dice`, before each
proposal) can rank its candidates by the draw they would win rather than by their probability.
With a `coupler` (by default `GumbelCoupler` from the tree settings' coupling_noise_weight and
coupling_scale; None when the weight is 0), the builders read the coupler's per-depth logits
((log q + a g) / s, dart_worker/drafters/coupling.py) instead of the head's for the sampled
sequences; greedy ones are untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dart_worker.drafters.base import (
    CommittedBlock,
    Dice,
    Finished,
    ModelDrafter,
    PerSequence,
    add_documents,
    empty_tree,
)
from dart_worker.drafters.coupling import GumbelCoupler
from dart_worker.hardware.kernels import shapes_for
from dart_worker.hardware.transfer import to_device, to_host
from dart_worker.head.draft_kv_cache import DraftKVCache
from ngram_native.builders import TreeParams, build_chain_trees, build_dart_trees, build_ddtree_trees
from ngram_native.job_ngram import JobNgram
from ngram_native.trees import SOURCE_HEAD, DraftTree

# Committed tokens handed to the N-gram scorer as context (it reads only its last n - 1).
NGRAM_CONTEXT_TOKENS = 8
# A head resuming after a pause reads at most this many of a sequence's latest unread rows; older
# ones are skipped (positions kept, `DraftKVCache.skip`). Reading them all made a probe's cost grow
# with the pause before it (after a long pause, nearly a whole target step, plus the prompts of the
# sequences that joined meanwhile; docs/benchmarks.md), so no back-off could
# bound what probing a head that never pays costs. A head that runs every round reads everything,
# joiners' whole prompts included: that is the context it was trained to see.
CATCH_UP_ROWS = 32


@dataclass
class _Unread:
    """Committed rows of one sequence that the head has not read yet: their features [n, F] (one
    tensor per block) and the token after each (shifted pairing)."""

    features: list[torch.Tensor] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


class HeadDrafter(ModelDrafter):
    """Runs the draft head over the committed rows and keeps its latest logits.

    The head's forward is lazy: `observe` only gathers the committed rows' features, and
    `run_model(True)` (called by the engine before a proposal) runs the head once over everything
    gathered since its last run. So while the engine's cost model pauses the head (rounds where
    drafting does not pay), it costs nothing, and resuming reads the missed rows in one call.
    """

    def __init__(self, head, tree: TreeParams, eos_token_ids: Sequence[int]):
        self.head = head
        self.tree = tree
        self.eos_ids = sorted(int(t) for t in eos_token_ids)
        self.cache: DraftKVCache | None = None  # the head's KV rows, one sequence per live one
        self.logits: torch.Tensor | None = None  # [B, D, draft vocab] after the last catch-up
        self.paused = False
        # The head's forwards in bucket shapes where the verify forward's are (CUDA: graphs).
        self.bucketed = shapes_for(head.device) == "bucketed"
        self.unread: PerSequence = PerSequence(_Unread)
        # (logits [B, D', V], dice) -> the logits the builders read; None: the head's own.
        self.coupler: Callable[[torch.Tensor, Sequence[Dice | None]], torch.Tensor] | None = (
            GumbelCoupler(head, tree.coupling_scale, tree.coupling_noise_weight) if tree.coupling_noise_weight > 0
            else None)
        self.dice: list[Dice | None] = []  # this round's, from `read_dice`

    def read_dice(self, dice: Sequence[Dice | None]) -> None:
        self.dice = list(dice)  # read by the next proposal only

    def observe(self, block: CommittedBlock) -> None:
        if block.joined:
            # Newcomers get empty head caches after the live ones; their prompt rows wait for the
            # next catch-up like any other unread rows (so the latest logits no longer cover the batch).
            fresh = self.head.new_cache(len(block.rows))
            self.cache = fresh if self.cache is None else DraftKVCache.concat([self.cache, fresh])
            self.logits = None
        self._gather(block, offset=self.unread.observe(block))

    def _gather(self, block: CommittedBlock, offset: int) -> None:
        """Queue the committed rows of `block` for sequences offset, offset + 1, ...: one gather of
        every sequence's rows (one upload of their indices), then a view per sequence."""
        counts = [len(rows) for rows in block.rows]
        total = sum(counts)
        if total:
            index = np.empty((2, total), dtype=np.int64)
            index[0] = np.repeat(np.arange(len(counts)), counts)
            index[1] = np.concatenate([np.asarray(rows, dtype=np.int64) for rows in block.rows if len(rows)])
            where = to_device(index, block.taps.device)
            features = block.taps[where[0], where[1]].to(self.head.device, non_blocking=True).split(counts)
        for b, (rows, tokens) in enumerate(zip(block.rows, block.tokens, strict=True)):
            if not len(rows):
                continue
            unread = self.unread[offset + b]
            unread.features.append(features[b])
            # Row k of the block carries the features of its token and the embedding of the token
            # after it (shifted pairing): the last committed row pairs with the newest token.
            unread.tokens.extend(tokens[len(tokens) - len(rows):])

    def run_model(self, on: bool) -> None:
        resuming = self.paused and on
        self.paused = not on
        if on:
            self.catch_up(window=CATCH_UP_ROWS if resuming else None)

    def catch_up(self, window: int | None = None) -> None:
        """Run the head over the rows observed since its last run (one batched forward): all of
        them, or each sequence's latest `window` (a head resuming after a pause: CATCH_UP_ROWS)."""
        counts = [len(u.tokens) for u in self.unread]
        if not any(counts):
            return
        over = np.maximum(np.asarray(counts) - window, 0) if window is not None else None
        if over is not None and over.any():
            self._skip_oldest(over)
            counts = [len(u.tokens) for u in self.unread]
        device = self.head.device
        batch, width = len(counts), max(counts)
        # Every sequence's unread rows scattered into one padded [B, width] block, on the device;
        # the next tokens and counts are host data (checked there by the head) uploaded once.
        rows = np.concatenate([np.arange(c) for c in counts])
        index = np.stack([np.repeat(np.arange(batch), counts), rows])
        next_tokens = np.zeros((batch, width), dtype=np.int64)
        next_tokens[index[0], index[1]] = np.concatenate([np.asarray(u.tokens, dtype=np.int64) for u in self.unread])
        where = to_device(index, device)
        flat = torch.cat([f for u in self.unread for f in u.features])
        padded = flat.new_zeros(batch, width, flat.shape[-1])
        padded[where[0], where[1]] = flat
        self.logits = self.head.draft_logits(padded, next_tokens, np.asarray(counts), self.cache,
                                             bucketed=self.bucketed)
        self.unread[:] = [_Unread() for _ in range(batch)]

    def _skip_oldest(self, over: np.ndarray) -> None:
        """Drop the `over[b]` oldest unread rows of each sequence b, unread for good."""
        for b in np.flatnonzero(over):
            unread, drop = self.unread[b], int(over[b])
            unread.features = [torch.cat(unread.features)[drop:]]
            unread.tokens = unread.tokens[drop:]
        self.cache.skip(over)

    def retire(self, finished: Finished, keep: Sequence[int]) -> None:
        self.unread.retire(finished, keep)
        if not len(keep):  # the batch is over: the next one starts from empty caches
            self.cache = self.logits = None
            return
        order = [int(b) for b in keep]
        self.cache.select(order)
        if self.logits is not None:
            self.logits = self.logits.index_select(0, to_device(order, self.logits.device, torch.long))

    def propose(self, tokens: Sequence[Sequence[int]], max_depths: Sequence[int]) -> list[DraftTree]:
        dice, self.dice = self.dice, []  # this round's: a proposal never reads an earlier round's dice
        if self.paused:
            return [empty_tree() for _ in tokens]
        self.catch_up()  # a caller that never pauses the head need not run it first
        if self.logits is None:
            raise RuntimeError(f"{self.name}: propose() before any observe(): the head has read nothing")
        caps = [min(c, self.tree.max_depth) if self.tree.max_depth else c for c in max_depths]
        if max(caps, default=0) == 0:
            return [empty_tree() for _ in tokens]
        logits = self.logits[:, : max(caps)]
        if self.coupler is not None and any(d is not None for d in dice):
            if len(dice) != len(tokens):
                raise ValueError(f"{self.name}: dice for {len(dice)} sequences, a proposal for {len(tokens)}")
            logits = self.coupler(logits, dice)
        return [t.from_source(SOURCE_HEAD) for t in self.build(logits, tokens, caps)]

    def build(self, logits: torch.Tensor, tokens: Sequence[Sequence[int]], caps: list[int]) -> list[DraftTree]:
        """Trees from draft logits [B, D', draft vocab] (D' = the deepest cap)."""
        raise NotImplementedError

    def candidates(self, values: torch.Tensor, draft_ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The tree builders' inputs on the host: target ids (int32) and float32 scores of the
        head's top-k, [B, D', k] each, in the round's one draft transfer."""
        ids, scores = to_host(self.head.to_target_ids(draft_ids).to(torch.int32), values.float())
        return ids, scores


class ChainDrafter(HeadDrafter):
    name = "chain"

    def build(self, logits, tokens, caps):
        ids, values = self.candidates(*logits.topk(1, dim=-1))
        return build_chain_trees(ids, values, budget=self.tree.budget,
                                 eos_ids=self.eos_ids, max_depths=caps)


class DDTreeDrafter(HeadDrafter):
    name = "ddtree"

    def build(self, logits, tokens, caps):
        top_k = min(self.tree.top_k, logits.shape[-1])
        ids, values = self.candidates(*torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1))
        return build_ddtree_trees(ids, values, budget=self.tree.budget,
                                  eos_ids=self.eos_ids, max_depths=caps)


class DartDrafter(HeadDrafter):
    """DART's beam over the head's top-k, re-scored by the static trie - mixed, when
    `tree.job_ngram_tokens` > 0, with the n-gram counts of the rows this drafter's engine has
    finished (`ngram_native.job_ngram.JobNgram`: per worker, so a long job drafts from the
    target's own earlier replies; with no rows finished yet it scores exactly like the trie)."""

    name = "dart"

    def __init__(self, head, tree: TreeParams, eos_token_ids: Sequence[int], trie):
        super().__init__(head, tree, eos_token_ids)
        self.trie = trie
        self.job_ngram: JobNgram | None = None
        if trie is not None and tree.job_ngram_tokens:
            self.job_ngram = JobNgram(base=trie, order=tree.job_ngram_order, max_tokens=tree.job_ngram_tokens,
                                      prior=tree.job_ngram_prior)

    def job_stores(self) -> dict[str, JobNgram]:
        return {} if self.job_ngram is None else {"job_ngram": self.job_ngram}

    def retire(self, finished: Finished, keep: Sequence[int]) -> None:
        if self.job_ngram is not None:
            add_documents(self.job_ngram, finished.outputs())
        super().retire(finished, keep)

    def build(self, logits, tokens, caps):
        ids, values = self.candidates(*logits.float().topk(min(self.tree.top_k, logits.shape[-1]), dim=-1))
        contexts = [t[-NGRAM_CONTEXT_TOKENS:] for t in tokens]
        scorer = self.job_ngram if self.job_ngram is not None else self.trie
        # self.tree as built (checked once); the builder reads at most the K candidates given
        return build_dart_trees(ids, values, contexts, scorer, params=self.tree, eos_ids=self.eos_ids,
                                max_depths=caps)
