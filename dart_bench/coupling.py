"""Drafts that know the dice (issue #48): `python -m jobs.bench coupling [config.yaml] [key=value ...]`.

A sampled token is a fixed function of the request's key, its position and the target's
distribution there (dart_worker.sampling.params), so a drafter may read the same randomness without
changing a committed token. How much that is worth depends on how the draw uses it. Along the
target's own sampled replies to ShareGPT dev prompts (replay: the target's taps fed to the draft
head one committed token a round, no verification forwards), for every reply position and draft
depth d = 1..depths, with p the target's warped distribution there and q the head's at the same
temperature, the share of positions where the target's drawn token equals

- `top1`: the head's most probable token (what the trees propose first today);
- `inverse_cdf`: the head's inverse-CDF draw with the position's uniform (the sampler before #48,
  `dart_bench.inverse_cdf`; since the switch the replies are the engine's Gumbel-max draws, so this
  is an uncoupled guess);
- `gumbel`: Gumbel-max with shared noise, argmax(log q + g) against argmax(log p + g), g the
  vocabulary-sized noise of the position (`gumbel.gumbel_noise`; the target's draw is this
  product on the replies' prefixes, not a decode of its own);
- `gumbel_2level`: the same with the two-level draw (`gumbel.gumbel_sample` with no singles:
  the block of 1024 token ids by Gumbel-max over block masses, then the token inside it) on both
  sides, which needs 1.3k noise values a row instead of the vocabulary's;
- `gumbel_partition`: the sampler's draw (`gumbel.gumbel_sample`: the 64 heaviest tokens as their
  own cells, blocks for the rest) against the drafter's guess (`gumbel.coupled_candidates`: the
  best of the head's top 64 by log q + g, the same noise);
- `greedy_ref`: the head's argmax against the target's argmax (greedy decoding's agreement);
- `coupling_limit`: 1 - TV(p, q), what no coupling can beat;

plus `chain`, the one-chain expected accepted length from those rates (sum over d of the product
of the rates up to d), and top-k membership (is the target's Gumbel draw among the k best of
log q + g; is today's draw among the k most probable of q; is the partitioned draw among the
drafter's k best guesses; for reference, is the target's argmax among the head's k most probable,
what greedy trees rest on). Then the CPU cost per row of the
noise and of each draw over the target's vocabulary. Writes coupling.json and coupling.md under
output_dir.

With `tau_modes`, also tau by replay (`dart_train.replay`, fixed sizing) of coupled trees: the
replies are sampled with the partitioned Gumbel-max draw (`gumbel_replies`: the target's own
autoregressive decode, every token `gumbel.gumbel_sample` with the noise of its generated index),
and the drafter builds its tree exactly as for greedy decoding but over the coupled distribution
q~_d = softmax((log q_d + g_d) / s) of each depth d (`GumbelCoupler`: q the head's distribution at
the request's temperature, g_d the target's token noise of the head's vocabulary at that position,
s a calibration scale from `coupling_scales`; DART's N-gram guidance still applied on top). Per
mode, budget and temperature: the greedy tau (greedy replies), today's tau (the same Gumbel
replies, no dice: drafts from q) and the coupled tau at each s (`agreement=false` skips the tables
above):

    python -m jobs.bench coupling agreement=false 'tau_modes=[dart,ddtree]' 'tau_budgets=[16,32]'
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dart_bench.replay import ReplayJobConfig, TuneConfigError, load_structured_config, replay_job_main
from dart_worker.drafters.coupling import GumbelCoupler

METHODS = ("top1", "inverse_cdf", "gumbel", "gumbel_2level", "gumbel_partition", "greedy_ref", "coupling_limit")
# Prompts whose head runs in one lockstep batch (bounds the target logits held: [reply, V] each).
GROUP = 4


@dataclass
class CouplingConfig(ReplayJobConfig):
    temperatures: list[float] = field(default_factory=lambda: [0.7, 1.0])
    num_prompts: int = 16
    check_prompts: int = 8  # the first dev prompts (the decoding benchmarks'): skipped
    max_new_tokens: int = 64
    depths: int = 4
    top_ks: list[int] = field(default_factory=lambda: [1, 2, 4])
    noise_rows: list[int] = field(default_factory=lambda: [1, 16])  # rows per call of the cost timing
    agreement: bool = True  # the per-depth agreement tables and the draw costs (off: tau only)
    # Tau by replay of these modes at these budgets: greedy, and at each temperature today's trees
    # and coupled trees at each calibration scale s (`GumbelCoupler`).
    tau_modes: list[str] = field(default_factory=list)
    tau_budgets: list[int] = field(default_factory=lambda: [16, 32])
    coupling_scales: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0])
    # Weights a of the noise in the coupled logits (log q + a g) / s: 1 is the coupled draw's own
    # ranking; below 1 a hedge towards q's (0: today's trees, at s = 1).
    coupling_noise_weights: list[float] = field(default_factory=lambda: [1.0])
    tau_tree: dict[str, Any] = field(default_factory=dict)  # TreeParams fields of every tau run ({}: defaults)
    dtype: str = "fp32"
    output_dir: str = "coupling"


def parse(argv: list[str]) -> CouplingConfig:
    cfg = load_structured_config(CouplingConfig, argv, TuneConfigError)
    if cfg.num_prompts < 1 or cfg.depths < 1 or not cfg.temperatures or any(t <= 0 for t in cfg.temperatures):
        raise TuneConfigError("num_prompts >= 1, depths >= 1 and temperatures > 0 are needed")
    if any(k < 1 for k in cfg.top_ks) or any(r < 1 for r in cfg.noise_rows):
        raise TuneConfigError("top_ks and noise_rows must be >= 1")
    if any(b < 1 for b in cfg.tau_budgets) or any(s <= 0 for s in cfg.coupling_scales):
        raise TuneConfigError("tau_budgets must be >= 1 and coupling_scales > 0")
    if any(not 0 < a <= 1 for a in cfg.coupling_noise_weights):
        raise TuneConfigError("coupling_noise_weights must be in (0, 1]")
    if cfg.tau_modes and cfg.seed is None:
        raise TuneConfigError("tau by replay needs a seed (the replies' key)")
    return cfg


@dataclass
class Tally:
    """Per method and depth: agreements (or summed 1 - TV) and positions counted."""

    depths: int
    top_ks: list[int]
    hits: dict[str, np.ndarray] = field(default_factory=dict)
    count: np.ndarray | None = None
    reproduced: list[int] = field(default_factory=lambda: [0, 0])  # replies' tokens re-drawn / checked

    def __post_init__(self):
        names = [*METHODS, *(f"{kind}_top{k}" for kind in ("gumbel", "partition", "q", "greedy")
                  for k in self.top_ks)]
        self.hits = {m: np.zeros(self.depths) for m in names}
        self.count = np.zeros(self.depths)

    def rates(self) -> dict[str, list[float]]:
        return {m: (h / np.maximum(self.count, 1)).tolist() for m, h in self.hits.items()}


def chain_length(rates: list[float]) -> float:
    """One chain's expected accepted length from per-depth acceptance rates."""
    return float(np.cumprod(rates).sum())


