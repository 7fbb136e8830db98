"""Tau without verification forwards: replay a drafter against the target's own replies.

Measuring tau with the engine costs one target forward over every draft tree of every round; on
a 2-core CPU a budget-60 tree costs seconds, so comparing a handful of tree settings on a few
dozen prompts takes hours. Under greedy decoding none of those forwards is needed once the
target's reply is known: the engine accepts exactly the deepest tree path that spells the
reply's next tokens, and the taps it hands the drafter are the target's hidden states of those
tokens, which one forward over prompt + reply gives for every position at once (a causal model's
row depends only on the rows before it). So:

    refs = target_references(parts, prompts, max_new_tokens)   # the replies + their taps, once
    stats = replay(build_drafter(parts, "dart", tree), refs, max_new_tokens)  # per settings: ms per round

`replay` drives the drafter through the engine's protocol (`Drafter`: observe/retire/propose, in
the engine's order, every sequence in one lockstep batch, the model never paused) and records each
round in the engine's `RequestStats`, so its tau is the engine's (`fixed` sizing: trees as
built, as the benchmark's budget cells). It differs from an engine run only where a multi-token
verify forward rounds differently from the one-forward taps (fp32: at exact near-ties of the
head's logits; bf16: more often, see docs/DESIGN.md); tests/test_replay.py checks it against the
engine round by round.

Sampled decoding replays the same way. Every sampled token is the Gumbel-max draw with the request's
noise for its position (dart_worker.sampling.gumbel), and verification walks the tree by those draws
(dart_worker.sampling.verification), so a request with a given key commits the same reply under every
drafter - the reply `ar` samples - and a round accepts exactly the deepest tree path that spells
its next tokens, as under greedy decoding. `target_references(..., params=SamplingParams(
temperature=1.0, seed=...))` samples the replies once; replaying them measures the drafter's
tau at that temperature on as many prompts as greedy replay does (tests/test_replay.py checks it
against the engine at temperature 1). In bf16 the engine's multi-token forwards round differently
from the one-token ones that sampled the reply, and a sampled draw is more sensitive to that than
an argmax: the engine's own reply would differ at some positions, so there the replayed tau is an
estimate of the engine's (the reply is still a sample of the target's distribution), not a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from dart_worker.drafters.base import NOTHING_FINISHED, CommittedBlock, Dice, Drafter, Finished
from dart_worker.engine import accepted_sources
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.sampling.params import SamplingParams, request_key
from dart_worker.stats import RequestStats
from ngram_native.trees import DraftTree

# Sequences per reference forward: bounds the padded taps block ([batch, longest, 3 x hidden]).
TAP_BATCH = 8


@dataclass
class Reference:
    """One prompt, the target's reply to it (greedy, or sampled with a fixed key) and its taps over both.

    taps: [len(tokens), F] fused hidden states of every token of prompt + reply, on the target's
    device and dtype (row i: what the engine hands a drafter for token i once it is committed).
    """

    prompt: list[int]
    reply: list[int]
    taps: torch.Tensor

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.reply


def target_replies(parts: EngineParts, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   mode: str = "ar", max_live: int = 8, params: SamplingParams | None = None) -> list[list[int]]:
    """The target's replies (token ids, EOS included when it ended there): greedy, or sampled with
    `params` (its max_new_tokens is replaced by `max_new_tokens`; give it a seed to get the same
    replies again). Any lossless `mode` gives the same replies (fp32); `ar` needs no head or trie."""
    engine = build_engine(parts, mode, defer_logits=False)
    params = replace(params or SamplingParams(temperature=0.0), max_new_tokens=max_new_tokens)
    results = engine.generate([list(p) for p in prompts], params, max_live=max_live)
    for i, result in enumerate(results):
        if result.error:
            raise ValueError(f"prompt {i}: {result.error}")
    return [list(r.token_ids) for r in results]


@torch.inference_mode()
def reference_taps(parts: EngineParts, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The target's taps over each whole sequence (one prefill per group of TAP_BATCH)."""
    target = parts.target
    out = []
    for start in range(0, len(sequences), TAP_BATCH):
        group = [list(s) for s in sequences[start : start + TAP_BATCH]]
        forward = target.prefill(target.new_state(len(group)), group)
        out.extend(forward.taps[b, : len(seq)].clone() for b, seq in enumerate(group))
    return out


def target_references(parts: EngineParts, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      replies: Sequence[Sequence[int]] | None = None, mode: str = "ar",
                      params: SamplingParams | None = None) -> list[Reference]:
    """References for `prompts`: their replies (given, e.g. saved from an earlier run, or generated
    with `mode`, greedy or sampled with `params`) and the taps over prompt + reply."""
    if replies is None:
        replies = target_replies(parts, prompts, max_new_tokens, mode=mode, params=params)
    if len(replies) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(replies)} replies")
    for i, reply in enumerate(replies):
        if not 1 <= len(reply) <= max_new_tokens:
            raise ValueError(f"reply {i} has {len(reply)} tokens; expected 1..{max_new_tokens}")
    taps = reference_taps(parts, [list(p) + list(r) for p, r in zip(prompts, replies)])
    return [Reference(list(p), list(r), t) for p, r, t in zip(prompts, replies, taps)]


