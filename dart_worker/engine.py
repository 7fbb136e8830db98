"""The decoding engine: batched lossless tree speculative decoding on one device.

One round for a batch of sequences (see docs/DESIGN.md):

    draft logits --top-k--> tree builder (C++) --> TreeBatch
    target.verify(tree) --> logits + taps --> verification (greedy / coupled sampling)
    commit accepted rows (KV compaction) --> draft head over the new rows --> draft logits

The engine owns the loop (prefill, verify, commit, stop rules); a `Drafter` (dart_worker.drafters)
owns its proposal state and returns one tree per live sequence per round. Engines are made by
`dart_worker.engine_factory.build_engine`, which picks the drafter by name from the registry.
Every drafter is lossless: greedy output equals the target's greedy output, and a sampled
request commits exactly the tokens plain sampling (`ar`) commits with the same key, whatever the
trees hold (dart_worker/verification.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from dart_worker import shape_buckets
from dart_worker.cost_model import RowAcceptance, TreeSizer, row_pace
from dart_worker.drafters.base import NOTHING_FINISHED, CommittedBlock, Drafter, Finished, add_documents, empty_tree
from dart_worker.drafters.grammar import constrain_trees
from dart_worker.grammar import GrammarBook, GrammarState
from dart_worker.kernels import logits_for, shapes_for
from dart_worker.kv_cache import retire_order
from dart_worker.logits_processors import RowControls, controlled_logits
from dart_worker.packed_rows import PackedRows
from dart_worker.sampling import SamplingParams, TokenHistory, request_key
from dart_worker.shape_buckets import batch_bucket, rows_bucket
from dart_worker.stats import RequestStats
from dart_worker.target import ForwardOutput, TargetAdapter, TargetState
from dart_worker.transfer import move_to, to_device
from dart_worker.tree_batch import TreeBatch
from dart_worker.verification import (
    Acceptance,
    TokenLogprobs,
    committed_logprobs,
    prompt_logprobs,
    verify_batch,
    verify_greedy_by_rows,
)
from ngram_native.trees import SOURCE_NAMES, DraftTree


@dataclass
class GenerationResult:
    """Outcome of one request; `error` is set (and the rest empty) when it could not run."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # "stop", "length", "context_limit" or "error"
    error: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    finished_unix: float | None = None  # wall clock (time.time()) when its last token was decided
    # With SamplingParams.logprobs = k > 0: per generated token its log-probability, and the ids and
    # log-probabilities of the k most likely tokens at its position (dart_worker.verification.committed_logprobs).
    logprobs: list[float] | None = None
    top_logprob_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # With SamplingParams.prompt_logprobs = k > 0: per prompt token its log-probability under the target
    # after the tokens before it (None for the first, which has nothing before it), and the ids and
    # log-probabilities of the k most likely tokens at its position (None for the first).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprob_ids: list[list[int] | None] | None = None
    prompt_top_logprobs: list[list[float] | None] | None = None
    # With SamplingParams.structured_output: whether the output is a whole sentence of its grammar
    # (a record that validates, a full match); False when max_new_tokens cut it short. None: free text.
    structured_complete: bool | None = None


@dataclass
class _Sequence:
    """Decoding state of one live request inside a batch."""

    index: int  # position in the caller's prompt list
    tokens: list[int]  # prompt + generated
    num_prompt: int
    params: SamplingParams
    stop_ids: frozenset[int]
    key: int  # the uniform key of its sampled tokens (dart_worker.sampling.request_key)
    stats: RequestStats
    finish_reason: str = ""
    text_end: int | None = None  # where a stop string starts in the generated text
    started: float = 0.0  # perf_counter when it joined the batch (its wall time starts there)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per round, when params.logprobs > 0
    sample: int = 0  # which of its prompt's completions (generate_samples)
    error: str | None = None  # why it stopped with finish_reason "error" (its grammar got stuck)
    acceptance: RowAcceptance = field(default_factory=RowAcceptance)  # its trees against the sizer's table
    grammar: GrammarState | None = None  # its structured-output matcher, at its committed tokens
    prompt_logprobs: TokenLogprobs | None = None  # with params.prompt_logprobs > 0, from its prefill

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt :]


