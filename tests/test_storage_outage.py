"""Object-storage outages (issue #47): transient failures retried with backoff under
`run.io_retry_s` from an operation's first failure, permanent ones stopping at once, the stop line
naming the URL, the HTTP status and the retries, and the stop note counting the rows on storage.

The S3 tests go through tests/fault_proxy.py, a proxy on loopback in front of the suite's S3
server (moto) that answers chosen requests with S3 error documents for a while. The S3 client
itself tries twice (AWS_MAX_ATTEMPTS=2, tests/s3_server.py), so an outage of seconds is beyond it,
as one of minutes is beyond a real client's defaults.
"""

from __future__ import annotations

import errno
import json
import re
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from dart_worker.artifacts import io_retry
from dart_worker.artifacts.io_retry import RetryLedger, RetryPolicy, classify
from pipeline.data.outputs import read_output, rows_to_table, write_part, written_rows
from pipeline.data.storage import StorageError
from pipeline.run import SUMMARY_NAME, main
from tests.fault_proxy import start_fault_proxy
from tests.test_pipeline_run import config_file, write_inputs

PARTS = r"/out/part-[0-9a-f]{20}\.parquet"


def client_error(status: int, code: str) -> OSError:
    """What s3fs raises for an S3 error answer: an OSError whose cause is botocore's ClientError."""
    cause = ClientError({"Error": {"Code": code, "Message": f"{code} happened"},
                         "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
    error = OSError(errno.EIO, f"{code} happened")
    error.__cause__ = cause
    return error


# ------------------------------------------------------------------------------ the policy


def test_the_retried_error_texts_read_alike_as_substrings_and_regexes_and_join_ray_data_quietly():
    """Ray Data reads `retried_io_errors` as regular expressions from December 2026 on: each of
    ours must match the same text either way (no character a regex reads otherwise), and adding
    them must not put Ray's deprecation warning in every job's log, while keeping Ray's own."""
    import warnings

    from ray.data import DataContext

    for text in io_retry.RETRIED_IO_ERROR_TEXT:
        assert re.escape(text) == text.replace(" ", "\\ "), text
        assert re.search(text, f"botocore: An error occurred ({text}) when calling PutObject")
    context = DataContext()
    before = list(context.retried_io_errors)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        io_retry.add_to_ray_data(context)
        io_retry.add_to_ray_data(context)  # twice: no entry twice
    assert not [w for w in caught if "retried_io_errors" in str(w.message)], [str(w.message) for w in caught]
    assert context.retried_io_errors == [*before, *[t for t in io_retry.RETRIED_IO_ERROR_TEXT if t not in before]]


@pytest.mark.parametrize(("error", "transient", "status"), [
    (client_error(500, "InternalError"), True, 500),
    (client_error(503, "SlowDown"), True, 503),
    (client_error(502, "BadGateway"), True, 502),
    (client_error(400, "RequestTimeout"), True, 400),
    (client_error(429, "TooManyRequests"), True, 429),
    (client_error(403, "AccessDenied"), False, 403),
    (client_error(404, "NoSuchBucket"), False, 404),
    (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), True, None),
    (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), True, None),
    (TimeoutError("read timed out"), True, None),
    (OSError(errno.ENOSPC, "No space left on device"), False, None),
    (ValueError("Invalid bucket name 'a b'"), False, None),
])
def test_transient_and_permanent_failures_are_told_apart(error, transient, status):
    failure = classify(error)
    assert (failure.transient, failure.status) == (transient, status)


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def failing(times: int, error: BaseException):
    calls = []

    def operation():
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "done"

    return operation, calls


def test_transient_failures_are_retried_with_growing_jittered_waits_until_they_pass():
    clock = FakeClock()
    policy = RetryPolicy(600, ledger=RetryLedger(), sleep=clock.sleep, clock=clock)
    operation, calls = failing(6, client_error(503, "SlowDown"))
    assert policy.call("write part", "s3://b/out/part-1.parquet", operation) == "done"
    assert len(calls) == 7 and len(clock.sleeps) == 6
    # full jitter: the i-th wait is a random share of 2^i seconds (botocore's ExponentialBackoff)
    assert all(0 <= s <= min(2 ** i, io_retry.MAX_BACKOFF_S) for i, s in enumerate(clock.sleeps))
    assert len(set(clock.sleeps)) > 1
    counts = policy.ledger.as_dict()["write part"]
    assert counts["retries"] == 6 and counts["recovered"] == 1 and counts["gave_up"] == 0
    assert counts["waited_s"] == pytest.approx(sum(clock.sleeps), abs=1e-3)


