"""`python -m pipeline.run config.yaml --dry-run`: everything the real run checks, then a plan; no generation.

The dry run validates the config, resolves and verifies every artifact with the code the real
run uses (`pipeline.startup.preflight.resolve_artifacts`: the target and its fingerprint, the draft head
against the target, the trie's header and tokenizer fingerprint), then lists the input files with
a row estimate, the output location and resume state, and the worker plan. It starts no Ray
instance and writes nothing under the output. Like the real run it builds the first-run caches
(the converted default target, the default trie) when they are missing, so a dry run also makes
the first real run start fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import AutoConfig

from dart_worker.hardware.device import DeviceUnavailable, resolve_dtype, resolve_worker_device
from dart_worker.hardware.kernels import shapes_for
from dart_worker.target.kv_budget import kv_budget
from pipeline.cluster.device_check import planned_device
from pipeline.data.inputs import InputError, jsonl_codec
from pipeline.data.outputs import existing_row_keys
from pipeline.data.storage import filesystem_for, redact
from pipeline.settings.config import PipelineConfig
from pipeline.startup.output_modes import plan_output
from pipeline.startup.preflight import StartupError, cpu_budget_problem, local_cpu_count, resolve_artifacts

EXACT_COUNT_BYTES = 64 << 20  # JSONL files up to this size are counted line by line
SAMPLE_BYTES = 1 << 20  # larger ones: rows estimated from the mean line length of the first MiB


def estimate_rows(url: str, fmt: str) -> tuple[int | None, bool]:
    """(rows, exact) for one input file: Parquet from its footer, JSONL by counting non-blank lines
    (or extrapolating from the first MiB of a large file; a large compressed file: unknown)."""
    fs, path = filesystem_for(url)
    if fmt == "parquet":
        with fs.open(path, "rb") as f:
            return pq.ParquetFile(f).metadata.num_rows, True
    codec = jsonl_codec(url)
    size = fs.size(path)
    with fs.open(path, "rb") as raw:
        f = pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), codec) if codec else raw
        if size <= EXACT_COUNT_BYTES:
            rows, tail = 0, b""
            while chunk := f.read(SAMPLE_BYTES):
                lines = (tail + chunk).split(b"\n")
                tail = lines.pop()
                rows += sum(1 for line in lines if line.strip())
            return rows + (1 if tail.strip() else 0), True
        if codec:
            return None, False
        sample = f.read(SAMPLE_BYTES)
    lines = sample.split(b"\n")[:-1] or [sample]
    return max(1, round(size / (len(sample) / len(lines)))), False


def kv_cache_plan(cfg: PipelineConfig, location: str) -> dict[str, Any]:
    """The worst-case KV cache of one worker (`dart_worker.target.kv_budget`) for the configured target,
    dtype and max_live, read from the target's config alone (no weights)."""
    r, d = cfg.resources, cfg.decoding
    path = Path(location)
    try:
        if path.suffix == ".gguf":
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            config = AutoConfig.from_pretrained(location)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        return {"error": f"cannot read the target's config: {exc}"}
    on_gpu = r.num_gpus_per_worker > 0
    dtype = (torch.bfloat16 if on_gpu else resolve_dtype("auto", "cpu")) if cfg.model.dtype == "auto" \
        else resolve_dtype(cfg.model.dtype, "cpu")
    device = torch.device("cuda" if on_gpu else "cpu")
    budget = kv_budget(config, dtype, max_live=r.live_rows, max_prompt_tokens=cfg.input.max_prompt_chars,
                       max_new_tokens=d.max_new_tokens, tree_rows=d.tree.budget,
                       bucketed=shapes_for(device) == "bucketed")
    typical = min(budget.context_tokens, 2048 + d.max_new_tokens)
    return {"dtype": str(dtype).removeprefix("torch."), "bytes_per_token": budget.bytes_per_token,
            "max_live": budget.max_live, "shapes": "bucketed" if budget.bucketed else "exact",
            "context_tokens": budget.context_tokens, "bound_bytes": budget.bound_bytes,
            "typical_tokens": typical, "typical_bytes": budget.at(typical)}


