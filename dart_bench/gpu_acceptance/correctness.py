"""Correctness on the device under test: the engine against transformers' own decoding.

Tiny random-weight models of each family (fp32, so exact equality is meaningful) decode the same
prompts three ways per registered drafter - each prompt alone, all at once (a ragged batch), and
under continuous batching - and every output must be what `model.generate` produces greedily
for that prompt alone. Seeded sampled requests must commit the tokens `ar` commits for the same
seed under every drafter. One chi-square test checks that the first two sampled tokens follow
the target's exact distribution.

Different kernels may round a logit differently (a tree forward against a one-token step), so
a divergence is diagnosed before it counts: where the two chosen tokens' logits differ by less
than `TIE_TOLERANCE` of the logits' scale (greedy), or the position's uniform lies that close
to a boundary of the warped CDF (sampling), the case is reported as a float tie, not a failure.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dart_worker.artifacts.random_models import random_model, tiny_config
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.head.draft_head import DartDraftHead
from dart_worker.sampling.gumbel import gumbel_noise, row_seeds
from dart_worker.sampling.params import (
    SamplingParams,
    TokenHistory,
    apply_penalties,
    request_key,
    warp_logits_to_probs,
)
from dart_worker.target.adapter import TargetAdapter
from ngram_native import NgramTrie, TreeParams, build_trie

VOCAB = 48  # small enough that draft top-k often holds the target's choice, so trees are accepted
EOS = 2
TIE_TOLERANCE = 1e-4  # relative to the largest |logit| (greedy) or absolute on log p + g (sampling)
SAMPLED = ((1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 0), (1.0, 0.8, 5))  # (temperature, top_p, top_k)


def random_prompts(count: int, seed: int, vocab: int = VOCAB, lengths=(5, 23)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1], (count,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in sizes]


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)


@torch.no_grad()
def transformers_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """`model.generate` greedily for one prompt: the reference every drafter must reproduce."""
    ids = torch.tensor([list(prompt)], device=model.device)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def _last_logits(model, tokens: Sequence[int]) -> torch.Tensor:
    return model(torch.tensor([list(tokens)], device=model.device)).logits[0, -1].float()


def diagnose_greedy(model, prompt, ours: list[int], reference: list[int]) -> dict[str, Any]:
    """Where `ours` first leaves `reference`, and whether the target was tied there."""
    k = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
    if k == len(ours) == len(reference):
        return {"status": "identical"}
    if k == min(len(ours), len(reference)):  # one stopped earlier, with the same tokens so far
        return {"status": "differs", "position": k, "why": f"lengths {len(ours)} vs {len(reference)}"}
    logits = _last_logits(model, list(prompt) + reference[:k])
    gap = float((logits[ours[k]] - logits[reference[k]]).abs())
    scale = float(logits.abs().max())
    status = "tie" if gap <= TIE_TOLERANCE * scale else "differs"
    return {"status": status, "position": k, "logit_gap": gap, "logit_scale": scale}


def diagnose_sampled(model, prompt, params: SamplingParams, ours: list[int], reference: list[int]) -> dict[str, Any]:
    """Where a sampled output leaves `ar`'s, and how close that position's Gumbel-max draw was to a
    tie: the gap between the two best log p + g (g the token noise of the position,
    `dart_worker.sampling.gumbel`; over a vocabulary this small nearly every token is a cell of its
    own, so this is the draw's own margin)."""
    k = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
    if k == len(ours) == len(reference):
        return {"status": "identical"}
    if k == min(len(ours), len(reference)):
        return {"status": "differs", "position": k, "why": f"lengths {len(ours)} vs {len(reference)}"}
    logits = _last_logits(model, list(prompt) + reference[:k])[None]
    logits = apply_penalties(logits, [params], [TokenHistory(list(prompt) + reference[:k], len(prompt))], [[]])
    probs = warp_logits_to_probs(logits, params)[0].double()
    seeds = torch.from_numpy(row_seeds(request_key(params), [k])).to(probs.device)
    scores = (probs.log() + gumbel_noise(seeds, torch.arange(probs.shape[-1], device=probs.device))[0]).cpu()
    best = scores.topk(2).values
    margin = float(best[0] - best[1])
    return {"status": "tie" if margin <= TIE_TOLERANCE else "differs", "position": k, "draw_margin": margin}


def self_trie(target: TargetAdapter, path: Path) -> NgramTrie:
    """A trie over the target's own greedy continuations: DART's n-gram term then finds the
    target's path, trees accept several tokens per round and compaction is exercised."""
    engine = build_engine(EngineParts(target=target), "ar")
    docs = [np.asarray(r.token_ids, dtype=np.int32)
            for r in engine.generate(random_prompts(12, seed=99), greedy(48))]
    build_trie(docs, path, order=3, vocab_size=VOCAB, tokenizer_fingerprint="acceptance")
    return NgramTrie.open(path, verify=True)


def family_parts(family: str, device: torch.device, directory: Path) -> tuple[Any, EngineParts]:
    model = random_model(tiny_config(family, vocab_size=VOCAB), device=device, dtype=torch.float32)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4, seed=123,
                                     device=device, dtype=torch.float32)
    target = TargetAdapter(model)
    parts = EngineParts(target=target, head=head, trie=self_trie(target, directory / f"{family}.ngram"),
                        eos_token_ids=(EOS,))
    return model, parts


