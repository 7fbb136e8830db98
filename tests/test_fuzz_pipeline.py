"""The whole job over hostile inputs: `python -m pipeline.run` on local Ray and the tiny artifacts.

- Every hostile line of tests/hostile_inputs.py, mixed with good rows, in plain, .gz and .zst
  files: rows out == rows in, every good row ok, exit 0, errors counted by kind in the summary.
- An input that becomes unreadable in the middle of the job (tests/flaky_fs.py): the job names
  the file, keeps every part already written, exits 1; a rerun with run.resume=true finishes
  it with every row exactly once. (In this process, through `main`: a local Ray whose workers
  can import the test filesystem.)
- An input that cannot be read at all is a start-up error (exit 2) before anything is written.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import ray

from pipeline.data.outputs import read_output, rows_to_table, write_part
from pipeline.data.storage import StorageError
from pipeline.run import SUMMARY_NAME, main, storage_failure
from tests.flaky_fs import FAIL_ENV
from tests.hostile_inputs import HOSTILE_JSONL, good_line, nonblank_lines
from tests.ray_processes import kill_ray_processes_under, short_temp_dir
from tests.test_pipeline_run import config_file, word_prompt

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def artifacts(tiny_artifacts):
    return tiny_artifacts


def run_job(config: Path, *overrides: str, env: dict | None = None, preamble: str = "") -> subprocess.CompletedProcess:
    """`python -m pipeline.run config overrides` in a fresh process with a Ray of its own (cleaned up after)."""
    ray_tmp = short_temp_dir("rf-")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_TMPDIR": ray_tmp, **(env or {})}
    if preamble:  # import something first (a test filesystem), then the same entry point
        command = [sys.executable, "-c", f"{preamble}; import sys; from pipeline.run import main; "
                   f"sys.exit(main(sys.argv[1:]))"]
    else:
        command = [sys.executable, "-m", "pipeline.run"]
    try:
        return subprocess.run([*command, str(config), *overrides], cwd=config.parent, env=env, capture_output=True,
                              text=True, timeout=400)
    finally:
        kill_ray_processes_under(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def zstd(data: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as out:
        out.write(data)
    return sink.getvalue().to_pybytes()


# Hostile lines that are nevertheless valid rows (their ids), and error kinds the summary must count.
VALID_HOSTILE = {"c1", "c3", "s5", "s6", "b1", "b2", "b4", "l1", "l4", "t1", "t2", "t3", "t4", "j4",
                 "123456789012345678901234567890", "i" * 100_000}
KINDS = {"prompt holds a lone surrogate", "id holds a lone surrogate", "malformed JSON", "missing id",
         "id is not a string or integer", "prompt longer than 1000 characters", "prompt is not a string",
         "line is not a JSON object"}


def test_hostile_corpus_end_to_end(tmp_path, artifacts, ray_head):
    """`python -m pipeline.run` in a process of its own, joining the session's Ray cluster
    (RAY_ADDRESS, as under `ray job submit`)."""
    import numpy as np

    rng = np.random.default_rng(0)
    good = {f"good-{k}": word_prompt(rng, int(rng.integers(2, 8))) for k in range(12)}
    hostile = [line for lines in HOSTILE_JSONL.values() for line in lines]
    # The plain file interleaves good and hostile lines; the compressed ones use CRLF and BOMs.
    plain = [good_line(k, p) for k, p in list(good.items())[:6]]
    plain = [line for pair in zip(plain + [b""] * len(hostile), hostile) for line in pair if line]
    raw = {
        "hostile.jsonl": b"\n".join(plain) + b"\n",
        "more.jsonl.gz": b"\xef\xbb\xbf" + b"\r\n".join(good_line(k, p) for k, p in list(good.items())[6:9]) + b"\r\n",
        "more.jsonl.zst": b"\n".join([b"\xef\xbb\xbf" + good_line(k, p) for k, p in list(good.items())[9:]]
                                     + [b"\x00\xff garbage", b"[1, 2]"]),
    }
    compressors = {".gz": gzip.compress, ".zst": zstd, ".jsonl": bytes}
    (tmp_path / "in").mkdir()
    for name, data in raw.items():
        (tmp_path / "in" / name).write_bytes(compressors[Path(name).suffix](data))
    expected_rows = sum(len(nonblank_lines(data)) for data in raw.values())
    out = tmp_path / "out"
    config = config_file(tmp_path, artifacts, [str(tmp_path / "in")], str(out), decoding__max_new_tokens=4,
                         resources__num_workers=1, resources__batch_size=8, output__rows_per_file=16)
    result = run_job(config, env={"RAY_ADDRESS": ray_head.address})
    assert result.returncode == 0, result.stderr[-3000:]

    table = read_output(str(out)).to_pylist()
    assert len(table) == expected_rows == len({r["row_key"] for r in table})
    by_id = {r["id"]: r for r in table if r["id"] is not None and not r["row_key"].startswith("dup:")}
    for row_id in [*good, *VALID_HOSTILE]:
        assert by_id[row_id]["error"] is None and by_id[row_id]["num_generated_tokens"] >= 1, by_id[row_id]
    summary = json.loads((out / SUMMARY_NAME).read_text())
    this = summary["this_run"]
    assert this["rows"] == expected_rows and this["rows_ok"] == len(good) + len(VALID_HOSTILE)
    assert set(this["errors_by_kind"]) >= KINDS, this["errors_by_kind"]
    assert sum(this["errors_by_kind"].values()) == this["rows_failed"] == expected_rows - this["rows_ok"]


# ------------------------------------------------------------------------------------------
# Failures in the middle of a job: in this process (main() gives the exit status), one local Ray


@pytest.fixture(scope="module")
def flaky_ray(tmp_path_factory, join_shared_ray):
    """Jobs on the session's Ray cluster whose workers import tests.flaky_fs (the cluster's
    PYTHONPATH holds the repository) and get its failure setting; yields its state dir."""
    state = tmp_path_factory.mktemp("flaky-state")
    with pytest.MonkeyPatch.context() as mp, join_shared_ray(forward=(FAIL_ENV,)):
        mp.setenv(FAIL_ENV, f"b.jsonl:{state}")
        ray.init(logging_level="ERROR")  # joins RAY_ADDRESS; the jobs below reuse this connection
        ray.data.DataContext.get_current().enable_progress_bars = False
        yield state


def error_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("error: "))


def test_read_failure_mid_job_keeps_parts_and_resume_finishes(tmp_path, artifacts, flaky_ray, capsys):
    import numpy as np

    rng = np.random.default_rng(1)
    inputs = tmp_path / "in"
    inputs.mkdir()
    for name, n in (("a", 4), ("b", 3)):
        (inputs / f"{name}.jsonl").write_text("".join(json.dumps({"id": f"{name}{k}", "prompt": word_prompt(rng, 4)})
                                                      + "\n" for k in range(n)))
    out = tmp_path / "out"
    # Plain decoding (ar): the failure semantics do not depend on the mode, and it starts fastest.
    config = str(config_file(tmp_path, artifacts, [f"flaky://{inputs}/"], str(out), decoding__mode="ar",
                             decoding__max_new_tokens=2, resources__num_workers=1, resources__batch_size=4,
                             output__rows_per_file=4))
    # Parts already written by an earlier attempt of the job (written directly here: a.jsonl's rows).
    for keys in (["id:a0", "id:a1"], ["id:a2", "id:a3"]):
        write_part(rows_to_table([{"row_key": k, "id": k[3:], "text": "w5", "finish_reason": "length",
                                   "run_id": "test-run"} for k in keys]), str(out), "test-run")
    before = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}

    # The job, resumed: b.jsonl reads in the duplicate-id pass, then fails once generation has begun.
    (flaky_ray / "allow").write_text("1")
    capsys.readouterr()
    assert main([config, "run.resume=true"]) == 1
    stderr = capsys.readouterr().err
    assert error_line(stderr).startswith(f"error: cannot read flaky://{inputs}/b.jsonl: OSError: connection reset")
    assert "run.resume=true" in stderr and f"every part already written under {out} is kept" in stderr
    after = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}
    assert after.items() >= before.items()  # nothing written before was touched
    assert not (out / SUMMARY_NAME).exists()  # a failed job writes no summary
    written = len(read_output(str(out)))

    # The outage is over: the rerun with resume finishes the job, every row exactly once.
    (flaky_ray / "allow").unlink()
    assert main([config, "run.resume=true"]) == 0
    keys = read_output(str(out))["row_key"].to_pylist()
    assert len(keys) == len(set(keys)) == 7
    summary = json.loads((out / SUMMARY_NAME).read_text())["this_run"]
    assert summary["rows_skipped_as_done"] == written and summary["rows"] == 7 - written == summary["rows_ok"]


def test_unreadable_input_is_a_startup_error(tmp_path, artifacts, flaky_ray, capsys):
    compressed = gzip.compress(b'{"id": "a", "prompt": "w5"}\n' * 2000)
    (tmp_path / "cut.jsonl.gz").write_bytes(compressed[: len(compressed) // 2])
    (tmp_path / "ok.jsonl").write_text('{"id": "b", "prompt": "w6"}\n')
    config = config_file(tmp_path, artifacts, [str(tmp_path / "*.json*")], str(tmp_path / "out"))
    capsys.readouterr()
    assert main([str(config)]) == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith(f"error: input: cannot read file://{tmp_path}/cut.jsonl.gz: OSError: "), line
    assert not list((tmp_path / "out").glob("part-*"))


def test_remote_traceback_text_names_the_classes_where_they_live_now():
    """Ray's UserCodeException carries only the traceback's text, whose last line names the error
    class by module: found whatever module StorageError and InputError live in."""
    from pipeline.data.inputs import InputError

    for cls in (StorageError, InputError):
        text = f"Traceback (most recent call last):\n  ...\n{cls.__module__}.{cls.__name__}: cannot read s3://b/x\n"
        assert storage_failure(RuntimeError(text)) == "cannot read s3://b/x"
    assert storage_failure(RuntimeError("builtins.ValueError: cannot read s3://b/x")) is None


def test_write_failure_is_found_behind_rays_wrapping(flaky_ray):
    """The writer's StorageError reaches the driver only as text inside a UserCodeException."""

    def fail(batch):
        raise StorageError("cannot write s3://bucket/out/part-0.parquet: OSError: connection reset")

    with pytest.raises(Exception) as excinfo:
        ray.data.range(4).map_batches(fail, batch_format="pyarrow").take_all()
    assert storage_failure(excinfo.value) == "cannot write s3://bucket/out/part-0.parquet: OSError: connection reset"
    assert storage_failure(ValueError("a bug")) is None