@torch.inference_mode()
def target_rows(parts, ref) -> torch.Tensor:
    """float32 logits [len(reply), V] of the target at each reply position (row j predicts reply[j])."""
    target = parts.target
    seq = ref.prompt + ref.reply
    out = target.prefill(target.new_state(1), [seq], keep_hidden=True)
    start = len(ref.prompt) - 1
    return target.logits_at(out.hidden[0, start : start + len(ref.reply)]).float()


@torch.inference_mode()
def tally_group(parts, drafter, refs, params, key: int, noise: torch.Tensor, tally: Tally) -> None:
    """Drive the head over `refs` one committed token a round and count every method's agreements."""
    from dart_worker.drafters.base import NOTHING_FINISHED, CommittedBlock, Finished

    head = parts.head
    depth_cap, temperature = tally.depths, params.temperature
    rows = [target_rows(parts, ref) for ref in refs]
    draft_to_target = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=head.device)).cpu()
    taps = [ref.taps for ref in refs]
    tokens = [ref.prompt + ref.reply[:1] for ref in refs]
    drafter.retire(NOTHING_FINISHED, keep=[])
    width = max(len(ref.prompt) for ref in refs)
    block = torch.zeros(len(refs), width, taps[0].shape[-1], dtype=taps[0].dtype, device=taps[0].device)
    for b, ref in enumerate(refs):
        block[b, : len(ref.prompt)] = taps[b][: len(ref.prompt)]
    drafter.observe(CommittedBlock(block, [range(len(r.prompt)) for r in refs], tokens, joined=True))
    live = list(range(len(refs)))  # the head's batch: references still drafting, in order
    for i in range(max(len(ref.reply) for ref in refs) - 1):
        # round i: generated tokens 0..i committed; depth d predicts generated index i + d
        drafter.catch_up()
        logits = drafter.logits[:, :depth_cap].float().cpu()
        picks = [(b, k, d) for k, b in enumerate(live) for d in range(1, min(depth_cap, logits.shape[1]) + 1)
                 if i + d < len(refs[b].reply)]
        if picks:
            _count(picks, i, refs, rows, logits, draft_to_target, params, key, noise, tally, temperature)
        keep = [k for k, b in enumerate(live) if i + 2 < len(refs[b].reply)]
        if len(keep) < len(live):
            done = [b for k, b in enumerate(live) if k not in keep]
            drafter.retire(Finished([tokens[b] for b in done], [len(refs[b].prompt) for b in done]), keep)
            live = [live[k] for k in keep]
        if not live:
            break
        step = torch.stack([taps[b][len(refs[b].prompt) + i] for b in live])[:, None]
        for b in live:
            tokens[b] = refs[b].prompt + refs[b].reply[: i + 2]
        drafter.observe(CommittedBlock(step, [range(1)] * len(live), [tokens[b] for b in live]))


