"""Run a job on a local Ray instance, scrape its live metrics from Ray's Prometheus endpoint while it
runs, and plot them: `python -m jobs.metrics_plot [config.yaml] [key=value ...] [--out PNG]`.

    python -m jobs.metrics_plot configs/local.yaml --out docs/metrics/local_run.png

What it does and how: dart_bench/metrics_plot.py.
"""

from __future__ import annotations

from dart_bench.metrics_plot import main

if __name__ == "__main__":
    raise SystemExit(main())