def dry_run(cfg: PipelineConfig, run_id: str) -> dict[str, Any]:
    """The plan of a run of `cfg`, after every start-up check; raises StartupError like the real run."""
    resolved = resolve_artifacts(cfg, run_id, create_output=False)
    inputs = []
    for url in resolved["input_files"]:
        try:
            rows, exact = estimate_rows(url, cfg.input.format)
        except (OSError, ValueError, InputError, pa.ArrowException) as exc:
            raise StartupError(f"input: cannot read {redact(url)}: {exc}") from None
        inputs.append({"url": redact(url), "rows": rows, "exact": exact})
    known = [i["rows"] for i in inputs if i["rows"] is not None]
    plan = plan_output(cfg, run_id)  # the real run's check: rows there and no output.if_exists stop it here
    output: dict[str, Any] = {"url": redact(cfg.output.url), "exists": resolved["output_exists"],
                              "resume": plan.mode == "resume", "plan": redact(plan.describe())}
    if plan.resumes:
        output["rows_done"] = len(existing_row_keys(cfg.output.url))
    r, m, d = cfg.resources, cfg.model, cfg.decoding
    from pipeline.startup.ray_connection import ray_target

    cluster = ray_target(cfg.run.ray_address).address  # None: a private local Ray
    external = cluster is not None
    if not external:
        problem = cpu_budget_problem(cfg, local_cpu_count())
        if problem:
            raise StartupError(problem)
    if not external and r.num_gpus_per_worker > 0:  # a local run's workers are on this machine: check here
        try:
            resolve_worker_device(m.device, ["0"])
        except DeviceUnavailable as exc:
            raise StartupError(f"model.device: {exc}") from None
    workers = (f"{r.min_workers}..{r.max_workers} (autoscaling)" if r.min_workers is not None
               else str(r.num_workers))
    return {
        "run_id": run_id,
        "artifacts": {
            "target": {"spec": m.target, "location": resolved["target_location"],
                       "fingerprint": resolved["target_fingerprint"]},
            "draft_head": ({"location": resolved["head_dir"], "fingerprint": resolved["head_fingerprint"]}
                           if "head_dir" in resolved else None),
            "trie": ({"url": redact(resolved["trie_url"]), "fingerprint": resolved["trie_fingerprint"]}
                     if "trie_url" in resolved else None),
            "warm_from": ({"url": redact(d.warm_from), "rows": len(resolved["warm_documents"]),
                           "tokens": sum(map(len, resolved["warm_documents"]))}
                          if "warm_documents" in resolved else None),
        },
        "inputs": {"files": inputs, "rows": sum(known) if known else None,
                   "exact": all(i["exact"] for i in inputs), "format": cfg.input.format},
        "output": output,
        "kv_cache": kv_cache_plan(cfg, resolved["target_location"]),
        "workers": {"workers": workers, "cpus_per_worker": r.num_cpus_per_worker,
                    "torch_threads": r.torch_threads or max(1, int(r.num_cpus_per_worker)),
                    "gpus_per_worker": r.num_gpus_per_worker, "batch_size": r.batch_size,
                    "max_live": r.live_rows, "mode": d.mode,
                    "sizing": d.sizing, "tree_budget": d.tree.budget, "max_new_tokens": d.max_new_tokens,
                    "temperature": d.temperature, "device": planned_device(cfg), "dtype": m.dtype,
                    "cluster": cluster if external else f"local Ray, {local_cpu_count()} CPUs"},
    }


def format_report(plan: dict[str, Any]) -> str:
    """The plan as the lines `--dry-run` prints."""
    a, i, o, w = plan["artifacts"], plan["inputs"], plan["output"], plan["workers"]
    lines = [f"dry run {plan['run_id']}: config valid, every artifact checked; nothing generated",
             f"target      {a['target']['spec']} -> {a['target']['location']}",
             f"            fingerprint {a['target']['fingerprint']}"]
    if a["draft_head"]:
        lines += [f"draft head  {a['draft_head']['location']}",
                  f"            fingerprint {a['draft_head']['fingerprint']} (fits the target)"]
    else:
        lines.append(f"draft head  not used by mode {w['mode']}")
    if a["trie"]:
        lines += [f"trie        {a['trie']['url']}",
                  f"            fingerprint {a['trie']['fingerprint']} (tokenizer matches)"]
    else:
        lines.append(f"trie        not used by mode {w['mode']}")
    if a.get("warm_from"):
        lines.append(f"warm from   {a['warm_from']['url']}: {a['warm_from']['rows']} rows, "
                     f"{a['warm_from']['tokens']} tokens (same target)")
    total = "unknown" if i["rows"] is None else f"{'' if i['exact'] else '~'}{i['rows']}"
    lines.append(f"inputs      {len(i['files'])} {i['format']} file(s), {total} rows")
    for f in i["files"][:20]:
        rows = "? rows" if f["rows"] is None else f"{'' if f['exact'] else '~'}{f['rows']} rows"
        lines.append(f"            {f['url']}  ({rows})")
    if len(i["files"]) > 20:
        lines.append(f"            ... and {len(i['files']) - 20} more")
    state = "exists" if o["exists"] else "will be created"
    if o["resume"]:
        resume = (f"resume: {o.get('rows_done', 0)} rows already written will be skipped" if o["exists"]
                  else "resume: nothing written yet")
    else:
        resume = o.get("plan", "fresh output")
    lines.append(f"output      {o['url']} ({state}; {resume})")
    if o["resume"] and o.get("plan", "").startswith("holds"):
        lines.append(f"            {o['plan']}")
    kv = plan["kv_cache"]
    if "error" in kv:
        lines.append(f"kv cache    unknown: {kv['error']}")
    else:
        lines.append(f"kv cache    {kv['bytes_per_token'] / 2**10:.1f} KiB per token ({kv['dtype']}); "
                     f"per worker at most "
                     f"{kv['bound_bytes'] / 2**30:.2f} GiB ({kv['max_live']} sequences x {kv['context_tokens']} "
                     f"tokens: the target's context or input.max_prompt_chars + max_new_tokens), "
                     f"{kv['typical_bytes'] / 2**30:.2f} GiB at {kv['typical_tokens']} tokens each")
    gpus = f", {w['gpus_per_worker']:g} GPU" if w["gpus_per_worker"] else ""
    lines.append(f"workers     {w['workers']} x ({w['cpus_per_worker']:g} CPU{gpus}, {w['torch_threads']} torch "
                 f"threads), batch {w['batch_size']} ({w['max_live']} decoding at a time), mode {w['mode']} "
                 f"(sizing {w['sizing']}, tree budget "
                 f"{w['tree_budget']}), device {w['device']}, dtype {w['dtype']}, on {w['cluster']}")
    return "\n".join(lines)