def _count(picks, i, refs, rows, logits, d2t, params, key, noise, tally, temperature) -> None:
    """Tally the rows `picks` ((reference, its batch row, depth)) of round i."""
    from dart_bench.gumbel import BLOCK_STREAM, GUMBEL_SINGLES, coupled_candidates, gumbel_sample, row_seeds
    from dart_bench.inverse_cdf import inverse_cdf_sample, position_uniforms
    from dart_worker.sampling.gumbel import gumbel_sample_threshold
    from dart_worker.sampling.params import warp_logits_to_probs

    positions = np.asarray([i + d for _, _, d in picks], dtype=np.int64)
    target_logits = torch.stack([rows[b][i + d] for b, _, d in picks])
    head_logits = torch.stack([logits[k, d - 1] for _, k, d in picks])
    drawn = torch.as_tensor([refs[b].reply[i + d] for b, _, d in picks])
    depth = torch.as_tensor([d - 1 for _, _, d in picks])
    p = warp_logits_to_probs(target_logits, params)
    q = (head_logits / temperature).softmax(dim=-1)
    logq = q.log().double()
    q_full = torch.zeros_like(p).index_copy_(1, d2t, q)
    uniforms = torch.from_numpy(position_uniforms(key, positions))
    g = noise[torch.from_numpy(positions)]  # [R, V] float64
    g_head = g[:, d2t]
    target_gumbel = (p.double().log() + g).argmax(dim=-1)
    head_gumbel_scores = logq + g_head
    seeds = torch.from_numpy(row_seeds(key, positions))
    block_seeds = torch.from_numpy(row_seeds(key, positions, BLOCK_STREAM))
    partitioned = gumbel_sample(p, seeds, block_seeds)
    top_q, top_ids = q.topk(GUMBEL_SINGLES, dim=-1)
    guesses, _ = coupled_candidates(top_q.log(), d2t[top_ids], seeds, max(tally.top_ks))
    results = {
        "top1": d2t[q.argmax(dim=-1)] == drawn,
        "inverse_cdf": inverse_cdf_sample(q_full, uniforms) == drawn,
        "gumbel": d2t[head_gumbel_scores.argmax(dim=-1)] == target_gumbel,
        "gumbel_2level": gumbel_sample(q_full, seeds, block_seeds, 0) == gumbel_sample(p, seeds, block_seeds, 0),
        "gumbel_partition": guesses[:, 0] == partitioned,
        "greedy_ref": d2t[head_logits.argmax(dim=-1)] == target_logits.argmax(dim=-1),
        "coupling_limit": torch.minimum(p[:, d2t], q).sum(dim=-1),
    }
    for k in tally.top_ks:
        top_g = d2t[head_gumbel_scores.topk(k, dim=-1).indices]
        top_k_q = d2t[q.topk(k, dim=-1).indices]
        results[f"gumbel_top{k}"] = (top_g == target_gumbel[:, None]).any(dim=-1)
        results[f"q_top{k}"] = (top_k_q == drawn[:, None]).any(dim=-1)
        results[f"partition_top{k}"] = (guesses[:, :k] == partitioned[:, None]).any(dim=-1)
        top_head = d2t[head_logits.topk(k, dim=-1).indices]  # greedy decoding's membership, for reference
        results[f"greedy_top{k}"] = (top_head == target_logits.argmax(dim=-1)[:, None]).any(dim=-1)
    for name, value in results.items():
        tally.hits[name] += np.bincount(depth.numpy(), weights=value.double().numpy(), minlength=tally.depths)
    tally.count += np.bincount(depth.numpy(), minlength=tally.depths)
    # do the replies (the engine's draws) reproduce (fp32: they should)
    redrawn = gumbel_sample_threshold(p, seeds, block_seeds) == drawn
    tally.reproduced[0] += int(redrawn.sum())
    tally.reproduced[1] += len(picks)


