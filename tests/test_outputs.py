"""Output rows: schema enforcement, atomic deterministic part files, resume, against disk and a real S3 server."""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.data import outputs
from pipeline.data.inputs import read_prompts
from pipeline.data.outputs import (
    OUTPUT_SCHEMA,
    PART_NAME_PATTERN,
    conform,
    existing_row_keys,
    filter_done,
    part_name,
    read_output,
    remove_temp_files,
    resume_progress,
    rows_to_table,
    sample_key,
    write_part,
)
from pipeline.data.storage import StorageError, filesystem_for
from tests.hypothesis_budget import examples
from tests.s3_server import running_s3_server

RUN = "run-1"


def output_row(key: str, **extra) -> dict:
    row = {"row_key": key, "id": key, "text": f"text of {key}", "run_id": RUN, "finish_reason": "length"}
    row.update(extra)
    return row


def table_of(*keys: str) -> pa.Table:
    return rows_to_table([output_row(k) for k in keys])


def files_in(directory) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


# ------------------------------------------------------------------------------------------
# Schema


def test_rows_to_table_full_row_and_nulls():
    full = {
        "row_key": "id:a",
        "id": "a",
        "text": "hello",
        "token_ids": np.array([1, 2, 3], dtype=np.int64),
        "logprobs": [-0.5, -1.25, 0.0],
        "top_logprob_ids": [[1, 4], [2, 1], [3, 0]],
        "top_logprobs": [[-0.5, -1.0], [-1.0, -1.25], [0.0, float("-inf")]],
        "finish_reason": "stop",
        "error": None,
        "num_prompt_tokens": 5,
        "num_generated_tokens": 3,
        "rounds": 2,
        "tau": 1.5,
        "acceptance_histogram": [1, 1],
        "per_position_acceptance": [0.5],
        "mean_tree_size": 12.0,
        "mean_batch_live": 3.5,
        "model_rounds": 2,
        "accepted_head": 1,
        "accepted_context": 0,
        "accepted_job_cache": 0,
        "prefill_s": 0.1,
        "draft_s": 0.01,
        "tree_s": 0.002,
        "grammar_s": 0.0005,
        "verify_s": 0.2,
        "commit_s": 0.001,
        "wall_s": 0.4,
        "tokens_per_s": 7.5,
        "finished_at": datetime(2026, 11, 22, 3, 0, 1, 250000, tzinfo=timezone.utc),
        "mode": "dart",
        "temperature": 0,  # an int where a float is expected is fine
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.5,
        "seed": np.int64(7),
        "max_new_tokens": 64,
        "n": 4,
        "sample_index": 1,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "text"}],
        "structured_output": '{"regex": "[a-z]+"}',
        "structured_complete": True,
        "accepted_grammar": 2,
        "prompt_logprobs": [None, -1.5, -0.25],
        "prompt_top_logprob_ids": [None, [4, 5], [6, 7]],
        "prompt_top_logprobs": [None, [-0.5, -1.5], [-0.25, -2.0]],
        "target_fingerprint": "t",
        "head_fingerprint": "h",
        "trie_fingerprint": "n",
        "run_id": RUN,
        "worker": "host:1",
        "source": "file:///x.jsonl",
    }
    assert set(full) == set(OUTPUT_SCHEMA.names)
    table = rows_to_table([full, {"row_key": "row:x", "run_id": RUN, "error": "empty prompt"}])
    assert table.schema.equals(OUTPUT_SCHEMA, check_metadata=True)
    first, second = table.to_pylist()
    assert first["token_ids"] == [1, 2, 3] and first["temperature"] == 0.0 and first["seed"] == 7
    assert first["finished_at"] == full["finished_at"]
    assert second["text"] is None and second["token_ids"] is None and second["error"] == "empty prompt"
    assert rows_to_table([]).schema.equals(OUTPUT_SCHEMA)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (output_row("k", rounds=1.5), r"'rounds' is int64, but row 1 \(row_key 'k'\) holds 1.5"),
        (output_row("k", tau="fast"), "'tau' is double, but row 1"),
        (output_row("k", token_ids=[1, "x"]), "'token_ids'"),
        (output_row("k", token_ids=[1, 2.0]), "'token_ids' is list<item: int32>, but row 1 .* floats are not"),
        (output_row("k", acceptance_histogram=np.array([1.0])), "'acceptance_histogram'"),
        (output_row("k", token_ids=[2**40]), "'token_ids'"),
        (output_row("k", colour="red"), r"row 1 has columns not in the output schema: \['colour'\]"),
        ({"row_key": None, "run_id": RUN}, "'row_key' must not be null"),
        ({"row_key": "k"}, "'run_id' must not be null"),
        (output_row("a"), r"row_key must be unique within a part; repeated: \['a'\]"),
    ],
)
def test_rows_to_table_rejects_bad_rows(row, message):
    with pytest.raises(ValueError, match=message):
        rows_to_table([output_row("a"), row])


