"""The whole job end to end on tiny artifacts: local files and a real S3 server on loopback.

Every input row yields exactly one output row (result or error) across worker crashes and a
killed-then-resumed run; greedy results through the pipeline equal plain autoregressive
decoding of the same prompt; start-up problems are clear errors before any work.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray

from dart_worker.artifacts.loading import load_target
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.prompt_format import encode_prompt, format_user_prompt
from dart_worker.sampling.params import SamplingParams
from pipeline.data.outputs import read_output, resume_progress
from pipeline.run import SUMMARY_NAME, main, run_pipeline
from pipeline.settings.config import load_config
from pipeline.worker import CRASH_ONCE_ENV
from tests.ray_processes import kill_ray_processes_under, short_temp_dir
from tests.tiny_models import TINY_VOCAB

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def artifacts(tiny_artifacts):
    """A tiny target dir, a random draft head checkpoint and a trie for its tokenizer (the
    session's, tests/conftest.py; other modules import this fixture by name)."""
    return tiny_artifacts


def word_prompt(rng, n: int) -> str:
    return " ".join(f"w{int(t)}" for t in rng.integers(4, TINY_VOCAB, size=n))


def write_inputs(path: Path, good: int, seed: int = 0) -> dict[str, str]:
    """JSONL with `good` valid rows plus one of each kind of bad row; returns id -> prompt."""
    rng = np.random.default_rng(seed)
    prompts = {f"row-{k}": word_prompt(rng, int(rng.integers(3, 12))) for k in range(good)}
    lines = [json.dumps({"id": k, "prompt": p}) for k, p in prompts.items()]
    lines += [
        '{"id": "broken", "prompt": ',  # malformed JSON
        json.dumps({"id": "empty", "prompt": ""}),
        json.dumps({"id": "number", "prompt": 42}),
        json.dumps({"id": "noprompt"}),
        json.dumps({"id": "toolong", "prompt": "w5 " * 400}),
        json.dumps({"id": "row-0", "prompt": "w9 w9"}),  # duplicate id
    ]
    path.write_text("\n".join(lines) + "\n")
    return prompts


def config_file(tmp_path: Path, artifacts: dict, inputs: list[str], output: str, **extra) -> Path:
    """A job's config on the tiny artifacts. One worker unless a test asks for more: each worker is
    an actor process that imports torch and transformers (several CPU-seconds on the suite's 2
    cores); the tests about rows spread over several workers say `resources__num_workers=2`."""
    cfg = {
        "input": {"urls": inputs, "format": "jsonl", "max_prompt_chars": 1000},
        "model": {"target": artifacts["target"], "draft_head": artifacts["head"], "trie": artifacts["trie"],
                  "dtype": "fp32", "device": "cpu"},
        "decoding": {"mode": "dart", "temperature": 0.0, "max_new_tokens": 12, "tree": {"budget": 8}},
        "resources": {"num_workers": 1, "num_cpus_per_worker": 0.5, "batch_size": 3},
        "output": {"url": output, "rows_per_file": 4},
        "run": {"run_id": "test-run", "progress_interval_s": 1},
    }
    for key, value in extra.items():
        section, name = key.split("__")
        cfg[section][name] = value
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(cfg))
    return path


def expected_greedy(artifacts: dict, prompts: dict[str, str], max_new_tokens: int = 12) -> dict[str, list[int]]:
    """Plain autoregressive greedy decoding of the same prompts, outside the pipeline."""
    model, tokenizer = load_target(artifacts["target"], dtype="fp32", device="cpu")
    engine = build_engine(EngineParts.from_model(model, tokenizer), "ar")  # the workers' EOS rule
    ids = [encode_prompt(tokenizer, format_user_prompt(tokenizer, p), templated=True) for p in prompts.values()]
    results = engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
    return {k: r.token_ids for k, r in zip(prompts, results)}