class _RoundClock:
    """One round's record: times its stages (each charged to every live sequence's stats as it
    ends) and holds what the sizer learns from the round."""

    def __init__(self, engine: DecodingEngine, live: list[_Sequence]):
        self.engine, self.live = engine, live
        self.started = engine._now()
        self.seconds: dict[str, float] = {}  # per stage timed here
        self.model_seconds = 0.0  # the drafter's model (and its trees when it ran): `_draft`
        self.verified_seconds = 0.0  # the verify forward until its verdict is on the host

    @contextmanager
    def stage(self, name: str) -> Iterator[float]:
        """Time the block as stage `name`; yields its start (perf_counter seconds)."""
        started = self.engine._now()
        yield started
        self.seconds[name] = self.seconds.get(name, 0.0) + self.engine._charge(self.live, name, started)


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
        strategy of `dart_worker.kernels`: deferred on a CPU where a short measurement says it pays
        (`TargetAdapter.deferred_logits_pay`: without matrix units the projection over every tree
        row is most of a verify forward); never on a GPU, where one batched projection is cheap
        and a walk would add a host round trip per tree level.

        `shapes`: the verify block's shapes, `bucketed` or `exact` (None = the `shapes` strategy
        of `dart_worker.kernels`: bucketed on CUDA, for CUDA graphs; `dart_worker.shape_buckets`).
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
        self.sync_timing = sync_timing
        self.bucketed = (shapes or shapes_for(self.device)) == "bucketed"
        # Exact shapes run a verify block's real rows only, where the target can (`_packed_rows`).
        self.packs_rows = not self.bucketed and target.packs_rows
        self._max_live: int | None = None  # the running `generate`'s, which caps batch buckets
        # Sizes every round's trees from measured costs (`decoding.sizing: auto`); None = the
        # drafter's trees as built (`fixed`).
        self.sizer = sizer
        # Structured-output constraints compiled for the target's vocabulary, each once.
        self.grammars = GrammarBook(tokenizer, target.vocab_size)

    # ------------------------------------------------------------------ public

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
        waiting: deque[list[_Sequence]] = deque()  # groups that share a prefill, in order
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

    def _result(self, seq: _Sequence) -> GenerationResult:
        if seq.error is not None:
            return GenerationResult(finish_reason="error", error=seq.error, stats=seq.stats, finished_unix=time.time())
        seq.stats.wall_seconds = time.perf_counter() - seq.started
        seq.stats.num_generated_tokens = len(seq.generated)
        result = GenerationResult(token_ids=seq.generated, text=self._detokenize(seq.generated)[: seq.text_end],
                                  finish_reason=seq.finish_reason, stats=seq.stats, finished_unix=time.time())
        if seq.params.logprobs:  # the rounds' tokens, cut where the stop rules cut the text
            n = len(result.token_ids)
            result.logprobs = np.concatenate([r.chosen for r in seq.logprobs])[:n].tolist()
            result.top_logprob_ids = np.concatenate([r.top_ids for r in seq.logprobs])[:n].tolist()
            result.top_logprobs = np.concatenate([r.top_logprobs for r in seq.logprobs])[:n].tolist()
        if seq.grammar is not None:
            result.structured_complete = seq.grammar.complete
        if seq.prompt_logprobs is not None:
            lp = seq.prompt_logprobs
            result.prompt_logprobs = [None, *lp.chosen.tolist()]
            result.prompt_top_logprob_ids = [None, *lp.top_ids.tolist()]
            result.prompt_top_logprobs = [None, *lp.top_logprobs.tolist()]
        return result

    # ---------------------------------------------------------------- set-up

    def _admit(self, index: int, prompt: str | Sequence[int], params: SamplingParams, sample: int = 0) -> _Sequence:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer")
            token_ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("empty prompt")
        bad = [t for t in token_ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the target vocabulary [0, {self.target.vocab_size})")
        if len(token_ids) >= self.target.max_positions:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; the target's context limit is {self.target.max_positions}"
            )
        if params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        stats = RequestStats(num_prompt_tokens=len(token_ids))
        stop_ids = self.eos_token_ids | frozenset(params.stop_token_ids)
        grammar = None
        if params.structured_output is not None:  # an invalid constraint: this request's error
            grammar = self.grammars.start(params.structured_output, stop_ids)
            if grammar.stuck:
                raise ValueError(f"structured_output: no token of the target's vocabulary can start its text "
                                 f"({params.structured_output.describe()})")
        return _Sequence(
            index=index,
            tokens=token_ids,
            num_prompt=len(token_ids),
            params=params,
            stop_ids=stop_ids,
            key=request_key(params),
            stats=stats,
            sample=sample,
            grammar=grammar,
        )

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

    def _decode(self, waiting: deque[list[_Sequence]], max_live: int, results: list[list[GenerationResult]]) -> None:
        """Rounds until every sequence has finished, admitting waiting groups (a prompt's
        completions, which share a prefill) in order as soon as the slots free up for all of one."""
        target, drafter = self.target, self.drafter
        live: list[_Sequence] = []
        state = None
        self._max_live = max_live
        drafter.retire(NOTHING_FINISHED, keep=[])  # an empty batch (whatever a batch that raised left)
        while live or waiting:
            if any(s.finish_reason for s in live):
                done = [s for s in live if s.finish_reason]
                keep = retire_order([bool(s.finish_reason) for s in live])  # survivors fill the holes
                drafter.retire(Finished([s.tokens for s in done], [s.num_prompt for s in done]), keep)
                for seq in live:
                    if seq.finish_reason:
                        results[seq.index][seq.sample] = self._result(seq)
                if keep:
                    state.select(keep)  # padding sequences are dropped with the finished ones
                    self._pad_batch(state, len(keep))
                live = [live[b] for b in keep]
            joining: list[list[_Sequence]] = []
            free = max_live - len(live)
            while waiting and len(waiting[0]) <= free:  # groups are at most max_live long
                free -= len(waiting[0])
                joining.append(waiting.popleft())
            if joining:
                state = self._join(joining, live, state)
                live = live + [seq for group in joining for seq in group]
                continue  # a joiner may be done already (one-token requests): retire it first
            if not live:
                continue

            clock = _RoundClock(self, live)
            trees, clock.model_seconds, model_ran = self._draft(live, state, draining=not waiting)
            with clock.stage("tree"):
                batch = self._tree_batch(live, trees, state.batch_size)
            with clock.stage("grammar"):
                controls = self._controls(live, trees)
            with clock.stage("verify"):
                deferred = self._defers(live)
                out = _live_rows(target.verify(state, batch.tokens, batch.depth, batch.ancestor,
                                               defer_logits=deferred, bucketed=self.bucketed,
                                               packed=self._packed_rows(batch)), len(live))
                block_start = state.cache_len() - batch.seq_len  # after a bucketed context's padding
                if deferred:  # the walk's vocabulary projections are part of verifying
                    acceptances = verify_greedy_by_rows(trees, _row_logits(target, out.hidden, trees, controls))
            with clock.stage("commit") as started:
                if not deferred:
                    acceptances = verify_batch(trees, out.logits, [s.params for s in live], [s.key for s in live],
                                               [len(s.tokens) - s.num_prompt for s in live], controls)
                # The forward until its verdict is on the host: what the sizer learns the cost of (on a
                # GPU without sync_timing, the verify stage alone would be the launch time only).
                clock.verified_seconds = clock.seconds["verify"] + (self._now() - started if not deferred else 0.0)
                if any(s.params.logprobs for s in live):
                    for seq, lp in zip(live, committed_logprobs(trees, out.logits, acceptances,
                                                                [s.params for s in live], controls)):
                        if lp is not None:
                            seq.logprobs.append(lp)
                for seq, tree, acc in zip(live, trees, acceptances):
                    seq.stats.record_round(len(acc.accepted), tree.size, int(tree.depths.max(initial=0)),
                                           accepted_sources(tree, acc.accepted), live=len(live), model_ran=model_ran)
                    self._append(seq, acc.tokens.tolist())
                rows = [acc.committed_rows.tolist() for acc in acceptances]
                target.commit(state, block_start, rows + [[]] * (state.batch_size - len(live)))  # padding: none
                self._finish_at_context_limit(live, state)
            if not all(s.finish_reason for s in live):  # hand the drafter the rows just committed
                with clock.stage("draft"):
                    drafter.observe(CommittedBlock(taps=out.taps, rows=rows, tokens=[s.tokens for s in live]))
            self._learn(clock, trees, acceptances, batch, live)

    def _tree_batch(self, live: list[_Sequence], trees: list[DraftTree], batch_size: int) -> TreeBatch:
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

    def _defers(self, live: list[_Sequence]) -> bool:
        """Whether this round's verify forward defers the vocabulary projection to the rows the
        greedy walk reads: only when every live row is greedy without penalties or logprobs, since
        sampled verification, penalties and logprobs read every node's distribution (a grammar's
        mask is applied to the rows the walk reads: `_row_logits`)."""
        return self.defer_logits and all(s.params.is_greedy and not s.params.has_penalties and not s.params.logprobs
                                         for s in live)

    def _learn(self, clock: _RoundClock, trees: list[DraftTree], acceptances: list[Acceptance], batch: TreeBatch,
               live: list[_Sequence]) -> None:
        """The sizer's feedback from one round: what was accepted of its trees, what the verify
        forward of `batch` cost, and the round's time outside the forward and the model."""
        if self.sizer is None:
            return
        self.sizer.observe(trees, [acc.accepted for acc in acceptances], batch.batch_size * batch.seq_len,
                           clock.verified_seconds, bands=[s.params.band for s in live],
                           first_tokens=[_first_token(acc) for acc in acceptances],
                           full_logits=not self._defers(live), real_rows=batch.num_real_rows)
        self.sizer.record_overhead(self._now() - clock.started - clock.verified_seconds - clock.model_seconds)

    def _join(self, groups: list[list[_Sequence]], live: list[_Sequence], state):
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
        t0 = self._now()
        for seq in joining:
            seq.started = time.perf_counter()
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
        first_trees = [empty_tree() for _ in joining]
        controls = self._controls(joining, first_trees)
        accepted = verify_batch(first_trees, logits[:, :1], [s.params for s in joining], [s.key for s in joining],
                                [0] * len(joining), controls)
        first = [acc.bonus for acc in accepted]
        if any(s.params.logprobs for s in joining):  # the prefill row decided the first token
            logprobs = committed_logprobs(first_trees, logits[:, :1], accepted, [s.params for s in joining], controls)
            for seq, lp in zip(joining, logprobs):
                if lp is not None:
                    seq.logprobs.append(lp)
        self._charge(joining, "prefill", t0)
        for seq, token in zip(joining, first):
            self._append(seq, [token])
        self._finish_at_context_limit(joining, fresh)
        t0 = self._now()
        if live:
            if self.bucketed:  # joiners take the padding sequences' rows
                state.resize_batch(len(live))
            state.extend(fresh)
        else:
            state = fresh
        self._pad_batch(state, len(live) + len(joining))
        drafter.observe(CommittedBlock(taps=taps, rows=[range(s.num_prompt) for s in joining],
                                       tokens=[s.tokens for s in joining], joined=True))
        self._charge(joining, "draft", t0)
        return state

    def _draft(self, live: list[_Sequence], state, draining: bool = False) -> tuple[list[DraftTree], float, bool]:
        """This round's trees, the seconds the drafter's model took (0 when it did not run) and
        whether it ran.

        With a sizer, drafting pauses while the sizer says so (`TreeSizer.drafting_wanted`: a
        sampled batch whose trees keep being cut to nothing), the drafter's model runs only when
        the sizer wants it, and the trees are cut to the size the cost model chooses; `draining`
        (no request waits for a slot) hands it each row's tokens left and pace, since the batch
        then ends with its longest row (`TreeSizer.drain`). Model work is charged as 'draft',
        building the trees as 'tree'. A structured-output request's trees are cut to what its
        grammar allows and carry its forced text (`_constrained`), even while drafting pauses:
        that text costs no model and is accepted almost surely.
        """
        caps = self._depth_caps(live, state)
        if max(caps) == 0:
            return [empty_tree() for _ in live], 0.0, False
        drafter, sizer = self.drafter, self.sizer
        if sizer is not None and not sizer.drafting_wanted():
            return self._constrained([empty_tree() for _ in live], live, caps), 0.0, False
        model_on = drafter.has_model and (sizer is None or sizer.model_wanted())
        t0 = self._now()
        if drafter.has_model:
            drafter.run_model(model_on)
        model_seconds = self._charge(live, "draft", t0) if model_on else 0.0
        t0 = self._now()
        trees = drafter.propose([s.tokens for s in live], caps)
        tree_seconds = self._charge(live, "tree", t0)
        trees = self._constrained(trees, live, caps)
        if sizer is None:
            return trees, model_seconds, model_on
        if model_on:
            sizer.record_model_seconds(model_seconds + tree_seconds)
            model_seconds += tree_seconds
        remaining = [s.params.max_new_tokens - len(s.generated) for s in live] if draining else None
        paces = [row_pace(s.stats.accepted_tokens, s.stats.rounds) for s in live] if draining else None
        sized = sizer.fit(trees, model_ran=model_on, bands=[s.params.band for s in live],
                          full_logits=not self._defers(live), remaining=remaining, paces=paces,
                          rows=[s.acceptance for s in live])
        return sized.trees, model_seconds, model_on

    def _constrained(self, trees: list[DraftTree], live: list[_Sequence], caps: list[int]) -> list[DraftTree]:
        """The grammar as a drafter (`drafters.grammar.constrain_trees`): forbidden drafts out, forced
        text in, for the sequences with a structured-output constraint; charged as 'grammar'."""
        if all(s.grammar is None for s in live):
            return trees
        t0 = self._now()
        trees = constrain_trees(trees, [s.grammar for s in live], caps, draft_forced=self.drafter.speculates)
        self._charge(live, "grammar", t0)
        return trees

    def _depth_caps(self, live: list[_Sequence], state) -> list[int]:
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

    def _controls(self, live: list[_Sequence], trees: Sequence[DraftTree]) -> list[RowControls]:
        """What changes each sequence's logits this round (`logits_processors.RowControls`): its
        penalties' history, its grammar's masks over its tree."""
        return [RowControls(seq.params, TokenHistory(seq.tokens, seq.num_prompt) if seq.params.has_penalties else None,
                            None if seq.grammar is None else seq.grammar.masks(tree))
                for seq, tree in zip(live, trees, strict=True)]

    def _append(self, seq: _Sequence, new_tokens: list[int]) -> None:
        """Commit tokens, cutting after the first stop id, at max_new_tokens and after the token
        that ends a grammar's text (a grammar without stop tokens ends the sequence there: plain
        decoding would have stopped after that token too)."""
        for k, token in enumerate(new_tokens):
            if token in seq.stop_ids:
                new_tokens = new_tokens[: k + 1]
                seq.finish_reason = "stop"
                break
        room = seq.params.max_new_tokens - len(seq.generated)
        if len(new_tokens) >= room:
            if len(new_tokens) > room or not seq.finish_reason:
                seq.finish_reason = "length"
            new_tokens = new_tokens[:room]
        if seq.grammar is not None:
            taken = seq.grammar.commit(new_tokens)
            if seq.grammar.stuck:  # never verified again: it ends here
                new_tokens = new_tokens[:taken]
                seq.finish_reason = "error"
                seq.error = ("structured_output: no token of the target's vocabulary can continue the text "
                             f"{self._detokenize(seq.generated + new_tokens)!r}")
            elif taken < len(new_tokens) or (seq.grammar.ended and not seq.finish_reason):
                new_tokens = new_tokens[:taken]
                seq.finish_reason = "stop"
        seq.tokens.extend(new_tokens)
        if seq.params.stop and new_tokens:
            dropped = self._cut_at_stop_string(seq, len(new_tokens))
            if dropped and seq.grammar is not None:
                seq.grammar.rollback(dropped)

    def _cut_at_stop_string(self, seq: _Sequence, num_new: int) -> int:
        """End the sequence at the first token that completes a stop string; returns how many
        committed tokens it dropped.

        Only an occurrence that ends in the text of the `num_new` tokens just committed is new
        (earlier text was checked on earlier rounds); the committed tokens after the completing
        one are dropped, exactly as if decoding had stopped there.
        """
        generated = seq.generated
        start = len(generated) - num_new
        before = len(self._detokenize(generated[:start]))
        longest = max(len(s) for s in seq.params.stop)
        for end in range(start + 1, len(generated) + 1):
            text = self._detokenize(generated[:end])
            window_start = max(0, before - longest + 1)
            hits = [i for s in seq.params.stop if (i := text.find(s, window_start)) >= 0]
            if hits:
                dropped = len(generated) - end
                del seq.tokens[seq.num_prompt + end :]
                seq.text_end = min(hits)
                seq.finish_reason = "stop"
                return dropped
            before = len(text)
        return 0

    def _finish_at_context_limit(self, live: list[_Sequence], state) -> None:
        """Stop sequences whose committed tokens (cached + root) fill the target's context."""
        for b, seq in enumerate(live):
            if not seq.finish_reason and int(state.lengths[b]) >= self.target.max_positions - 1:
                seq.finish_reason = "context_limit"

    def _now(self) -> float:
        if self.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _charge(self, live: list[_Sequence], stage: str, started: float) -> float:
        """Add the seconds since `started` to every live sequence's `stage`; return them."""
        elapsed = self._now() - started
        for seq in live:
            seq.stats.stage_seconds[stage] += elapsed
        return elapsed


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