def family_cases(family: str, device: torch.device, modes: Sequence[str], prompts: int,
                 new_tokens: int) -> Iterator[dict[str, Any]]:
    """Every mode x {alone, ragged batch, continuous batching} greedy, and seeded sampling vs ar:
    one case at a time (the report is written after each), in exact float32 throughout."""
    with exact_float32(), tempfile.TemporaryDirectory(prefix="dart-acceptance-") as tmp:
        model, parts = family_parts(family, device, Path(tmp))
        requests = random_prompts(prompts, seed=2)
        reference = [transformers_greedy(model, p, new_tokens) for p in requests]
        warps = [SAMPLED[i % len(SAMPLED)] for i in range(prompts)]
        sampled = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=10 + i, max_new_tokens=new_tokens)
                   for i, (t, p, k) in enumerate(warps)]
        ar_sampled = [r.token_ids for r in build_engine(parts, "ar").generate(requests, sampled)]
        for mode in modes:
            engine = build_engine(parts, mode, TreeParams(budget=16))
            for how, max_live in (("alone", 1), ("ragged batch", None), ("continuous batching", 2)):
                started = time.perf_counter()
                results = (engine.generate(requests, greedy(new_tokens), max_live=max_live) if max_live != 1
                           else [engine.generate([p], greedy(new_tokens))[0] for p in requests])
                verdicts = [diagnose_greedy(model, p, r.token_ids, ref)
                            for p, r, ref in zip(requests, results, reference)]
                yield _case(family, mode, f"greedy, {how}", verdicts, results, time.perf_counter() - started)
            started = time.perf_counter()
            results = engine.generate(requests, sampled, max_live=3)
            verdicts = [diagnose_sampled(model, p, s, r.token_ids, ref)
                        for p, s, r, ref in zip(requests, sampled, results, ar_sampled)]
            yield _case(family, mode, "seeded sampling = ar", verdicts, results, time.perf_counter() - started)