def _cost_cases(rows: int, vocab: int, device: torch.device) -> dict:
    """What `noise_costs` times, over `rows` rows of `vocab` tokens."""
    from dart_bench.gumbel import BLOCK_STREAM, gumbel_noise, gumbel_sample, gumbel_sample_threshold, row_seeds
    from dart_bench.inverse_cdf import inverse_cdf_sample

    logits = torch.randn(rows, vocab, device=device) * 3
    probs = logits.softmax(dim=-1)
    seeds = torch.from_numpy(row_seeds(7, np.arange(rows))).to(device)
    block_seeds = torch.from_numpy(row_seeds(7, np.arange(rows), BLOCK_STREAM)).to(device)
    uniforms = torch.rand(rows, dtype=torch.float64, device=device)
    ids = torch.arange(vocab, device=device)
    return {
        "softmax (reference pass)": lambda: logits.softmax(dim=-1),
        "gumbel noise, whole vocabulary": lambda: gumbel_noise(seeds, ids),
        "gumbel-max draw, whole vocabulary": lambda: (probs.double().log() + gumbel_noise(seeds, ids)).argmax(-1),
        "gumbel-max draw, two-level": lambda: gumbel_sample(probs, seeds, block_seeds, 0),
        "gumbel-max draw, partitioned (top-64 alone)": lambda: gumbel_sample(probs, seeds, block_seeds),
        "gumbel-max draw, partitioned (p > 1/256 alone)": lambda: gumbel_sample_threshold(probs, seeds, block_seeds),
        "inverse-CDF draw (before #48)": lambda: inverse_cdf_sample(probs, uniforms),
    }


def noise_costs(vocab: int, row_counts: list[int], device: torch.device, repeats: int = 5) -> list[dict]:
    """Milliseconds per row (median of `repeats`) over a `vocab`-token row: the warp's softmax (a
    reference pass), the vocabulary-sized Gumbel noise, the flat Gumbel-max draw (noise + argmax),
    the two-level draw and the inverse-CDF draw it replaces."""
    out = []
    for rows in row_counts:
        for name, fn in _cost_cases(rows, vocab, device).items():
            fn()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            out.append({"rows": rows, "what": name, "ms_per_row": 1e3 * float(np.median(times)) / rows})
    return out