def test_conform_names_the_differences():
    table = table_of("a")
    with pytest.raises(ValueError, match=r"missing \['worker'\]"):
        conform(table.drop_columns(["worker"]))
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        conform(table.append_column("extra", pa.array([1])))
    with pytest.raises(ValueError, match="rounds: int32"):
        conform(table.set_column(table.schema.get_field_index("rounds"), "rounds", pa.array([1], pa.int32())))
    with pytest.raises(ValueError, match="column order differs"):
        conform(table.select(list(reversed(table.column_names))))
    # Lost nullability flags and metadata (as after some Ray Data concatenations) are restored.
    loose = pa.schema([f.with_nullable(True) for f in OUTPUT_SCHEMA])
    restored = conform(table.cast(loose))
    assert restored.schema.equals(OUTPUT_SCHEMA, check_metadata=True)
    with pytest.raises(ValueError, match="'run_id' must not be null"):
        conform(
            table.cast(loose).set_column(table.schema.get_field_index("run_id"), "run_id", pa.nulls(1, pa.string()))
        )


@settings(max_examples=examples(100), deadline=None)
@given(keys=st.sets(st.text(max_size=6), min_size=1, max_size=8), seed=st.randoms())
def test_part_name_depends_only_on_the_set_of_keys(keys, seed):
    keys = list(keys)
    shuffled = keys[:]
    seed.shuffle(shuffled)
    name = part_name(keys)
    assert PART_NAME_PATTERN.fullmatch(name)
    assert part_name(shuffled) == name
    assert part_name([*keys, "\x00extra"]) != name


def test_part_name_is_unambiguous():
    assert part_name(["ab", "c"]) != part_name(["a", "bc"])
    assert part_name(["a\nb"]) != part_name(["a", "b"])


# ------------------------------------------------------------------------------------------
# Writing locally


def test_write_part_atomic_and_idempotent(tmp_path):
    out = tmp_path / "out"
    url = write_part(table_of("b", "a"), str(out), RUN)
    name = part_name(["a", "b"])
    assert url == (out / name).resolve().as_uri()
    assert files_in(out) == [name]  # no temporary file left behind
    first_bytes = (out / name).read_bytes()
    metadata = pq.read_schema(out / name).metadata
    assert metadata[b"dart.run_id"] == RUN.encode()
    assert metadata[b"dart.output_schema_version"] == outputs.SCHEMA_VERSION.encode()

    # The same batch again (e.g. a retried task), even in another row order: same single file.
    assert write_part(table_of("a", "b"), f"file://{out}", RUN) == url
    assert files_in(out) == [name]
    assert (out / name).read_bytes() == first_bytes  # rows are stored sorted by row_key

    write_part(table_of("c"), str(out), RUN)
    assert files_in(out) == sorted([name, part_name(["c"])])
    assert read_output(str(out)).column("row_key").to_pylist() == ["a", "b", "c"]


def test_write_part_refuses_bad_tables(tmp_path):
    with pytest.raises(ValueError, match="empty part"):
        write_part(rows_to_table([]), str(tmp_path), RUN)
    with pytest.raises(ValueError, match=r"run_id \['run-1'\], expected only 'run-2'"):
        write_part(table_of("a"), str(tmp_path), "run-2")
    with pytest.raises(ValueError, match="does not match the output schema"):
        write_part(pa.table({"row_key": ["a"]}), str(tmp_path), RUN)
    assert files_in(tmp_path) == []


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_failed_write_leaves_nothing(tmp_path, monkeypatch, failing):
    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outputs.os, failing, fail)
    with pytest.raises(StorageError, match=r"cannot write .*part-[0-9a-f]{20}\.parquet: OSError"):
        write_part(table_of("a"), str(tmp_path), RUN)
    assert files_in(tmp_path) == []


