"""The decoding engine: batched lossless tree speculative decoding on one device.

One round for a batch of sequences (see docs/DESIGN.md):

    draft logits --top-k--> tree builder (C++) --> TreeBatch
    target.verify(tree) --> logits + taps --> verification (greedy / rejection sampling)
    commit accepted rows (KV compaction) --> draft head over the new rows --> draft logits

Modes: `ar` (no draft; a one-row "tree", same KV machinery), `chain` (top-1 per position),
`ddtree` (best-first over draft log-probs) and `dart` (draft + N-gram beam search).
Every mode is lossless: greedy output equals the target's greedy output, sampled output
is distributed as the target's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dart_worker.sampling import SamplingParams, make_generator, warp_logits_to_probs
from dart_worker.stats import RequestStats
from dart_worker.target import TargetAdapter
from dart_worker.tree_batch import TreeBatch
from dart_worker.verification import verify_batch
from ngram_native.trees import DraftTree, build_chain_trees, build_dart_trees, build_ddtree_trees

MODES = ("ar", "chain", "ddtree", "dart")


@dataclass(frozen=True)
class TreeConfig:
    """How draft trees are built; defaults follow the DART reference implementation."""

    budget: int = 60  # draft nodes per tree (root excluded)
    top_k: int = 25  # candidates per draft position
    beam_width: int = 20
    depth_decay: float = 0.7  # (l+1)^-depth_decay level weight
    draft_decay: float = 0.9  # draft log-prob weight decay per level
    ngram_weight: float = 0.5
    max_depth: int | None = None  # None = every position the draft head predicts


@dataclass
class GenerationResult:
    """Outcome of one request; `error` is set (and the rest empty) when it could not run."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # "stop", "length", "context_limit" or "error"
    error: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)


@dataclass
class _Sequence:
    """Decoding state of one live request inside a batch."""

    index: int  # position in the caller's request list
    tokens: list[int]  # prompt + generated
    num_prompt: int
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    stats: RequestStats
    finish_reason: str = ""
    text_end: int | None = None  # where a stop string starts in the generated text

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt :]