def measure(cfg: CouplingConfig) -> dict[str, Any]:
    from dart_bench.common import load_parts, machine_conditions, select_prompts
    from dart_bench.gumbel import gumbel_noise, row_seeds
    from dart_bench.replay import references, reply_sampling
    from dart_worker.engine_factory import build_drafter
    from dart_worker.hardware.device import configure_cpu_threads
    from dart_worker.sampling.params import request_key
    from ngram_native.builders import TreeParams

    threads = configure_cpu_threads(cfg.threads)
    conditions = machine_conditions(threads)
    out = Path(cfg.output_dir)
    parts = load_parts(cfg, ["chain", *cfg.tau_modes])
    if parts.head is None:
        raise TuneConfigError("coupling needs a draft head")
    chosen = select_prompts(parts.tokenizer, cfg.check_prompts + cfg.num_prompts, cfg.max_prompt_tokens)
    prompts = [ids for _, ids in chosen[cfg.check_prompts :]]
    if not prompts:
        raise TuneConfigError(f"no dev prompts fit max_prompt_tokens={cfg.max_prompt_tokens}")
    vocab = parts.target.vocab_size
    # Every reply is sampled with the same seed (one SamplingParams for the batch), so one key.
    key = request_key(reply_sampling(cfg))
    positions = np.arange(cfg.max_new_tokens)
    results = []
    for temperature in cfg.temperatures if cfg.agreement else []:
        if not results:
            noise = gumbel_noise(torch.from_numpy(row_seeds(key, positions)), torch.arange(vocab))  # [T, V] float64
        cfg_t = replace(cfg, temperature=float(temperature))
        folder = out / f"T{temperature:g}"
        folder.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        refs = references(cfg_t, parts, prompts, folder)
        params = reply_sampling(cfg_t)
        tally = Tally(cfg.depths, list(cfg.top_ks))
        for first in range(0, len(refs), GROUP):
            drafter = build_drafter(parts, "chain", TreeParams(budget=cfg.depths, max_depth=cfg.depths))
            tally_group(parts, drafter, refs[first : first + GROUP], params, key, noise, tally)
        rates = tally.rates()
        results.append({
            "temperature": float(temperature), "prompts": len(refs), "positions_per_depth": tally.count.tolist(),
            "rates": rates, "chain": {m: chain_length(rates[m]) for m in METHODS if m != "coupling_limit"},
            "replies_reproduced": tally.reproduced, "seconds": time.perf_counter() - start,
        })
        print(f"T={temperature:g}: {len(refs)} prompts in {results[-1]['seconds']:.0f} s")
    costs = noise_costs(vocab, list(cfg.noise_rows), parts.target.device) if cfg.agreement else []
    taus = replay_taus(cfg, parts, prompts, out) if cfg.tau_modes else []
    return {"taus": taus, "config": {k: v for k, v in vars(cfg).items()}, "machine": conditions,
            "dtype": str(parts.target.dtype), "vocab": vocab, "draft_vocab": parts.head.config.draft_vocab_size,
            "load_average_end": list(os.getloadavg()), "results": results, "noise_costs": costs}


@torch.inference_mode()
def gumbel_replies(parts, prompts: list[list[int]], params, max_new_tokens: int, group: int = 8) -> list[list[int]]:
    """The target's replies sampled with the partitioned Gumbel-max draw (`gumbel.gumbel_sample`,
    the token at generated index t drawn with the noise rows of (request_key(params), t)): plain
    autoregressive decoding, one token a forward, EOS included where a reply ends."""
    from dart_bench.gumbel import BLOCK_STREAM, gumbel_sample, row_seeds
    from dart_worker.sampling.params import request_key, warp_logits_to_probs

    target, key, eos = parts.target, request_key(params), set(parts.eos_token_ids)
    replies = []
    for first in range(0, len(prompts), group):
        batch = prompts[first : first + group]
        state = target.new_state(len(batch))
        logits = target.prefill(state, batch).logits[:, -1]
        out: list[list[int]] = [[] for _ in batch]
        device = logits.device
        for t in range(max_new_tokens):
            seeds = torch.from_numpy(row_seeds(key, np.full(len(batch), t))).to(device)
            block_seeds = torch.from_numpy(row_seeds(key, np.full(len(batch), t), BLOCK_STREAM)).to(device)
            drawn = gumbel_sample(warp_logits_to_probs(logits.float(), params), seeds, block_seeds).tolist()
            for b, token in enumerate(drawn):
                if not out[b] or (out[b][-1] not in eos and len(out[b]) < max_new_tokens):
                    out[b].append(int(token))
            if t + 1 == max_new_tokens or all(r[-1] in eos for r in out):
                break
            tokens = torch.as_tensor([[r[-1]] for r in out], device=target.device)
            zeros = torch.zeros_like(tokens)
            forward = target.verify(state, tokens, zeros, torch.ones(len(batch), 1, 1, dtype=torch.bool,
                                                                       device=target.device))
            target.commit(state, state.cache_len() - 1, [[0]] * len(batch))
            logits = forward.logits[:, 0]
        replies.extend(out)
    return replies


