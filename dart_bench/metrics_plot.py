"""Run a job on a local Ray instance, scrape its live metrics from Ray's Prometheus endpoint while it
runs, and plot them: `python -m jobs.metrics_plot [config.yaml] [key=value ...] [--out PNG]`.

    python -m jobs.metrics_plot configs/local.yaml --out docs/metrics/local_run.png

The job is the ordinary `pipeline.run_pipeline`; the script only starts Ray with
`_metrics_export_port` first, polls http://127.0.0.1:<port>/metrics every `--interval` seconds and
keeps the ray_dart_* samples (also written as JSON next to the PNG). The output goes to a temporary
directory unless output.url is overridden. docs/metrics.md explains the metrics.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import socket
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

SCRAPE_TIMEOUT_S = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """Sums of the ray_dart_* samples, keyed by name plus the labels that matter for the plot."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S).read().decode()
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("ray_dart_"):
                continue
            key = s.name.removeprefix("ray_dart_")
            for label in ("source", "stage", "le", "error_kind"):
                if label in s.labels:
                    key += f"|{label}={s.labels[label]}"
            out[key] += s.value
    return dict(out)


def run_and_scrape(config: str, overrides: list[str], interval: float) -> tuple[list[dict[str, Any]], dict]:
    import ray

    from pipeline.run import run_pipeline
    from pipeline.settings.config import load_config

    cfg = load_config(config, overrides)
    port = free_port()
    ray.init(_metrics_export_port=port, include_dashboard=False, logging_level=logging.WARNING)
    result: dict[str, Any] = {}

    def job() -> None:
        try:
            result["summary"] = run_pipeline(cfg)
        except BaseException as exc:  # reported by the main thread
            result["error"] = exc

    thread = threading.Thread(target=job, daemon=True)
    started = time.time()
    thread.start()
    series = []
    try:
        tail_until = None
        while True:
            with contextlib.suppress(OSError):  # the agent may not answer during start-up
                series.append({"t": time.time() - started, **scrape(port)})
            if not thread.is_alive():
                # Ray's agent exports every few seconds: keep scraping until the totals settle.
                rows = result.get("summary", {}).get("this_run", {}).get("rows")
                tail_until = tail_until or time.time() + 60
                settled = bool(series) and (rows is None or series[-1].get("rows_done_total", 0) >= rows)
                if settled or time.time() > tail_until:
                    break
            time.sleep(interval)
    finally:
        thread.join()
        ray.shutdown()
    if "error" in result:
        raise result["error"]
    return series, result["summary"]


def quantile_from_buckets(sample: dict[str, float], name: str, q: float) -> float | None:
    """The q-quantile of a scraped histogram: the upper bound of the bucket where it falls."""
    buckets = sorted((float(k.split("le=")[1]), v) for k, v in sample.items() if k.startswith(f"{name}_bucket|"))
    if not buckets or buckets[-1][1] == 0:
        return None
    target = q * buckets[-1][1]
    return next(le for le, count in buckets if count >= target)


