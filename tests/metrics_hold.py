"""A Ray `worker_process_setup_hook` for tests/test_metrics.py: a generation batch returns only once
Ray's metrics endpoint shows the job-state gauge it just set.

Gauges are the live state of a worker process: Ray stops exporting them when the process ends, and
a job's actor pool ends with the job. A tiny job can now finish within one export interval of its
last batch (its read and write tasks no longer import torch), so the test scraped no gauge at all
(`held == []`). Holding each batch until its own value is visible makes the test independent of
how fast the job is; it changes nothing the gauges or counters say.
"""

from __future__ import annotations

import os
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

PORT_ENV = "DART_TEST_METRICS_PORT"
HOLD_LIMIT_S = 60.0


def _gauge(port: str, worker: str, state: str) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (sample.name == "ray_dart_job_state_tokens" and sample.labels.get("worker") == worker
                    and sample.labels.get("state") == state):
                return sample.value
    return None


def hold_batches_until_exported() -> None:
    from pipeline.worker import GenerationWorker

    original = GenerationWorker.__call__

    def call(self, batch):
        table = original(self, batch)
        port = os.environ[PORT_ENV]
        held = {state: tokens for state, (tokens, _) in (self.engine.job_state() or {}).items()}
        deadline = time.monotonic() + HOLD_LIMIT_S
        while held and time.monotonic() < deadline:
            if all(_gauge(port, self.worker_name, state) == tokens for state, tokens in held.items()):
                break
            time.sleep(0.2)
        return table

    GenerationWorker.__call__ = call
