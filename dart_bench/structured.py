"""Structured output side by side: `python -m jobs.bench structured [key=value ...]`.

ShareGPT dev prompts wrapped in an extraction instruction, every row constrained by one JSON
schema (strings, an integer, an enum and an array), decoded by `ar` and the default mode with the
same schema, interleaved batch by batch in alternating order and repeated (as `jobs.bench engine`
does), at each temperature and batch size. Printed per cell: tokens/s and whole-run throughput
against `ar`, tau, accepted tokens by source (the grammar's forced text among them), the share of
rows whose JSON is complete and validates against the schema, and the grammar's own time per round
(cutting trees, drafting forced text, the masks over the tree: the `grammar` stage) against `ar`'s
whole round.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field

from omegaconf import OmegaConf

from dart_bench.common import CellsBenchConfig, load_parts, machine_conditions, run_record, summarize, write_report
from dart_bench.engine import cell_order, print_table
from dart_worker.defaults import DEFAULT_BUDGET, DEFAULT_MODE
from dart_worker.engine_factory import build_engine
from dart_worker.hardware.device import configure_cpu_threads
from dart_worker.sampling.params import SamplingParams
from ngram_native.builders import TreeParams

# Strings and the array are bounded, as a real extraction schema's usually are, so that a record
# can end within max_new_tokens (a base model left unbounded writes a topic until the limit).
DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 60},
        "language": {"type": "string", "maxLength": 20},
        "num_questions": {"type": "integer", "minimum": 0},
        "tone": {"enum": ["neutral", "friendly", "formal", "urgent"]},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 5},
    },
    "required": ["topic", "language", "num_questions", "tone", "keywords"],
}
INSTRUCTION = ("Read the user message below and describe it as one JSON object with the fields topic (a short "
               "phrase), language, num_questions (how many questions it asks), tone (neutral, friendly, formal "
               "or urgent) and keywords (a few words from the message).\n\nMessage:\n{text}\n\nJSON:")


@dataclass
class StructuredBenchConfig(CellsBenchConfig):
    modes: list[str] = field(default_factory=lambda: ["ar", DEFAULT_MODE])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4])
    budget: int = DEFAULT_BUDGET
    sizing: str = "auto"
    max_new_tokens: int = 96
    num_prompts: int = 8
    max_prompt_tokens: int = 384
    schema: dict = field(default_factory=lambda: dict(DEFAULT_SCHEMA))
    sync_timing: bool = True
    output: str | None = None


def extraction_prompts(tokenizer, num_prompts: int, max_prompt_tokens: int) -> list[tuple[str, list[int]]]:
    """The first dev prompts that fit, each wrapped in the extraction instruction: (id, token ids)."""
    from dart_train.corpus import sharegpt_dev_prompts
    from dart_worker.prompt_format import format_user_prompt

    prompts = []
    for p in sharegpt_dev_prompts(num_prompts * 3, max_chars=3 * max_prompt_tokens):
        ids = tokenizer(format_user_prompt(tokenizer, INSTRUCTION.format(text=p.text)))["input_ids"]
        if len(ids) <= max_prompt_tokens:
            prompts.append((p.id, ids))
        if len(prompts) == num_prompts:
            break
    return prompts


def run_cells(cfg, engines, prompts, batch_size: int, temperature: float) -> dict[str, list[dict]]:
    """Every mode on every prompt, `batch_size` prompts per call, modes interleaved per batch in
    alternating order, `cfg.repeats` times; each record also holds the row's text and completeness."""
    records: dict[str, list[dict]] = {m: [] for m in cfg.modes}
    groups = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    for repeat in range(cfg.repeats):
        for g, group in enumerate(groups):
            params = [SamplingParams(temperature=temperature, seed=cfg.seed + n, max_new_tokens=cfg.max_new_tokens,
                                     structured_output={"json": cfg.schema}) for n in group]
            for mode in cell_order(cfg.modes, repeat * len(groups) + g):
                results = engines[mode].generate([prompts[n][1] for n in group], params)
                for n, result in zip(group, results):
                    if result.error:
                        raise RuntimeError(f"{mode} on prompt {prompts[n][0]}: {result.error}")
                    records[mode].append({**run_record(prompts[n][0], repeat, result, g), "text": result.text,
                                          "complete": bool(result.structured_complete)})
    return records