def test_retries_stop_when_the_budget_from_the_first_failure_is_spent():
    clock = FakeClock()
    policy = RetryPolicy(45, ledger=RetryLedger(), sleep=clock.sleep, clock=clock)
    operation, calls = failing(10 ** 6, client_error(500, "InternalError"))
    with pytest.raises(StorageError) as excinfo:
        policy.call("write part", "s3://b/out/part-1.parquet", operation)
    message = str(excinfo.value)
    assert clock.now == pytest.approx(45)  # the last wait ends exactly at the budget, then one last try
    assert message.startswith("cannot write s3://b/out/part-1.parquet: HTTP 500 InternalError (transient, "
                              f"retried {len(calls) - 1} times over 45 s, until run.io_retry_s=45 ran out)"), message
    assert policy.ledger.as_dict()["write part"]["gave_up"] == 1


@pytest.mark.parametrize("error", [client_error(403, "AccessDenied"), OSError(errno.ENOSPC, "No space left")])
def test_a_permanent_failure_stops_at_once(error):
    clock = FakeClock()
    policy = RetryPolicy(600, ledger=RetryLedger(), sleep=clock.sleep, clock=clock)
    operation, calls = failing(1, error)
    with pytest.raises(StorageError, match=r"cannot read s3://b/x: .*\(permanent, not retried\)"):
        policy.call("read part", "s3://b/x", operation)
    assert len(calls) == 1 and not clock.sleeps


def test_a_missing_object_stays_a_file_not_found_error_for_the_caller():
    """A caller that treats a missing file on its own (`except FileNotFoundError`: an artifact that
    is not there, a part removed since the listing) still can when the policy wrapped the error;
    every other failure is a StorageError only."""
    policy = RetryPolicy(600, ledger=RetryLedger(), sleep=FakeClock().sleep)
    missing, _ = failing(1, FileNotFoundError(errno.ENOENT, "no such key"))
    with pytest.raises(FileNotFoundError, match=r"cannot read s3://b/x: .*\(permanent, not retried\)") as excinfo:
        policy.call("read artifact", "s3://b/x", missing)
    assert isinstance(excinfo.value, StorageError)
    denied, _ = failing(1, client_error(403, "AccessDenied"))
    with pytest.raises(StorageError) as excinfo:
        policy.call("read artifact", "s3://b/x", denied)
    assert not isinstance(excinfo.value, FileNotFoundError)


# ------------------------------------------------------------------ S3 through the proxy