def test_every_row_once_with_errors_and_lossless_results(tmp_path, artifacts, shared_ray, monkeypatch):
    """On the session's Ray cluster: the crash hook reaches this job's workers (forwarded), so a
    worker still dies mid-batch and Ray still redoes the batch."""
    marker = tmp_path / "crashed"
    monkeypatch.setenv(CRASH_ONCE_ENV, str(marker))  # one worker dies mid-batch; Ray redoes the batch
    prompts = write_inputs(tmp_path / "in.jsonl", good=10)
    cfg = load_config(config_file(tmp_path, artifacts, [str(tmp_path / "in.jsonl")], str(tmp_path / "out"),
                                  resources__num_workers=2))
    summary = run_pipeline(cfg)
    assert marker.exists(), "the crash hook never fired"

    table = read_output(str(tmp_path / "out")).to_pylist()
    keys = [r["row_key"] for r in table]
    assert len(keys) == len(set(keys)) == 16  # 10 good + 6 bad, each exactly once
    by_id = {}
    for r in table:
        by_id.setdefault(r["id"], []).append(r)
    errors = {r["id"]: r["error"] for r in table if r["error"]}
    assert "empty" in errors["empty"] and "not a string" in errors["number"]
    assert "missing prompt" in errors["noprompt"] and "longer than" in errors["toolong"]
    assert any("malformed JSON" in (r["error"] or "") for r in table)
    assert sum("duplicate id" in (r["error"] or "") for r in by_id["row-0"]) == 1

    expected = expected_greedy(artifacts, prompts)
    for key, tokens in expected.items():
        ok = [r for r in by_id[key] if not r["error"]]
        assert len(ok) == 1 and ok[0]["token_ids"] == tokens, key
        assert ok[0]["mode"] == "dart" and ok[0]["run_id"] == "test-run" and ok[0]["rounds"] >= 1
    assert all(r["finished_at"] is not None and r["finished_at"].tzinfo is not None for r in table)
    assert summary["this_run"]["rows"] == 16 and summary["this_run"]["rows_failed"] == 6
    assert summary["duplicate_ids"]["count"] == 1
    assert json.loads((tmp_path / "out" / SUMMARY_NAME).read_text())["run_id"] == "test-run"


def test_a_sampled_job_reproduces_its_rows_under_another_mode_and_batching(tmp_path, artifacts, shared_ray):
    """Per-row seeds + coupled sampling: a seeded sampled job writes the same tokens for every row
    under `ar` with one worker and under `dart_lookup` (job cache and job n-gram learning as rows
    finish) with two workers, other batch sizes and continuous batching."""
    prompts = write_inputs(tmp_path / "in.jsonl", good=8, seed=3)
    runs = {}
    for name, extra in {"ar": dict(decoding__mode="ar", resources__num_workers=1, resources__batch_size=5),
                        "dart_lookup": dict(decoding__mode="dart_lookup", resources__num_workers=2,
                                            resources__batch_size=3, resources__max_live=2)}.items():
        path = config_file(tmp_path, artifacts, [str(tmp_path / "in.jsonl")], str(tmp_path / name),
                           decoding__temperature=1.0, decoding__top_p=0.9, decoding__seed=7, **extra)
        run_pipeline(load_config(path))
        runs[name] = {r["row_key"]: r["token_ids"] for r in read_output(str(tmp_path / name)).to_pylist()
                      if not r["error"]}
    assert len(runs["ar"]) == len(prompts)
    assert runs["dart_lookup"] == runs["ar"]
    assert len({tuple(t) for t in runs["ar"].values()}) == len(prompts)


def test_killed_run_resumes_without_duplicates(tmp_path, artifacts, shared_ray):
    """A run killed with its whole process group (driver and its private Ray, as a pod dies) mid-job;
    the resumed run (on the session's cluster) writes every row exactly once."""
    write_inputs(tmp_path / "in.jsonl", good=24, seed=1)
    out = tmp_path / "out"
    cfg = config_file(tmp_path, artifacts, [str(tmp_path / "in.jsonl")], str(out),
                      output__rows_per_file=2, resources__num_workers=1, resources__batch_size=1,
                      decoding__max_new_tokens=24)
    ray_tmp = short_temp_dir("rk-")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_TMPDIR": ray_tmp}
    for joins_the_session_cluster in ("RAY_ADDRESS", "RAY_RUNTIME_ENV_HOOK"):  # the killed run's Ray is its own
        env.pop(joins_the_session_cluster, None)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.run", str(cfg)], cwd=tmp_path, env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and len(list(out.glob("part-*.parquet"))) < 3 and proc.poll() is None:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    kill_ray_processes_under(ray_tmp)  # its Ray instance, and nobody else's
    shutil.rmtree(ray_tmp, ignore_errors=True)
    written = {r for p in out.glob("part-*.parquet") for r in pq.read_table(p, columns=["row_key"])["row_key"]
               .to_pylist()}
    assert 0 < len(written) < 30, "kill the run half-way: some but not all rows written"

    summary = run_pipeline(load_config(cfg, ["run.resume=true"]))
    assert summary["this_run"]["rows_skipped_as_done"] == len(written)
    assert summary["this_run"]["rows"] == 30 - len(written)
    keys = read_output(str(out))["row_key"].to_pylist()
    assert len(keys) == len(set(keys)) == 30


