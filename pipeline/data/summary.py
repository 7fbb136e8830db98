"""Job progress and the job summary, computed from the small per-row stats the writers return.

The driver never sees generated text: each write task hands back only the numeric columns of
the rows it wrote, which is enough for the periodic progress line and for the summary
(rows ok/failed, tokens, throughput, the tau distribution, per-mode figures, error kinds).
"""

from __future__ import annotations

import time
from array import array
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.settings.sampling_settings import GROUPED_SETTINGS, SETTING_NAMES

SUMMARY_NAME = "_job_summary.json"  # written next to the parts
# The sampling settings a row decoded with (output columns of the same names): the summary groups
# rows by them to report tau per setting, since speculation pays differently per temperature.
SETTING_COLUMNS = GROUPED_SETTINGS
# Distinct settings tallied one by one; rows of further ones (per-row settings drawn from a range)
# are tallied together as "other", so the driver's memory stays bounded.
MAX_SETTING_GROUPS = 64
STAT_COLUMNS = ("row_key", "id", "error", "mode", "num_generated_tokens", "tau", "rounds", "wall_s",
                "mean_tree_size", "mean_batch_live", "model_rounds", "finish_reason", "accepted_head",
                "accepted_context", "accepted_job_cache", "accepted_grammar", "sample_index", "n", *SETTING_COLUMNS)

# Per-row provenance columns.
ACCEPTED_SOURCES = ("accepted_head", "accepted_context", "accepted_job_cache", "accepted_grammar")


@dataclass
class RunTally:
    """Running totals over the rows written by this run.

    Constant work per row and 8 bytes per decoded row (its tau, for the percentiles of the summary):
    a nightly job tallies 10^7 rows, and the progress line, printed every few seconds, must not
    rescan them (it did: statistics.mean over every tau so far, each time).
    """

    started: float = field(default_factory=time.time)
    rows: int = 0
    failed: int = 0
    tokens: int = 0
    taus: array = field(default_factory=lambda: array("d"))
    tau_sum: float = 0.0
    errors: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)
    sample_tokens: array = field(default_factory=lambda: array("q"))  # tokens of each decoded sample
    per_setting: dict[tuple | str, dict[str, float]] = field(default_factory=dict)
    per_mode: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(
        lambda: {"rows": 0, "tokens": 0, "tau_sum": 0.0, "tau_rows": 0, "tree_sum": 0.0, "live_sum": 0.0,
                 "rounds": 0, "model_rounds": 0, **dict.fromkeys(ACCEPTED_SOURCES, 0)}))
    _last_print: float = 0.0

    def add(self, batch: pa.Table) -> None:
        for row in batch.select([c for c in STAT_COLUMNS if c in batch.column_names]).to_pylist():
            self.rows += 1
            self.finish_reasons[row.get("finish_reason") or "error"] += 1
            if row.get("error"):
                self.failed += 1
                self.errors[error_kind(row["error"])] += 1
                continue
            tokens = int(row.get("num_generated_tokens") or 0)
            self.tokens += tokens
            self.sample_tokens.append(tokens)
            setting = self._setting(row)
            setting["rows"] += 1
            setting["tokens"] += tokens
            if row.get("rounds"):
                setting["tau_sum"] += float(row["tau"])
                setting["tau_rows"] += 1
            mode = self.per_mode[row.get("mode") or "?"]
            mode["rows"] += 1
            mode["tokens"] += tokens
            if row.get("rounds"):
                self.taus.append(float(row["tau"]))
                self.tau_sum += float(row["tau"])
                mode["tau_sum"] += float(row["tau"])
                mode["tau_rows"] += 1
                mode["tree_sum"] += float(row.get("mean_tree_size") or 0.0)
                mode["live_sum"] += float(row.get("mean_batch_live") or 0.0)
                mode["rounds"] += int(row["rounds"])
                mode["model_rounds"] += int(row.get("model_rounds") or 0)
                for source in ACCEPTED_SOURCES:
                    mode[source] += int(row.get(source) or 0)

    def _setting(self, row: dict) -> dict[str, float]:
        """The running totals of the row's sampling settings (or of "other", past MAX_SETTING_GROUPS)."""
        key = tuple(row.get(c) for c in SETTING_COLUMNS)
        if key not in self.per_setting and len(self.per_setting) >= MAX_SETTING_GROUPS:
            key = "other"
        if key not in self.per_setting:
            self.per_setting[key] = {"rows": 0, "tokens": 0, "tau_sum": 0.0, "tau_rows": 0}
        return self.per_setting[key]

    def settings_report(self) -> list[dict[str, Any]]:
        """Per distinct sampling setting (most rows first): the settings, rows, tokens and mean tau."""
        report = []
        for key, s in sorted(self.per_setting.items(), key=lambda kv: -kv[1]["rows"]):
            settings = {"other": True} if key == "other" else dict(zip(SETTING_COLUMNS, key))
            report.append({"settings": settings, "rows": s["rows"], "tokens": s["tokens"],
                           "mean_tau": s["tau_sum"] / s["tau_rows"] if s["tau_rows"] else None})
        return report

    @property
    def elapsed(self) -> float:
        return max(time.time() - self.started, 1e-9)

    def progress_line(self) -> str:
        tau = self.tau_sum / len(self.taus) if self.taus else 0.0
        return (f"[progress] {self.rows} rows ({self.failed} failed), {self.tokens} tokens, "
                f"{self.tokens / self.elapsed:.1f} tok/s, {self.rows / self.elapsed:.2f} rows/s, mean tau {tau:.2f}")

    def maybe_print(self, interval_s: float) -> None:
        now = time.time()
        if now - self._last_print >= interval_s:
            self._last_print = now
            print(self.progress_line(), flush=True)