def gumbel_references(cfg: CouplingConfig, parts, prompts: list[list[int]], folder: Path) -> list:
    """References of `prompts` with `gumbel_replies` at cfg.temperature (cached in
    gumbel_replies.json under `folder`, keyed like `replay.references`)."""
    import hashlib
    import json

    from dart_bench.replay import reply_sampling
    from dart_train.replay import target_references

    params = reply_sampling(cfg)
    key = hashlib.sha256(json.dumps(["gumbel-partitioned", cfg.target, cfg.dtype, str(parts.target.dtype),
                                     cfg.max_new_tokens, prompts, params.temperature, params.top_p,
                                     params.top_k, params.seed]).encode()).hexdigest()
    path = folder / "gumbel_replies.json"
    if path.is_file() and json.loads(path.read_text()).get("key") == key:
        replies = json.loads(path.read_text())["replies"]
    else:
        start = time.perf_counter()
        replies = gumbel_replies(parts, prompts, params, cfg.max_new_tokens)
        print(f"Gumbel-sampled replies of {len(prompts)} prompts at T={params.temperature:g} in "
              f"{time.perf_counter() - start:.0f} s")
        path.write_text(json.dumps({"key": key, "replies": replies}))
    refs = target_references(parts, prompts, cfg.max_new_tokens, replies=replies)
    return refs, redrawn(parts, refs, params)


@torch.inference_mode()
def redrawn(parts, refs, params) -> list[int]:
    """[tokens re-drawn, tokens checked]: each reply token drawn again by `gumbel.gumbel_sample` from
    one forward over prompt + reply (a different shape than the decode's one-token forwards), so
    the replies are the draws the coupled drafter is measured against (fp32: all or nearly all)."""
    from dart_bench.gumbel import BLOCK_STREAM, gumbel_sample, row_seeds
    from dart_worker.sampling.params import request_key, warp_logits_to_probs

    key, same, total = request_key(params), 0, 0
    for ref in refs:
        positions = np.arange(len(ref.reply))
        seeds, block_seeds = (torch.from_numpy(row_seeds(key, positions, stream)) for stream in (0, BLOCK_STREAM))
        drawn = gumbel_sample(warp_logits_to_probs(target_rows(parts, ref), params), seeds, block_seeds)
        same += int((drawn == torch.as_tensor(ref.reply)).sum())
        total += len(ref.reply)
    return [same, total]


def replay_taus(cfg: CouplingConfig, parts, prompts: list[list[int]], out: Path) -> list[dict]:
    """Tau by replay of every tau mode x budget: greedy replies; and at each temperature the
    Gumbel-sampled replies drafted from q (today) and from the coupled distribution at each scale."""
    from dart_bench.replay import references, reply_sampling, setting
    from dart_train.replay import mean_tau, replay
    from dart_worker.engine_factory import build_drafter

    rows = []
    for temperature in [0.0, *cfg.temperatures]:
        cfg_t = replace(cfg, temperature=float(temperature))
        folder = out / f"T{temperature:g}"
        folder.mkdir(parents=True, exist_ok=True)
        params = reply_sampling(cfg_t)
        greedy = params.is_greedy
        if greedy:
            refs = references(cfg_t, parts, prompts, folder)
        else:
            refs, check = gumbel_references(cfg_t, parts, prompts, folder)
            print(f"T={temperature:g}: {check[0]}/{check[1]} reply tokens re-drawn from one forward", flush=True)
        for mode in cfg.tau_modes:
            for budget in cfg.tau_budgets:
                # every prompt once: no job history
                tree = setting(dict(cfg.tau_tree), budget=budget, job_ngram_tokens=0)
                couplings = [(s, a) for a in cfg.coupling_noise_weights for s in cfg.coupling_scales]
                for scale, weight in [(None, None)] if greedy else [(None, None), *couplings]:
                    drafter = build_drafter(parts, mode, tree)
                    if scale is not None:
                        drafter.coupler = GumbelCoupler(parts.head, scale, weight)
                    start = time.perf_counter()
                    stats = replay(drafter, refs, cfg.max_new_tokens, parts.target.max_positions,
                                   dice=None if scale is None else params)
                    rows.append({"mode": mode, "budget": budget, "temperature": float(temperature), "scale": scale,
                                 "noise_weight": weight,
                                 "replies_redrawn": None if greedy else check,
                                 "tau": mean_tau(stats), "per_prompt_tau": [st.tau for st in stats],
                                 "seconds": time.perf_counter() - start, "load_average": list(os.getloadavg())})
                    print(f"tau {mode} budget {budget} T={temperature:g} scale={scale} noise weight {weight}: "
                          f"{rows[-1]['tau']:.3f} "
                          f"({rows[-1]['seconds']:.0f} s)", flush=True)
    return rows


