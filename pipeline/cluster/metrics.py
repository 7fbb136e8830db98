"""Live job metrics through `ray.util.metrics`, so Ray's Prometheus endpoint and dashboard carry them.

The worker calls `record_batch(outputs, ...)` once per finished batch with the output rows it is
about to return. Everything here comes from those rows (the per-row statistics of
`dart_worker.stats.STAT_COLUMNS`), so the metrics and the Parquet output never disagree - but for
the job-state gauges, which report what the worker's drafter has learnt from finished rows
(`DecodingEngine.job_state()`), a worker property rather than a row's:

    dart_rows_done                  counter    every finished row (generated or error row)
    dart_rows_failed                counter    error rows, label error_kind
    dart_generated_tokens           counter    tokens generated
    dart_accepted_tokens            counter    accepted draft tokens, label source (one per
                                               `accepted_<source>` statistics column)
    dart_stage_seconds              counter    engine seconds per stage (label stage), a batch's
                                               shared time counted once per batch
    dart_tokens_per_s               gauge      this worker's throughput over its last batch
    dart_batch_occupancy            gauge      mean live sequences per round / max_live, last batch
    dart_job_state_tokens           gauge      tokens the worker's job-level drafting state holds
                                               (label state: job_cache, job_ngram)
    dart_job_state_bytes            gauge      its memory (label state)
    dart_tau                        histogram  per row: tokens committed per verification round
    dart_tree_size                  histogram  per row: mean draft nodes verified per round (the
                                               size the cost model chose, when sizing=auto)
    dart_stage_seconds_per_round    histogram  per row and stage (label stage): seconds per round
    dart_batch_seconds              histogram  wall time of one worker batch

Every series carries the labels run_id, worker and mode. Ray's exporter adds the prefix `ray_`
and, for counters, the suffix `_total` (ray_dart_rows_done_total); docs/metrics.md lists units,
the PromQL behind the Grafana dashboard (k8s/grafana/dart-dashboard.json) and how to scrape them.

Metric objects are created on the first call, once per process. Outside a Ray worker (a unit test,
a benchmark calling the worker class directly) `record_batch` does nothing, and a metrics failure
is logged once and never fails a batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from dart_worker.sampling.params import temperature_band
from dart_worker.stats import STAGES, STAT_COLUMNS
from pipeline.data.summary import error_kind

log = logging.getLogger(__name__)

PREFIX = "dart_"
LABELS = ("run_id", "worker", "mode")
# Draft-token sources, derived from the statistics columns: a new `accepted_<source>` column
# becomes a new value of the `source` label without touching this module.
SOURCES = tuple(c.removeprefix("accepted_") for c in STAT_COLUMNS if c.startswith("accepted_"))
# Stages that happen once per verification round (prefill happens once per row).
ROUND_STAGES = tuple(s for s in STAGES if s != "prefill" and f"{s}_s" in STAT_COLUMNS)
TAU_BOUNDARIES = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0]
TREE_SIZE_BOUNDARIES = [0.5, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128]
ROUND_SECONDS_BOUNDARIES = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
BATCH_SECONDS_BOUNDARIES = [0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250]


# name -> (kind, description with unit, extra labels, histogram boundaries): the one list of the
# metrics; docs/metrics.md and k8s/grafana/dart-dashboard.json are checked against it.
METRICS: dict[str, tuple[str, str, tuple[str, ...], list[float] | None]] = {
    "rows_done": ("counter", "Rows finished: generated or error rows (rows)", (), None),
    "rows_failed": ("counter", "Error rows, by error kind (rows)", ("error_kind",), None),
    "generated_tokens": ("counter", "Tokens generated (tokens)", (), None),
    "accepted_tokens": ("counter", "Accepted draft tokens by proposing source (tokens)", ("source",), None),
    "stage_seconds": ("counter", "Engine time by stage, once per batch (seconds)", ("stage",), None),
    "tokens_per_s": ("gauge", "Tokens generated per second over the worker's last batch (tokens/s)", (), None),
    "batch_occupancy": ("gauge", "Mean sequences verified together per round / max_live, last batch (0..1)",
                        (), None),
    "job_state_tokens": ("gauge", "Tokens held by the worker's job-level drafting state (tokens)", ("state",), None),
    "job_state_bytes": ("gauge", "Memory of the worker's job-level drafting state (bytes)", ("state",), None),
    "tau": ("histogram", "Tokens committed per verification round, per row, by temperature band (tokens)",
            ("temperature",), TAU_BOUNDARIES),
    "tree_size": ("histogram", "Mean draft nodes verified per round, per row (nodes)", (), TREE_SIZE_BOUNDARIES),
    "stage_seconds_per_round": ("histogram", "Seconds per verification round by stage, per row (seconds)",
                                ("stage",), ROUND_SECONDS_BOUNDARIES),
    "batch_seconds": ("histogram", "Wall time of one worker batch (seconds)", (), BATCH_SECONDS_BOUNDARIES),
}


def exported_names() -> set[str]:
    """Every series name Ray's Prometheus endpoint shows for these metrics."""
    names = set()
    for name, (kind, *_rest) in METRICS.items():
        full = "ray_" + PREFIX + name
        names |= ({full + "_total"} if kind == "counter" else {full} if kind == "gauge"
                  else {full + "_bucket", full + "_count", full + "_sum"})
    return names