@pytest.fixture
def proxy(s3_server, s3_bucket, monkeypatch):
    """The fault proxy in front of the session's S3 server, this test's environment pointed at it."""
    proxy = start_fault_proxy(s3_server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        yield proxy
    finally:
        proxy.stop()


def part_table(keys: list[str]) -> pa.Table:
    return rows_to_table([{"row_key": k, "id": k, "text": "w5", "finish_reason": "length", "run_id": "r"}
                          for k in keys])


def test_a_part_upload_rides_out_a_write_outage_through_the_proxy(proxy, s3_bucket, caplog):
    rule = proxy.fail("PUT", PARTS, status=500, code="InternalError", for_s=3)
    with io_retry.using(RetryPolicy(20, ledger=RetryLedger())) as policy, caplog.at_level("WARNING"):
        write_part(part_table(["a", "b"]), f"s3://{s3_bucket}/out", "r")
    assert rule.faults >= 2 and policy.ledger.as_dict()["write part"]["recovered"] == 1
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting on storage: write part")]
    assert waits and "HTTP 500 InternalError" in waits[0] and "retrying for " in waits[0], waits
    assert read_output(f"s3://{s3_bucket}/out")["row_key"].to_pylist() == ["a", "b"]


def test_a_part_upload_gives_up_after_the_budget_naming_url_status_and_retries(proxy, s3_bucket):
    proxy.fail("PUT", PARTS, status=503, code="SlowDown")
    began = time.monotonic()
    with io_retry.using(RetryPolicy(2, ledger=RetryLedger())), pytest.raises(StorageError) as excinfo:
        write_part(part_table(["a"]), f"s3://{s3_bucket}/out", "r")
    assert time.monotonic() - began < 15
    assert str(excinfo.value).startswith(f"cannot write s3://{s3_bucket}/out/part-")
    assert ": HTTP 503 SlowDown (transient, retried " in str(excinfo.value)
    # s3fs tries SlowDown a few times itself within each attempt: the time is counted as it went
    assert re.search(r"\(transient, retried \d+ times? over \d+ s, until run.io_retry_s=2 ran out\): OSError: ",
                     str(excinfo.value)), str(excinfo.value)


# ------------------------------------------------------------------------------ whole jobs


def s3_job(tmp_path, artifacts, bucket: str, good: int, **extra):
    """A job reading a local input and writing to s3://bucket/out through the proxy: mode ar,
    one worker, a part every two rows."""
    write_inputs(tmp_path / "in.jsonl", good=good)
    settings = {"decoding__mode": "ar", "decoding__max_new_tokens": 4, "model__draft_head": None, "model__trie": None,
                "resources__num_workers": 1, "resources__batch_size": 2, "output__rows_per_file": 2, **extra}
    return config_file(tmp_path, artifacts, [str(tmp_path / "in.jsonl")], f"s3://{bucket}/out", **settings), good + 6


def output_keys(s3_server, bucket: str) -> list[str]:
    """Row keys under s3://bucket/out, read from the S3 server directly (not through the proxy)."""
    fs = s3_server.filesystem()
    keys = []
    for path in fs.glob(f"{bucket}/out/part-*.parquet"):
        with fs.open(path, "rb") as f:
            keys += pq.read_table(f, columns=["row_key"])["row_key"].to_pylist()
    return keys


@pytest.mark.slow
def test_a_job_rides_out_a_write_outage_with_every_row_once(tmp_path, tiny_artifacts, proxy, s3_bucket, s3_server,
                                                             shared_ray, capsys):
    """Writes of parts refused with HTTP 500 for 3 s from the second part on (run.io_retry_s=20):
    the job waits, says so, and finishes with every row once; the summary counts the retries. (3 s
    is beyond the S3 client's own two tries, as test_a_part_upload_rides_out_a_write_outage_through_the_proxy
    shows with the same outage.)"""
    config, rows = s3_job(tmp_path, tiny_artifacts, s3_bucket, good=6, run__io_retry_s=20.0)
    rule = proxy.fail("PUT", PARTS, status=500, code="InternalError", for_s=3, after=1)
    capsys.readouterr()
    assert main([str(config)]) == 0, capsys.readouterr().err[-3000:]
    assert rule.faults >= 1
    shown = capsys.readouterr().out  # the driver's progress says what the storage cost
    assert "storage: rode out transient failures so far: write part " in shown, shown[-3000:]
    keys = output_keys(s3_server, s3_bucket)
    assert len(keys) == len(set(keys)) == rows
    summary = json.loads(s3_server.filesystem().cat_file(f"{s3_bucket}/out/{SUMMARY_NAME}"))
    assert summary["storage_retries"]["write part"]["retries"] >= 1
    assert summary["storage_retries"]["write part"]["recovered"] >= 1


@pytest.mark.slow
def test_an_outage_longer_than_the_budget_stops_with_one_line_and_resume_writes_every_row_once(
        tmp_path, tiny_artifacts, proxy, s3_bucket, s3_server, shared_ray, capsys):
    config, rows = s3_job(tmp_path, tiny_artifacts, s3_bucket, good=6, run__io_retry_s=2.0)
    proxy.fail("PUT", PARTS, status=500, code="InternalError", after=2)  # two parts land, then none
    capsys.readouterr()
    assert main([str(config)]) == 1
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("error: "))
    assert line.startswith(f"error: cannot write s3://{s3_bucket}/out/part-"), line
    assert ": HTTP 500 InternalError (transient, retried " in line and "until run.io_retry_s=2 ran out" in line, line
    on_storage = len(output_keys(s3_server, s3_bucket))
    assert 0 < on_storage < rows  # the parts written before the outage, counted exactly in the note
    assert f"({on_storage} rows of this run on storage, 0 of earlier runs)" in err, err[-2000:]

    proxy.clear()  # the store is back: the resumed run writes the rest, every row once
    assert main([str(config), "run.resume=true"]) == 0
    keys = output_keys(s3_server, s3_bucket)
    assert len(keys) == len(set(keys)) == rows