@contextmanager
def exact_float32() -> Iterator[None]:
    """Exact equality needs exact float32 products on every device (no TF32 shortcuts)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _case(family: str, mode: str, what: str, verdicts: list[dict], results, seconds: float) -> dict[str, Any]:
    statuses = [v["status"] for v in verdicts]
    rounds = sum(r.stats.rounds for r in results)
    tokens = sum(len(r.token_ids) for r in results)
    return {"family": family, "mode": mode, "check": what, "requests": len(verdicts),
            "identical": statuses.count("identical"), "ties": statuses.count("tie"),
            "differs": statuses.count("differs"), "tau": round(tokens / max(rounds, 1), 3),
            "details": [v for v in verdicts if v["status"] != "identical"],
            "passed": "differs" not in statuses, "seconds": round(seconds, 2)}


# ------------------------------------------------------------------------------- chi-square

@torch.no_grad()
def exact_two_token_distribution(model, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """P(y1, y2 | prompt) under the warped target (penalties included), by enumerating y1 (toy vocabulary)."""
    device = model.device
    first_logits = model(torch.tensor([prompt], device=device)).logits[:, -1]
    first = warp_logits_to_probs(apply_penalties(first_logits, [params], [TokenHistory(prompt, len(prompt))], [[]]),
                                 params)[0]
    vocab = first.shape[0]
    batch = torch.tensor([[*prompt, y] for y in range(vocab)], device=device)
    histories = [TokenHistory([*prompt, y], len(prompt)) for y in range(vocab)]
    second = warp_logits_to_probs(apply_penalties(model(batch).logits[:, -1], [params] * vocab, histories,
                                                  [[]] * vocab), params)
    return (first[:, None] * second).double().cpu().numpy()


def chi_square_p_value(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square goodness of fit (expected rescaled to the observed total); the upper
    tail of the chi-square distribution is the regularised upper incomplete gamma function."""
    expected = expected * observed.sum() / expected.sum()
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def first_two_tokens_p_value(model, prompt, params: SamplingParams, token_ids: Sequence[Sequence[int]]) -> float:
    """Chi-square p-value of sampled (y1, y2) pairs against the exact warped target distribution
    (cells expecting < 5 draws pooled); 0.0 if a pair the target gives probability 0 was drawn."""
    expected = exact_two_token_distribution(model, prompt, params) * len(token_ids)
    counts = np.zeros_like(expected)
    for ids in token_ids:
        counts[ids[0], ids[1]] += 1
    if counts[~(expected > 0)].sum():
        return 0.0
    keep = expected >= 5
    observed = np.append(counts[keep], counts[~keep].sum())
    expect = np.append(expected[keep], expected[~keep].sum())
    if expect[-1] == 0:
        observed, expect = observed[:-1], expect[:-1]
    return chi_square_p_value(observed, expect)


def chi_square_case(device: torch.device, mode: str, draws: int) -> Iterator[dict[str, Any]]:
    """y1 comes from prefill, y2 from the first verified tree: 4000 draws over the 64 cells of an
    8-token vocabulary catch a 2% shift of a likely cell's probability. (A generator: one result,
    computed in exact float32.)"""
    vocab = 8
    model = random_model(tiny_config("llama", vocab_size=vocab, initializer_range=0.1), device=device)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4, seed=123,
                                     device=device, dtype=torch.float32)
    parts = EngineParts(target=TargetAdapter(model), head=head)
    prompt = [3, 5, 1, 6, 3, 5, 1, 6, 2, 4, 7, 0, 2]  # repeats, so lookup drafters graft context nodes
    params = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=3) for i in range(draws)]
    tree = TreeParams(top_k=vocab, budget=12, beam_width=4, lookup_min_match=1)
    started = time.perf_counter()
    with exact_float32():
        results = build_engine(parts, mode, tree).generate([prompt] * draws, params, max_live=min(draws, 1024))
        p_value = first_two_tokens_p_value(model, prompt, params[0], [r.token_ids for r in results])
    accepted_first = float(np.mean([r.stats.accept_lengths[0] for r in results]))
    yield {"mode": mode, "check": "chi-square, first two tokens at T=1", "draws": draws,
            "p_value": p_value, "accepted_in_first_round": round(accepted_first, 3),
            "passed": p_value > 1e-3, "seconds": round(time.perf_counter() - started, 2)}
