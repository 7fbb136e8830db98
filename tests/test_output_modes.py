"""A run never silently replaces another run's rows (issue #32): pipeline/startup/output_modes.py.

An output holding parts stops a run at start-up with one line saying what is there, unless
`output.if_exists` says resume, beside or replace; a replacement commits only after the new run
has finished, and a crash anywhere in it loses neither run; `--dry-run` says which will happen;
a night of `jobs.nightly` always resumes its own output.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import pipeline.startup.output_modes as output_modes
from pipeline.data.outputs import read_output, rows_to_table, write_part
from pipeline.data.summary import SUMMARY_NAME
from pipeline.settings.config import ConfigError, load_config
from pipeline.startup.output_modes import (
    COMMIT_MARKER,
    commit_output,
    inspect_output,
    open_output,
    plan_output,
)
from pipeline.startup.preflight import StartupError

# ----------------------------------------------------------------------------- without Ray


def write_run(url: str, run_id: str, keys: range, per_part: int = 3, finished: bool = True) -> None:
    """Parts of a run as the job writes them, and its job summary when it finished."""
    keys = list(keys)
    for k in range(0, len(keys), per_part):
        rows = [{"row_key": f"id:{i}", "id": str(i), "run_id": run_id, "text": f"{run_id}-{i}"}
                for i in keys[k: k + per_part]]
        write_part(rows_to_table(rows), url, run_id)
    if finished:
        Path(url, SUMMARY_NAME).write_text(json.dumps({"run_id": run_id, "output": {"rows": len(keys)}}))


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under `directory` (relative name -> sha256): to prove that nothing changed."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def config(out: Path, *overrides: str):
    return load_config(None, ["input.urls=[unused.jsonl]", f"output.url={out}", *overrides])


def rows_by_key(url: str) -> dict[str, str]:
    table = read_output(url, ["row_key", "text", "run_id"])
    return {k: f"{r}:{t}" for k, r, t in zip(table["row_key"].to_pylist(), table["run_id"].to_pylist(),
                                            table["text"].to_pylist())}


def test_inspection_says_which_runs_how_many_rows_when_and_whether_finished(tmp_path):
    out = tmp_path / "out"
    assert inspect_output(str(out)).empty and inspect_output(str(out)).describe().startswith("no readable rows")
    write_run(str(out), "first", range(7), finished=False)
    state = inspect_output(str(out))
    assert (state.parts, state.rows, state.rows_by_run, state.finished) == (3, 7, {"first": 7}, False)
    assert state.last_written is not None
    Path(out, SUMMARY_NAME).write_text(json.dumps({"output": {"rows": 7}}))
    assert inspect_output(str(out)).finished
    line = inspect_output(str(out)).describe()
    assert "run 'first' (7 rows) in 3 parts" in line and "finished" in line and "UTC" in line


def test_an_output_holding_a_run_stops_the_next_one_with_one_line(tmp_path):
    out = tmp_path / "out"
    write_run(str(out), "local", range(5))
    before = snapshot(out)
    with pytest.raises(StartupError) as caught:
        open_output(config(out, "run.run_id=local"), "local")
    message = str(caught.value)
    assert "\n" not in message
    assert f"output {out} already holds run 'local' (5 rows)" in message and "finished" in message
    assert all(word in message for word in ("output.if_exists", "resume", "beside", "replace"))
    with pytest.raises(StartupError, match="run 'local'"):  # another run id changes nothing
        open_output(config(out, "run.run_id=other"), "other")
    assert snapshot(out) == before
    # an output without parts is fresh, whatever else is there
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / SUMMARY_NAME).write_text("{}")
    assert plan_output(config(empty), "x").describe() == "fresh output"


def test_resume_continues_the_run_that_is_there(tmp_path):
    out = tmp_path / "out"
    write_run(str(out), "run-20261120-010101", range(4), finished=False)
    plan = open_output(config(out, "run.resume=true"), "run-20261127-000000")
    assert plan.resumes and plan.write_url == str(out)
    assert plan.run_id == "run-20261120-010101"  # no run id configured: the output stays one run
    explicit = open_output(config(out, "output.if_exists=resume", "run.run_id=mine"), "mine")
    assert explicit.resumes and explicit.run_id == "mine"


def test_beside_writes_a_sibling_and_never_touches_the_output(tmp_path):
    out = tmp_path / "out"
    write_run(str(out), "local", range(4))
    before = snapshot(out)
    plan = open_output(config(out, "output.if_exists=beside", "run.run_id=v2"), "v2")
    assert plan.write_url == f"{out}-v2" and Path(plan.write_url).is_dir() and plan.run_id == "v2"
    same_id = plan_output(config(out, "output.if_exists=beside", "run.run_id=local"), "local")
    assert same_id.run_id.startswith("local-") and same_id.write_url == f"{out}-{same_id.run_id}"
    write_run(plan.write_url, "v2", range(2))
    with pytest.raises(StartupError, match=r"another run\.run_id"):
        plan_output(config(out, "output.if_exists=beside", "run.run_id=v2"), "v2")
    assert snapshot(out) == before


def test_replace_commits_only_after_the_new_run_has_finished(tmp_path):
    out = tmp_path / "out"
    write_run(str(out), "old", range(0, 9))
    before = snapshot(out)
    plan = open_output(config(out, "output.if_exists=replace", "run.run_id=new"), "new")
    assert plan.stages and plan.write_url == f"{out}/_replace-new"
    write_run(plan.write_url, "new", range(3, 8), per_part=2)  # the new run's parts, then its summary
    assert snapshot(out) == {**before, **{k: v for k, v in snapshot(out).items() if k.startswith("_replace-new")}}
    assert set(rows_by_key(str(out)).values()) == {f"old:old-{i}" for i in range(9)}  # readers see the old run
    commit_output(plan)
    assert rows_by_key(str(out)) == {f"id:{i}": f"new:new-{i}" for i in range(3, 8)}
    assert json.loads((out / SUMMARY_NAME).read_text())["run_id"] == "new"
    assert not list(out.glob("_replace-*"))


def test_a_replacement_that_fails_before_its_commit_loses_nothing(tmp_path):
    out = tmp_path / "out"
    write_run(str(out), "old", range(6))
    before = snapshot(out)
    plan = open_output(config(out, "output.if_exists=replace", "run.run_id=new"), "new")
    write_run(plan.write_url, "new", range(2), finished=False)  # ... and the run dies here
    assert {k: v for k, v in snapshot(out).items() if not k.startswith("_replace-")} == before
    # the next run in the default mode still sees the old run, and stops
    with pytest.raises(StartupError, match="run 'old' \\(6 rows\\)"):
        open_output(config(out, "run.run_id=new"), "new")
    # the next replace run starts over: the unfinished staging directory is removed
    again = open_output(config(out, "output.if_exists=replace", "run.run_id=new2"), "new2")
    assert not Path(plan.write_url).exists() and Path(again.write_url).is_dir()


@pytest.mark.parametrize("crash_after", [0, 1, 3, 4, 6, 8])
def test_a_crash_during_the_swap_is_finished_by_the_next_run(tmp_path, monkeypatch, crash_after):
    """The swap moves 3 new parts in, deletes 5 old ones, moves the summary: a crash after any step."""
    from fsspec.implementations.local import LocalFileSystem

    out = tmp_path / "out"
    write_run(str(out), "old", range(10), per_part=2)
    plan = open_output(config(out, "output.if_exists=replace", "run.run_id=new"), "new")
    write_run(plan.write_url, "new", range(4, 12), per_part=3)
    steps = {"n": 0}
    real_move, real_rm_file = output_modes._move, LocalFileSystem.rm_file

    def step(action, *args):
        steps["n"] += 1
        if steps["n"] > crash_after:
            raise OSError("the driver died here")
        return action(*args)

    monkeypatch.setattr(output_modes, "_move", lambda *a: step(real_move, *a))
    monkeypatch.setattr(LocalFileSystem, "rm_file", lambda *a: step(real_rm_file, *a))
    with pytest.raises(OSError, match="died"):
        commit_output(plan)
    assert (Path(plan.write_url) / COMMIT_MARKER).is_file()
    monkeypatch.undo()
    # Any next run on the output (here one that stops at once, in the default mode) rolls the commit forward.
    with pytest.raises(StartupError, match="run 'new' \\(8 rows\\)"):
        open_output(config(out, "run.run_id=later"), "later")
    assert rows_by_key(str(out)) == {f"id:{i}": f"new:new-{i}" for i in range(4, 12)}
    assert not list(out.glob("_replace-*"))


def test_config_refuses_unknown_modes_and_contradictions(tmp_path):
    with pytest.raises(ConfigError, match=r"output\.if_exists"):
        config(tmp_path, "output.if_exists=overwrite")
    with pytest.raises(ConfigError, match=r"run\.resume"):
        config(tmp_path, "run.resume=true", "output.if_exists=replace")
    assert config(tmp_path, "run.resume=true").output.if_exists == "error"  # resume=true is the resume mode


# ------------------------------------------------------------------------------- the nightly job


def test_a_night_always_resumes_its_own_output(tmp_path):
    from pipeline.nightly import NightlyError, load_night

    path = tmp_path / "nightly.yaml"
    path.write_text(json.dumps({"pipeline": {"input": {"urls": [str(tmp_path / "in/{date}/*.jsonl")]},
                                             "output": {"url": str(tmp_path / "out/{date}")}}}))
    night = load_night(path, ["date=2026-11-20"])
    out = Path(night.config.output.url)
    # the night ran to the end; a rerun (a retry, or by hand) resumes it under the same run id
    write_run(str(out), "nightly-2026-11-20", range(5))
    plan = plan_output(night.config, night.config.run.run_id)
    assert plan.resumes and plan.run_id == "nightly-2026-11-20" and plan.write_url == str(out)
    for mode in ("beside", "replace", "error"):
        with pytest.raises(NightlyError, match=r"output\.if_exists"):
            load_night(path, ["date=2026-11-20", f"output.if_exists={mode}"])
    assert load_night(path, ["date=2026-11-20", "output.if_exists=resume"]).config.run.resume


# ------------------------------------------------------------------------ whole jobs (Ray)


@pytest.fixture
def artifacts(tiny_artifacts):
    return tiny_artifacts


def job_file(tmp_path: Path, artifacts: dict, run_id: str, max_new_tokens: int) -> Path:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": f"r{k}", "prompt": f"w{5 + k} w{40 + k}"}) + "\n"
                                               for k in range(6)))
    cfg = {"input": {"urls": [str(tmp_path / "in.jsonl")]},
           "model": {"target": artifacts["target"], "dtype": "fp32", "device": "cpu"},
           "decoding": {"mode": "ar", "max_new_tokens": max_new_tokens},
           "resources": {"num_workers": 1, "num_cpus_per_worker": 0.5, "batch_size": 3},
           "output": {"url": str(tmp_path / "out"), "rows_per_file": 2},
           "run": {"run_id": run_id, "progress_interval_s": 5}}
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.integration
def test_second_run_stops_then_replace_and_beside(tmp_path, artifacts, shared_ray, capsys, monkeypatch):
    """Its jobs join the session's Ray cluster (tests/conftest.py), each a Ray job of its own, as
    each `python -m pipeline.run` would be."""
    from pipeline.run import main, run_pipeline

    out = tmp_path / "out"
    first = job_file(tmp_path, artifacts, "first", max_new_tokens=3)
    assert main([str(first)]) == 0
    assert {r["run_id"] for r in read_output(str(out), ["run_id"]).to_pylist()} == {"first"}
    before = snapshot(out)
    capsys.readouterr()

    # The same command again: before this change it exited 0 and rewrote the parts.
    assert main([str(first)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "already holds run 'first' (6 rows)" in err and "output.if_exists" in err
    assert snapshot(out) == before

    # --dry-run says what each mode would do, and changes nothing.
    second = job_file(tmp_path, artifacts, "second", max_new_tokens=5)
    assert main([str(second), "--dry-run"]) == 2
    assert "already holds run 'first'" in capsys.readouterr().err
    assert main([str(second), "output.if_exists=replace", "--dry-run"]) == 0
    assert f"this run ('second') writes to {out}/_replace-second and replaces it only once it has finished" \
        in capsys.readouterr().out
    assert main([str(second), "output.if_exists=beside", "--dry-run"]) == 0
    assert f"writes beside it, to {out}-second" in capsys.readouterr().out
    assert snapshot(out) == before

    # A replacement whose driver dies after generating everything (before the summary): nothing lost.
    import pipeline.run as run_module

    def dies(*args, **kwargs):
        raise RuntimeError("driver killed")

    monkeypatch.setattr(run_module, "build_summary", dies)
    with pytest.raises(RuntimeError, match="driver killed"):
        run_pipeline(load_config(second, ["output.if_exists=replace"]))
    assert len(list((out / "_replace-second").glob("part-*.parquet"))) == 3
    assert {k: v for k, v in snapshot(out).items() if not k.startswith("_replace-")} == before
    monkeypatch.undo()

    # The replacement again, to the end: the output holds the second run only, every row once.
    summary = run_pipeline(load_config(second, ["output.if_exists=replace"]))
    assert summary["output_plan"]["found"]["rows_by_run"] == {"first": 6}
    table = read_output(str(out), ["run_id", "max_new_tokens", "error"]).to_pylist()
    assert len(table) == 6 and {(r["run_id"], r["max_new_tokens"], r["error"]) for r in table} == {("second", 5, None)}
    assert json.loads((out / SUMMARY_NAME).read_text())["run_id"] == "second"
    assert not list(out.glob("_replace-*"))

    # Beside: a third run next to it; the output is untouched.
    kept = snapshot(out)
    summary = run_pipeline(load_config(second, ["output.if_exists=beside", "run.run_id=third"]))
    assert summary["output_plan"]["write_url"] == f"{out}-third" and snapshot(out) == kept
    assert {r["run_id"] for r in read_output(f"{out}-third", ["run_id"]).to_pylist()} == {"third"}
    assert len(read_output(f"{out}-third", ["run_id"])) == 6