def validity(rows: list[dict], schema: dict) -> float:
    """Share of rows whose text is a whole JSON value that validates against `schema`."""
    import jsonschema

    ok = 0
    for r in rows:
        try:
            jsonschema.validate(json.loads(r["text"]), schema)
            ok += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return ok / len(rows) if rows else 0.0


def grammar_share(summary: dict, mode: str) -> float | None:
    """`mode`'s grammar stage per round over `ar`'s whole round (ms/round summed over stages)."""
    ar, own = summary.get("ar", {}).get("ms_per_round"), summary.get(mode, {}).get("ms_per_round")
    if not ar or not own:
        return None
    return own["grammar"] / sum(ar.values())


def main(argv: list[str] | None = None) -> dict:
    cfg: StructuredBenchConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(StructuredBenchConfig),
                                                                     OmegaConf.from_cli(argv)))
    threads = configure_cpu_threads(cfg.threads)
    parts = load_parts(cfg, cfg.modes)
    tree = TreeParams(budget=cfg.budget, lookup_cache_tokens=cfg.lookup_cache_tokens, job_ngram_tokens=0)
    engines = {mode: build_engine(parts, mode, tree, sizing=cfg.sizing, batches=(1, *cfg.batch_sizes))
               for mode in cfg.modes}
    for engine in engines.values():
        engine.sync_timing = cfg.sync_timing
    prompts = extraction_prompts(parts.tokenizer, cfg.num_prompts, cfg.max_prompt_tokens)
    conditions = machine_conditions(threads)
    print(f"{len(prompts)} ShareGPT dev prompts as extraction requests, one JSON schema, {cfg.max_new_tokens} new "
          f"tokens, {cfg.dtype} on {parts.target.device} ({conditions['cpu']}), modes {cfg.modes}, "
          f"repeats {cfg.repeats}")
    cells = {}
    for temperature in cfg.temperatures:
        for batch_size in cfg.batch_sizes:
            records = run_cells(cfg, engines, prompts, batch_size, temperature)
            summary = summarize(records)
            for mode, rows in records.items():
                summary[mode]["valid"] = validity(rows, cfg.schema)
                summary[mode]["complete"] = statistics.mean(r["complete"] for r in rows)
                summary[mode]["grammar_share_of_ar_round"] = grammar_share(summary, mode)
            label = f"T={temperature:g} B={batch_size}"
            cells[label] = {"summary": summary, "records": records}
            print(f"{label}:")
            print_table(summary)
            for mode in cfg.modes:
                s = summary[mode]
                share = s["grammar_share_of_ar_round"]
                print(f"  {mode}: valid {s['valid']:.2f}, complete {s['complete']:.2f}, grammar "
                      f"{s.get('ms_per_round', {}).get('grammar', 0):.2f} ms/round"
                      + (f" ({100 * share:.1f}% of ar's round)" if share is not None else ""))
    print("\nthroughput against ar with the same schema (whole run):")
    for label, cell in cells.items():
        summary = cell["summary"]
        ar = summary["ar"]["throughput"]
        print(f"  {label}: " + ", ".join(f"{mode} {summary[mode]['throughput'] / ar:.3f}x"
                                         for mode in cfg.modes if mode != "ar" and ar))
    report = {"config": asdict(cfg), "machine": conditions,
              "cells": {label: cell["summary"] for label, cell in cells.items()},
              "records": {label: cell["records"] for label, cell in cells.items()}}
    write_report(cfg.output, report)
    return report
