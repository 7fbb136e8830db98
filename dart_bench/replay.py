"""What the replay jobs share (`python -m jobs.bench tune_tree | job_ngram | context_bound`): their
config, the target's replies to the dev prompts (cached in output_dir) and the command line.

Every tau is measured without verification forwards (`dart_train.replay`): the target's replies
and their taps are computed once; a drafter setting then costs only its own head forwards and
tree builds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dart_bench.common import TargetBenchConfig, load_parts, select_prompts
from dart_worker.sampling.gumbel import SAMPLER
from dart_worker.sampling.params import SamplingParams
from ngram_native.builders import InvalidTreeParams, TreeParams

# The knobs the search may move, and their types (budget is swept, not searched).
KNOBS = {"top_k": int, "beam_width": int, "depth_decay": float, "draft_decay": float, "ngram_weight": float}


@dataclass
class ReplayJobConfig(TargetBenchConfig):
    """What every replay job (`tune_tree`, `job_ngram`, `context_bound`) reads: the target and
    drafting artifacts, the dev prompts, and how the replayed replies are decoded."""

    budgets: list[int] = field(default_factory=lambda: [16, 32, 60])
    num_prompts: int = 48  # dev prompts measured on
    check_prompts: int = 8  # the first dev prompts (the benchmark's): held out
    # How the replayed replies are decoded: greedy at temperature 0; otherwise sampled with `seed`
    # (replay is exact for sampled replies too: dart_train.replay), so tau is measured at that warp.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    output_dir: str = "replay"



class TuneConfigError(ValueError):
    pass


def load_structured_config(schema: type, argv: list[str], error: type[Exception]):
    """`[config.yaml] key=value ...` -> an instance of the dataclass `schema`
    (pipeline.settings.config.load_structured)."""
    from pipeline.settings.config import load_structured

    path, overrides = (argv[0], argv[1:]) if argv and "=" not in argv[0] else (None, argv)
    return load_structured(schema, path, overrides, error)


def reply_sampling(cfg) -> SamplingParams:
    """How a replay job's replies are decoded (cfg.temperature, top_p, top_k; sampled with cfg.seed)."""
    try:
        return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed,
                              max_new_tokens=cfg.max_new_tokens)
    except (TypeError, ValueError) as exc:
        raise TuneConfigError(f"reply sampling: {exc}") from None


def replay_kind(cfg) -> str:
    """How a replay job's replies were decoded, for report titles."""
    params = reply_sampling(cfg)
    if params.is_greedy:
        return "greedy replay"
    warp = f", top_p {params.top_p:g}" if params.top_p < 1 else ""
    warp += f", top_k {params.top_k}" if params.top_k else ""
    return f"replay of replies sampled at T={params.temperature:g}{warp}, seed {params.seed}"



def references(cfg: ReplayJobConfig, parts, prompts: list[list[int]], out: Path) -> list:
    """The references of `prompts`, their replies (decoded as `reply_sampling(cfg)` says) reused from
    replies.json when it matches."""
    from dart_train.replay import target_references

    params = reply_sampling(cfg)
    sampled = [] if params.is_greedy else [params.temperature, params.top_p, params.top_k, params.seed, SAMPLER]
    key = hashlib.sha256(json.dumps([cfg.target, cfg.dtype, str(parts.target.dtype), cfg.max_new_tokens,
                                     prompts, *sampled]).encode()).hexdigest()
    path = out / "replies.json"
    replies = None
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            replies = saved["replies"]
    if replies is None:
        start = time.perf_counter()
        refs = target_references(parts, prompts, cfg.max_new_tokens, params=params)
        kind = "greedy" if params.is_greedy else "sampled"
        print(f"{kind} replies of {len(prompts)} prompts in {time.perf_counter() - start:.0f} s")
        path.write_text(json.dumps({"key": key, "replies": [r.reply for r in refs]}))
        return refs
    return target_references(parts, prompts, cfg.max_new_tokens, replies=replies)


def replay_setup(cfg: ReplayJobConfig, modes: list[str]):
    """A replay job's common start: torch threads, the output directory, the target with what
    `modes` need, the check + measured dev prompts ((id, token ids), in order) and their
    references (replies cached in output_dir). Returns (threads, parts, chosen, refs)."""
    from dart_worker.hardware.device import configure_cpu_threads

    threads = configure_cpu_threads(cfg.threads)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = load_parts(cfg, modes)
    chosen = select_prompts(parts.tokenizer, cfg.check_prompts + cfg.num_prompts, cfg.max_prompt_tokens)
    if len(chosen) < cfg.check_prompts + 1:
        raise TuneConfigError(f"only {len(chosen)} dev prompts fit max_prompt_tokens={cfg.max_prompt_tokens}")
    return threads, parts, chosen, references(cfg, parts, [ids for _, ids in chosen], out)



def replay_job_main(argv: list[str] | None, module: str, doc: str, parse, measure, summarize, name: str,
                    header) -> int:
    """The command line of a replay job (`tune_tree`, `job_ngram`, `context_bound`): parse `[config.yaml]
    key=value ...` (errors: exit 2), `measure(cfg)` -> figures with "results", then write
    <output_dir>/<name>.json and <name>.md (`header(cfg, figures)` + `summarize(figures["results"])`)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    parser.add_argument("args", nargs="*", help="[config.yaml] key=value ...")
    args = parser.parse_args(argv)
    try:
        cfg = parse(list(args.args))
    except TuneConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    figures = measure(cfg)
    table = summarize(figures["results"])
    figures["command"] = f"python -m {module} " + shlex.join(args.args)
    out = Path(cfg.output_dir)
    (out / f"{name}.json").write_text(json.dumps(figures, indent=1))
    (out / f"{name}.md").write_text(header(cfg, figures) + "\n".join(table) + "\n")
    print("\n".join(table))
    print(f"wrote {out / (name + '.md')} and {out / (name + '.json')}")
    return 0


def setting(base: dict[str, Any], **changes) -> TreeParams:
    """TreeParams with the defaults, then `base`, then `changes` (knob values cast to their type)."""
    values = {**base, **changes}
    try:
        return TreeParams(**{k: KNOBS[k](v) if k in KNOBS else v for k, v in values.items()})
    except InvalidTreeParams as exc:
        raise TuneConfigError("; ".join(f"{n}: {m}" for n, m in exc.problems)) from None