def plot(series: list[dict[str, Any]], this_run: dict, mode: str, out: Path, window_s: float = 20.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in series]

    def col(key: str) -> list[float]:
        return [s.get(key, 0.0) for s in series]

    def rate(key: str) -> list[float]:
        """Per-second increase over the last `window_s` (like PromQL rate): Ray exports in steps."""
        values, out_ = col(key), []
        for i in range(len(t)):
            j = next(k for k in range(i + 1) if t[i] - t[k] <= window_s)
            out_.append((values[i] - values[j]) / (t[i] - t[j]) if t[i] > t[j] else 0.0)
        return out_

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    ax = axes[0][0]
    ax.plot(t, col("rows_done_total"), label="rows done")
    failed = [sum(v for k, v in s.items() if k.startswith("rows_failed_total")) for s in series]
    ax.plot(t, failed, label="rows failed")
    ax.set_title("rows (ray_dart_rows_done_total, _failed_total)")
    ax.legend()
    ax = axes[0][1]
    ax.plot(t, col("generated_tokens_total"), label="generated tokens", color="C2")
    ax.set_title("generated tokens (counter)")
    twin = ax.twinx()
    twin.plot(t, rate("generated_tokens_total"), color="C3", alpha=0.6, label=f"tokens/s (rate over {window_s:g} s)")
    twin.plot(t, col("tokens_per_s"), color="C4", ls="--", label="tokens/s gauge (last batch)")
    twin.legend(loc="lower right", fontsize=8)
    ax = axes[0][2]
    sources = sorted({k.split("=", 1)[1] for s in series for k in s if k.startswith("accepted_tokens_total|")})
    for source in sources:
        ax.plot(t, col(f"accepted_tokens_total|source={source}"), label=source)
    ax.set_title("accepted draft tokens by source")
    ax.legend()
    ax = axes[1][0]
    last = series[-1]
    buckets = sorted(((float(k.split("le=")[1]), v) for k, v in last.items() if k.startswith("tau_bucket|")),
                     key=lambda b: b[0])
    edges = [b[0] for b in buckets if b[0] != float("inf")]
    counts = [buckets[0][1]] + [buckets[i][1] - buckets[i - 1][1] for i in range(1, len(buckets))]
    labels = [f"<={e:g}" for e in edges] + [">" + f"{edges[-1]:g}"] if edges else []
    ax.bar(range(len(counts)), counts)
    ax.set_xticks(range(len(counts)), labels, rotation=45, fontsize=8)
    ax.set_title("tau per row (histogram, end of run)")
    ax = axes[1][1]
    for stage in ("prefill", "draft", "tree", "verify", "commit"):
        ax.plot(t, col(f"stage_seconds_total|stage={stage}"), label=stage)
    ax.set_title("engine seconds by stage (counter)")
    ax.legend()
    ax = axes[1][2]
    ax.plot(t, col("batch_occupancy"), label="batch occupancy (gauge, last batch)")
    ax.set_ylim(0, 1.05)
    ax.set_title("batch occupancy; median chosen tree size")
    ax.legend(loc="lower left", fontsize=8)
    ax2 = ax.twinx()
    ax2.plot(t, [quantile_from_buckets(s, "tree_size", 0.5) for s in series], color="C1",
             label="tree size p50 (nodes/round)")
    ax2.legend(loc="lower right", fontsize=8)
    for row in axes:
        for a in row:
            a.set_xlabel("seconds since start")
    axes[1][0].set_xlabel("tokens committed per round")
    this = this_run
    fig.suptitle(f"Live metrics scraped from Ray's Prometheus endpoint: {this['rows']} rows, "
                 f"{this['generated_tokens']} tokens, {this['tokens_per_s']:.1f} tok/s, "
                 f"mean tau {this['tau'].get('mean') or 0:.2f} (mode {mode})")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.metrics_plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="configs/local.yaml")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--out", default="docs/metrics/local_run.png")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes")
    parser.add_argument("--replot", metavar="JSON", help="plot the scrapes saved by an earlier run; run nothing")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        plot(saved["series"], saved["this_run"], saved.get("mode", "?"), out)
        print(f"plot {out}")
        return 0
    overrides = list(args.overrides)
    if not any(o.startswith("output.url=") for o in overrides):
        overrides.append(f"output.url={tempfile.mkdtemp(prefix='metrics-plot-')}")
    if not any(o.startswith("run.run_id=") for o in overrides):
        overrides.append("run.run_id=metrics-plot")
    series, summary = run_and_scrape(args.config, overrides, args.interval)
    mode = summary["config"]["decoding"]["mode"]
    plot(series, summary["this_run"], mode, out)
    out.with_suffix(".json").write_text(json.dumps({"series": series, "this_run": summary["this_run"], "mode": mode},
                                                   indent=1, default=str))
    print(f"{len(series)} scrapes; plot {out}, data {out.with_suffix('.json')}")
    return 0