@pytest.mark.slow
def test_a_403_stops_the_job_at_once(tmp_path, tiny_artifacts, proxy, s3_bucket, s3_server, shared_ray, capsys):
    config, _ = s3_job(tmp_path, tiny_artifacts, s3_bucket, good=2, run__io_retry_s=600.0)
    rule = proxy.fail("PUT", PARTS, status=403, code="AccessDenied")
    capsys.readouterr()
    began = time.monotonic()
    assert main([str(config)]) == 1
    assert time.monotonic() - began < 300  # far inside run.io_retry_s: nothing waited
    line = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("error: "))
    assert f"cannot write s3://{s3_bucket}/out/part-" in line
    assert ": HTTP 403 AccessDenied (permanent, not retried)" in line, line
    assert set(rule.paths.values()) == {1}  # each part's upload was tried once
    assert written_rows(f"s3://{s3_bucket}/out") == 0


# ------------------------------------------------------------------------------ artifacts at start-up


def upload_dir(s3_server, local: str, bucket: str, prefix: str) -> str:
    """Put a local directory's files under s3://bucket/prefix directly (not through the proxy)."""
    fs = s3_server.filesystem()
    for path in sorted(Path(local).iterdir()):
        fs.put_file(str(path), f"{bucket}/{prefix}/{path.name}")
    return f"s3://{bucket}/{prefix}"


def test_a_target_fetch_rides_out_an_outage_and_without_a_budget_names_the_status(
        tiny_artifacts, proxy, s3_bucket, s3_server, tmp_path, monkeypatch):
    """A worker's target (or tokenizer, or draft head) on S3 answering 503 SlowDown for 3 s:
    fetched whole under the job's budget; with none, the error names the status."""
    from dart_worker.artifacts.target_store import TargetFetchError, fetch_model_dir

    url = upload_dir(s3_server, tiny_artifacts["target"], s3_bucket, "model")
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "cache-a"))
    rule = proxy.fail("GET", rf"/{s3_bucket}", status=503, code="SlowDown", for_s=3)
    with io_retry.using(RetryPolicy(20, ledger=RetryLedger())) as policy:
        local = fetch_model_dir(url)
    assert rule.faults >= 1
    assert sum(c["recovered"] for c in policy.ledger.as_dict().values()) >= 1, policy.ledger.as_dict()
    for path in Path(tiny_artifacts["target"]).iterdir():
        if not path.name.startswith("."):  # hidden files (a fingerprint cache) are not the model's
            assert (local / path.name).read_bytes() == path.read_bytes(), path.name

    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "cache-b"))  # nothing cached: the store is asked
    proxy.fail("GET", rf"/{s3_bucket}", status=503, code="SlowDown", for_s=3)
    with pytest.raises(TargetFetchError) as excinfo:  # outside a job: no budget (io_retry.NO_RETRY)
        fetch_model_dir(url)
    assert f"target {url}: cannot list it: " in str(excinfo.value)
    # (a listing's error answer reaches botocore without its error document: the status alone)
    assert ": HTTP 503 (transient, not retried: run.io_retry_s=0)" in str(excinfo.value), str(excinfo.value)


class DroppingFile:
    """A store file whose connection drops once, after its first read (`drops` counts down)."""

    def __init__(self, inner, state: dict):
        self.inner, self.state = inner, state

    def seek(self, offset, whence=0):
        self.state["seeks"].append(offset)
        return self.inner.seek(offset, whence)

    def read(self, n=-1):
        if self.state["reads"] and self.state["drops"]:
            self.state["drops"] -= 1
            raise ConnectionResetError(104, "Connection reset by peer")
        data = self.inner.read(n if n is None or n < 0 else min(n, self.state["chunk"]))
        self.state["reads"] += 1
        self.state["bytes"] += len(data)
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.inner.close()


class DroppingFS:
    """An fsspec filesystem whose `open` of one file name gives a DroppingFile."""

    def __init__(self, fs, name: str, state: dict):
        self.fs, self.name, self.state = fs, name, state

    def __getattr__(self, attr):
        return getattr(self.fs, attr)

    def open(self, path, mode="rb", **kwargs):
        inner = self.fs.open(path, mode, **kwargs)
        return DroppingFile(inner, self.state) if path.endswith("/" + self.name) else inner