def accepted_path(tree: DraftTree, continuation: Sequence[int]) -> np.ndarray:
    """Node indices (root's child first) of the deepest path of `tree` that spells the start of
    `continuation`: what verification accepts when the target's next tokens (argmax or coupled
    draws) are it."""
    matched = np.zeros(tree.size, dtype=bool)
    best = -1
    for i in range(tree.size):
        depth, parent = int(tree.depths[i]), int(tree.parents[i])
        if depth <= len(continuation) and int(tree.tokens[i]) == continuation[depth - 1] \
                and (parent < 0 or matched[parent]):
            matched[i] = True
            if best < 0 or depth > tree.depths[best]:
                best = i
    path = []
    while best >= 0:
        path.append(best)
        best = int(tree.parents[best])
    return np.asarray(path[::-1], dtype=np.int64)


def _block(refs: list[Reference], starts: list[int], counts: list[int], tokens: list[list[int]],
           joined: bool = False) -> CommittedBlock:
    """Rows starts[b] .. starts[b] + counts[b] - 1 of each reference's taps, as the engine's block."""
    first = refs[0].taps
    taps = torch.zeros(len(refs), max(counts), first.shape[-1], dtype=first.dtype, device=first.device)
    for b, (ref, start, count) in enumerate(zip(refs, starts, counts)):
        taps[b, :count] = ref.taps[start : start + count]
    return CommittedBlock(taps=taps, rows=[range(c) for c in counts], tokens=tokens, joined=joined)


@torch.inference_mode()
def replay(drafter: Drafter, refs: Sequence[Reference], max_new_tokens: int,
           max_positions: int | None = None, dice: SamplingParams | None = None) -> list[RequestStats]:
    """Decoding of every reference at once with `drafter`, verification replaced by the references
    (greedy or sampled, the same either way): one `RequestStats` per reference (accept lengths,
    tree sizes, sources) as the engine would record them with fixed tree sizing. `dice`: how the
    replies were sampled (its seed gives every reference's key): before each proposal the drafter
    reads each sequence's `Dice` (key, position, temperature; `Drafter.read_dice`); None or greedy
    hands none."""
    refs = list(refs)
    if not refs:
        return []
    stats = [RequestStats() for _ in refs]
    live = list(range(len(refs)))
    # tokens[b]: prompt + the reply's first token (sampled at prefill), as after the engine's prefill.
    tokens = [ref.prompt + ref.reply[:1] for ref in refs]
    drafter.retire(NOTHING_FINISHED, keep=[])  # an empty batch, then every reference joins it
    drafter.observe(_block(refs, [0] * len(refs), [len(ref.prompt) for ref in refs], tokens, joined=True))
    done = [len(tokens[b]) - len(refs[b].prompt) >= len(refs[b].reply) for b in live]
    if dice is not None and not dice.is_greedy and dice.seed is None:
        raise ValueError("replay's dice need a seeded SamplingParams (the replies' seed): seed None has no fixed key")
    key = None if dice is None or dice.is_greedy else request_key(dice)
    while True:
        if any(done):
            finished = [b for b, d in zip(live, done) if d]
            keep = [i for i, d in enumerate(done) if not d]
            drafter.retire(Finished([tokens[b] for b in finished], [len(refs[b].prompt) for b in finished]), keep)
            if not keep:
                break
            live = [live[i] for i in keep]
        caps = []
        for b in live:
            remaining = max_new_tokens - (len(tokens[b]) - len(refs[b].prompt))
            room = (max_positions or 1 << 30) - 2 - (len(tokens[b]) - 1)
            caps.append(max(0, min(remaining - 1, room)))
        if key is not None:
            drafter.read_dice([Dice(key, len(tokens[b]) - len(refs[b].prompt), dice.temperature) for b in live])
        trees = drafter.propose([tokens[b] for b in live], caps)
        starts, counts = [], []
        for b, tree in zip(live, trees):
            ref, root = refs[b], len(tokens[b]) - 1
            path = accepted_path(tree, ref.tokens[root + 1 :])
            stats[b].record_round(len(path), tree.size, int(tree.depths.max(initial=0)),
                                  accepted_sources(tree, path), live=len(live), model_ran=drafter.has_model)
            new = ref.tokens[root + 1 : root + 2 + len(path)]  # accepted + the bonus token, if any
            tokens[b] = tokens[b] + new
            starts.append(root)
            counts.append(len(path) + 1)
        done = [len(tokens[b]) - len(refs[b].prompt) >= len(refs[b].reply) for b in live]
        if not all(done):
            drafter.observe(_block([refs[b] for b in live], starts, counts, [tokens[b] for b in live]))
    return stats


def paired_difference(values: Sequence[float], baseline: Sequence[float]) -> tuple[float, float | None]:
    """Mean of the per-prompt differences values - baseline and its standard error (None for one
    prompt): how replay comparisons on the same replies report a change."""
    diffs = np.asarray(values, dtype=np.float64) - np.asarray(baseline, dtype=np.float64)
    if diffs.shape != (len(values),) or len(values) != len(baseline):
        raise ValueError(f"paired values need equal lengths, got {len(values)} and {len(baseline)}")
    stderr = float(diffs.std(ddof=1) / np.sqrt(len(diffs))) if len(diffs) > 1 else None
    return float(diffs.mean()), stderr


def mean_tau(stats: Sequence[RequestStats]) -> float:
    """The benchmark's tau: the mean over requests of each one's tokens per round."""
    taus = [s.tau for s in stats if s.rounds]
    return float(np.mean(taus)) if taus else 0.0
