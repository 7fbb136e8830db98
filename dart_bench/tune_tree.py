"""Tree settings that draft the most per round: `python -m jobs.bench tune_tree [config.yaml] [key=value ...]`.

DART's beam search has five knobs besides the budget (`decoding.tree`: top_k, beam_width,
depth_decay, draft_decay, ngram_weight); their defaults are the DART reference's, chosen for other
targets, heads and tries. What suits a head depends on how sharp and how calibrated it is, so
this job measures it: tau at each budget on ShareGPT dev prompts (greedy, or sampled at the
`temperature` / `top_p` / `top_k` given), by coordinate search
over a grid (one knob at a time through its values, keeping the best, `passes` times over).

Every tau is measured without verification forwards (`dart_train.replay`: the target's
replies and their taps are computed once; a drafter setting then costs only its own head
forwards and tree builds, milliseconds per round instead of seconds on a CPU), and equals the
engine's `fixed`-sizing tau (tests/test_replay.py). The first `check_prompts` dev prompts (the
benchmark's, `jobs.bench report`) are held out: the search runs on the next `num_prompts`, and the table
reports the default and the best setting on both sets, so overfitting the search set shows.
Drafters are built as a job builds them (`base` may change that): with DART's job n-gram on, which
here learns only from the replies that finish first within the lockstep batch (`jobs.bench job_ngram`
measures it warmed by earlier rows).

    python -m jobs.bench tune_tree mode=dart 'budgets=[16,32,60]' num_prompts=32
    python -m jobs.bench tune_tree head=outputs/my_head/export 'grid={ngram_weight: [0, 0.5, 1]}'

Writes tune.json (every setting measured) and tune.md under `output_dir`; the replies are kept in
replies.json there and reused while target, dtype, prompts and max_new_tokens are unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from dart_bench.common import machine_conditions
from dart_bench.replay import (
    KNOBS,
    ReplayJobConfig,
    TuneConfigError,
    load_structured_config,
    replay_job_main,
    replay_kind,
    replay_setup,
    reply_sampling,
    setting,
)
from ngram_native.builders import TreeParams

# The grid searched when the config names none (a `grid` given replaces it whole).
DEFAULT_GRID = {
    "ngram_weight": [0.0, 0.25, 0.5, 1.0, 2.0],
    "depth_decay": [0.0, 0.35, 0.7, 1.0, 1.5],
    "draft_decay": [0.6, 0.8, 0.9, 1.0, 1.2],
    "beam_width": [8, 20, 40, 80],
    "top_k": [10, 25, 50, 100],
}


@dataclass
class TuneTreeConfig(ReplayJobConfig):
    mode: str = "dart"  # any registered tree drafter (dart, ddtree, dart_lookup, ...)
    base: dict[str, Any] = field(default_factory=dict)  # starting setting (TreeParams fields); {} = defaults
    grid: dict[str, list] = field(default_factory=dict)  # knob -> values; {} = DEFAULT_GRID
    passes: int = 2
    num_prompts: int = 32  # dev prompts searched on (the check prompts are reported only)
    output_dir: str = "tune_tree"


def parse_config(argv: list[str]) -> TuneTreeConfig:
    cfg: TuneTreeConfig = load_structured_config(TuneTreeConfig, argv, TuneConfigError)
    reply_sampling(cfg)
    from dart_worker.drafters import drafter_names, drafter_spec

    if cfg.mode not in drafter_names() or not drafter_spec(cfg.mode).uses_tree:
        raise TuneConfigError(f"mode: {cfg.mode!r} is not a tree drafter")
    cfg.grid = cfg.grid or {k: list(v) for k, v in DEFAULT_GRID.items()}
    for name, values in cfg.grid.items():
        if name not in KNOBS:
            raise TuneConfigError(f"grid.{name}: not a searchable knob; expected some of {sorted(KNOBS)}")
        if not values:
            raise TuneConfigError(f"grid.{name}: no values")
    for name in cfg.base:
        if name == "budget" or name not in {f.name for f in dataclasses.fields(TreeParams)}:
            raise TuneConfigError(f"base.{name}: not a TreeParams field (budget is set by budgets)")
    if not cfg.budgets or min(cfg.budgets) < 1:
        raise TuneConfigError(f"budgets: {cfg.budgets}: expected one or more budgets >= 1")
    if cfg.num_prompts < 1 or cfg.check_prompts < 0 or cfg.passes < 1:
        raise TuneConfigError("num_prompts >= 1, check_prompts >= 0 and passes >= 1 are needed")
    for b in cfg.budgets:  # each raises TuneConfigError naming a bad field
        setting(cfg.base, budget=b)
    for n, vs in cfg.grid.items():
        for v in vs:
            setting(cfg.base, **{n: v})
    return cfg


def knobs_of(params: TreeParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in KNOBS}


class Replayer:
    """Tau of a tree setting on a set of references, memoised per setting."""

    def __init__(self, parts, mode: str, refs, max_new_tokens: int):
        self.parts, self.mode, self.refs, self.max_new_tokens = parts, mode, refs, max_new_tokens
        self.measured: dict[tuple, dict] = {}

    def __call__(self, params: TreeParams) -> dict:
        from dart_train.replay import mean_tau, replay
        from dart_worker.engine_factory import build_drafter

        key = tuple(sorted(dataclasses.asdict(params).items()))
        if key not in self.measured:
            start = time.perf_counter()
            stats = replay(build_drafter(self.parts, self.mode, params), self.refs, self.max_new_tokens,
                           self.parts.target.max_positions)
            self.measured[key] = {"budget": params.budget, **knobs_of(params), "tau": mean_tau(stats),
                                  "mean_tree_size": sum(s.mean_tree_size for s in stats) / len(stats),
                                  "seconds": time.perf_counter() - start}
        return self.measured[key]


def coordinate_search(measure: Replayer, start: TreeParams, grid: dict[str, list], passes: int) -> TreeParams:
    """Move one knob at a time to its best grid value (ties keep the current one); repeat."""
    best = start
    for _ in range(passes):
        before = best
        for name, values in grid.items():
            for value in values:
                candidate = dataclasses.replace(best, **{name: KNOBS[name](value)})
                if measure(candidate)["tau"] > measure(best)["tau"]:
                    best = candidate
        if best == before:
            break
    return best


def tune(cfg: TuneTreeConfig) -> dict[str, Any]:
    threads, parts, chosen, refs = replay_setup(cfg, [cfg.mode])
    search = Replayer(parts, cfg.mode, refs[cfg.check_prompts :], cfg.max_new_tokens)
    check = Replayer(parts, cfg.mode, refs[: cfg.check_prompts], cfg.max_new_tokens) if cfg.check_prompts else None
    rows = []
    for budget in cfg.budgets:
        start = setting(cfg.base, budget=budget)
        best = coordinate_search(search, start, cfg.grid, cfg.passes)
        row = {"budget": budget, "base": knobs_of(start), "best": knobs_of(best),
               "search_tau": {"base": search(start)["tau"], "best": search(best)["tau"]}}
        if check is not None:
            row["check_tau"] = {"base": check(start)["tau"], "best": check(best)["tau"]}
        rows.append(row)
        print(summary_lines([row])[-1], flush=True)
    return {"config": OmegaConf.to_container(OmegaConf.structured(cfg)), "conditions": machine_conditions(threads),
            "dtype": str(parts.target.dtype), "search_prompts": [i for i, _ in chosen[cfg.check_prompts :]],
            "check_prompts": [i for i, _ in chosen[: cfg.check_prompts]], "results": rows,
            "measured": list(search.measured.values())}


def summary_lines(rows: list[dict]) -> list[str]:
    lines = ["| budget | tau default (search / check) | tau best (search / check) | best setting |",
             "|---:|---|---|---|"]
    for r in rows:
        check = r.get("check_tau", {})
        changed = {k: v for k, v in r["best"].items() if r["base"][k] != v}
        lines.append(f"| {r['budget']} | {r['search_tau']['base']:.3f} / {check.get('base', float('nan')):.3f} | "
                     f"{r['search_tau']['best']:.3f} / {check.get('best', float('nan')):.3f} | "
                     f"{json.dumps(changed) if changed else '(the default)'} |")
    return lines


def _header(cfg: TuneTreeConfig, figures: dict) -> str:
    cond = figures["conditions"]
    return (f"# Tree settings searched ({cfg.mode}, {replay_kind(cfg)})\n\n    {figures['command']}\n\n"
            f"{cond.get('cpu', '?')}, {figures['dtype']}; {len(figures['search_prompts'])} search prompts, "
            f"{len(figures['check_prompts'])} held-out check prompts, {cfg.max_new_tokens} new tokens.\n\n")


def main(argv: list[str] | None = None) -> int:
    return replay_job_main(argv, "jobs.bench tune_tree", __doc__, parse_config, tune, summary_lines, "tune", _header)
