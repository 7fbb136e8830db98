"""Before/after equality of the engine's behaviour: every mode, fixed and auto sizing, on tiny models.

A refactor of the engine's round or of its cost model must not change what it decodes, nor what
the tree sizer decides. This runs every registered drafter on a tiny random-weight target (and a
random draft head, and a small N-gram trie) over greedy, seeded-sampled and text requests
(logprobs, penalties, several completions per prompt, stop strings, structured output,
continuous batching), with trees as built (`sizing: fixed`) and sized by the cost model
(`sizing: auto`) under two cost profiles, exact and bucketed shapes, deferred and full logits;
and writes every result (token ids, text, finish reason, logprobs, per-request statistics with
their stage seconds) and the cost model's final state to one JSON file:

    python -m dart_bench.equivalence --out before.json     # at the old commit
    python -m dart_bench.equivalence --out after.json      # at the new one
    python -m dart_bench.equivalence --compare before.json after.json

`--default-target` adds the default target (Gemma-3-270M, fp32 on the CPU, its shipped head and
the default trie, loaded or built and cached as every job does) decoding a few prompts with
fixed trees, `dart_lookup` and `ar`: the real model's fixed-size decode, not only tiny ones.

The sizer decides from measured seconds, so with a real clock two runs of the same code differ.
Here time is synthetic (`SyntheticClock`): `time.perf_counter` and `time.time` read a clock that
moves only when the target, the drafter or its model does work, or the engine verifies on the
host, by a fixed cost per row, token, node or request (a `Profile`); the sizer's start-up curves
are that profile's (not measured). Every duration the engine records, and so every decision the
sizer takes from them, is then a function of the work alone and of the stage it falls in, however
often and wherever the code reads the clock.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any
from unittest import mock

import numpy as np
import torch

VOCAB = 32  # small, so that drafts are often right and trees accept several tokens
# A character tokenizer over the whole vocabulary (stop strings and structured output need text).
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz ,")
EOS = 2


@dataclass(frozen=True)
class Profile:
    """Synthetic seconds of each kind of work (a verify forward's are base + per row)."""

    verify_base: float
    verify_row: float
    full_logits_row: float  # extra per row when the forward projects every row to the vocabulary
    projection_row: float  # `logits_at` (the deferred walk's rows, prompt logprobs)
    prefill_token: float
    model: float  # one run of the drafter's model
    propose_node: float  # per proposed node (plus propose_base per call)
    propose_base: float
    verdict: float  # host-side verification per request (`verify_batch`), plus per accepted node
    commit_row: float  # per committed row: the target's KV compaction (`commit`)
    observe_row: float  # per committed row the drafter reads (`observe`)
    start_up_error: float  # the sizer's start-up curves are the true costs times this

    def verify_seconds(self, rows: int, full_logits: bool) -> float:
        return self.verify_base + rows * (self.verify_row + (self.full_logits_row if full_logits else 0.0))


PROFILES = {
    # Trees are nearly free (a GPU or a CPU with matrix units): sizing keeps big trees.
    "cheap": Profile(verify_base=0.020, verify_row=0.0002, full_logits_row=0.0001, projection_row=0.0001,
                     prefill_token=0.0005, model=0.004, propose_node=0.00002, propose_base=0.0005,
                     verdict=0.0004, commit_row=0.00002, observe_row=0.00003, start_up_error=0.8),
    # Rows and the model cost next to nothing: trees pay whenever a node may be accepted.
    "free": Profile(verify_base=0.020, verify_row=0.00001, full_logits_row=0.00001, projection_row=0.00001,
                    prefill_token=0.0002, model=0.0003, propose_node=0.000001, propose_base=0.0001,
                    verdict=0.0001, commit_row=0.00001, observe_row=0.00001, start_up_error=1.0),
    # Every row costs (a CPU without matrix units), the model is dear: trees are cut, the model pauses.
    "dear": Profile(verify_base=0.020, verify_row=0.006, full_logits_row=0.004, projection_row=0.002,
                    prefill_token=0.001, model=0.030, propose_node=0.0001, propose_base=0.002,
                    verdict=0.002, commit_row=0.0001, observe_row=0.0002, start_up_error=1.3),
}


class SyntheticClock:
    """Seconds that move only by `advance` (the work wrappers), read by `now`."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.profile = PROFILES["cheap"]

    def reset(self, profile: Profile) -> None:
        self.t, self.profile = 1000.0, profile

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@contextmanager
def synthetic_time(clock: SyntheticClock) -> Iterator[None]:
    """`time.perf_counter` and `time.time` read `clock` (every caller that looks them up on the
    module at call time, as the engine, the drafters and the sizer do)."""
    with mock.patch.object(time, "perf_counter", clock.now), mock.patch.object(time, "time", clock.now):
        yield


def char_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + CHARS)}
    assert len(vocab) == VOCAB
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


def _timed_target(target, clock: SyntheticClock):
    """Wrap the target's work (on the instance) so that each call advances `clock`."""
    verify, prefill, logits_at = target.verify, target.prefill, target.logits_at

    def timed_verify(state, tokens, depths, ancestor, defer_logits=False, bucketed=False, packed=None):
        out = verify(state, tokens, depths, ancestor, defer_logits=defer_logits, bucketed=bucketed, packed=packed)
        rows = int(tokens.numel()) if packed is None else int(packed.rows.numel())
        clock.advance(clock.profile.verify_seconds(rows, not defer_logits))
        return out

    def timed_prefill(state, prompts, keep_hidden=False):
        out = prefill(state, prompts, keep_hidden=keep_hidden)
        clock.advance(clock.profile.verify_base + clock.profile.prefill_token * sum(len(p) for p in prompts))
        return out

    def timed_logits_at(hidden):
        out = logits_at(hidden)
        clock.advance(clock.profile.projection_row * int(np.prod(hidden.shape[:-1])))
        return out

    commit = target.commit

    def timed_commit(state, block_start, accepted_rows):
        commit(state, block_start, accepted_rows)
        clock.advance(clock.profile.commit_row * sum(len(rows) for rows in accepted_rows))

    target.verify, target.prefill, target.logits_at = timed_verify, timed_prefill, timed_logits_at
    target.commit = timed_commit
    return target


def _timed_drafter(drafter, clock: SyntheticClock):
    propose = drafter.propose

    def timed_propose(tokens, max_depths):
        trees = propose(tokens, max_depths)
        clock.advance(clock.profile.propose_base + clock.profile.propose_node * sum(t.size for t in trees))
        return trees

    observe = drafter.observe

    def timed_observe(block):
        observe(block)
        clock.advance(clock.profile.observe_row * sum(len(rows) for rows in block.rows))

    drafter.propose, drafter.observe = timed_propose, timed_observe
    if drafter.has_model:
        run_model = drafter.run_model

        def timed_run_model(on):
            run_model(on)
            if on:
                clock.advance(clock.profile.model)

        drafter.run_model = timed_run_model
    return drafter


@contextmanager
def timed_verdicts(clock: SyntheticClock) -> Iterator[None]:
    """The engine's host-side verification (`verify_batch`, whatever its arguments) advances the
    clock by what it decided; patched where the engine looks it up (an engine that no longer
    imports it fails here, loudly)."""
    from dart_worker import engine

    verify_batch = engine.verify_batch

    def timed(*args, **kwargs):
        acceptances = verify_batch(*args, **kwargs)
        clock.advance(clock.profile.verdict * (len(acceptances) + sum(a.num_accepted for a in acceptances)))
        return acceptances

    with mock.patch.object(engine, "verify_batch", timed):
        yield


def _synthetic_curves(clock: SyntheticClock):
    """A stand-in for `calibration.latency_curves`: the profile's costs on the calibration grid,
    off by the profile's start-up error (so the sizer's online learning has work to do)."""
    from dart_worker.calibration import LatencyModel, grid

    def latency_curves(target, defer_logits, batches):
        profile = clock.profile
        out = {}
        for batch in sorted({int(b) for b in batches} | {1}):
            rows = grid(batch)
            out[batch] = LatencyModel(rows, [profile.start_up_error * profile.verify_seconds(r, not defer_logits)
                                             for r in rows])
        return out

    return latency_curves


# ------------------------------------------------------------------------------ requests


def _prompts(seed: int, count: int, repeat: bool) -> list[list[int]]:
    """Random prompts over the character ids; `repeat`: each its own text twice (lookup finds it)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(5, 16, (count,), generator=gen).tolist()
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in sizes]
    return [p + p if repeat and i % 2 == 0 else p for i, p in enumerate(prompts)]


def request_sets() -> dict[str, dict[str, Any]]:
    """name -> {prompts, samples (per prompt, its completions' params), max_live}."""
    from dart_worker.sampling.params import SamplingParams, for_sample

    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    greedy_prompts = _prompts(1, 7, repeat=True)
    greedy_samples = [[replace(greedy, max_new_tokens=8 + 5 * i, stop_token_ids=(5,) if i == 3 else ())]
                      for i in range(len(greedy_prompts))]
    sampled = SamplingParams(temperature=0.8, top_k=16, max_new_tokens=20)
    sampled_prompts = _prompts(2, 6, repeat=True)
    sampled_samples = [
        [replace(sampled, seed=11)],
        [for_sample(replace(sampled, seed=12, temperature=1.0), j) for j in range(3)],
        [replace(sampled, seed=13, logprobs=3, top_p=0.9, min_p=0.05)],
        [replace(sampled, seed=14, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.2)],
        [replace(greedy, logprobs=2, prompt_logprobs=2, max_new_tokens=16)],
        [replace(sampled, seed=15, temperature=0.3, max_new_tokens=28)],
    ]
    text_prompts = _prompts(3, 5, repeat=True)
    text_samples = [
        [replace(greedy, stop=("wf", "q"))],  # stop strings the target's text holds
        [replace(sampled, seed=21, stop=("hs",))],
        [replace(greedy, structured_output={"regex": "[a-e]+( [a-e]+)*"}, max_new_tokens=14)],
        [replace(sampled, seed=22, structured_output={"choice": ["abc de", "bad cab", "ed"]})],
        [replace(sampled, seed=23, structured_output={"regex": "(ab|cd)+,[a-z]{2,6}"}, max_new_tokens=16)],
    ]
    return {
        "greedy": dict(prompts=greedy_prompts, samples=greedy_samples, max_live=3),
        "sampled": dict(prompts=sampled_prompts, samples=sampled_samples, max_live=4),
        "text": dict(prompts=text_prompts, samples=text_samples, max_live=2),
    }


# ------------------------------------------------------------------------------ the runs


@dataclass(frozen=True)
class Case:
    mode: str
    sizing: str  # "fixed" or "auto"
    profile: str  # the synthetic costs (PROFILES)
    requests: str  # request_sets' name
    defer_logits: bool = False
    shapes: str = "exact"

    @property
    def name(self) -> str:
        return (f"{self.mode}/{self.sizing}/{self.profile}/{self.requests}"
                f"/{'deferred' if self.defer_logits else 'full'}/{self.shapes}")


def cases(modes: tuple[str, ...]) -> list[Case]:
    out = []
    for mode in modes:
        for requests in ("greedy", "sampled", "text"):
            out.append(Case(mode, "fixed", "cheap", requests))
            for profile in PROFILES:
                out.append(Case(mode, "auto", profile, requests))
        out.append(Case(mode, "auto", "dear", "greedy", defer_logits=True))
        out.append(Case(mode, "fixed", "cheap", "greedy", defer_logits=True))
        out.append(Case(mode, "auto", "cheap", "sampled", shapes="bucketed"))
    return out


def _stats(stats) -> dict[str, Any]:
    return {**stats.to_row(), "accept_lengths": stats.accept_lengths, "tree_sizes": stats.tree_sizes,
            "tree_depths": stats.tree_depths, "batch_live": stats.batch_live,
            "accepted_by_source": stats.accepted_by_source}


def _result(result) -> dict[str, Any]:
    out = {name: getattr(result, name) for name in (
        "token_ids", "text", "finish_reason", "error", "finished_unix", "logprobs", "top_logprob_ids", "top_logprobs",
        "prompt_logprobs", "prompt_top_logprob_ids", "prompt_top_logprobs", "structured_complete")}
    out["stats"] = _stats(result.stats)
    return out


class Runner:
    """The tiny target, head, trie and tokenizer every case shares; one fresh engine per case."""

    def __init__(self, workdir: Path):
        from dart_worker.artifacts.random_models import random_model, tiny_config
        from dart_worker.engine_factory import EngineParts
        from dart_worker.head.draft_head import DartDraftHead
        from dart_worker.target.adapter import TargetAdapter
        from ngram_native import NgramTrie, build_trie

        self.clock = SyntheticClock()
        model = random_model(tiny_config("llama", vocab_size=VOCAB), seed=0)
        torch.manual_seed(123)
        head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4)
        target = _timed_target(TargetAdapter(model), self.clock)
        self.parts = EngineParts(target=target, tokenizer=char_tokenizer(), head=head, eos_token_ids=(EOS,))
        # A trie over the target's own greedy continuations: DART's N-gram term then finds the
        # target's path, and trees accept several tokens a round (the sizer keeps deep trees).
        build_trie(self._continuations(), workdir / "tiny.ngram", order=3, vocab_size=VOCAB,
                   tokenizer_fingerprint="tiny")
        self.parts.trie = NgramTrie.open(workdir / "tiny.ngram", verify=True)
        self.requests = request_sets()

    def _continuations(self) -> list[np.ndarray]:
        from dart_worker.engine_factory import build_engine
        from dart_worker.sampling.params import SamplingParams

        prompts = [p for i in range(1, 4) for p in _prompts(i, 8, repeat=i == 1)]
        with synthetic_time(self.clock):
            results = build_engine(self.parts, "ar").generate(prompts, SamplingParams(temperature=0.0,
                                                                                      max_new_tokens=40))
        return [np.asarray(p + r.token_ids, dtype=np.int32) for p, r in zip(prompts, results)]

    def run(self, case: Case) -> dict[str, Any]:
        from dart_worker import calibration
        from dart_worker.engine_factory import build_drafter, build_engine
        from ngram_native import TreeParams

        tree = TreeParams(budget=12, lookup_cache_tokens=4096)
        self.clock.reset(PROFILES[case.profile])
        with synthetic_time(self.clock), timed_verdicts(self.clock), \
                mock.patch.object(calibration, "latency_curves", _synthetic_curves(self.clock)):
            drafter = _timed_drafter(build_drafter(self.parts, case.mode, tree), self.clock)
            engine = build_engine(self.parts, case.mode, tree, defer_logits=case.defer_logits, sizing=case.sizing,
                                  batches=(1, 2, 4), shapes=case.shapes, drafter=drafter)
            req = self.requests[case.requests]
            results = engine.generate_samples(req["prompts"], req["samples"], max_live=req["max_live"])
            return {"results": [[_result(r) for r in per_prompt] for per_prompt in results],
                    "cost_model": engine.cost_model(), "clock_end": self.clock.now()}


DEFAULT_PROMPTS = ("Write a short poem about the sea.", "List three uses of a paperclip.",
                   "Explain what a hash map is.")


def run_default_target(modes: tuple[str, ...] = ("dart_lookup", "ar")) -> dict[str, Any]:
    """The default target's fixed-size decode of DEFAULT_PROMPTS (two greedy, one seeded), per mode."""
    from dart_bench.common import TargetBenchConfig, load_parts
    from dart_worker.engine_factory import build_drafter, build_engine
    from dart_worker.sampling.params import SamplingParams
    from ngram_native import TreeParams

    torch.set_num_threads(1)
    clock = SyntheticClock()
    parts = load_parts(TargetBenchConfig(dtype="fp32", device="cpu"), list(modes))
    _timed_target(parts.target, clock)
    params = [SamplingParams(temperature=0.0, max_new_tokens=24)] * 2 + [
        SamplingParams(temperature=0.8, seed=7, max_new_tokens=24)]
    tree = TreeParams(budget=16)
    out = {}
    for mode in modes:
        clock.reset(PROFILES["dear"])
        with synthetic_time(clock), timed_verdicts(clock):
            drafter = _timed_drafter(build_drafter(parts, mode, tree), clock)
            engine = build_engine(parts, mode, tree, defer_logits=False, sizing="fixed", drafter=drafter)
            results = engine.generate(list(DEFAULT_PROMPTS), params, max_live=2)
        out[f"default_target/{mode}/fixed"] = {"results": [[_result(r)] for r in results], "cost_model": None,
                                               "clock_end": clock.now()}
    return out


def run_all(modes: tuple[str, ...] | None = None) -> dict[str, Any]:
    from dart_worker.drafters import drafter_names

    torch.set_num_threads(1)  # one summation order: a float sum may differ between thread counts
    with TemporaryDirectory() as workdir:
        runner = Runner(Path(workdir))
        return {case.name: runner.run(case) for case in cases(modes or drafter_names())}


def differences(before: Any, after: Any, path: str = "") -> Iterator[str]:
    """Where two JSON values differ (a path and both sides), depth first."""
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(set(before) | set(after)):
            if key not in before or key not in after:
                yield f"{path}/{key}: only in {'after' if key not in before else 'before'}"
            else:
                yield from differences(before[key], after[key], f"{path}/{key}")
    elif isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        for i, (b, a) in enumerate(zip(before, after)):
            yield from differences(b, a, f"{path}[{i}]")
    elif before != after or type(before) is not type(after):
        yield f"{path}: {json.dumps(before)[:120]} != {json.dumps(after)[:120]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=Path, help="run every case and write the results here (JSON)")
    group.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                       help="compare two results files; exit 1 when they differ")
    parser.add_argument("--modes", nargs="*", help="only these drafter modes (default: every registered one)")
    parser.add_argument("--default-target", action="store_true",
                        help="also decode with the default target (fixed trees; loads it, see the module doc)")
    args = parser.parse_args(argv)
    if args.out:
        started = time.perf_counter()
        data = run_all(tuple(args.modes) if args.modes else None)
        if args.default_target:
            data |= run_default_target()
        args.out.write_text(json.dumps(data, indent=1, sort_keys=True))
        print(f"{len(data)} cases in {time.perf_counter() - started:.0f} s -> {args.out}")
        return 0
    before, after = (json.loads(p.read_text()) for p in args.compare)
    found = {case: list(differences(before.get(case), after.get(case))) for case in sorted(set(before) | set(after))}
    changed = {case: lines for case, lines in found.items() if lines}
    for case, lines in changed.items():
        print(f"{case}: {len(lines)} differences, first: {lines[0]}")
    if changed:
        print(f"DIFFERENT: {len(changed)} of {len(found)} cases differ")
        return 1
    print(f"IDENTICAL: {len(before)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
