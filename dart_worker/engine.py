"""The decoding engine: batched lossless tree speculative decoding on one device.

One round for a batch of sequences (see docs/DESIGN.md):

    draft logits --top-k--> tree builder (C++) --> TreeBatch
    target.verify(tree) --> logits + taps --> verification (greedy / coupled sampling)
    commit accepted rows (KV compaction) --> draft head over the new rows --> draft logits

The engine owns the loop (`_decode`: admit, draft, verify, commit, retire); a `Drafter`
(dart_worker.drafters) owns its proposal state and returns one tree per live sequence per round;
a sizing policy (dart_worker.sizing.policy) plans each round's trees and learns from the round's
record (dart_worker/decode_round.py), which also holds the one clock every stage time comes from;
each request's stop rules are its `LiveSequence`'s (dart_worker/live_sequence.py). Engines are made by
`dart_worker.engine_factory.build_engine`, which picks the drafter by name from the registry.
Every drafter is lossless: greedy output equals the target's greedy output, and a sampled
request commits exactly the tokens plain sampling (`ar`) commits with the same key, whatever the
trees hold (dart_worker/sampling/verification.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from contextlib import nullcontext

import numpy as np
import torch

from dart_worker.decode_round import RoundRecord, StageClock
from dart_worker.drafters.base import (
    NOTHING_FINISHED,
    CommittedBlock,
    Dice,
    Drafter,
    Finished,
    add_documents,
    empty_tree,
)
from dart_worker.drafters.grammar import constrain_trees
from dart_worker.hardware.kernels import logits_for, shapes_for
from dart_worker.hardware.transfer import move_to, to_device
from dart_worker.live_sequence import GenerationResult, LiveSequence, finish_at_context_limit, prompt_token_ids
from dart_worker.sampling.grammar import GrammarBook
from dart_worker.sampling.logits_processors import RowControls, controlled_logits
from dart_worker.sampling.params import SamplingParams, TokenHistory, request_key
from dart_worker.sampling.verification import (
    TokenLogprobs,
    VerifyRow,
    committed_logprobs,
    prompt_logprobs,
    verify_batch,
    verify_greedy_by_rows,
)
from dart_worker.sizing.policy import FIXED_SIZING, SizingPolicy
from dart_worker.sizing.sizer import TreeSizer
from dart_worker.stats import RequestStats
from dart_worker.target import shape_buckets
from dart_worker.target.adapter import ForwardOutput, TargetAdapter
from dart_worker.target.kv_cache import retire_order
from dart_worker.target.packed_rows import PackedRows
from dart_worker.target.shape_buckets import batch_bucket, rows_bucket
from dart_worker.target.target_state import TargetState
from dart_worker.target.tree_batch import TreeBatch
from ngram_native.trees import SOURCE_NAMES, DraftTree

__all__ = ["DecodingEngine", "GenerationResult", "accepted_sources"]


class DecodingEngine:
    """Owns one target and one drafter on one device; decodes batches of requests."""

    def __init__(
        self,
        target: TargetAdapter,
        drafter: Drafter,
        tokenizer=None,
        eos_token_ids: Sequence[int] = (),
        defer_logits: bool | None = None,
        sizer: TreeSizer | None = None,
        sync_timing: bool = False,
        shapes: str | None = None,
    ):
        """`sync_timing`: on a GPU, synchronise at every stage boundary so each stage's time is
        its own (a benchmark asks for it); off, the only host waits in a round are the
        verification transfers, and a stage's queued GPU work is charged where the host next
        waits (verification). On a CPU every stage's time is exact either way.

        `defer_logits`: in rounds where every request is greedy, project to the vocabulary only
        the rows the verification walk reads (`verify_greedy_by_rows`). None = the `logits`
        strategy of `dart_worker.hardware.kernels`: deferred on a CPU where a short measurement says it pays
        (`TargetAdapter.deferred_logits_pay`: without matrix units the projection over every tree
        row is most of a verify forward); never on a GPU, where one batched projection is cheap
        and a walk would add a host round trip per tree level.

        `shapes`: the verify block's shapes, `bucketed` or `exact` (None = the `shapes` strategy
        of `dart_worker.hardware.kernels`: bucketed on CUDA, for CUDA graphs; `dart_worker.target.shape_buckets`).
        Bucketed, the target's state holds `forward_batch(live)` sequences, padding after the live
        ones."""
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.device = target.device
        if defer_logits is None:
            defer_logits = logits_for(self.device, target.deferred_logits_pay) == "deferred"
        self.defer_logits = defer_logits
        self.clock = StageClock(self.device, sync_timing)  # every time the engine records
        self.bucketed = (shapes or shapes_for(self.device)) == "bucketed"
        # Exact shapes run a verify block's real rows only, where the target can (`_packed_rows`).
        self.packs_rows = not self.bucketed and target.packs_rows
        self._max_live: int | None = None  # the running `generate`'s, which caps batch buckets
        # Sizes every round's trees from measured costs (`decoding.sizing: auto`); None = the
        # drafter's trees as built (`fixed`). The round reaches it through `_policy` only.
        self.sizer = sizer
        # Structured-output constraints compiled for the target's vocabulary, each once.
        self.grammars = GrammarBook(tokenizer, target.vocab_size)

    # ------------------------------------------------------------------ public

    @property
    def sync_timing(self) -> bool:
        """Whether the clock synchronises a GPU at every stage boundary (see `__init__`)."""
        return self.clock.sync

    @sync_timing.setter
    def sync_timing(self, on: bool) -> None:
        self.clock.sync = on

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        max_live: int | None = None,
    ) -> list[GenerationResult]:
        """Decode all prompts; one result per prompt, in order.

        `max_live`: at most this many sequences decode together (None: all at once). Continuous
        batching: when a sequence finishes, the next waiting prompt is prefilled and joins the
        running batch, so no slot idles while the longest request of a batch finishes.
        """
        params = SamplingParams() if params is None else params
        per_request = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_request) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_request)} sampling params")
        return [samples[0] for samples in self.generate_samples(prompts, [[p] for p in per_request], max_live)]

    def generate_samples(
        self,
        prompts: Sequence[str | Sequence[int]],
        samples: Sequence[Sequence[SamplingParams]],
        max_live: int | None = None,
    ) -> list[list[GenerationResult]]:
        """Several completions per prompt: `samples[i]` holds one SamplingParams per completion of
        prompt i (usually `for_sample(params, j)` for j < n: each its own seed); returns
        results[i][j] in that order.

        A prompt's completions share one prefill: the prompt is forwarded once and its KV cache
        rows are copied on the device, one per completion, before they join the batch (each then
        samples its own first token from the shared prefill row). The completions of one prompt
        join together, so with `max_live` >= n the prompt is forwarded exactly once; a prompt with
        more completions than `max_live` is prefilled once per chunk of `max_live`. Each
        completion is otherwise an ordinary sequence: it decodes exactly as the prompt alone with
        its own params would (a seeded completion commits the same tokens).
        """
        if len(samples) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(samples)} lists of sampling params")
        if max_live is not None and max_live < 1:
            raise ValueError(f"max_live must be >= 1, got {max_live}")
        results = [[GenerationResult() for _ in s] for s in samples]
        waiting: deque[list[LiveSequence]] = deque()  # groups that share a prefill, in order
        limit = max_live or sum(len(s) for s in samples) or 1
        for i, (prompt, per_sample) in enumerate(zip(prompts, samples)):
            if not per_sample:
                raise ValueError(f"prompt {i} asks for no completions")
            group = []
            for j, p in enumerate(per_sample):
                try:
                    group.append(self._admit(i, prompt, p, sample=j))
                except ValueError as exc:
                    results[i][j] = GenerationResult(finish_reason="error", error=str(exc))
            waiting.extend(group[k : k + limit] for k in range(0, len(group), limit))
        if waiting:
            self._decode(waiting, limit, results)
        return results

    def warm(self, documents: Sequence[Sequence[int]], kinds: Sequence[str] = ("job_ngram",)) -> None:
        """Load earlier outputs (token ids) into the job-level drafting state of the `kinds` named
        ("job_ngram", "job_cache"), as if this engine had finished those rows (a drafter without
        that state ignores them)."""
        for kind, store in self.drafter.job_stores().items():
            if kind in kinds:
                add_documents(store, documents)

    def job_state(self) -> dict[str, tuple[int, int]]:
        """What this engine learnt from finished rows, by kind ("job_ngram", "job_cache"): (tokens
        held, bytes of memory). Empty when its drafter keeps no job-level state."""
        return {kind: (len(store), store.memory_bytes) for kind, store in self.drafter.job_stores().items()}

    def sizing_calibration(self) -> str | None:
        """One line for a log: the cost model's measured forward costs and where trees stop paying
        (`TreeSizer.calibration_line`); None when trees are not sized (`sizing: fixed`, `ar`)."""
        return None if self.sizer is None else self.sizer.calibration_line()

    def cost_model(self) -> dict | None:
        """The cost model as it stands (measured latencies, calibrated acceptance, model and
        overhead seconds: `TreeSizer.describe`), for a report; None when trees are not sized."""
        return None if self.sizer is None else self.sizer.describe()

    # ---------------------------------------------------------------- set-up

    def _admit(self, index: int, prompt: str | Sequence[int], params: SamplingParams, sample: int = 0) -> LiveSequence:
        """A request ready to join a batch; ValueError (that request's error) for what cannot run."""
        token_ids = prompt_token_ids(prompt, self.tokenizer, self.target.vocab_size, self.target.max_positions)
        if params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        stop_ids = self.eos_token_ids | frozenset(params.stop_token_ids)
        grammar = None
        if params.structured_output is not None:  # an invalid constraint: this request's error
            grammar = self.grammars.start(params.structured_output, stop_ids)
            if grammar.stuck:
                raise ValueError(f"structured_output: no token of the target's vocabulary can start its text "
                                 f"({params.structured_output.describe()})")
        return LiveSequence(index=index, tokens=token_ids, num_prompt=len(token_ids), params=params, stop_ids=stop_ids,
                            key=request_key(params), stats=RequestStats(num_prompt_tokens=len(token_ids)),
                            sample=sample, grammar=grammar)

    @property
    def _policy(self) -> SizingPolicy:
        """How the round's trees are sized (`SizingPolicy`: plan, learn)."""
        return FIXED_SIZING if self.sizer is None else self.sizer

    def _detokenize(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def forward_batch(self, live: int) -> int:
        """Sequences a verify forward over `live` live ones runs: with bucketed shapes their batch
        bucket, capped at the running batch's `max_live` (`shape_buckets.batch_bucket`); with
        exact shapes `live` itself. The tree sizer prices rounds with it (`TreeSizer.batch_bucket`)."""
        return batch_bucket(live, self._max_live) if self.bucketed and live else live

    def _pad_batch(self, state: TargetState, live: int) -> None:
        """Bucketed shapes: the state's sequences past the `live` ones become padding up to
        `forward_batch(live)` (`TargetState.resize_batch`); exact shapes: nothing to do."""
        if self.bucketed:
            state.resize_batch(self.forward_batch(live))

    # ------------------------------------------------------------- main loop

    def _decode(self, waiting: deque[list[LiveSequence]], max_live: int,
                results: list[list[GenerationResult]]) -> None:
        """Rounds until every sequence has finished, admitting waiting groups (a prompt's
        completions, which share a prefill) in order as soon as the slots free up for all of one."""
        live: list[LiveSequence] = []
        state = None
        self._max_live = max_live
        self.drafter.retire(NOTHING_FINISHED, keep=[])  # an empty batch (whatever a batch that raised left)
        while live or waiting:
            live = self._retire(live, state, results)
            joining = _admissible(waiting, max_live - len(live))
            if joining:
                state = self._join(joining, live, state)
                live = live + [seq for group in joining for seq in group]
                continue  # a joiner may be done already (one-token requests): retire it first
            if not live:
                continue
            record = RoundRecord(live, state, self.clock, draining=not waiting, deferred=self._defers(live))
            self._draft(record)
            self._verify(record)
            self._commit(record)
            self._policy.learn(record)

    def _retire(self, live: list[LiveSequence], state, results: list[list[GenerationResult]]) -> list[LiveSequence]:
        """Hand the finished sequences their results and drop them from the batch (the target's
        cache, the drafter's state); the survivors fill the holes."""
        if not any(s.finish_reason for s in live):
            return live
        done = [s for s in live if s.finish_reason]
        keep = retire_order([bool(s.finish_reason) for s in live])
        self.drafter.retire(Finished([s.tokens for s in done], [s.num_prompt for s in done]), keep)
        for seq in done:
            results[seq.index][seq.sample] = seq.result(self._detokenize)
        if keep:
            state.select(keep)  # padding sequences are dropped with the finished ones
            self._pad_batch(state, len(keep))
        return [live[b] for b in keep]

    def _draft(self, record: RoundRecord) -> None:
        """The round's trees, as the sizing policy plans them, none deeper than `_depth_caps`."""
        caps = self._depth_caps(record.live, record.state)
        if max(caps) == 0:
            record.trees = record.empty_trees()
        else:
            record.trees = self._policy.plan(record, lambda model: self._propose(record, caps, model))

    def _propose(self, record: RoundRecord, caps: list[int], model: bool | None) -> list[DraftTree]:
        """The drafter's trees (`model`: run its model first; None: no drafting) under each
        request's grammar (`_constrained`: its forced text is drafted even without drafting)."""
        drafter = self.drafter
        if model is None:
            return self._constrained(record, record.empty_trees(), caps)
        record.model_ran = model and drafter.has_model
        if drafter.has_model:
            with record.stage("draft") if record.model_ran else nullcontext():
                drafter.run_model(record.model_ran)
        with record.stage("tree"):
            drafter.read_dice(_dice(record.live))
            trees = drafter.propose([s.tokens for s in record.live], caps)
        if record.model_ran:  # what the model cost this round: its forward and the proposal
            record.model_seconds = record.seconds["draft"] + record.seconds["tree"]
        return self._constrained(record, trees, caps)

    def _verify(self, record: RoundRecord) -> None:
        """The verify forward and each tree's accepted path; the verdict's wait (not deferred) is
        charged as committing, and counts in the forward's cost the policy learns."""
        live, state, target = record.live, record.state, self.target
        with record.stage("tree"):
            batch = record.batch = self._tree_batch(live, record.trees, state.batch_size)
        with record.stage("grammar"):
            rows = record.rows = self._verify_rows(live, record.trees)
        with record.stage("verify"):
            out = record.out = _live_rows(target.verify(state, batch.tokens, batch.depth, batch.ancestor,
                                                        defer_logits=record.deferred, bucketed=self.bucketed,
                                                        packed=self._packed_rows(batch)), len(live))
            record.block_start = state.cache_len() - batch.seq_len  # after a bucketed context's padding
            if record.deferred:  # the walk's vocabulary projections are part of verifying
                record.acceptances = verify_greedy_by_rows(record.trees, _row_logits(target, out.hidden, rows))
        if not record.deferred:
            with record.stage("commit"):
                record.acceptances = verify_batch(rows, out.logits)
        record.verified_seconds = record.seconds["verify"] + record.seconds["commit"]

    def _commit(self, record: RoundRecord) -> None:
        """Commit each sequence's accepted path and bonus (`LiveSequence.commit`: the stop rules),
        keep their K/V rows, and hand the drafter the rows just committed."""
        live, state = record.live, record.state
        with record.stage("commit"):
            self._keep_logprobs(live, record.rows, record.out.logits, record.acceptances)
            for seq, tree, acc in zip(live, record.trees, record.acceptances):
                seq.stats.record_round(len(acc.accepted), tree.size, int(tree.depths.max(initial=0)),
                                       accepted_sources(tree, acc.accepted), live=len(live), model_ran=record.model_ran)
                seq.commit(acc.tokens.tolist(), self._detokenize)
            rows = record.committed_rows = [acc.committed_rows.tolist() for acc in record.acceptances]
            self.target.commit(state, record.block_start, rows + [[]] * (state.batch_size - len(live)))  # padding: none
            finish_at_context_limit(live, state, self.target.max_positions)
        if not all(s.finish_reason for s in live):
            with record.stage("draft"):
                self.drafter.observe(CommittedBlock(taps=record.out.taps, rows=rows, tokens=[s.tokens for s in live]))

    def _keep_logprobs(self, seqs: list[LiveSequence], rows: list[VerifyRow], logits: torch.Tensor,
                       acceptances) -> None:
        """Each sequence that asks for logprobs keeps those of the tokens it just committed."""
        if any(s.params.logprobs for s in seqs):
            for seq, lp in zip(seqs, committed_logprobs(rows, logits, acceptances)):
                if lp is not None:
                    seq.logprobs.append(lp)

    def _join(self, groups: list[list[LiveSequence]], live: list[LiveSequence], state):
        """Prefill the groups' prompts (once per group: its sequences are completions of one
        prompt), sample the joiners' first tokens and add them after `live` (a new batch when
        nothing is live): the target's cache and the drafter's state grow by their rows.

        A group's prefilled cache rows are copied on the device, one per completion
        (`TargetState.repeat`), never recomputed. The drafter gets one
        sequence per completion, each with its own tokens (siblings differ from their first token
        on): the prefill block's taps are repeated the same way, so each completion's drafter state
        is exactly what prefilling it alone would have given."""
        target, drafter = self.target, self.drafter
        joining = [seq for group in groups for seq in group]
        fresh = target.new_state(len(groups))
        with self.clock.stage(joining, "prefill"):
            for seq in joining:
                seq.started = self.clock.wall()
            wanted = [max(s.params.prompt_logprobs for s in group) for group in groups]
            out = target.prefill(fresh, [group[0].tokens for group in groups], keep_hidden=any(wanted))
            for g, (group, k) in enumerate(zip(groups, wanted)):  # a prompt's completions share its logprobs
                if k:
                    scored = prompt_logprobs(target.logits_at, out.hidden[g], group[0].tokens, k)
                    for seq in group:
                        if seq.params.prompt_logprobs:
                            seq.prompt_logprobs = _first_k(scored, seq.params.prompt_logprobs)
            logits, taps = out.logits, out.taps
            if len(joining) > len(groups):
                order = [g for g, group in enumerate(groups) for _ in group]
                index = to_device(np.asarray(order, dtype=np.int64), logits.device)  # one upload, non-blocking
                fresh.repeat(order, index)  # copied to the devices of a split target's other layers
                logits, taps = logits.index_select(0, index), taps.index_select(0, move_to(index, taps.device))
            # The first token is the draw verification makes at the root of an empty tree.
            first_rows = self._verify_rows(joining, [empty_tree() for _ in joining])
            accepted = verify_batch(first_rows, logits[:, :1])
            self._keep_logprobs(joining, first_rows, logits[:, :1], accepted)  # the prefill row decided it
        for seq, acc in zip(joining, accepted):
            seq.commit([acc.bonus], self._detokenize)
        finish_at_context_limit(joining, fresh, target.max_positions)
        with self.clock.stage(joining, "draft"):
            if live:
                if self.bucketed:  # joiners take the padding sequences' rows
                    state.resize_batch(len(live))
                state.extend(fresh)
            else:
                state = fresh
            self._pad_batch(state, len(live) + len(joining))
            drafter.observe(CommittedBlock(taps=taps, rows=[range(s.num_prompt) for s in joining],
                                           tokens=[s.tokens for s in joining], joined=True))
        return state

    def _tree_batch(self, live: list[LiveSequence], trees: list[DraftTree], batch_size: int) -> TreeBatch:
        """The verify block of `live`'s trees. Bucketed shapes: rows padded to their bucket, and
        after the live sequences one root-only tree of `PADDING_TOKEN` per padding sequence of the
        state (`batch_size` in all), so the block has the state's batch."""
        roots = [s.tokens[-1] for s in live]
        padding = batch_size - len(live)
        if padding:
            roots += [shape_buckets.PADDING_TOKEN] * padding
            trees = [*trees, *(empty_tree() for _ in range(padding))]
        pad_rows = rows_bucket(1 + max(t.size for t in trees)) if self.bucketed else None
        return TreeBatch.from_trees(roots, trees, self.device, vocab_size=self.target.vocab_size, pad_to=pad_rows)

    def _packed_rows(self, batch: TreeBatch) -> PackedRows | None:
        """The rows a verify forward runs packed (`TargetAdapter.verify`'s `packed`): a block
        of unequal trees with exact shapes runs its real rows only (on a CPU a padding row costs
        as much as a real one); bucketed shapes keep the block's one shape, and a block without
        padding runs as it is."""
        padded = batch.num_real_rows < batch.batch_size * batch.seq_len
        return batch.packed if padded and self.packs_rows else None

    def _defers(self, live: list[LiveSequence]) -> bool:
        """Whether this round's verify forward defers the vocabulary projection to the rows the
        greedy walk reads: only when every live row is greedy without penalties or logprobs, since
        sampled verification, penalties and logprobs read every node's distribution (a grammar's
        mask is applied to the rows the walk reads: `_row_logits`)."""
        return self.defer_logits and all(s.params.is_greedy and not s.params.has_penalties and not s.params.logprobs
                                         for s in live)

    def _constrained(self, record: RoundRecord, trees: list[DraftTree], caps: list[int]) -> list[DraftTree]:
        """The grammar as a drafter (`drafters.grammar.constrain_trees`): forbidden drafts out, forced
        text in, for the sequences with a structured-output constraint; charged as 'grammar'."""
        if all(s.grammar is None for s in record.live):
            return trees
        with record.stage("grammar"):
            return constrain_trees(trees, [s.grammar for s in record.live], caps, draft_forced=self.drafter.speculates)

    def _depth_caps(self, live: list[LiveSequence], state) -> list[int]:
        """Deepest draft node worth verifying per sequence: tokens left and context room."""
        caps = []
        for b, seq in enumerate(live):
            remaining = seq.params.max_new_tokens - len(seq.generated)
            # The root sits at position lengths[b]; a accepted nodes plus the bonus token must
            # keep the sequence within max_positions tokens.
            context_room = self.target.max_positions - 2 - int(state.lengths[b])
            caps.append(max(0, min(remaining - 1, context_room)))
        return caps

    # ---------------------------------------------------------------- helpers

    def _verify_rows(self, seqs: list[LiveSequence], trees: Sequence[DraftTree]) -> list[VerifyRow]:
        """Each sequence's part of verifying `trees`: its tree, what changes its logits this round
        (`logits_processors.RowControls`: its penalties' history, its grammar's masks over its
        tree), its key and the generated index its root row predicts."""
        return [VerifyRow(tree, RowControls(seq.params, TokenHistory(seq.tokens, seq.num_prompt)
                                            if seq.params.has_penalties else None,
                                            None if seq.grammar is None else seq.grammar.masks(tree)),
                          seq.key, len(seq.tokens) - seq.num_prompt)
                for seq, tree in zip(seqs, trees, strict=True)]


def _dice(live: list[LiveSequence]) -> list[Dice | None]:
    """Each live sequence's `Dice` for the coming proposal (None for a greedy one): its key (drawn
    once per request, from its seed or fresh entropy), the generated index its root row draws and
    its temperature - what its verification will draw with (`VerifyRow`)."""
    return [None if s.params.is_greedy else Dice(s.key, len(s.tokens) - s.num_prompt, s.params.temperature)
            for s in live]


def _admissible(waiting: deque[list[LiveSequence]], free: int) -> list[list[LiveSequence]]:
    """The waiting groups that join now: in order, while the next fits the `free` slots whole
    (groups are at most max_live long)."""
    joining = []
    while waiting and len(waiting[0]) <= free:
        free -= len(waiting[0])
        joining.append(waiting.popleft())
    return joining


def _first_k(scored: TokenLogprobs, k: int) -> TokenLogprobs:
    """`scored` with only its k most likely alternatives per position."""
    return TokenLogprobs(scored.chosen, scored.top_ids[:, :k], scored.top_logprobs[:, :k])


def _live_rows(out: ForwardOutput, live: int) -> ForwardOutput:
    """The live sequences' part of a verify forward's outputs (views: nothing is copied); padding
    sequences come after them and nothing reads theirs."""
    if out.taps.shape[0] == live:
        return out
    return ForwardOutput(logits=None if out.logits is None else out.logits[:live], taps=out.taps[:live],
                         hidden=None if out.hidden is None else out.hidden[:live])


def _row_logits(target: TargetAdapter, hidden: torch.Tensor, rows: Sequence[VerifyRow]):
    """`row_logits` for `verify_greedy_by_rows`: logits of chosen (sequence, row) pairs, each changed
    by its sequence's logits processors (a grammar's mask) as the full verification would."""

    def row_logits(index: np.ndarray, block_rows: np.ndarray) -> torch.Tensor:
        where = to_device(np.stack([index, block_rows]), hidden.device)
        logits = target.logits_at(hidden[where[0], where[1]])
        return controlled_logits(logits, [(rows[b].tree, rows[b].controls, np.asarray([row - 1]))
                                          for b, row in zip(index.tolist(), block_rows.tolist(), strict=True)])

    return row_logits


def accepted_sources(tree: DraftTree, accepted: np.ndarray) -> dict[str, int] | None:
    """Accepted draft tokens per source (SOURCE_* bits of the tree's nodes), if the tree tracks them."""
    if tree.sources is None or not len(accepted):
        return None
    bits = tree.sources[accepted]
    return {name: int(np.count_nonzero(bits & bit)) for bit, name in SOURCE_NAMES.items()}