def test_failed_serialisation_leaves_nothing(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("encoder crashed")

    monkeypatch.setattr(outputs.pq, "write_table", fail)
    with pytest.raises(RuntimeError, match="encoder crashed"):
        write_part(table_of("a"), str(tmp_path / "out"), RUN)
    assert files_in(tmp_path / "out") == []


# ------------------------------------------------------------------------------------------
# Resume


def test_resume_progress_counts_an_input_row_done_only_when_all_its_samples_are_written(tmp_path):
    out = str(tmp_path / "out")

    def sample_rows(key: str, n: int, samples) -> list[dict]:
        return [{**output_row(sample_key(key, j)), "sample_index": j, "n": n} for j in samples]

    write_part(rows_to_table(sample_rows("id:a", 3, [0, 1]) + sample_rows("id:b", 2, [1])), out, RUN)
    write_part(rows_to_table(sample_rows("id:a", 3, [2]) + sample_rows("id:c", 1, [0])), out, RUN)
    legacy = output_row("id:d")  # a part written before schema 6: no n, no sample_index
    legacy_table = rows_to_table([legacy]).drop_columns(["n", "sample_index"])
    (tmp_path / "out" / part_name(["id:d"])).write_bytes(pq_bytes(legacy_table))
    progress = resume_progress(out)
    assert progress.done == {"id:a", "id:c", "id:d"}
    assert progress.partial == {"id:b": (2, (1,))} and progress.rows_written == 6
    assert existing_row_keys(out) == {"id:a", "sample:1:id:a", "sample:2:id:a", "sample:1:id:b", "id:c", "id:d"}


def test_existing_row_keys_ignores_temp_and_foreign_files(tmp_path):
    out = tmp_path / "out"
    assert existing_row_keys(str(out)) == set()  # a first run: nothing there yet
    write_part(table_of("a", "b"), str(out), RUN)
    write_part(table_of("c"), str(out), RUN)
    # A writer that crashed before its rename, and files that are not parts.
    (out / f".tmp-{part_name(['d'])}.1234").write_bytes(pq_bytes(table_of("d")))
    (out / "_job_summary.json").write_text("{}")
    (out / "notes.parquet").write_bytes(pq_bytes(table_of("e")))
    assert existing_row_keys(str(out)) == {"a", "b", "c"}
    assert read_output(str(out)).column("row_key").to_pylist() == ["a", "b", "c"]
    assert remove_temp_files(str(out)) == 1
    assert sorted(files_in(out)) == sorted(
        [part_name(["a", "b"]), part_name(["c"]), "_job_summary.json", "notes.parquet"]
    )


def pq_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: b"garbage, not parquet",
        lambda data: data[: len(data) // 2],  # truncated
        lambda data: b"",
        lambda data: pq_bytes(pa.table({"other": [1]})),  # a Parquet file without row_key
    ],
    ids=["garbage", "truncated", "empty", "no-row-key"],
)
def test_corrupt_part_is_quarantined_and_redone(tmp_path, caplog, damage):
    out = tmp_path / "out"
    write_part(table_of("a"), str(out), RUN)
    bad = out / part_name(["b", "c"])
    bad.write_bytes(damage(pq_bytes(table_of("b", "c"))))
    with pytest.raises(StorageError, match=rf"output part .*{bad.name}"):
        read_output(str(out))  # reading never modifies the output
    with caplog.at_level(logging.WARNING, logger="pipeline.data.outputs"):
        assert existing_row_keys(str(out)) == {"a"}
    assert f"corrupt output part {bad.resolve().as_uri()}" in caplog.text
    assert not bad.exists() and (out / "_corrupt" / bad.name).exists()
    # The rows are generated again and written under the same name; the evidence stays aside.
    write_part(table_of("b", "c"), str(out), RUN)
    assert existing_row_keys(str(out)) == {"a", "b", "c"}
    assert read_output(str(out)).num_rows == 3


