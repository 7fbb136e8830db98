"""Job-cache benchmark on a templated job: `python -m jobs.bench templated [key=value ...]`.

Builds a templated job by itself - `rows` prompts from one template with different slot values,
the kind of dataset-generation job where row 10,000 looks like rows 1..9,999 - and decodes it with
the same lookup drafter twice in one process: the job cache off (`lookup_cache_tokens=0`; for
`dart_lookup` also its job n-gram, `job_ngram_tokens=0`) and on.
The rows go through in chunks, alternating the two arms chunk by chunk (so drift in machine load
hits both alike); within a chunk, `batch_size` rows decode together with continuous batching, and
the cache-on engine keeps its cache across chunks, as a pipeline worker keeps it across batches.

Printed per arm: rows/s, tokens/s, tau, accepted draft tokens by source (head / context /
job_cache), greedy agreement between the arms, and the cost of the lookup side per sequence per
round - context tree, job-cache query, graft (median and p99, microseconds) - next to the verify
time per round; plus the cost of adding a finished row to the cache. Keys (defaults small enough
for minutes on a 2-core CPU with the default model): target, head, trie, dtype, device, threads,
mode (lookup | dart_lookup | ddtree_lookup), rows, max_new_tokens, batch_size, chunk_rows, budget,
sizing, temperature, cache_tokens, cache_prompts, template, slot_values, seed, output.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

from omegaconf import OmegaConf

from dart_bench.common import load_parts, write_report
from dart_worker.defaults import DEFAULT_DTYPE
from dart_worker.drafters import drafter_names
from dart_worker.engine_factory import build_drafter, build_engine
from dart_worker.hardware.device import configure_cpu_threads
from dart_worker.prompt_format import format_user_prompt
from dart_worker.sampling.params import SamplingParams
from ngram_native.builders import TreeParams
from ngram_native.trees import SOURCE_NAMES

DEFAULT_TEMPLATE = ("Write a product listing for a {0} in the {1} category. Use exactly this format:\n"
                    "Name: <name>\nCategory: {1}\nPrice: <price in dollars>\nDescription: <two sentences>\n"
                    "Shipping: Ships in 2 business days. Free returns within 30 days.")
DEFAULT_SLOTS = [["desk lamp", "office"], ["rain jacket", "outdoor"], ["coffee grinder", "kitchen"],
                 ["yoga mat", "fitness"], ["phone charger", "electronics"], ["wool scarf", "clothing"],
                 ["garden hose", "garden"], ["board game", "toys"], ["water bottle", "outdoor"],
                 ["notebook", "office"], ["frying pan", "kitchen"], ["running shoes", "fitness"]]
ARMS = ("cache_off", "cache_on")


@dataclass
class TemplatedConfig:
    target: str = "default"
    head: str | None = None  # dart_lookup / ddtree_lookup only: None = the shipped default head
    trie: str | None = None  # dart_lookup only: None = the default trie
    dtype: str = DEFAULT_DTYPE
    device: str = "auto"
    threads: int | None = None
    mode: str = "lookup"
    rows: int = 48
    max_new_tokens: int = 48
    batch_size: int = 4  # rows decoding together (continuous batching)
    chunk_rows: int = 8  # rows per generate call; the arms alternate chunk by chunk
    budget: int = 32
    sizing: str = "auto"
    temperature: float = 0.0
    cache_tokens: int = TreeParams.lookup_cache_tokens
    cache_prompts: bool = False
    template: str = DEFAULT_TEMPLATE  # "{0}", "{1}", ... are the slots
    # Slot values: row r uses slot_values[r % len] (a list per row, or one string for "{0}"); a
    # round of them repeats with a row number appended to the last slot, so every row differs.
    slot_values: list = field(default_factory=lambda: [list(s) for s in DEFAULT_SLOTS])
    seed: int = 0
    output: str | None = None  # JSON file for all figures


def templated_prompts(template: str, slot_values: list, rows: int) -> list[str]:
    """`rows` user messages from one template: row r fills it with slot_values[r % n]."""
    if not slot_values:
        raise ValueError("slot_values must not be empty")
    out = []
    for r in range(rows):
        values = slot_values[r % len(slot_values)]
        values = [values] if isinstance(values, str) else list(values)
        if r >= len(slot_values):  # later rounds: distinct rows with the same template
            values[-1] = f"{values[-1]} {r // len(slot_values) + 1}"
        out.append(template.format(*values))
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class LookupProfile:
    """Times the lookup side of a drafter's context indexes (`drafters.lookup.ContextIndexes`) by
    wrapping its steps on the instance, so the drafter's code carries no profiling. `records`: per
    `propose`, {"batch", "context_s", "job_cache_s", "graft_s"} (0 for a step it did not run); per
    finished batch added to the job cache, {"finished", "add_s"}."""

    def __init__(self, context):
        self.records: list[dict] = []
        propose, cache_finished = context.propose, context.cache_finished

        def timed_propose(tokens, max_depths):
            self.records.append({"batch": len(max_depths), "context_s": 0.0, "job_cache_s": 0.0, "graft_s": 0.0})
            return propose(tokens, max_depths)

        def timed_cache_finished(finished):
            start = time.perf_counter()
            cache_finished(finished)
            self.records.append({"finished": len(finished.tokens), "add_s": time.perf_counter() - start})

        context.propose, context.cache_finished = timed_propose, timed_cache_finished
        for step, key in (("context_trees", "context_s"), ("job_cache_trees", "job_cache_s"),
                          ("graft_job_cache", "graft_s")):
            setattr(context, step, self._timed(getattr(context, step), key))

    def _timed(self, step, key: str):
        def timed(*args):
            start = time.perf_counter()
            out = step(*args)
            self.records[-1][key] += time.perf_counter() - start  # the propose that called it
            return out

        return timed


def summarize_arm(results: list, wall: float, profile: list[dict]) -> dict:
    rows = [r.stats.to_row() for r in results if not r.error]
    tokens = sum(r["num_generated_tokens"] for r in rows)
    rounds = sum(r["rounds"] for r in rows)
    accepted = sum(sum(k * c for k, c in enumerate(r["acceptance_histogram"])) for r in rows)
    per_seq = {key: [p[key] / p["batch"] for p in profile if p.get("batch")]
               for key in ("context_s", "job_cache_s", "graft_s")}
    index_graft = [p["job_cache_s"] / p["batch"] + p["graft_s"] / p["batch"] for p in profile if p.get("batch")]
    adds = [p["add_s"] / p["finished"] for p in profile if p.get("finished")]
    verify = [r["verify_s"] / r["rounds"] for r in rows if r["rounds"]]
    return {
        "rows": len(results), "rows_failed": len(results) - len(rows), "tokens": tokens, "wall_s": wall,
        "rows_per_s": len(results) / wall if wall else 0.0, "tokens_per_s": tokens / wall if wall else 0.0,
        "tau": (accepted + rounds) / rounds if rounds else 0.0, "rounds": rounds,
        "accepted_tokens_by_source": {s: sum(r[f"accepted_{s}"] for r in rows) for s in SOURCE_NAMES.values()},
        "us_per_seq_round": {
            **{key.removesuffix("_s"): {"median": 1e6 * _pct(v, 0.5), "p99": 1e6 * _pct(v, 0.99)}
               for key, v in per_seq.items()},
            "index_plus_graft": {"median": 1e6 * _pct(index_graft, 0.5), "p99": 1e6 * _pct(index_graft, 0.99)},
        },
        "verify_ms_per_round": {"median": 1e3 * _pct(verify, 0.5), "p99": 1e3 * _pct(verify, 0.99)},
        "cache_add_us_per_row": {"median": 1e6 * _pct(adds, 0.5), "p99": 1e6 * _pct(adds, 0.99)},
    }


def print_summary(summary: dict[str, dict], agreement: float | None) -> None:
    print(f"{'arm':<10}{'rows/s':>8}{'tok/s':>8}{'tau':>6}  accepted head/context/job_cache"
          "   index+graft us/seq/round (med/p99)   verify ms/round (med/p99)")
    for arm, s in summary.items():
        src = "/".join(str(v) for v in s["accepted_tokens_by_source"].values())
        ig, v = s["us_per_seq_round"]["index_plus_graft"], s["verify_ms_per_round"]
        print(f"{arm:<10}{s['rows_per_s']:>8.3f}{s['tokens_per_s']:>8.1f}{s['tau']:>6.2f}  {src:<32}"
              f"   {ig['median']:>8.1f} / {ig['p99']:<8.1f}                {v['median']:.1f} / {v['p99']:.1f}")
    on = summary.get("cache_on", {})
    if on:
        us = on["us_per_seq_round"]
        print(f"cache_on lookup side per seq per round (us, med/p99): context {us['context']['median']:.1f}/"
              f"{us['context']['p99']:.1f}, job cache {us['job_cache']['median']:.1f}/{us['job_cache']['p99']:.1f}, "
              f"graft {us['graft']['median']:.1f}/{us['graft']['p99']:.1f}; cache add per finished row "
              f"{on['cache_add_us_per_row']['median']:.1f} us")
    if agreement is not None:
        print(f"greedy agreement cache_on vs cache_off: {agreement:.3f} of rows identical")


def main(argv: list[str] | None = None) -> dict:
    cfg: TemplatedConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TemplatedConfig),
                                                               OmegaConf.from_cli(argv)))
    if cfg.mode not in drafter_names() or "lookup" not in cfg.mode:
        raise ValueError(f"mode must be a lookup drafter (lookup, dart_lookup, ddtree_lookup), got {cfg.mode!r}")
    if cfg.rows < 1 or cfg.max_new_tokens < 1 or cfg.batch_size < 1 or cfg.chunk_rows < 1:
        raise ValueError("rows, max_new_tokens, batch_size and chunk_rows must be >= 1")
    if cfg.cache_tokens < 1:
        raise ValueError(f"cache_tokens must be >= 1 (the cache_on arm needs a cache), got {cfg.cache_tokens}")
    configure_cpu_threads(cfg.threads)
    parts = load_parts(cfg, [cfg.mode])
    tokenizer = parts.tokenizer
    messages = templated_prompts(cfg.template, cfg.slot_values, cfg.rows)
    prompts = [tokenizer(format_user_prompt(tokenizer, m))["input_ids"] for m in messages]
    base = TreeParams(budget=cfg.budget, lookup_cache_prompts=cfg.cache_prompts)
    # Off: no job-level state at all (for dart_lookup, its job n-gram is off too).
    off = {"lookup_cache_tokens": 0, "job_ngram_tokens": 0}
    trees = {"cache_off": TreeParams(**{**asdict(base), **off}),
             "cache_on": TreeParams(**{**asdict(base), "lookup_cache_tokens": cfg.cache_tokens})}
    # Each arm's drafter is built here and kept: its context indexes are timed per round.
    drafters = {arm: build_drafter(parts, cfg.mode, tree) for arm, tree in trees.items()}
    engines = {arm: build_engine(parts, cfg.mode, tree, sizing=cfg.sizing, drafter=drafters[arm])
               for arm, tree in trees.items()}
    profiles = {arm: LookupProfile(drafter.context).records for arm, drafter in drafters.items()}
    print(f"templated job: {cfg.rows} rows ({statistics.mean(map(len, prompts)):.0f} prompt tokens on average), "
          f"{cfg.max_new_tokens} new tokens, mode {cfg.mode}, batch {cfg.batch_size}, budget {cfg.budget}, "
          f"sizing {cfg.sizing}, T={cfg.temperature:g}, cache {cfg.cache_tokens} tokens"
          f"{' (prompts too)' if cfg.cache_prompts else ''}, {cfg.dtype} on {parts.target.device}")
    results: dict[str, list] = {arm: [] for arm in ARMS}
    walls = dict.fromkeys(ARMS, 0.0)
    for start in range(0, cfg.rows, cfg.chunk_rows):
        chunk = range(start, min(start + cfg.chunk_rows, cfg.rows))
        params = [SamplingParams(temperature=cfg.temperature, seed=cfg.seed + r, max_new_tokens=cfg.max_new_tokens)
                  for r in chunk]
        for arm in ARMS:
            t0 = time.perf_counter()
            results[arm].extend(engines[arm].generate([prompts[r] for r in chunk], params, max_live=cfg.batch_size))
            walls[arm] += time.perf_counter() - t0
        print(f"  rows {chunk.stop}/{cfg.rows} done")
    summary = {arm: summarize_arm(results[arm], walls[arm], profiles[arm]) for arm in ARMS}
    agreement = None
    if cfg.temperature == 0:
        same = [a.token_ids == b.token_ids for a, b in zip(results["cache_off"], results["cache_on"])]
        agreement = sum(same) / len(same)
    cache = drafters["cache_on"].context.job_cache
    summary["cache_on"]["cache"] = {"documents": cache.num_documents, "tokens": len(cache),
                                    "evicted_documents": cache.evicted_documents, "memory_bytes": cache.memory_bytes}
    print_summary(summary, agreement)
    report = {"config": asdict(cfg), "summary": summary, "greedy_agreement": agreement,
              "rows": {arm: [{"row": i, "token_ids": r.token_ids, **(r.stats.to_row() if r.stats else {})}
                             for i, r in enumerate(results[arm])] for arm in ARMS}}
    write_report(cfg.output, report)
    return report
