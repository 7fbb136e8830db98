"""`python -m jobs.gpu_acceptance`: the GPU acceptance run, proven on a CPU so it cannot rot.

- the GPU's kernel plan (`shapes=bucketed`, `gqa=pack`, `logits=batched`, `warp=dense`) forced on
  CPU tensors runs every section end to end, in a process where the packages a bare GPU machine
  lacks cannot be imported; a planted bug in the bucketed path turns it red (and leaves the CPU's
  own plan green: the forced plan is what reaches that code);
- the run writes its report as it goes, survives a section that raises, has one deadline (a
  section cut off at its next result; a hung one cut off by the watchdog, which writes the report
  and ends the process), and exits 1 only for a failed or raising correctness section.

Every run uses tiny models and one torch thread (on a shared 2-core machine, two threads spin
against each other: 20x slower here), so each takes seconds of CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from dart_bench.gpu_acceptance import plan, speed
from dart_bench.gpu_acceptance.correctness import chi_square_p_value
from dart_bench.gpu_acceptance.report import markdown
from dart_bench.gpu_acceptance.runner import AcceptanceRun, Deadline, Section, process_started
from dart_worker.target.tree_batch import TreeBatch
from jobs.gpu_acceptance.__main__ import main

REPO = Path(__file__).resolve().parents[1]
GPU_PLAN = ["kernels.shapes=bucketed", "kernels.gqa=pack", "kernels.logits=batched", "kernels.warp=dense",
            "kernels.projection=linear"]  # what dart_worker.hardware.kernels picks on CUDA
SMALL = ["device=cpu", "prompts=2", "new_tokens=12", "chi_square_draws=300", "shapes=[tiny-llama]", "context=24",
         "generate_tokens=6", "repeats=1", "verify_batches=[1,2]", "verify_rows=[1,4]", "gqa_batches=[1,2]",
         "gqa_rows=[1,4]", "drafting_tokens=6", "throughput_batch=2", "budget=8", "time_budget_s=1e9"]
# What the lent GPU machine does not have (omegaconf travels as a wheel, docs/gpu.md).
ABSENT_ON_THE_GPU_MACHINE = ("ray", "gguf", "ijson", "s3fs", "zstandard", "moto", "matplotlib", "pyarrow.dataset")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_in_a_process(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def read_report(directory: Path) -> tuple[dict, dict, str]:
    report = json.loads((directory / "acceptance.json").read_text())
    return report, {r["name"]: r for r in report["sections"]}, (directory / "acceptance.md").read_text()


# ------------------------------------------------------------------------- the GPU plan on a CPU

@pytest.mark.slow  # ~16 s of CPU in a fresh process; 30-60 s of wall time on a shared 2-core machine
def test_the_gpu_plan_runs_every_section_on_a_cpu_without_what_a_bare_gpu_machine_lacks(tmp_path):
    args = [*SMALL, *GPU_PLAN, "families=[llama,gemma3]", f"output_dir={tmp_path}"]
    done = run_in_a_process("import sys\n"
                            f"for name in {ABSENT_ON_THE_GPU_MACHINE!r}: sys.modules[name] = None  # ImportError\n"
                            "from jobs.gpu_acceptance.__main__ import main\n"
                            f"sys.exit(main({args!r}))\n")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report, sections, md = read_report(tmp_path)
    assert report["state"] == "finished" and report["exit_code"] == 0
    statuses = {r["name"]: r["status"] for r in report["sections"]}
    assert set(statuses.values()) == {"passed"}, statuses
    assert list(sections) == [  # the most valuable first: one family, the first shape's ar and verify, the rest
        "correctness/llama", "speed/tiny-llama/build", "speed/tiny-llama/per_token", "speed/tiny-llama/verify",
        "correctness/gemma3", "correctness/chi-square", "speed/tiny-llama/gqa", "speed/tiny-llama/drafting",
        "speed/tiny-llama/syncs", "speed/tiny-llama/throughput"]
    (built,) = sections["speed/tiny-llama/build"]["results"]
    assert built["kernels"] == {"projection": "linear", "warp": "dense", "logits": "batched", "gqa": "pack",
                                "shapes": "bucketed"}
    cases = [c for family in ("llama", "gemma3") for c in sections[f"correctness/{family}"]["results"]]
    assert {"ar", "chain", "ddtree", "dart", "lookup", "dart_lookup", "ddtree_lookup"} <= {c["mode"] for c in cases}
    assert {c["check"] for c in cases} == {"greedy, alone", "greedy, ragged batch", "greedy, continuous batching",
                                          "seeded sampling = ar"}
    assert all(c["differs"] == 0 for c in cases)
    assert max(c["tau"] for c in cases if c["mode"] == "dart") > 1.0, "trees were accepted (compaction exercised)"
    assert sections["correctness/chi-square"]["results"][0]["passed"]
    assert {(c["batch"], c["rows"]) for c in sections["speed/tiny-llama/verify"]["results"]} == {
        (1, 1), (1, 4), (2, 1), (2, 4)}
    assert {c["gqa"] for c in sections["speed/tiny-llama/gqa"]["results"]} == {"pack", "enable_gqa", "repeat"}
    assert {c["mode"] for c in sections["speed/tiny-llama/drafting"]["results"]} == {"dart", "dart_lookup"}
    assert all(c["syncs_per_round"] >= 1 for c in sections["speed/tiny-llama/syncs"]["results"])
    assert {c["mode"] for c in sections["speed/tiny-llama/throughput"]["results"]} == {"ar", "dart_lookup"}
    assert md.startswith("# GPU acceptance run: PASSED") and "kernels forced: shapes=bucketed" in md
    assert "| gemma3 | dart_lookup |" in md and "Verify forward" in md and "syncs per round" in md
    assert "PASSED" in done.stdout


def padding_rows_leak_into_real_rows(monkeypatch) -> None:
    """The planted bug: a bucketed block's padding rows (rows past a tree, `pad_to`) become
    visible to the real rows, which then attend to junk. Exact blocks are built without `pad_to`."""
    real = TreeBatch.from_trees.__func__

    def leaky(cls, root_tokens, trees, device, *, pad_to=None, **kwargs):
        batch = real(cls, root_tokens, trees, device, pad_to=pad_to, **kwargs)
        if pad_to is not None:
            for b, nodes in enumerate(batch.num_nodes):
                batch.ancestor[b, : 1 + nodes, 1 + nodes:] = True
        return batch

    monkeypatch.setattr(TreeBatch, "from_trees", classmethod(leaky))


@pytest.mark.parametrize("plan_name", ["gpu", "cpu"])
def test_a_planted_bug_in_the_bucketed_path_fails_the_gpu_plan(tmp_path, monkeypatch, plan_name):
    padding_rows_leak_into_real_rows(monkeypatch)
    forced = GPU_PLAN if plan_name == "gpu" else []
    code = main([*SMALL, *forced, "sections=[correctness]", "families=[llama]", "modes=[ar,dart_lookup]",
                 "chi_square_draws=0", f"output_dir={tmp_path}"])
    _, sections, md = read_report(tmp_path)
    failed = {(c["mode"], c["check"]) for c in sections["correctness/llama"]["results"] if not c["passed"]}
    if plan_name == "cpu":  # the CPU's own plan (exact shapes) never pads a block: it cannot see this bug
        assert code == 0 and not failed
        return
    assert code == 1 and sections["correctness/llama"]["status"] == "failed"
    assert ("dart_lookup", "greedy, ragged batch") in failed and not any(mode == "ar" for mode, _ in failed)
    assert md.startswith("# GPU acceptance run: FAILED") and "**FAIL" in md


# ------------------------------------------------------------------------- failures and the deadline

def test_a_raising_section_and_a_hung_one_leave_a_complete_report_and_exit_1(tmp_path):
    """qwen3's correctness raises, gemma3's hangs past the deadline: the watchdog writes the report
    (llama's results kept, both named, the rest skipped) and ends the process with exit 1."""
    code = f"""
import sys, threading
from dart_bench.gpu_acceptance import plan
from jobs.gpu_acceptance.__main__ import main

def family_cases(family, *args):
    if family == "qwen3":
        raise RuntimeError("a kernel that only this device runs")
    if family == "gemma3":
        threading.Event().wait()  # hangs: only the watchdog ends this
    yield {{"family": family, "mode": "ar", "check": "greedy, alone", "requests": 1, "identical": 1, "ties": 0,
           "differs": 0, "tau": 1.0, "details": [], "passed": True}}

plan.family_cases = family_cases
main(["device=cpu", "sections=[correctness]", "families=[llama,qwen3,gemma3]", "chi_square_draws=50",
      "time_budget_s=2", "watchdog_grace_s=0.5", "output_dir={tmp_path}"])
sys.exit(99)  # never reached: the watchdog exits
"""
    done = run_in_a_process(code, timeout=120)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    report, sections, md = read_report(tmp_path)
    assert report["state"] == "cut off by the watchdog" and report["exit_code"] == 1
    assert sections["correctness/llama"]["status"] == "passed" and len(sections["correctness/llama"]["results"]) == 1
    qwen3 = sections["correctness/qwen3"]
    assert qwen3["status"] == "error: RuntimeError: a kernel that only this device runs"
    assert qwen3["error"]["type"] == "RuntimeError" and any("family_cases" in f for f in qwen3["error"]["frames"])
    assert sections["correctness/gemma3"]["status"] == "skipped: time"
    assert sections["correctness/gemma3"]["cut_off_by"] == "watchdog"
    assert sections["correctness/chi-square"]["status"] == "skipped: time"
    assert md.startswith("# GPU acceptance run: FAILED")
    assert "| correctness/qwen3 | **error: RuntimeError" in md
    assert "| correctness/gemma3 | skipped: time (cut off)" in md
    assert "watchdog" in done.stdout


def test_the_report_is_written_as_it_goes_and_a_section_is_cut_at_its_next_result(tmp_path, monkeypatch):
    """A timing section raises and a correctness section passes the deadline halfway: the first
    is recorded as an error, the second keeps the result it had and stops; no correctness check
    failed, so the exit code is 0. While a section runs, the files already hold the ones before."""
    seen_on_disk = []

    def family_cases(family, *args):
        report = json.loads((tmp_path / "acceptance.json").read_text())
        seen_on_disk.append({r["name"]: r["status"] for r in report["sections"]})
        yield {"family": family, "mode": "ar", "check": "greedy, alone", "requests": 1, "identical": 1, "ties": 0,
               "differs": 0, "tau": 1.0, "details": [], "passed": True}
        if family == "qwen3":
            time.sleep(1.6)  # the deadline passes here
            yield {"family": family, "mode": "dart", "check": "greedy, alone", "requests": 1, "identical": 1,
                   "ties": 0, "differs": 0, "tau": 1.0, "details": [], "passed": True}
            raise AssertionError("a section cut off at the deadline is not resumed")

    def measure(self, name):
        if name == "per_token":
            raise ValueError("no such kernel")
        yield from ()

    def build(self):
        yield {"shape": self.shape, "dtype": "float32", "parameters_b": 0.0, "kernels": {}, "build_s": 0.0}

    monkeypatch.setattr(plan, "family_cases", family_cases)
    monkeypatch.setattr(speed.ShapeBench, "measure", measure)
    monkeypatch.setattr(speed.ShapeBench, "build", build)
    code = main(["device=cpu", "families=[llama,qwen3,gemma3]", "chi_square_draws=0", "shapes=[tiny-llama]",
                 "time_budget_s=1.5", f"output_dir={tmp_path}"])
    report, sections, md = read_report(tmp_path)
    assert code == 0 and report["exit_code"] == 0 and report["state"] == "finished"
    assert seen_on_disk[1]["correctness/llama"] == "passed" and seen_on_disk[1]["correctness/qwen3"] == "running"
    assert seen_on_disk[1]["speed/tiny-llama/per_token"].startswith("error: ValueError: no such kernel")
    qwen3 = sections["correctness/qwen3"]
    assert qwen3["status"] == "skipped: time" and qwen3["cut_off"] and len(qwen3["results"]) == 2
    assert sections["correctness/gemma3"]["status"] == "skipped: time" and "results" not in sections[
        "correctness/gemma3"]
    assert sections["speed/tiny-llama/verify"]["status"] == "passed"
    assert all(sections[f"speed/tiny-llama/{n}"]["status"] == "skipped: time"
               for n in ("gqa", "drafting", "syncs", "throughput"))
    assert md.startswith("# GPU acceptance run: ERRORS") and "raised ValueError: no such kernel" in md


def test_out_of_device_memory_frees_it_and_the_run_goes_on(tmp_path):
    freed = []

    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        yield

    sections = [Section("speed/big/verify", "speed", out_of_memory),
                Section("correctness/llama", "correctness", lambda: iter([{"passed": True}]))]
    report = {"config": {}, "environment": {"cpu": "x", "device": "cpu", "torch": "t", "torch_cuda": None,
                                            "transformers": "5", "python": "3", "dtype": "float32"}}
    run = AcceptanceRun(report, sections, tmp_path, Deadline(time.monotonic(), 60), 1.0, markdown,
                        free_memory=lambda: freed.append(True), log=lambda line: None)
    assert run.run() == 0 and freed == [True]
    assert [r["status"] for r in report["sections"]] == ["error: OutOfMemoryError: CUDA out of memory. Tried to "
                                                         "allocate 2.00 GiB", "passed"]


def test_a_verify_batch_out_of_memory_is_a_cell_and_the_grid_goes_on(monkeypatch):
    def verify_batch(target, device, batch, rows, *args):
        if batch == 64:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        return [{"batch": batch, "rows": n, "ms": 1.0, "vs_one_row": 1.0} for n in rows]

    class Target:
        def deferred_logits_pay(self):
            return False

    monkeypatch.setattr(speed, "_verify_batch", verify_batch)
    cells = list(speed.verify_grid(Target(), torch.device("cpu"), [1, 64, 8], [1, 4], 16, 1))
    assert [(c["batch"], c["rows"]) for c in cells] == [(1, 1), (1, 4), (64, None), (8, 1), (8, 4)]
    assert cells[2]["error"].startswith("out of memory")


def test_the_deadline_counts_from_process_start():
    elapsed = time.monotonic() - process_started()
    assert 0 < elapsed < time.monotonic()  # this process started before the test, not at it
    assert elapsed > 0.5  # importing torch alone takes longer than that


# ------------------------------------------------------------------------- settings and helpers

def test_bad_settings_are_one_line_errors_before_anything_runs(tmp_path, capsys):
    for args, message in ((["sections=[speedy]"], "sections: unknown ['speedy']"),
                          (["device=tpu"], "device/dtype"),
                          (["modes=[ar,dartt]"], "modes: unknown ['dartt']"),
                          (["shapes=[llama9-1t]"], "shapes: unknown ['llama9-1t']"),
                          (["kernels.shapes=wobbly"], "kernels: unknown shapes strategy 'wobbly'"),
                          (["time_budget_s=0"], "time_budget_s must be > 0")):
        assert main(["device=cpu", *args, f"output_dir={tmp_path}"]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "acceptance.json").exists()


def test_chi_square_p_value_matches_scipy():
    rng = np.random.default_rng(0)
    expected = rng.uniform(5, 50, size=12)
    observed = rng.poisson(expected).astype(float)
    ours = chi_square_p_value(observed, expected)
    theirs = scipy_stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue
    assert ours == pytest.approx(theirs, rel=1e-9)


def test_report_writes_are_atomic(tmp_path):
    """A reader polling the report while it is rewritten never sees half a file."""
    from dart_bench.gpu_acceptance.runner import write_atomically

    target = tmp_path / "acceptance.json"
    write_atomically(target, json.dumps({"n": 0}))
    stop, bad = threading.Event(), []

    def reader():
        while not stop.is_set():
            try:
                json.loads(target.read_text())
            except json.JSONDecodeError as exc:
                bad.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    for n in range(300):
        write_atomically(target, json.dumps({"n": n, "pad": "x" * 20000}))
    stop.set()
    thread.join()
    assert not bad and json.loads(target.read_text())["n"] == 299
    assert [p.name for p in tmp_path.iterdir()] == ["acceptance.json"]


def test_the_bundle_carries_the_omegaconf_this_suite_runs():
    """The GPU machine installs omegaconf from the bundle's wheels: the version pinned is the one
    installed here, where these tests import it, and nothing the GPU machine has is carried."""
    import omegaconf

    from jobs.gpu_acceptance.bundle import ON_THE_GPU_MACHINE, pins

    carried = dict(pin.split("==") for pin in pins())
    assert carried["omegaconf"] == omegaconf.__version__
    assert not set(carried) & ON_THE_GPU_MACHINE