def tau_table(taus: list[dict]) -> list[str]:
    """Per mode, budget and temperature: greedy tau, today's tau, and the coupled tau at each
    scale with its ratio to greedy and its paired gain over today (mean +- standard error over
    prompts)."""
    from dart_train.replay import paired_difference

    if not taus:
        return []
    lines = ["| mode | budget | T | tau, greedy | tau, today (q) | s | noise weight | tau, coupled | coupled / greedy "
             "| coupled / today | paired gain over today |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    by = {(r["mode"], r["budget"], r["temperature"], r["scale"], r.get("noise_weight", 1.0)): r for r in taus}
    for (mode, budget, temperature, scale, weight), r in by.items():
        if scale is None:
            continue
        greedy = by.get((mode, budget, 0.0, None, None))
        today = by[(mode, budget, temperature, None, None)]
        gain, err = paired_difference(r["per_prompt_tau"], today["per_prompt_tau"])
        greedy_tau = greedy["tau"] if greedy else float("nan")
        lines.append(f"| {mode} | {budget} | {temperature:g} | {greedy_tau:.3f} | {today['tau']:.3f} | {scale:g} | "
                     f"{weight:g} | "
                     f"{r['tau']:.3f} | {r['tau'] / greedy_tau:.2f} | {r['tau'] / today['tau']:.2f} | "
                     f"{gain:+.3f}" + ("" if err is None else f" +- {err:.3f}") + " |")
    return lines


def summarize(results: list[dict]) -> list[str]:
    lines = []
    for r in results:
        depths = len(r["positions_per_depth"])
        lines += [f"### T={r['temperature']:g} ({r['prompts']} prompts, positions per depth "
                  f"{', '.join(str(int(c)) for c in r['positions_per_depth'])}; replies re-drawn "
                  f"{r['replies_reproduced'][0]}/{r['replies_reproduced'][1]})", "",
                  "| agreement with the target's draw | " + " | ".join(f"depth {d}" for d in range(1, depths + 1))
                  + " | one-chain expected accepted length |",
                  "|---|" + "---:|" * (depths + 1)]
        for m in METHODS:
            chain = r["chain"].get(m)
            lines.append(f"| {m} | " + " | ".join(f"{v:.3f}" for v in r["rates"][m])
                         + f" | {'' if chain is None else f'{chain:.3f}'} |")
        lines += ["", "| top-k membership | " + " | ".join(f"depth {d}" for d in range(1, depths + 1)) + " |",
                  "|---|" + "---:|" * depths]
        for name in [n for n in r["rates"] if n.startswith(("gumbel_top", "partition_top", "q_top", "greedy_top"))]:
            lines.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in r["rates"][name]) + " |")
        lines.append("")
    return lines


def cost_table(costs: list[dict]) -> list[str]:
    lines = ["| rows per call | what | ms per row |", "|---:|---|---:|"]
    lines += [f"| {c['rows']} | {c['what']} | {c['ms_per_row']:.2f} |" for c in costs]
    return lines


def header(cfg: CouplingConfig, figures: dict) -> str:
    m = figures["machine"]
    return (f"# Coupling: agreement of draft with the target's sampled token\n\n"
            f"{m['cpu']}, {m['threads']} threads, {figures['dtype']}, load {m['load_average_start']} -> "
            f"{figures['load_average_end']}, git {m['git_commit']}; target vocabulary {figures['vocab']}, "
            f"head vocabulary {figures['draft_vocab']}\n\n"
            + ("\n".join(cost_table(figures["noise_costs"])) + "\n\n" if figures["noise_costs"] else "")
            + "\n".join(tau_table(figures["taus"])) + "\n\n")


def main(argv: list[str] | None = None) -> int:
    return replay_job_main(argv, "jobs.bench coupling", __doc__, parse, measure, summarize, "coupling", header)