class _Metrics:
    """The metric objects of one process (Ray registers each name once per process)."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        made = {}
        for name, (kind, description, extra, boundaries) in METRICS.items():
            tags = (*LABELS, *extra)
            if kind == "counter":
                made[name] = Counter(PREFIX + name, description=description, tag_keys=tags)
            elif kind == "gauge":
                made[name] = Gauge(PREFIX + name, description=description, tag_keys=tags)
            else:
                made[name] = Histogram(PREFIX + name, description=description, boundaries=boundaries, tag_keys=tags)
        self.rows_done, self.rows_failed = made["rows_done"], made["rows_failed"]
        self.generated_tokens, self.accepted_tokens = made["generated_tokens"], made["accepted_tokens"]
        self.stage_seconds, self.tokens_per_s = made["stage_seconds"], made["tokens_per_s"]
        self.batch_occupancy, self.tau, self.tree_size = made["batch_occupancy"], made["tau"], made["tree_size"]
        self.stage_per_round, self.batch_seconds = made["stage_seconds_per_round"], made["batch_seconds"]
        self.job_state_tokens, self.job_state_bytes = made["job_state_tokens"], made["job_state_bytes"]


_metrics: _Metrics | None = None
_disabled = False


def _get() -> _Metrics | None:
    """The process's metrics, created on first use; None outside Ray or after a failure."""
    global _metrics, _disabled
    if _metrics is not None or _disabled:
        return _metrics
    try:
        import ray

        if not ray.is_initialized():
            return None  # not in a Ray worker: nothing to export to (checked again next batch)
        _metrics = _Metrics()
    except Exception:  # metrics must never stop generation
        log.warning("live metrics disabled in this process", exc_info=True)
        _disabled = True
    return _metrics


def record_batch(outputs: Iterable[dict[str, Any]], *, run_id: str, worker: str, mode: str,
                 batch_size: int, wall_s: float, job_state: dict[str, tuple[int, int]] | None = None) -> None:
    """Record one finished worker batch: `outputs` are its output rows (one per input row);
    `job_state`: the drafter's job-level state after it, {kind: (tokens, bytes)}."""
    metrics = _get()
    if metrics is None:
        return
    try:
        labels = {"run_id": str(run_id), "worker": str(worker), "mode": str(mode)}
        _record(metrics, list(outputs), labels, batch_size, wall_s)
        for state, (tokens, nbytes) in (job_state or {}).items():
            metrics.job_state_tokens.set(tokens, tags={**labels, "state": state})
            metrics.job_state_bytes.set(nbytes, tags={**labels, "state": state})
    except Exception:
        log.warning("could not record batch metrics", exc_info=True)


def _record(m: _Metrics, rows: list[dict[str, Any]], labels: dict[str, str], batch_size: int,
            wall_s: float) -> None:
    failed: dict[str, int] = {}
    tokens = 0
    accepted = dict.fromkeys(SOURCES, 0)
    stage_seconds = dict.fromkeys((*ROUND_STAGES, "prefill"), 0.0)
    live, live_rows = 0.0, 0
    for row in rows:
        if row.get("error"):
            kind = error_kind(row["error"])
            failed[kind] = failed.get(kind, 0) + 1
            continue
        tokens += int(row.get("num_generated_tokens") or 0)
        for source in SOURCES:
            accepted[source] += int(row.get(f"accepted_{source}") or 0)
        for stage in stage_seconds:  # a batch's stage time is charged to every row it served
            stage_seconds[stage] = max(stage_seconds[stage], float(row.get(f"{stage}_s") or 0.0))
        rounds = int(row.get("rounds") or 0)
        if rounds:
            m.tau.observe(float(row["tau"]), tags={**labels, "temperature": temperature_band(row.get("temperature"))})
            m.tree_size.observe(float(row.get("mean_tree_size") or 0.0), tags=labels)
            for stage in ROUND_STAGES:
                m.stage_per_round.observe(float(row.get(f"{stage}_s") or 0.0) / rounds, tags={**labels, "stage": stage})
            if row.get("mean_batch_live") is not None:
                live += float(row["mean_batch_live"])
                live_rows += 1

    if rows:
        m.rows_done.inc(len(rows), tags=labels)
    for kind, count in failed.items():
        m.rows_failed.inc(count, tags={**labels, "error_kind": kind})
    if tokens:
        m.generated_tokens.inc(tokens, tags=labels)
    for source, count in accepted.items():
        if count:
            m.accepted_tokens.inc(count, tags={**labels, "source": source})
    for stage, seconds in stage_seconds.items():
        if seconds > 0:
            m.stage_seconds.inc(seconds, tags={**labels, "stage": stage})
    if wall_s > 0:
        m.tokens_per_s.set(tokens / wall_s, tags=labels)
        m.batch_seconds.observe(wall_s, tags=labels)
    if live_rows and batch_size > 0:
        m.batch_occupancy.set(live / live_rows / batch_size, tags=labels)