def test_read_output_keeps_one_copy_of_overlapping_parts(tmp_path, caplog):
    out = tmp_path / "out"
    write_part(rows_to_table([output_row("a"), output_row("b", text="first")]), str(out), RUN)
    write_part(rows_to_table([output_row("b", text="second"), output_row("c")]), str(out), RUN)
    with caplog.at_level(logging.WARNING, logger="pipeline.data.outputs"):
        table = read_output(str(out))
    assert table.column("row_key").to_pylist() == ["a", "b", "c"]
    first_part = min(part_name(["a", "b"]), part_name(["b", "c"]))
    assert table.column("text").to_pylist()[1] == ("first" if first_part == part_name(["a", "b"]) else "second")
    assert "1 repeated row keys" in caplog.text
    assert read_output(str(out), columns=["text"]).column_names == ["text"]


@pytest.fixture(scope="module")
def s3():
    with running_s3_server(buckets=["outputs", "inputs"]) as server:
        yield server


@pytest.fixture(scope="module")
def ray_session(s3, join_shared_ray):
    """This process joined to the session's Ray cluster for the module; its workers get the
    module's S3 server variables (set here by `s3`, forwarded by the join)."""
    with join_shared_ray(connect=True):
        yield



def test_parts_of_schema_version_1_read_back_with_null_added_columns(tmp_path):
    """A run resumed after an upgrade finds parts without `finished_at`: they still count."""
    out = tmp_path / "out"
    now = datetime(2026, 11, 22, 3, 0, tzinfo=timezone.utc)
    write_part(rows_to_table([output_row("a", finished_at=now)]), str(out), RUN)
    old = table_of("b", "c").drop_columns(["finished_at"])
    (out / part_name(["b", "c"])).write_bytes(pq_bytes(old))
    assert existing_row_keys(str(out)) == {"a", "b", "c"}
    table = read_output(str(out))
    assert table.schema.equals(OUTPUT_SCHEMA.remove_metadata(), check_metadata=False)
    assert table.column("finished_at").to_pylist() == [now, None, None]
    assert read_output(str(out), columns=["finished_at"]).column("finished_at").null_count == 2
    # Any other missing column still marks a part that is not ours.
    (out / part_name(["d"])).write_bytes(pq_bytes(table_of("d").drop_columns(["text"])))
    with pytest.raises(StorageError, match="does not match the output schema"):
        read_output(str(out))

def test_parts_of_schema_version_3_read_back_with_null_accepted_job_cache(tmp_path):
    """Parts written before the job cache (version 3) lack `accepted_job_cache`: resume and reads keep
    working, the column reads as null there."""
    out = tmp_path / "out"
    write_part(rows_to_table([output_row("a", accepted_job_cache=4)]), str(out), RUN)
    old = table_of("b").drop_columns(["accepted_job_cache"])
    (out / part_name(["b"])).write_bytes(pq_bytes(old))
    assert existing_row_keys(str(out)) == {"a", "b"}
    table = read_output(str(out))
    assert table.schema.equals(OUTPUT_SCHEMA.remove_metadata(), check_metadata=False)
    assert sorted(table.column("accepted_job_cache").to_pylist(), key=lambda v: v is None) == [4, None]


def test_filter_done(ray_session):
    keys = [f"id:{i}" for i in range(500)]
    ds = ray.data.from_items([{"row_key": k, "prompt": "p"} for k in keys], override_num_blocks=4)
    assert filter_done(ds, set()) is ds
    done = set(keys[::3]) | {"id:not-in-input"}
    remaining = filter_done(ds, done).take_all()
    assert sorted(r["row_key"] for r in remaining) == sorted(set(keys) - done)
    assert filter_done(ds, set(keys)).count() == 0


def generate(rows: pa.Table) -> pa.Table:
    """A stand-in for the generation workers: one output row per input row."""
    return rows_to_table(
        [
            output_row(r["row_key"], id=r["id"], error=r["error"], source=r["source"], text=r["prompt"])
            for r in rows.to_pylist()
        ]
    )