class DecodingEngine:
    """Owns one target (and optionally a draft head and N-gram trie) on one device."""

    def __init__(
        self,
        target: TargetAdapter,
        tokenizer=None,
        draft_head=None,
        trie=None,
        mode: str = "dart",
        tree: TreeConfig | None = None,
        eos_token_ids: Sequence[int] = (),
    ):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        if mode != "ar" and draft_head is None:
            raise ValueError(f"mode {mode!r} needs a draft head")
        self.target = target
        self.tokenizer = tokenizer
        self.draft_head = draft_head
        self.trie = trie if mode == "dart" else None
        self.mode = mode
        self.tree = tree or TreeConfig()
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.device = target.device

    # ------------------------------------------------------------------ public

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Decode all prompts together (one batch); one result per prompt, in order."""
        params = SamplingParams() if params is None else params
        per_request = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_request) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_request)} sampling params")
        results = [GenerationResult() for _ in prompts]
        live = []
        for i, (prompt, p) in enumerate(zip(prompts, per_request)):
            try:
                live.append(self._admit(i, prompt, p))
            except ValueError as exc:
                results[i] = GenerationResult(finish_reason="error", error=str(exc))
        if live:
            started = time.perf_counter()
            self._decode(live)
            wall = time.perf_counter() - started
            for seq in live:
                seq.stats.wall_seconds = wall
                seq.stats.num_generated_tokens = len(seq.generated)
                results[seq.index] = GenerationResult(
                    token_ids=seq.generated,
                    text=self._detokenize(seq.generated)[: seq.text_end],
                    finish_reason=seq.finish_reason,
                    stats=seq.stats,
                )
        return results

    # ---------------------------------------------------------------- set-up

    def _admit(self, index: int, prompt: str | Sequence[int], params: SamplingParams) -> _Sequence:
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
        return _Sequence(
            index=index,
            tokens=token_ids,
            num_prompt=len(token_ids),
            params=params,
            stop_ids=self.eos_token_ids | frozenset(params.stop_token_ids),
            generator=make_generator(params, self.device),
            stats=stats,
        )

    def _detokenize(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ------------------------------------------------------------- main loop

    def _decode(self, live: list[_Sequence]) -> None:
        target = self.target
        state = target.new_state(len(live))
        draft_cache = self.draft_head.new_cache(len(live)) if self.mode != "ar" else None

        t0 = self._now()
        out = target.prefill(state, [s.tokens for s in live])
        first = self._sample_rows(out.logits[:, 0], live)
        self._charge(live, "prefill", t0)
        for seq, token in zip(live, first):
            self._append(seq, [token])
        self._finish_at_context_limit(live, state)

        draft_logits = None
        if self.mode != "ar":
            t0 = self._now()
            prompt_len = max(s.num_prompt for s in live)
            next_tokens = torch.zeros(len(live), prompt_len, dtype=torch.long, device=self.device)
            for b, seq in enumerate(live):
                next_tokens[b, : seq.num_prompt] = torch.as_tensor(seq.tokens[1 : seq.num_prompt + 1])
            num_new = torch.tensor([s.num_prompt for s in live], device=self.device)
            draft_logits = self.draft_head.propose(out.taps, next_tokens, num_new, draft_cache)
            self._charge(live, "draft", t0)

        while True:
            keep = [b for b, s in enumerate(live) if not s.finish_reason]
            if not keep:
                return
            if len(keep) < len(live):
                index = torch.tensor(keep, device=self.device)
                state.select(index)
                if draft_cache is not None:
                    draft_cache.select(index)
                    draft_logits = draft_logits[index]
                live = [live[b] for b in keep]

            t0 = self._now()
            trees = self._build_trees(live, draft_logits, state)
            batch = TreeBatch.from_trees([s.tokens[-1] for s in live], trees, self.device)
            self._charge(live, "tree", t0)

            t0 = self._now()
            block_start = state.cache_len()
            out = target.verify(state, batch.tokens, batch.depth, batch.ancestor)
            self._charge(live, "verify", t0)

            t0 = self._now()
            acceptances = verify_batch(trees, out.logits, [s.params for s in live], [s.generator for s in live])
            rows = []
            for seq, tree, acc in zip(live, trees, acceptances):
                accepted_tokens = [int(tree.tokens[i]) for i in acc.accepted]
                seq.stats.record_round(len(acc.accepted), tree.size, int(tree.depths.max(initial=0)))
                self._append(seq, [*accepted_tokens, int(acc.bonus)])
                rows.append([0] + [i + 1 for i in acc.accepted])
            target.commit(state, block_start, rows)
            self._finish_at_context_limit(live, state)
            self._charge(live, "commit", t0)

            if self.mode != "ar" and any(not s.finish_reason for s in live):
                t0 = self._now()
                draft_logits = self._draft_step(live, out.taps, rows, draft_cache)
                self._charge(live, "draft", t0)

    def _draft_step(self, live, taps: torch.Tensor, rows: list[list[int]], draft_cache) -> torch.Tensor:
        """Feed the committed rows (fused taps paired with the next committed token) to the draft."""
        width = max(len(r) for r in rows)
        row_index = torch.zeros(len(live), width, dtype=torch.long, device=self.device)
        next_tokens = torch.zeros(len(live), width, dtype=torch.long, device=self.device)
        for b, (seq, r) in enumerate(zip(live, rows)):
            row_index[b, : len(r)] = torch.as_tensor(r)
            # Row k of the committed block carries the features of token k and the embedding of
            # token k + 1 (shifted pairing): the last row pairs with the bonus token.
            next_tokens[b, : len(r)] = torch.as_tensor(seq.tokens[len(seq.tokens) - len(r) :])
        features = torch.gather(taps, 1, row_index[:, :, None].expand(-1, -1, taps.shape[-1]))
        num_new = torch.tensor([len(r) for r in rows], device=self.device)
        return self.draft_head.propose(features, next_tokens, num_new, draft_cache)

    # ------------------------------------------------------------------ trees

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

    def _build_trees(self, live: list[_Sequence], draft_logits, state) -> list[DraftTree]:
        caps = self._depth_caps(live, state)
        if self.mode == "ar" or max(caps) == 0:
            return [_empty_tree() for _ in live]
        cfg = self.tree
        logits = draft_logits[:, : min(max(caps), cfg.max_depth or draft_logits.shape[1])]
        top_k = min(cfg.top_k, logits.shape[-1])
        common = dict(budget=cfg.budget, eos_ids=sorted(self.eos_token_ids), max_depths=caps)
        if self.mode == "chain":
            values, ids = logits.topk(1, dim=-1)
            return build_chain_trees(self._to_target(ids), values.float().cpu().numpy(), **common)
        if self.mode == "ddtree":
            values, ids = torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
            return build_ddtree_trees(self._to_target(ids), values.cpu().numpy(), **common)
        values, ids = logits.float().topk(top_k, dim=-1)
        contexts = [s.tokens[-8:] for s in live]
        return build_dart_trees(
            self._to_target(ids), values.cpu().numpy(), contexts, self.trie,
            top_k=top_k, beam_width=cfg.beam_width, depth_decay=cfg.depth_decay,
            draft_decay=cfg.draft_decay, ngram_weight=cfg.ngram_weight, **common,
        )  # fmt: skip

    def _to_target(self, draft_ids: torch.Tensor) -> np.ndarray:
        return self.draft_head.to_target_ids(draft_ids).to(torch.int32).cpu().numpy()

    # ---------------------------------------------------------------- helpers

    def _sample_rows(self, logits: torch.Tensor, live: list[_Sequence]) -> list[int]:
        """One token per sequence from [B, V] logits (greedy or with the request's generator)."""
        tokens = []
        for b, seq in enumerate(live):
            if seq.params.is_greedy:
                tokens.append(int(logits[b].argmax()))
            else:
                probs = warp_logits_to_probs(logits[b : b + 1], seq.params)
                tokens.append(int(torch.multinomial(probs[0], 1, generator=seq.generator)))
        return tokens

    def _append(self, seq: _Sequence, new_tokens: list[int]) -> None:
        """Commit tokens, cutting after the first stop id and at max_new_tokens."""
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
        seq.tokens.extend(new_tokens)
        if seq.params.stop and new_tokens:
            self._cut_at_stop_string(seq, len(new_tokens))

    def _cut_at_stop_string(self, seq: _Sequence, num_new: int) -> None:
        """End the sequence at the first token that completes a stop string.

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
                del seq.tokens[seq.num_prompt + end :]
                seq.text_end = min(hits)
                seq.finish_reason = "stop"
                return
            before = len(text)

    def _finish_at_context_limit(self, live: list[_Sequence], state) -> None:
        """Stop sequences whose committed tokens (cached + root) fill the target's context."""
        for b, seq in enumerate(live):
            if not seq.finish_reason and int(state.lengths[b]) >= self.target.max_positions - 1:
                seq.finish_reason = "context_limit"

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _charge(self, live: list[_Sequence], stage: str, started: float) -> None:
        elapsed = self._now() - started
        for seq in live:
            seq.stats.stage_seconds[stage] += elapsed


def _empty_tree() -> DraftTree:
    empty = np.zeros(0, dtype=np.int32)
    return DraftTree(tokens=empty, parents=empty, depths=empty)