def _row_logits(target: TargetAdapter, hidden: torch.Tensor, trees: Sequence[DraftTree],
                controls: Sequence[RowControls]):
    """`row_logits` for `verify_greedy_by_rows`: logits of chosen (sequence, row) pairs, each changed
    by its sequence's logits processors (a grammar's mask) as the full verification would."""

    def row_logits(index: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        where = to_device(np.stack([index, rows]), hidden.device)
        logits = target.logits_at(hidden[where[0], where[1]])
        return controlled_logits(logits, [(trees[b], controls[b], np.asarray([row - 1]))
                                          for b, row in zip(index.tolist(), rows.tolist(), strict=True)])

    return row_logits


def accepted_sources(tree: DraftTree, accepted: np.ndarray) -> dict[str, int] | None:
    """Accepted draft tokens per source (SOURCE_* bits of the tree's nodes), if the tree tracks them."""
    if tree.sources is None or not len(accepted):
        return None
    bits = tree.sources[accepted]
    return {name: int(np.count_nonzero(bits & bit)) for bit, name in SOURCE_NAMES.items()}


def _first_token(acceptance: Acceptance) -> int:
    """The first token a round committed for a sequence: its first accepted node's, or the bonus."""
    return int(acceptance.accepted_tokens[0]) if acceptance.num_accepted else int(acceptance.bonus)
