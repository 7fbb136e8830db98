"""`python -m jobs.gpu_acceptance device=cpu`: the GPU acceptance run, on a CPU, so it cannot rot.

Small shapes keep it to about a minute; everything a GPU run does runs here too (every drafter
against transformers' generate, seeded sampling against `ar`, the chi-square test, every timing
section), and a planted engine bug must turn it red.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats as scipy_stats

from dart_bench.gpu_acceptance.correctness import chi_square_p_value
from dart_worker.target import TargetAdapter
from jobs.gpu_acceptance.__main__ import main

SMALL = ["device=cpu", "prompts=2", "new_tokens=12", "chi_square_draws=400", "context=24", "generate_tokens=6",
         "repeats=1", "verify_batches=[1,2]", "verify_rows=[1,4]", "drafting_tokens=6", "throughput_batch=2",
         "budget=8", "time_budget_s=1e9"]


def test_the_acceptance_run_passes_on_a_cpu_and_reports_every_section(tmp_path, capsys):
    assert main([*SMALL, f"output_dir={tmp_path}"]) == 0
    report = json.loads((tmp_path / "acceptance.json").read_text())
    markdown = (tmp_path / "acceptance.md").read_text()
    assert report["passed"] and report["environment"]["device"] == "cpu"
    cases = report["correctness"]["cases"]
    modes = {c["mode"] for c in cases}
    assert {"ar", "chain", "ddtree", "dart", "lookup", "dart_lookup", "ddtree_lookup"} <= modes
    assert {c["family"] for c in cases} == {"llama", "qwen3", "gemma3"}
    assert {c["check"] for c in cases} == {"greedy, alone", "greedy, ragged batch", "greedy, continuous batching",
                                          "seeded sampling = ar"}
    assert all(c["differs"] == 0 for c in cases)
    assert max(c["tau"] for c in cases if c["mode"] == "dart") > 1.0, "trees were accepted (compaction exercised)"
    assert report["correctness"]["chi_square"]["passed"]
    (shape,) = report["speed"]
    assert shape["shape"] == "small-llama" and not shape["skipped"]
    assert {(c["batch"], c["rows"]) for c in shape["verify"]} == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert shape["per_token"]["ar_ms_per_token"] > 0 and shape["per_token"]["transformers_ms_per_token"] > 0
    assert {c["mode"] for c in shape["drafting"]} == {"dart", "dart_lookup"}
    assert {c["gqa"] for c in shape["gqa"]} == {"pack", "enable_gqa", "repeat"}
    assert all(c["syncs_per_round"] >= 1 for c in shape["syncs"])  # counted, not assumed to be zero
    assert {c["mode"] for c in shape["throughput"]} == {"ar", "dart_lookup"}
    assert "# GPU acceptance run: PASSED" in markdown and "| llama | dart_lookup |" in markdown
    assert "Verify forward" in markdown and "syncs per round" in markdown
    assert "PASSED" in capsys.readouterr().out


def test_a_planted_engine_bug_fails_the_run(tmp_path, monkeypatch):
    """Compaction that keeps the root's K/V in place of the last accepted node's is caught (exit 1).
    (Keeping the right rows in another order would be no bug: keys carry their positions.)"""
    real_commit = TargetAdapter.commit

    def wrong_rows(self, state, block_start, accepted_rows):
        rows = [list(r[:-1]) + list(r[:1]) if len(r) > 1 else r for r in accepted_rows]
        return real_commit(self, state, block_start, rows)

    monkeypatch.setattr(TargetAdapter, "commit", wrong_rows)
    assert main([*SMALL, "sections=[correctness]", "families=[llama]", "modes=[ar,dart]", "chi_square_draws=0",
                 f"output_dir={tmp_path}"]) == 1
    report = json.loads((tmp_path / "acceptance.json").read_text())
    failed = {(c["mode"], c["check"]) for c in report["correctness"]["cases"] if not c["passed"]}
    assert ("dart", "greedy, ragged batch") in failed and not any(mode == "ar" for mode, _ in failed)
    assert "**FAIL" in (tmp_path / "acceptance.md").read_text()


def test_bad_settings_are_one_line_errors(tmp_path, capsys):
    assert main(["device=cpu", "sections=[speedy]", f"output_dir={tmp_path}"]) == 2
    assert "sections: unknown ['speedy']" in capsys.readouterr().err
    assert main(["device=tpu", f"output_dir={tmp_path}"]) == 2
    assert "device/dtype" in capsys.readouterr().err


def test_chi_square_p_value_matches_scipy():
    rng = np.random.default_rng(0)
    expected = rng.uniform(5, 50, size=12)
    observed = rng.poisson(expected).astype(float)
    ours = chi_square_p_value(observed, expected)
    theirs = scipy_stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue
    assert ours == pytest.approx(theirs, rel=1e-9)


def test_it_needs_nothing_a_bare_gpu_machine_lacks(tmp_path):
    """The lent GPU machine has no ray, gguf, ijson, s3fs, zstandard, moto or matplotlib: the run
    must not import them (omegaconf travels as a wheel, docs/gpu.md)."""
    import subprocess
    import sys
    from pathlib import Path

    absent = ("ray", "gguf", "ijson", "s3fs", "zstandard", "moto", "matplotlib", "pyarrow.dataset")
    args = [*SMALL, "families=[gemma3]", "modes=[ar,dart_lookup]", "chi_square_draws=0", f"output_dir={tmp_path}"]
    code = ("import sys\n"
            f"for name in {absent!r}: sys.modules[name] = None  # import raises ImportError\n"
            "from jobs.gpu_acceptance.__main__ import main\n"
            f"sys.exit(main({args!r}))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "acceptance.md").exists()
