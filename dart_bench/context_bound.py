"""The most any context drafter could add: `python -m jobs.bench context_bound [config.yaml] [key=value ...]`.

`dart_lookup` grafts spans copied from the request's own text (the context index) and from the
job's earlier rows (the job cache) into DART's tree. How much tau that can add depends on the
workload, not only on the index: a reply that never repeats its prompt or earlier replies leaves
nothing to copy. This job measures the ceiling on a set of prompts, by replay (dart_train.replay,
greedy or sampled replies alike), next to `dart` and `dart_lookup` on the same replies:

- `dart + oracle context`: each round, DART's tree plus the reply's true next tokens, cut to the
  longest run that follows some earlier occurrence of the current suffix (`min_match` tokens) in
  the request's prompt + reply so far - what a perfect context drafter could copy, chosen with
  hindsight among all matches, outside the node budget;
- `dart + oracle context + job`: the same with every earlier prompt's text and reply in front
  of the context too (a job cache that holds every earlier row, prompts included).

No context drafter that copies spans after a suffix match can accept more per round than these
(the graft is the reply itself wherever it exists in the context), so their tau over `dart`'s
bounds what the hybrid can reach on these prompts. The first `check_prompts` dev prompts are
skipped (the benchmark's own), as in the other replay jobs.

    python -m jobs.bench context_bound temperature=1.0 'budgets=[16,60]'

Writes context_bound.json and context_bound.md under `output_dir`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from dart_bench.replay import (
    ReplayJobConfig,
    TuneConfigError,
    load_structured_config,
    replay_job_main,
    replay_kind,
    reply_sampling,
    setting,
)
from dart_worker.drafters.base import Composite, Drafter
from ngram_native.trees import SOURCE_CONTEXT, DraftTree, merge_trees


@dataclass
class ContextBoundConfig(ReplayJobConfig):
    budgets: list[int] = field(default_factory=lambda: [16, 60])
    min_match: int = 1  # suffix tokens an oracle span must follow (1: the weakest condition, the highest bound)
    temperature: float = 1.0  # of the replayed replies (0: greedy; > 0: sampled with `seed`)
    output_dir: str = "bench_context_bound"


def parse_config(argv: list[str]) -> ContextBoundConfig:
    cfg = load_structured_config(ContextBoundConfig, argv, TuneConfigError)
    reply_sampling(cfg)
    if cfg.min_match < 1 or cfg.num_prompts < 1 or not cfg.budgets:
        raise TuneConfigError("min_match >= 1, num_prompts >= 1 and one or more budgets are needed")
    for budget in cfg.budgets:
        setting({}, budget=budget)  # TuneConfigError naming a bad field
    return cfg


def longest_copy(context: np.ndarray, suffix: Sequence[int], continuation: Sequence[int]) -> int:
    """The longest k such that some occurrence of `suffix` in `context` is followed there by
    continuation[:k] (0 if none): the most a span copied after a suffix match can get right."""
    m, n = len(suffix), len(context)
    if not len(continuation) or m == 0 or n <= m:
        return 0
    hits = context[m:] == continuation[0]
    for j, token in enumerate(suffix):
        hits &= context[j : n - m + j] == token
    best = 0
    for start in np.flatnonzero(hits) + m:
        k = 1
        while k < len(continuation) and start + k < n and context[start + k] == continuation[k]:
            k += 1
        best = max(best, k)
    return best


class OracleContext(Composite):
    """`inner`'s trees plus each round's oracle span (see the module doc), for replaying `refs`.

    It knows each sequence's reply, so it is a measuring device, never a drafter to decode with.
    Sequences are the references in order (replay's lockstep batch joins them all at once),
    followed through `retire`.
    """

    def __init__(self, inner: Drafter, refs: Sequence, min_match: int, job: bool):
        self.inner, self.refs, self.min_match, self.job = inner, list(refs), min_match, job
        self.parts = (inner,)
        self.has_model = inner.has_model
        self.live: list[int] = []
        # Every reference's prompt + reply in run order; reference r's earlier rows are the first
        # starts[r] tokens (for job=True).
        self.run_tokens = np.asarray([t for ref in self.refs for t in ref.tokens], dtype=np.int64)
        self.starts = np.cumsum([0] + [len(ref.tokens) for ref in self.refs])

    def observe(self, block) -> None:
        if block.joined:
            self.live = list(range(len(block.rows)))
        super().observe(block)

    def retire(self, finished, keep) -> None:
        self.live = [self.live[i] for i in keep]
        super().retire(finished, keep)

    def propose(self, tokens, max_depths) -> list[DraftTree]:
        trees = self.inner.propose(tokens, max_depths)
        out = []
        for b, tree in enumerate(trees):
            ref, seq = self.refs[self.live[b]], list(tokens[b])
            continuation = ref.tokens[len(seq) : len(seq) + max_depths[b]]
            context = np.asarray(seq, dtype=np.int64)
            if self.job:
                context = np.concatenate([self.run_tokens[: self.starts[self.live[b]]], context])
            k = longest_copy(context, seq[-self.min_match :], continuation) if len(seq) >= self.min_match else 0
            if k:
                span = DraftTree(np.asarray(continuation[:k], np.int32), np.arange(-1, k - 1, dtype=np.int32),
                                 np.arange(1, k + 1, dtype=np.int32), np.zeros(k),
                                 np.full(k, SOURCE_CONTEXT, np.uint8))
                tree = merge_trees(tree, span, tree.size + k)
            out.append(tree)
        return out


CELLS = ("dart", "dart_lookup", "dart + oracle context", "dart + oracle context + job")


def measure(cfg: ContextBoundConfig) -> dict[str, Any]:
    from dart_bench.common import machine_conditions
    from dart_bench.replay import replay_setup
    from dart_train.replay import mean_tau, replay
    from dart_worker.engine_factory import build_drafter

    threads, parts, chosen, refs = replay_setup(cfg, ["dart_lookup"])
    refs = refs[cfg.check_prompts :]
    rows = []
    for budget in cfg.budgets:
        params = setting({}, budget=budget, job_ngram_tokens=0)  # every prompt once: no job history
        for cell in CELLS:
            drafter = build_drafter(parts, "dart_lookup" if cell == "dart_lookup" else "dart", params)
            if "oracle" in cell:
                drafter = OracleContext(drafter, refs, cfg.min_match, job=cell.endswith("job"))
            stats = replay(drafter, refs, cfg.max_new_tokens, parts.target.max_positions)
            rows.append({"budget": budget, "cell": cell, "tau": mean_tau(stats),
                         "per_prompt_tau": [s.tau for s in stats],
                         "accepted_by_source": {k: int(sum(s.accepted_by_source.get(k, 0) for s in stats))
                                                for k in ("head", "context", "job_cache")}})
            print(summary_lines(rows)[-1], flush=True)
    return {"config": OmegaConf.to_container(OmegaConf.structured(cfg)), "conditions": machine_conditions(threads),
            "dtype": str(parts.target.dtype), "prompts": [i for i, _ in chosen[cfg.check_prompts :]],
            "results": rows}


def summary_lines(rows: list[dict]) -> list[str]:
    from dart_train.replay import paired_difference

    lines = ["| budget | cell | tau | x dart | vs dart |", "|---:|---|---:|---:|---:|"]
    dart = {r["budget"]: r for r in rows if r["cell"] == "dart"}
    for r in rows:
        base = dart[r["budget"]]
        mean, stderr = paired_difference(r["per_prompt_tau"], base["per_prompt_tau"])
        diff = "" if r is base else f"{mean:+.3f}" + (f" +- {stderr:.3f}" if stderr is not None else "")
        lines.append(f"| {r['budget']} | {r['cell']} | {r['tau']:.3f} | {r['tau'] / base['tau']:.3f} | {diff} |")
    return lines


def _header(cfg: ContextBoundConfig, figures: dict) -> str:
    return (f"# What a context drafter could add to dart at most ({replay_kind(cfg)})\n\n"
            f"    {figures['command']}\n\n"
            f"{figures['conditions'].get('cpu', '?')}, {figures['dtype']}; {len(figures['prompts'])} dev prompts, "
            f"{cfg.max_new_tokens} new tokens, oracle spans after a {cfg.min_match}-token suffix match; "
            "'vs dart': mean per-prompt difference +- standard error.\n\n")


def main(argv: list[str] | None = None) -> int:
    return replay_job_main(argv, "jobs.bench context_bound", __doc__, parse_config, measure, summary_lines,
                           "context_bound", _header)
