"""`python -m pipeline.run config.yaml --dry-run`: every start-up check of the real run, a plan,
exit 0 and nothing generated; each kind of problem is exit 2 with one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from dart_worker.artifacts.fingerprint import tokenizer_fingerprint
from dart_worker.head.draft_checkpoint import save_draft_head
from dart_worker.head.draft_head import DartDraftHead
from ngram_native import build_trie
from pipeline.data.outputs import rows_to_table, write_part
from pipeline.run import main
from tests.tiny_models import TINY_VOCAB, save_tiny_artifacts, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    found = save_tiny_artifacts(root)
    # A head trained for another target (a larger vocabulary) ...
    other = tiny_model("llama", vocab_size=TINY_VOCAB + 32)
    torch.manual_seed(0)
    save_draft_head(DartDraftHead.random_init(other.config, other.get_input_embeddings(), draft_length=3),
                    root / "other_head")
    # ... and a trie counted with another tokenizer.
    docs = [np.random.default_rng(0).integers(4, TINY_VOCAB, size=40).astype(np.int32)]
    build_trie(docs, root / "other.ngram", order=3, vocab_size=TINY_VOCAB + 32,
               tokenizer_fingerprint=tokenizer_fingerprint(tiny_tokenizer(TINY_VOCAB + 32)))
    return found | {"other_head": str(root / "other_head"), "other_trie": str(root / "other.ngram")}


def write_config(tmp_path: Path, artifacts: dict, **sections) -> Path:
    cfg = {
        "input": {"urls": [str(tmp_path / "in" / "*.jsonl")]},
        "model": {"target": artifacts["target"], "draft_head": artifacts["head"], "trie": artifacts["trie"],
                  "dtype": "fp32", "device": "cpu"},
        "decoding": {"mode": "dart", "max_new_tokens": 8},
        "resources": {"num_workers": 1, "num_cpus_per_worker": 0.5, "batch_size": 3},
        "output": {"url": str(tmp_path / "out")},
        "run": {"run_id": "dry"},
    }
    for section, values in sections.items():
        cfg[section].update(values)
    (tmp_path / "in").mkdir(exist_ok=True)
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps({"id": k, "prompt": f"w{4 + k}"}) + "\n"
                                                     for k in range(5)) + "\n")
    (tmp_path / "in" / "b.jsonl").write_text('{"id": "x", "prompt": "w7"}\n{"id": "y", "prompt": "w8"}')
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(cfg))
    return path


def test_dry_run_checks_everything_and_generates_nothing(tmp_path, artifacts, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray.shutdown()
    assert main([str(write_config(tmp_path, artifacts)), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "config valid" in out
    assert "target" in out and str(Path(artifacts["target"]).resolve()) in out
    assert artifacts["head"] in out and "(fits the target)" in out
    assert artifacts["trie"] in out and "(tokenizer matches)" in out
    assert "2 jsonl file(s), 7 rows" in out and "a.jsonl  (5 rows)" in out and "b.jsonl  (2 rows)" in out
    assert "will be created" in out and "fresh output" in out
    assert "workers     1 x (0.5 CPU, 1 torch threads), batch 3 (3 decoding at a time), mode dart" in out
    assert "kv cache" in out and "KiB per token" in out and "3 sequences x" in out
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"
    assert not ray.is_initialized(), "a dry run starts no Ray"


def test_dry_run_reports_resume_state(tmp_path, artifacts, capsys):
    path = write_config(tmp_path, artifacts, run={"run_id": "dry", "resume": True})
    write_part(rows_to_table([{"row_key": "id:0", "id": "0", "run_id": "earlier"},
                              {"row_key": "id:1", "id": "1", "run_id": "earlier"}]), str(tmp_path / "out"), "earlier")
    assert main([str(path), "--dry-run"]) == 0
    assert "(exists; resume: 2 rows already written will be skipped)" in capsys.readouterr().out
    # mode ar needs neither head nor trie: the plan says so
    assert main([str(path), "decoding.mode=ar", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "draft head  not used by mode ar" in out and "trie        not used by mode ar" in out


@pytest.mark.parametrize(("overrides", "where", "detail"), [
    (["decoding.mode=nope"], "invalid config", "decoding.mode"),
    (["no_such_section.key=1"], "invalid config", "no_such_section"),
    (["input.urls=[/nonexistent/in-*.jsonl]"], "input", "nonexistent"),
    (["model.target=/nonexistent/model"], "model.target", "does not exist"),
    (["model.draft_head=OTHER_HEAD"], "model.draft_head", "vocab_size"),
    (["model.tap_layers=[0,1,2]"], "model.draft_head", "tap"),
    (["model.trie=OTHER_TRIE"], "model.trie", "tokenizer"),
    (["model.trie=/nonexistent/x.ngram"], "model.trie", "x.ngram"),
    (["output.url=nosuchprotocol://bucket/out"], "output", "not writable"),
    (["resources.num_workers=4", "resources.num_cpus_per_worker=1"], "resources", "leave none"),
])
def test_dry_run_failures_are_one_line_and_exit_2(tmp_path, artifacts, capsys, monkeypatch, overrides, where, detail):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("pipeline.startup.dry_run.local_cpu_count", lambda: 2)
    path = write_config(tmp_path, artifacts)
    overrides = [o.replace("OTHER_HEAD", artifacts["other_head"]).replace("OTHER_TRIE", artifacts["other_trie"])
                 for o in overrides]
    assert main([str(path), *overrides, "--dry-run"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("error: ") and where in err and detail in err, err
    assert "\n" not in err or err.startswith("error: invalid config"), err  # config problems list one per line
    assert "dry run" not in captured.out


def test_dry_run_estimates_large_and_parquet_inputs(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.startup import dry_run

    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": ["x", "y", "z"]}), tmp_path / "p.parquet")
    assert dry_run.estimate_rows(str(tmp_path / "p.parquet"), "parquet") == (3, True)
    line = json.dumps({"id": "0", "prompt": "w5 " * 20}) + "\n"
    (tmp_path / "big.jsonl").write_text(line * 3000)
    monkeypatch.setattr(dry_run, "EXACT_COUNT_BYTES", 10_000)
    monkeypatch.setattr(dry_run, "SAMPLE_BYTES", 5_000)
    rows, exact = dry_run.estimate_rows(str(tmp_path / "big.jsonl"), "jsonl")
    assert not exact and abs(rows - 3000) <= 30
