"""The write task of a job's dataflow: one atomic Parquet part per block, its stats handed back.

Ray Data runs `write_rows` in task workers, processes that import this module and what it
imports, and nothing else of the job: so it, like pipeline.data.inputs, imports neither torch nor
transformers (tests/test_layering.py), and a task worker starts in a fraction of the time and
memory a generation worker needs.
"""

from __future__ import annotations

import pyarrow as pa

from dart_worker.artifacts import io_retry
from pipeline.data.outputs import write_part
from pipeline.data.storage import retry_policy
from pipeline.data.summary import STAT_COLUMNS

# Columns a write task adds to the stats it hands back: its upload's retries and seconds waited
# (on the part's first row), which the driver sums into the summary's storage_retries.
WRITE_RETRY_COLUMNS = ("storage_write_retries", "storage_write_wait_s")


def write_rows(batch: pa.Table, output_url: str, run_id: str, io_retry_s: float = 0.0) -> pa.Table:
    """Ray Data task: write one atomic Parquet part, its upload retried under the job's policy
    (dart_worker/artifacts/io_retry.py); hand back only the per-row stats and the upload's retries."""
    policy = retry_policy(io_retry_s)
    with io_retry.using(policy):
        write_part(batch, output_url, run_id)
    stats = batch.select([c for c in STAT_COLUMNS if c in batch.column_names])
    count = policy.ledger.counts.get("write part", io_retry.OperationCount())
    rest = [0] * (len(stats) - 1)
    return (stats.append_column(WRITE_RETRY_COLUMNS[0], pa.array([count.retries, *rest], pa.int64()))
            .append_column(WRITE_RETRY_COLUMNS[1], pa.array([count.waited_s, *rest], pa.float64())))


def add_write_retries(ledger: io_retry.RetryLedger, batch: pa.Table) -> None:
    """The retries of the write tasks behind `batch` (WRITE_RETRY_COLUMNS), into the driver's ledger."""
    if WRITE_RETRY_COLUMNS[0] not in batch.column_names:
        return
    retries = batch.column(WRITE_RETRY_COLUMNS[0]).to_pylist()
    waited = batch.column(WRITE_RETRY_COLUMNS[1]).to_pylist()
    parts_retried = sum(1 for r in retries if r)
    if parts_retried:
        ledger.merge({"write part": {"retries": sum(retries), "waited_s": sum(waited), "recovered": parts_retried}})
