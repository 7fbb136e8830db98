"""Measured verify-forward costs per live batch size, cached on disk per machine and model shape.

The tree sizer (`dart_worker.sizing`) needs what a verify forward of R rows costs at the batch
the worker actually runs: rows of 16 sequences do not cost what rows of one sequence do (attention
reads one cache per sequence; on a GPU a batch-1 curve is flat and would make 64 x 60 rows look
free). So each live batch size gets its own measured curve. Measuring them costs seconds at every
start-up on a CPU, for a result that depends only on the machine, the model's shape and the kernel
choices, not on the job: curves are cached under `$DART_CACHE_DIR/calibration/`, keyed by
everything they depend on (`calibration_key`), and a worker on a machine that has run the same
target before starts without measuring. The sizer still refines every curve online.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
import transformers

from dart_worker.artifacts.cache_dir import cache_dir, write_text_atomically
from dart_worker.drafters.registry import SIZING_MODES
from dart_worker.hardware.contention import ContentionMeter
from dart_worker.hardware.device import cpu_model_name
from dart_worker.hardware.kernels import describe
from dart_worker.sizing.latency import LatencyModel
from dart_worker.sizing.sizer import TreeSizer

log = logging.getLogger(__name__)

CALIBRATION_FORMAT = 2  # 2: only curves measured on a quiet machine are stored
MAX_ROWS = 128  # rows of the largest calibrated forward at batch 1 (and per batch: see `grid`)
CONTEXT = 128  # committed tokens of every calibrated sequence
DISABLE_ENV = "DART_NO_CALIBRATION_CACHE"  # set to 1: measure every time, read and write nothing

_SHAPE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "sliding_window", "layer_types",
                 "tie_word_embeddings", "final_logit_softcapping")


def grid(batch: int, max_rows: int = MAX_ROWS) -> list[int]:
    """Total rows of the calibrated forwards at `batch`: batch x (1, 2, 4, ...) rows per sequence,
    up to max(max_rows, 2 x batch) rows in all (larger trees at a large batch never pay on a CPU,
    and on a GPU the curve is extended linearly along its last segment)."""
    top = max(max_rows, 2 * batch)
    per_sequence = [1]
    while batch * per_sequence[-1] * 2 <= top:
        per_sequence.append(per_sequence[-1] * 2)
    return [batch * n for n in per_sequence]


def _machine() -> str:
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        gpus = f"; gpus {', '.join(names)}"
    else:
        gpus = ""
    return f"{cpu_model_name()} x{torch.get_num_threads()} threads{gpus}"


def calibration_key(target, defer_logits: bool) -> dict:
    """Everything a measured curve depends on: machine, device, dtype, model shape, kernels, versions."""
    config = target.config
    shape = {name: getattr(config, name, None) for name in _SHAPE_FIELDS}
    return {"format": CALIBRATION_FORMAT, "machine": _machine(), "device": str(target.device),
            "dtype": str(target.dtype).removeprefix("torch."), "shape": shape,
            "attention": getattr(target.model.config, "_attn_implementation", None),
            # Not `shapes`: the grid's forwards (CONTEXT slots, 1, 2, 4 ... rows per sequence) have
            # bucket shapes already, so both strategies measure the same forwards.
            "kernels": {k: v for k, v in describe(target.device, target.dtype).items() if k != "shapes"}
                       | {"logits": "deferred" if defer_logits else "batched"},
            "torch": torch.__version__, "transformers": transformers.__version__,
            "context": CONTEXT, "max_rows": MAX_ROWS}


def _path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_dir("calibration") / f"{digest}.json"


def measure(target, *, defer_logits: bool, batch: int, passes: int = 3) -> LatencyModel:
    """Time real verify forwards of `batch` sequences (a CONTEXT-token prefix each, then chain
    trees) over `grid(batch)` total rows: the fastest of `passes` passes over the grid after a
    warm-up (passes, not back-to-back repeats, so a burst of load elsewhere lands on one sample of
    many sizes; the fastest, because load only ever adds time and a size measured too dear would
    never be tried, so never corrected online)."""
    rows_grid = grid(batch)
    device = target.device
    generator = torch.Generator().manual_seed(batch)
    state = target.new_state(batch)
    target.prefill(state, [torch.randint(0, target.vocab_size, (CONTEXT,), generator=generator).tolist()
                           for _ in range(batch)])

    def seconds_of(rows: int) -> float:
        n = rows // batch
        tokens = torch.randint(0, target.vocab_size, (batch, n), generator=generator).to(device)
        depth = torch.arange(n, device=device)[None].expand(batch, -1)
        ancestor = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None].expand(batch, -1, -1)
        start = _now(device)
        out = target.verify(state, tokens, depth, ancestor, defer_logits=defer_logits)
        if defer_logits:
            target.logits_at(out.hidden[:, :1])
        elapsed = _now(device) - start
        target.commit(state, CONTEXT, [[] for _ in range(batch)])  # drop the block again
        return elapsed

    seconds_of(rows_grid[-1])  # warm-up: first calls pay one-time costs
    samples = np.array([[seconds_of(rows) for rows in rows_grid] for _ in range(passes)])
    return LatencyModel(rows_grid, samples.min(axis=0).tolist())


def latency_curves(target, defer_logits: bool, batches: Iterable[int]) -> dict[int, LatencyModel]:
    """Measured curves for every batch size in `batches` (copies: each sizer refines its own).

    Kept per target adapter (the benchmarks build many engines over one target) and on disk per
    `calibration_key`; only batch sizes found in neither are measured.
    """
    wanted = sorted({int(b) for b in batches} | {1})
    memo = target.__dict__.setdefault("_latency_curves", {}).setdefault(defer_logits, {})
    missing = [b for b in wanted if b not in memo]
    if missing:
        use_disk = os.environ.get(DISABLE_ENV, "") not in ("1", "true", "yes")
        key = calibration_key(target, defer_logits)
        path = _path(key)
        stored = _load(path, key) if use_disk else {}
        measured = {}
        for batch in missing:
            if batch in stored:
                memo[batch] = stored[batch]
                continue
            with ContentionMeter() as meter:
                memo[batch] = measure(target, defer_logits=defer_logits, batch=batch)
            log.info("calibrated verify forwards at batch %d in %.1f s: %s", batch, meter.wall_seconds,
                     memo[batch].describe())
            if meter.quiet:
                measured[batch] = memo[batch]
            elif use_disk:
                log.warning("not caching the calibration at batch %d: measured under load (%s); "
                            "the next start measures again", batch, meter.describe())
        if measured and use_disk:
            _save(path, key, _load(path, key) | measured)
    return {b: copy.deepcopy(memo[b]) for b in wanted}


def deferral_pays(target) -> bool:
    """`target.deferred_logits_pay()` (the `logits` strategy's measurement on a CPU), measured once
    per machine and model shape and then read from the cache beside the curves.

    The decision keys the curves (`calibration_key`'s `logits`), and its two sides are often close
    (on a CPU where `logits_at` runs MKL's faster orientation, a tree's rows cost about as much as
    a walk's few single ones; docs/benchmarks.md), so a worker that measured it afresh at every
    start could flip under a burst of load elsewhere, miss its own curves and spend its start-up
    calibrating again. Stored, every start on the machine decides alike."""
    if target._deferral_pays is None:
        target._deferral_pays = bool(_measured_once(target, "deferred_logits_pay", target.deferred_logits_pay))
    return target._deferral_pays


def _measured_once(target, name: str, measure_now):
    """The value `measure_now()` gave on this machine for this model shape (the `name`d measurement
    under `calibration_key`, the `logits` choice aside), from the cache; measured and stored when
    absent. A measurement taken under load is used but not stored."""
    use_disk = os.environ.get(DISABLE_ENV, "") not in ("1", "true", "yes")
    key = calibration_key(target, defer_logits=False)
    key["kernels"] = {k: v for k, v in key["kernels"].items() if k != "logits"}
    key["decision"] = name
    path = _path(key)
    if use_disk:
        try:
            data = json.loads(path.read_text())
            if data.get("key") == json.loads(json.dumps(key, default=str)):
                return data["value"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    with ContentionMeter() as meter:
        value = measure_now()
    if use_disk and not meter.quiet:
        log.warning("not caching the %s measurement: measured under load (%s)", name, meter.describe())
    elif use_disk:
        try:
            write_text_atomically(path, json.dumps({"key": key, "value": value}, indent=1, default=str))
        except OSError as err:
            log.warning("could not cache the %s measurement at %s: %s", name, path, err)
    return value


def _load(path: Path, key: dict) -> dict[int, LatencyModel]:
    """The curves stored for `key` (none if absent, unreadable or stored for another key)."""
    try:
        data = json.loads(path.read_text())
        if data.get("key") != json.loads(json.dumps(key, default=str)):
            return {}
        return {int(b): LatencyModel(c["rows"], c["seconds"]) for b, c in data["curves"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _save(path: Path, key: dict, curves: dict[int, LatencyModel]) -> None:
    data = {"key": key, "curves": {str(b): {"rows": c.rows.astype(int).tolist(), "seconds": c.seconds.tolist()}
                                   for b, c in sorted(curves.items())}}
    try:
        write_text_atomically(path, json.dumps(data, indent=1, default=str))
    except OSError as err:  # a read-only cache costs a measurement next time, nothing else
        log.warning("could not cache the calibration at %s: %s", path, err)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def make_sizer(target, sizing: str, budget: int, defer_logits: bool, batches=(1,)) -> TreeSizer | None:
    """The engine's sizer for `decoding.sizing` ("auto": measured; "fixed": None, trees as built),
    with a verify cost curve for each live batch size in `batches` (measured once per machine and
    model shape, then read from the cache). An engine that defers the vocabulary projection
    (`defer_logits`) does so only on greedy rounds; its sampled rounds project every row, so
    those forwards get curves of their own."""
    if sizing not in SIZING_MODES:
        raise ValueError(f"sizing must be one of {SIZING_MODES}, got {sizing!r}")
    if sizing == "fixed" or budget == 0:
        return None
    curves = latency_curves(target, defer_logits, batches)
    full = latency_curves(target, False, batches) if defer_logits else None
    return TreeSizer(curves[1], max_budget=budget, _latency_by_batch=curves, _full_logits_latency_by_batch=full)
