"""The pipeline against a real S3-compatible server on loopback (moto_server), and via `ray job submit`.

Inputs (JSONL and Parquet) are read from a bucket through Ray Data, Parquet parts and the job
summary are written back to the bucket, and a second run with resume generates nothing new.
Credentials come only from the environment, and never appear in outputs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from pipeline.data.outputs import read_output
from pipeline.run import SUMMARY_NAME, run_pipeline
from pipeline.settings.config import load_config
from tests.ray_processes import start_ray_head
from tests.test_pipeline_run import REPO, artifacts, config_file, write_inputs  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration


def test_jsonl_and_parquet_from_a_bucket_and_resume(tmp_path, artifacts, s3_server, s3_bucket, shared_ray):  # noqa: F811
    """On the session's S3 server (a bucket of this test's) and Ray cluster: the job's workers
    get the S3 settings and credentials from this process's environment (forwarded)."""
    fs, bucket = s3_server.filesystem(), s3_bucket
    prompts = write_inputs(tmp_path / "a.jsonl", good=5)
    fs.put(str(tmp_path / "a.jsonl"), f"{bucket}/prompts/jsonl/a.jsonl")
    table = pa.table({"id": [f"pq-{k}" for k in range(4)], "prompt": ["w5 w6 w7", "w8 w9", None, "w10 w11 w12"]})
    pq.write_table(table, tmp_path / "b.parquet")
    fs.put(str(tmp_path / "b.parquet"), f"{bucket}/prompts/parquet/b.parquet")

    jsonl_cfg = config_file(tmp_path, artifacts, [f"s3://{bucket}/prompts/jsonl/*.jsonl"],
                            f"s3://{bucket}/results/jsonl")
    summary = run_pipeline(load_config(jsonl_cfg))
    assert summary["this_run"]["rows"] == len(prompts) + 6
    out = read_output(f"s3://{bucket}/results/jsonl")
    assert out.num_rows == len(prompts) + 6 and len(set(out["row_key"].to_pylist())) == out.num_rows
    assert fs.exists(f"{bucket}/results/jsonl/{SUMMARY_NAME}")

    parquet_cfg = config_file(tmp_path, artifacts, [f"s3://{bucket}/prompts/parquet/"],
                              f"s3://{bucket}/results/parquet", input__format="parquet")
    run_pipeline(load_config(parquet_cfg))
    ray.shutdown()
    rows = {r["id"]: r for r in read_output(f"s3://{bucket}/results/parquet").to_pylist()}
    assert set(rows) == {"pq-0", "pq-1", "pq-2", "pq-3"}
    assert rows["pq-2"]["error"] and not rows["pq-0"]["error"] and rows["pq-0"]["num_generated_tokens"] > 0

    again = run_pipeline(load_config(parquet_cfg, ["run.resume=true"]))
    assert again["this_run"]["rows"] == 0 and again["this_run"]["rows_skipped_as_done"] == 4
    assert read_output(f"s3://{bucket}/results/parquet").num_rows == 4

    secret = s3_server.env["AWS_SECRET_ACCESS_KEY"]
    for path in fs.find(f"{bucket}/results"):
        assert secret.encode() not in fs.cat_file(path), f"credential leaked into {path}"


@pytest.mark.slow
def test_ray_job_submit_end_to_end(tmp_path, tiny_artifacts):
    """`ray start --head` with token auth, then `ray job submit -- python -m pipeline.run ...`.

    The head binds 127.0.0.1 with every port chosen free, so another Ray cluster on the machine
    (a user's, another test run's) cannot take its dashboard or job agent's port; the test waits
    for the job agent by asking it (its health check), then submits once."""
    if shutil.which("ray") is None:
        pytest.skip("the ray CLI is not on PATH")
    ray.shutdown()
    write_inputs(tmp_path / "in.jsonl", good=4)
    cfg = config_file(tmp_path, tiny_artifacts, [str(tmp_path / "in.jsonl")], str(tmp_path / "out"),
                      resources__num_workers=1)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    subprocess.run(["ray", "get-auth-token", "--generate"], env=env, capture_output=True, check=False)
    head = start_ray_head(num_cpus=2, env=env, dashboard=True, prefix="rj-")
    try:
        head.wait_for_job_agent(timeout_s=240)
        submitted = head.ray_cli("job", "submit", "--address", head.dashboard_url, "--",
                                 sys.executable, "-m", "pipeline.run", str(cfg), timeout=600, check=False)
        assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
        assert "succeeded" in submitted.stdout.lower()
    finally:
        head.stop()
    out = read_output(str(tmp_path / "out"))
    assert out.num_rows == 10 and len(set(out["row_key"].to_pylist())) == 10
    assert json.loads((tmp_path / "out" / SUMMARY_NAME).read_text())["this_run"]["rows"] == 10