def test_n_samples_resume_regenerates_only_the_missing_samples(tmp_path, artifacts, shared_ray):
    """n = 3 completions per prompt, written 2 rows per part, so a prompt's samples spread over
    parts; parts lost as a crash between two writes loses them (parts are atomic), the resumed run
    generates exactly the samples missing, with the same tokens (each sample's seed is its own)."""
    prompts = write_inputs(tmp_path / "in.jsonl", good=5, seed=4)
    out = tmp_path / "out"
    cfg = config_file(tmp_path, artifacts, [str(tmp_path / "in.jsonl")], str(out), output__rows_per_file=2,
                      decoding__mode="dart_lookup", decoding__temperature=1.0, decoding__n=3, decoding__seed=3,
                      resources__num_workers=1, resources__batch_size=2)
    run_pipeline(load_config(cfg))
    first = {r["row_key"]: r for r in read_output(str(out)).to_pylist()}
    ok = [r for r in first.values() if not r["error"]]
    assert len(ok) == 3 * len(prompts) and len(first) == len(ok) + 6  # bad rows: one error row each
    assert {(r["sample_index"], r["n"]) for r in ok} == {(0, 3), (1, 3), (2, 3)}
    for key in prompts:  # three different samples of each prompt
        assert len({tuple(first[k]["token_ids"]) for k in (f"id:{key}", f"sample:1:id:{key}",
                                                         f"sample:2:id:{key}")}) > 1, key

    parts = sorted(out.glob("part-*.parquet"))
    lost = {k for p in parts[::3] for k in pq.read_table(p, columns=["row_key"])["row_key"].to_pylist()}
    for p in parts[::3]:
        p.unlink()
    assert any(k.startswith("sample:") for k in lost) and len(lost) < len(first)
    assert resume_progress(str(out)).partial, "some prompt must have lost only some of its samples"
    ray.shutdown()
    summary = run_pipeline(load_config(cfg, ["run.resume=true"]))
    assert summary["this_run"]["rows"] == len(lost)
    assert summary["this_run"]["rows_skipped_as_done"] == len(first) - len(lost)
    again = {r["row_key"]: r for r in read_output(str(out)).to_pylist()}
    assert set(again) == set(first)
    assert {k for k, r in again.items() if r["run_id"] == "test-run"} == set(first)
    for key in first:
        assert again[key]["token_ids"] == first[key]["token_ids"] and again[key]["error"] == first[key]["error"], key


def test_startup_errors_are_clear_and_early(tmp_path, artifacts, capsys):
    write_inputs(tmp_path / "in.jsonl", good=2)
    base = config_file(tmp_path, artifacts, [str(tmp_path / "in.jsonl")], str(tmp_path / "out"))
    corrupt = tmp_path / "corrupt.ngram"
    corrupt.write_bytes(Path(artifacts["trie"]).read_bytes()[:100])
    bad_head = tmp_path / "bad_head"
    bad_head.mkdir()
    (bad_head / "config.json").write_text("{not json")
    cases = [
        (["model.trie=" + str(tmp_path / "missing.ngram")], "model.trie"),
        (["model.trie=" + str(corrupt)], "model.trie"),
        (["model.draft_head=" + str(bad_head)], "model.draft_head"),
        (["input.urls=[" + str(tmp_path / "nothing-*.jsonl") + "]"], "input"),
        (["model.target=" + str(tmp_path / "no-model")], "model.target"),
    ]
    for overrides, where in cases:
        assert main([str(base), *overrides]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and where in err, (overrides, err)
    assert not (tmp_path / "out" / SUMMARY_NAME).exists()


def test_cpu_budget_that_would_deadlock_is_refused(tmp_path, artifacts, monkeypatch):
    from pipeline.run import StartupError, check_cpu_budget

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = config_file(tmp_path, artifacts, ["x.jsonl"], str(tmp_path / "out"))
    check_cpu_budget(load_config(path, ["resources.num_workers=1", "resources.num_cpus_per_worker=1"]))
    tight = load_config(path, ["resources.num_workers=2", "resources.num_cpus_per_worker=1"])
    with pytest.raises(StartupError, match="leave none for reading"):
        check_cpu_budget(tight)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # an external cluster may autoscale: only a warning
    check_cpu_budget(tight)
