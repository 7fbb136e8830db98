"""Live metrics (pipeline/cluster/metrics.py): a small job on a local Ray cluster with the Prometheus
export port set; the scraped series must agree with the rows the job wrote."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from dart_worker.stats import STAT_COLUMNS
from pipeline.cluster import metrics
from pipeline.data.outputs import read_output
from pipeline.data.summary import error_kind
from pipeline.run import run_pipeline
from pipeline.settings.config import load_config
from tests import metrics_hold
from tests.tiny_models import TINY_VOCAB, save_tiny_artifacts

REPO = Path(__file__).resolve().parents[1]


def test_sources_and_stages_come_from_the_stats_columns():
    assert set(metrics.SOURCES) == {c.removeprefix("accepted_") for c in STAT_COLUMNS if c.startswith("accepted_")}
    assert {"head", "context"} <= set(metrics.SOURCES)
    assert set(metrics.ROUND_STAGES) == {"draft", "tree", "grammar", "verify", "commit"}


def test_record_batch_outside_ray_is_a_no_op():
    ray.shutdown()
    metrics.record_batch([{"error": None, "num_generated_tokens": 3, "rounds": 2, "tau": 1.5}],
                         run_id="r", worker="w", mode="ar", batch_size=1, wall_s=0.1)
    assert metrics._metrics is None


class GaugeWatcher:
    """Scrapes the endpoint in a thread while a `with` block runs; `seen` holds each scrape that
    had any of `names` (only those names kept), in order."""

    def __init__(self, port: int, names: tuple[str, ...], every_s: float = 0.25):
        self.port, self.names, self.every_s = port, names, every_s
        self.seen: list[dict[str, list]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                found = scrape(self.port)
            except OSError:  # the agent is not serving yet
                continue
            kept = {name: found[name] for name in self.names if name in found}
            if kept:
                self.seen.append(kept)

    def __enter__(self) -> GaugeWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, list]:
    """name -> [(labels, value)] for every dart_ sample on Ray's metrics endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("ray_dart_"):
                found[sample.name].append((sample.labels, sample.value))
    return found


def total(samples: dict[str, list], name: str, **labels) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


