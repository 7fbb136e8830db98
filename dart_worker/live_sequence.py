"""One request while it decodes: its tokens, settings and statistics, its stop rules and its result.

The engine (`dart_worker.engine`) keeps one `LiveSequence` per request in its batch and commits
each round's tokens through `LiveSequence.commit`, which applies every stop rule (stop ids,
max_new_tokens, a grammar's end, stop strings) exactly as plain decoding would have stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dart_worker.sampling.grammar import GrammarState
from dart_worker.sampling.params import SamplingParams
from dart_worker.sampling.verification import TokenLogprobs
from dart_worker.sizing.acceptance import RowAcceptance
from dart_worker.stats import RequestStats


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
    # log-probabilities of the k most likely tokens at its position
    # (dart_worker.sampling.verification.committed_logprobs).
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
class LiveSequence:
    """Decoding state of one live request inside a batch, and its stop rules (`commit`)."""

    index: int  # position in the caller's prompt list
    tokens: list[int]  # prompt + generated
    num_prompt: int
    params: SamplingParams
    stop_ids: frozenset[int]
    key: int  # the noise key of its sampled tokens (dart_worker.sampling.params.request_key)
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

    def result(self, detokenize: Callable[[list[int]], str]) -> GenerationResult:
        """Its outcome, now that it has finished (wall time and counts set here)."""
        if self.error is not None:
            return GenerationResult(finish_reason="error", error=self.error, stats=self.stats,
                                    finished_unix=time.time())
        self.stats.wall_seconds = time.perf_counter() - self.started
        self.stats.num_generated_tokens = len(self.generated)
        result = GenerationResult(token_ids=self.generated, text=detokenize(self.generated)[: self.text_end],
                                  finish_reason=self.finish_reason, stats=self.stats, finished_unix=time.time())
        if self.params.logprobs:  # the rounds' tokens, cut where the stop rules cut the text
            n = len(result.token_ids)
            result.logprobs = np.concatenate([r.chosen for r in self.logprobs])[:n].tolist()
            result.top_logprob_ids = np.concatenate([r.top_ids for r in self.logprobs])[:n].tolist()
            result.top_logprobs = np.concatenate([r.top_logprobs for r in self.logprobs])[:n].tolist()
        if self.grammar is not None:
            result.structured_complete = self.grammar.complete
        if self.prompt_logprobs is not None:
            lp = self.prompt_logprobs
            result.prompt_logprobs = [None, *lp.chosen.tolist()]
            result.prompt_top_logprob_ids = [None, *lp.top_ids.tolist()]
            result.prompt_top_logprobs = [None, *lp.top_logprobs.tolist()]
        return result

    def commit(self, new_tokens: list[int], detokenize: Callable[[list[int]], str]) -> None:
        """Commit tokens, cutting after the first stop id, at max_new_tokens and after the token
        that ends a grammar's text (a grammar without stop tokens ends the sequence there: plain
        decoding would have stopped after that token too)."""
        for k, token in enumerate(new_tokens):
            if token in self.stop_ids:
                new_tokens = new_tokens[: k + 1]
                self.finish_reason = "stop"
                break
        room = self.params.max_new_tokens - len(self.generated)
        if len(new_tokens) >= room:
            if len(new_tokens) > room or not self.finish_reason:
                self.finish_reason = "length"
            new_tokens = new_tokens[:room]
        if self.grammar is not None:
            taken = self.grammar.commit(new_tokens)
            if self.grammar.stuck:  # never verified again: it ends here
                new_tokens = new_tokens[:taken]
                self.finish_reason = "error"
                self.error = ("structured_output: no token of the target's vocabulary can continue the text "
                              f"{detokenize(self.generated + new_tokens)!r}")
            elif taken < len(new_tokens) or (self.grammar.ended and not self.finish_reason):
                new_tokens = new_tokens[:taken]
                self.finish_reason = "stop"
        self.tokens.extend(new_tokens)
        if self.params.stop and new_tokens:
            dropped = self._cut_at_stop_string(len(new_tokens), detokenize)
            if dropped and self.grammar is not None:
                self.grammar.rollback(dropped)

    def _cut_at_stop_string(self, num_new: int, detokenize: Callable[[list[int]], str]) -> int:
        """End the sequence at the first token that completes a stop string; returns how many
        committed tokens it dropped.

        Only an occurrence that ends in the text of the `num_new` tokens just committed is new
        (earlier text was checked on earlier rounds); the committed tokens after the completing
        one are dropped, exactly as if decoding had stopped there.
        """
        generated = self.generated
        start = len(generated) - num_new
        before = len(detokenize(generated[:start]))
        longest = max(len(s) for s in self.params.stop)
        for end in range(start + 1, len(generated) + 1):
            text = detokenize(generated[:end])
            window_start = max(0, before - longest + 1)
            hits = [i for s in self.params.stop if (i := text.find(s, window_start)) >= 0]
            if hits:
                dropped = len(generated) - end
                del self.tokens[self.num_prompt + end :]
                self.text_end = min(hits)
                self.finish_reason = "stop"
                return dropped
            before = len(text)
        return 0


def finish_at_context_limit(live: list[LiveSequence], state, max_positions: int) -> None:
    """Stop sequences whose committed tokens (cached + root) fill the target's context."""
    for b, seq in enumerate(live):
        if not seq.finish_reason and int(state.lengths[b]) >= max_positions - 1:
            seq.finish_reason = "context_limit"


def prompt_token_ids(prompt: str | Sequence[int], tokenizer, vocab_size: int, max_positions: int) -> list[int]:
    """A prompt's token ids (a text prompt tokenized); ValueError for one the target cannot read."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer")
        token_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    else:
        token_ids = [int(t) for t in prompt]
    if not token_ids:
        raise ValueError("empty prompt")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} outside the target vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_positions:
        raise ValueError(f"prompt has {len(token_ids)} tokens; the target's context limit is {max_positions}")
    return token_ids