def run_job(input_dir, output_url: str, fail_after: int | None = None) -> None:
    """Read, skip what is done, generate, write one part per batch; optionally die after some batches."""
    ds = read_prompts([str(input_dir)], "jsonl")
    ds = filter_done(ds, existing_row_keys(output_url))
    for written, batch in enumerate(ds.iter_batches(batch_size=7, batch_format="pyarrow")):
        if fail_after is not None and written == fail_after:
            raise KeyboardInterrupt("job killed")
        write_part(generate(batch), output_url, RUN)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_killed_job_resumes_without_losing_or_repeating_rows(ray_session, s3, tmp_path, where):
    lines = [json.dumps({"id": i % 40, "prompt": f"p{i}"}) for i in range(50)] + ["{broken", "", '{"prompt": "x"}']
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(lines) + "\n")
    output_url = str(tmp_path / "out") if where == "local" else f"s3://outputs/resume-{time.time_ns()}"
    all_keys = {r["row_key"] for r in read_prompts([str(tmp_path / "in")], "jsonl").take_all()}
    assert len(all_keys) == 52

    with pytest.raises(KeyboardInterrupt):
        run_job(tmp_path / "in", output_url, fail_after=3)
    assert len(existing_row_keys(output_url)) == 21
    run_job(tmp_path / "in", output_url)
    table = read_output(output_url)
    assert sorted(table.column("row_key").to_pylist()) == sorted(all_keys)
    assert existing_row_keys(output_url) == all_keys
    run_job(tmp_path / "in", output_url)  # nothing left to do: no new part
    assert rows_in_part_files(output_url) == 52  # raw count: read_output would hide a repeated row


def rows_in_part_files(output_url: str) -> int:
    fs, directory = filesystem_for(output_url)
    parts = fs.glob(f"{directory}/part-*.parquet")
    total = 0
    for path in parts:
        with fs.open(path, "rb") as f:
            total += pq.ParquetFile(f).metadata.num_rows
    return total


# ------------------------------------------------------------------------------------------
# A real S3 server


def write_from_ray_workers(output_url: str, keys: list[str]) -> list[str]:
    ds = ray.data.from_items([{"key": k} for k in keys], override_num_blocks=2)

    def write(batch: pa.Table) -> pa.Table:
        url = write_part(table_of(*batch.column("key").to_pylist()), output_url, RUN)
        return pa.table({"url": [url]})

    return sorted(r["url"] for r in ds.map_batches(write, batch_format="pyarrow", batch_size=5).take_all())


def test_s3_parts_written_by_ray_workers(ray_session, s3):
    fs = s3.filesystem()
    urls = write_from_ray_workers("s3://outputs/run-a", [f"k{i}" for i in range(10)])
    assert len(urls) == 2 and all(u.startswith("s3://outputs/run-a/part-") for u in urls)
    listed = sorted(fs.ls("outputs/run-a"))
    assert [f"s3://{p}" for p in listed] == urls
    # Writing the same batches again (retries) replaces the objects: still two parts, same rows.
    assert write_from_ray_workers("s3://outputs/run-a", [f"k{i}" for i in range(10)]) == urls
    assert sorted(fs.ls("outputs/run-a")) == listed
    assert existing_row_keys("s3://outputs/run-a") == {f"k{i}" for i in range(10)}
    assert read_output("s3://outputs/run-a").num_rows == 10


def test_s3_corrupt_part_and_missing_places(ray_session, s3, monkeypatch):
    fs = s3.filesystem()
    write_part(table_of("a"), "s3://outputs/run-b", RUN)
    fs.pipe_file(f"outputs/run-b/{part_name(['z'])}", b"not parquet")
    assert existing_row_keys("s3://outputs/run-b") == {"a"}
    assert fs.exists(f"outputs/run-b/_corrupt/{part_name(['z'])}")
    assert not fs.exists(f"outputs/run-b/{part_name(['z'])}")

    assert existing_row_keys("s3://outputs/never-written") == set()
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist"):
        existing_row_keys("s3://no-such-bucket/run")
    with pytest.raises(StorageError, match=r"cannot write s3://no-such-bucket/run/part-"):
        write_part(table_of("a"), "s3://no-such-bucket/run", RUN)

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint.rsplit(":", 1)[0] + ":1")
    start = time.monotonic()
    with pytest.raises(StorageError) as excinfo:
        existing_row_keys("s3://outputs/run-b")
    assert "s3://outputs/run-b" in str(excinfo.value) and "Could not connect" in str(excinfo.value)
    assert s3.env["AWS_SECRET_ACCESS_KEY"] not in str(excinfo.value)
    with pytest.raises(StorageError, match="cannot write s3://outputs/run-b/part-"):
        write_part(table_of("a"), "s3://outputs/run-b", RUN)
    assert time.monotonic() - start < 20