@pytest.mark.integration
def test_metrics_reach_the_prometheus_endpoint(tmp_path):
    artifacts = save_tiny_artifacts(tmp_path / "artifacts")
    rng = np.random.default_rng(1)
    lines = [json.dumps({"id": f"r{k}", "prompt": " ".join(f"w{int(t)}" for t in rng.integers(4, TINY_VOCAB, 6))})
             for k in range(7)]
    lines += [json.dumps({"id": "empty", "prompt": ""}), '{"id": "broken", "prompt": ']
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    cfg = {
        "input": {"urls": [str(tmp_path / "in.jsonl")]},
        "model": {"target": artifacts["target"], "draft_head": artifacts["head"], "trie": artifacts["trie"],
                  "dtype": "fp32", "device": "cpu"},
        "decoding": {"mode": "dart", "max_new_tokens": 10, "tree": {"budget": 8}},
        "resources": {"num_workers": 1, "num_cpus_per_worker": 0.5, "batch_size": 3},
        "output": {"url": str(tmp_path / "out"), "rows_per_file": 4},
        "run": {"run_id": "metrics-test", "progress_interval_s": 5},
    }
    (tmp_path / "job.yaml").write_text(json.dumps(cfg))

    port = free_port()
    ray.shutdown()
    # Gauges are the live state of a worker process: Ray stops exporting them once the process
    # is gone (the job's actor pool ends with the job), so they are scraped while the job runs.
    ray.init(num_cpus=2, include_dashboard=False, _metrics_export_port=port,
             _system_config={"metrics_report_interval_ms": 500},
             runtime_env={"worker_process_setup_hook": "tests.metrics_hold.hold_batches_until_exported",
                          "env_vars": {metrics_hold.PORT_ENV: str(port), "PYTHONPATH": str(REPO)}})
    gauges = GaugeWatcher(port, ("ray_dart_job_state_tokens", "ray_dart_job_state_bytes",
                                 "ray_dart_tokens_per_s", "ray_dart_batch_occupancy"))
    try:
        with gauges:
            run_pipeline(load_config(tmp_path / "job.yaml"))
        table = read_output(str(tmp_path / "out")).to_pylist()
        assert len(table) == 9
        ok = [r for r in table if not r["error"]]
        failed = defaultdict(int)
        for r in table:
            if r["error"]:
                failed[error_kind(r["error"])] += 1

        # Ray's metrics agent exports every few seconds: poll until the counters are complete.
        deadline, samples = time.time() + 90, {}
        while time.time() < deadline:
            samples = scrape(port)
            if total(samples, "ray_dart_rows_done_total") >= 9 and "ray_dart_tau_count" in samples:
                break
            time.sleep(0.5)  # the report interval (metrics_report_interval_ms)
    finally:
        ray.shutdown()

    run = {"run_id": "metrics-test", "mode": "dart"}
    assert total(samples, "ray_dart_rows_done_total", **run) == 9
    for kind, count in failed.items():
        assert total(samples, "ray_dart_rows_failed_total", error_kind=kind, **run) == count
    assert total(samples, "ray_dart_rows_failed_total") == 9 - len(ok)
    assert total(samples, "ray_dart_generated_tokens_total", **run) == sum(r["num_generated_tokens"] for r in ok)
    for source in metrics.SOURCES:
        assert total(samples, "ray_dart_accepted_tokens_total", source=source, **run) == \
            sum(r[f"accepted_{source}"] for r in ok)
    with_rounds = [r for r in ok if r["rounds"]]
    assert total(samples, "ray_dart_tau_count", **run) == len(with_rounds)
    # Ray exports histogram sums from bucket midpoints, so the buckets are what is exact.
    for lab, value in samples["ray_dart_tau_bucket"]:
        assert value == sum(r["tau"] <= float(lab["le"]) for r in with_rounds), lab["le"]
    assert total(samples, "ray_dart_tree_size_count", **run) == len(with_rounds)
    for stage in ("verify", "draft", "tree"):
        assert total(samples, "ray_dart_stage_seconds_per_round_count", stage=stage, **run) == len(with_rounds)
        assert total(samples, "ray_dart_stage_seconds_total", stage=stage, **run) > 0
    # the worker's job n-gram (one worker) holds every generated token of the job's rows
    # the worker's job n-gram (one worker) holds the generated tokens of the rows it finished:
    # seen growing while the job ran, never past the job's total
    held = [total(seen, "ray_dart_job_state_tokens", state="job_ngram", **run) for seen in gauges.seen]
    held = [v for v in held if v]
    assert held and held == sorted(held) and held[-1] <= sum(r["num_generated_tokens"] for r in ok), held
    assert any(total(seen, "ray_dart_job_state_bytes", state="job_ngram", **run) > 0 for seen in gauges.seen)
    workers = {lab["worker"] for lab, _ in samples["ray_dart_rows_done_total"]}
    assert workers == {r["worker"] for r in table if r["worker"]}
    speeds = [v for seen in gauges.seen for _, v in seen.get("ray_dart_tokens_per_s", [])]
    assert speeds and all(v >= 0 for v in speeds)
    occupancy = [v for seen in gauges.seen for _, v in seen.get("ray_dart_batch_occupancy", [])]
    assert occupancy and all(0 < v <= 1 for v in occupancy)
    assert total(samples, "ray_dart_batch_seconds_count", **run) >= 3  # 9 rows in batches of 3


def test_docs_list_every_metric():
    text = (REPO / "docs" / "metrics.md").read_text()
    for name, (kind, *_rest) in metrics.METRICS.items():
        exported = f"ray_dart_{name}" + ("_total" if kind == "counter" else "")
        assert f"`{exported}`" in text, exported