def test_a_dropped_connection_mid_file_continues_from_the_bytes_received(tiny_artifacts, s3_bucket, s3_server,
                                                                        tmp_path, monkeypatch):
    """A retried download does not begin the file again: the next try seeks past what arrived."""
    from dart_worker.artifacts import target_store

    url = upload_dir(s3_server, tiny_artifacts["target"], s3_bucket, "model-drop")
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "cache"))
    weights = Path(tiny_artifacts["target"]) / "model.safetensors"
    size = weights.stat().st_size
    state = {"reads": 0, "drops": 1, "bytes": 0, "seeks": [], "chunk": size // 3}
    real = target_store.list_model
    monkeypatch.setattr(target_store, "list_model",
                        lambda u, what="target": (lambda fs, files: (DroppingFS(fs, weights.name, state), files))(
                            *real(u, what)))
    with io_retry.using(RetryPolicy(20, ledger=RetryLedger(), sleep=lambda s: None)) as policy:
        local = target_store.fetch_model_dir(url)
    assert state["drops"] == 0 and state["seeks"] == [size // 3]  # the second try began at the first's end
    assert state["bytes"] == size  # every byte read from the store once
    assert (local / weights.name).read_bytes() == weights.read_bytes()
    assert policy.ledger.as_dict()["read artifact"]["recovered"] == 1


def test_a_trie_fetch_rides_out_an_outage(tiny_artifacts, proxy, s3_bucket, s3_server, tmp_path, monkeypatch):
    """The N-gram trie on S3 answering 500 for 3 s: its header check and download wait it out (a
    node's store fetches so, under the budget of the worker that started it)."""
    from pipeline.cluster import ngram_store

    monkeypatch.setattr(ngram_store, "_ray_running", lambda: False)  # this process fetches, as a store does
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "cache"))
    s3_server.filesystem().put_file(tiny_artifacts["trie"], f"{s3_bucket}/tries/tiny.ngram")
    url = f"s3://{s3_bucket}/tries/tiny.ngram"
    rule = proxy.fail("GET", r"/tries/tiny\.ngram", status=500, code="InternalError", for_s=3)
    with io_retry.using(RetryPolicy(20, ledger=RetryLedger())) as policy:
        trie = ngram_store.acquire_trie(url)
    trie.close()
    assert rule.faults >= 1 and policy.ledger.as_dict()["read artifact"]["recovered"] >= 1

    # a connection dropped mid-download: the next try continues the file, and the copy verifies
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "cache-drop"))
    size = Path(tiny_artifacts["trie"]).stat().st_size
    state = {"reads": 0, "drops": 1, "bytes": 0, "seeks": [], "chunk": size // 3}
    real = ngram_store.url_filesystem
    monkeypatch.setattr(ngram_store, "url_filesystem",
                        lambda u: (lambda fs, path: (DroppingFS(fs, "tiny.ngram", state), path))(*real(u)))
    with io_retry.using(RetryPolicy(20, ledger=RetryLedger(), sleep=lambda s: None)):
        ngram_store.acquire_trie(url).close()
    assert state["drops"] == 0 and state["seeks"] == [size // 3] and state["bytes"] == size


def test_a_workers_start_up_and_a_nodes_trie_store_fetch_under_the_jobs_budget(tiny_artifacts, monkeypatch):
    from pipeline.cluster.ngram_store import NgramStore
    from pipeline.settings.config import to_dict
    from pipeline.worker import GenerationWorker
    from tests.tiny_models import tiny_worker_config

    budgets = []
    monkeypatch.setattr(GenerationWorker, "_start_up",
                        lambda self, resolved: budgets.append(io_retry.active().budget_s))
    cfg = tiny_worker_config(tiny_artifacts)
    cfg.run.io_retry_s = 42.0
    GenerationWorker(to_dict(cfg), {})
    monkeypatch.setattr(NgramStore, "_place", lambda self: budgets.append(io_retry.active().budget_s) or {})
    NgramStore("s3://b/t.ngram", "key", "node", io_retry_s=17.0)
    assert budgets == [42.0, 17.0]
    assert io_retry.active() is io_retry.NO_RETRY  # and nothing is left set after them