def error_kind(message: str) -> str:
    """Group error messages by their stable prefix (before any row-specific detail); a row with several
    problems ("missing id; empty prompt") counts under its first."""
    return message.split(";")[0].split(":")[0].split("(")[0].strip()[:80]


TAU_EDGES = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


def tau_distribution(taus: Any) -> dict[str, Any]:
    """Count, mean, p10/p50/p90 (the element at rank int(q * n) of the sorted taus), min, max and a
    histogram over TAU_EDGES (labels "<e" and ">=8.0", empty bins left out), with numpy."""
    ordered = np.sort(np.asarray(taus, dtype=np.float64))
    n = len(ordered)
    if not n:
        return {"count": 0}

    def pct(q: float) -> float:
        return float(ordered[min(n - 1, int(q * n))])

    bins = np.bincount(np.searchsorted(np.asarray(TAU_EDGES), ordered, side="right"), minlength=len(TAU_EDGES) + 1)
    labels = [f"<{e}" for e in TAU_EDGES] + [f">={TAU_EDGES[-1]}"]
    return {"count": n, "mean": float(ordered.mean()), "p10": pct(0.1), "p50": pct(0.5), "p90": pct(0.9),
            "min": float(ordered[0]), "max": float(ordered[-1]),
            "histogram": {label: int(c) for label, c in zip(labels, bins) if c}}


def count_distribution(values: Any) -> dict[str, Any]:
    """Count, mean, p10/p50/p90 (as `tau_distribution` ranks them), min and max of integer counts."""
    ordered = np.sort(np.asarray(values, dtype=np.int64))
    n = len(ordered)
    if not n:
        return {"count": 0}
    return {"count": n, "mean": float(ordered.mean()), **{f"p{round(q * 100)}": int(ordered[min(n - 1, int(q * n))])
                                                         for q in (0.1, 0.5, 0.9)},
            "min": int(ordered[0]), "max": int(ordered[-1])}


def sampling_in_force(config: dict) -> dict[str, Any]:
    """The config's sampling settings (decoding.*): what every row without settings of its own used."""
    decoding = config.get("decoding", {})
    return {name: decoding.get(name) for name in SETTING_NAMES if name in decoding}


def output_totals(output_url: str) -> dict[str, Any]:
    """Figures over every row under the output (this run and any earlier attempt it resumed),
    computed in Arrow from the three columns they need: a Python object per row on the driver
    was 40 MB per 100k rows at the end of every job."""
    from pipeline.data.outputs import read_output  # pulls in Ray; this module stays light

    table = read_output(output_url, ["row_key", "error", "num_generated_tokens"])
    if table.num_rows == 0:
        return {"rows": 0}
    failed = int(pc.sum(pc.fill_null(pc.not_equal(table.column("error"), ""), False)).as_py() or 0)
    return {"rows": table.num_rows, "distinct_row_keys": pc.count_distinct(table.column("row_key")).as_py(),
            "rows_ok": table.num_rows - failed, "rows_failed": failed,
            "generated_tokens": int(pc.sum(pc.fill_null(table.column("num_generated_tokens"), 0)).as_py() or 0)}


def build_summary(tally: RunTally, *, run_id: str, config: dict, resumed_rows: int, duplicates: dict,
                  output_totals: dict[str, Any], output_plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job summary. `output_plan` (pipeline.startup.output_modes.OutputPlan.as_dict) says where the run
    wrote and what the output held when it started (the run it resumed, wrote beside or replaced)."""
    wall = tally.elapsed
    return {
        "run_id": run_id,
        "wall_s": wall,
        "this_run": {
            "rows": tally.rows,
            "rows_ok": tally.rows - tally.failed,
            "rows_failed": tally.failed,
            "rows_skipped_as_done": resumed_rows,
            "generated_tokens": tally.tokens,
            "rows_per_s": tally.rows / wall,
            "tokens_per_s": tally.tokens / wall,
            "tau": tau_distribution(tally.taus),
            # every decoded row is one sample (decoding.n of them per prompt); error rows excluded
            "tokens_per_sample": count_distribution(tally.sample_tokens),
            "sampling": {"config": sampling_in_force(config), "per_setting": tally.settings_report()},
            "finish_reasons": dict(tally.finish_reasons),
            "errors_by_kind": dict(tally.errors.most_common(20)),
            "per_mode": {
                mode: {"rows": m["rows"], "tokens": m["tokens"],
                       "mean_tau": m["tau_sum"] / m["tau_rows"] if m["tau_rows"] else None,
                       "mean_tree_size": m["tree_sum"] / m["tau_rows"] if m["tau_rows"] else None,
                       # sequences decoding together (batch occupancy), mean over rows
                       "mean_batch_live": m["live_sum"] / m["tau_rows"] if m["tau_rows"] else None,
                       # share of rounds in which the draft head ran (sizing auto pauses it)
                       "model_round_share": m["model_rounds"] / m["rounds"] if m["rounds"] else None,
                       "accepted_tokens_by_source": {s.removeprefix("accepted_"): m[s] for s in ACCEPTED_SOURCES}}
                for mode, m in tally.per_mode.items()
            },
        },
        "duplicate_ids": {"count": len(duplicates), "examples": sorted(map(str, duplicates))[:10]},
        "output": output_totals,
        "output_plan": output_plan,
        "config": config,
    }
