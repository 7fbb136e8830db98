"""A worker's device follows what Ray assigned it, and a GPU it cannot use stops the job at start-up.

The machine running the suite has no GPU, so "Ray assigned a GPU, torch cannot use it" is real
here: a local Ray instance declares one GPU, and the CPU build of torch cannot use it. The job
must stop with one line naming what was assigned and what torch is, not decode on the CPU.
"""

from __future__ import annotations

import gzip

import pytest
import ray
import torch

from dart_worker.hardware import device as device_module
from dart_worker.hardware.device import DeviceUnavailable, resolve_worker_device
from pipeline.cluster.device_check import planned_device, worker_failure
from pipeline.run import SUMMARY_NAME, main, run_pipeline
from pipeline.settings.config import ConfigError, load_config
from tests.test_pipeline_run import config_file, write_inputs
from tests.tiny_models import save_tiny_artifacts


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return save_tiny_artifacts(tmp_path_factory.mktemp("artifacts"))


@pytest.fixture
def ray_with_a_gpu(monkeypatch):
    """A local Ray instance that declares one GPU (this machine has none)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray.shutdown()
    ray.init(num_cpus=2, num_gpus=1, logging_level="ERROR")
    yield
    ray.shutdown()


def test_auto_follows_the_assignment_and_mismatches_are_errors():
    assert resolve_worker_device("auto", []) == torch.device("cpu")
    assert resolve_worker_device("cpu", []) == torch.device("cpu")
    with pytest.raises(DeviceUnavailable, match="assigned this worker no GPU"):
        resolve_worker_device("cuda", [])
    with pytest.raises(DeviceUnavailable, match=r"assigned this worker GPU\(s\) 3.*num_gpus_per_worker=0"):
        resolve_worker_device("cpu", ["3"])


def test_assigned_gpus_that_torch_cannot_use_name_both_sides(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    if torch.version.cuda is None:  # this suite's CPU build of torch
        with pytest.raises(DeviceUnavailable) as caught:
            resolve_worker_device("auto", ["0", "1"])
        line = str(caught.value)
        assert "GPU(s) 0, 1 (CUDA_VISIBLE_DEVICES=0,1)" in line and torch.__version__ in line
        assert "build without CUDA" in line and "\n" not in line
    # A CUDA build on a node whose driver is older than the wheel's CUDA: initialisation fails.
    monkeypatch.setattr(torch.version, "cuda", "12.8")

    def old_driver():
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 11040).\nmore text")

    monkeypatch.setattr(torch.cuda, "init", old_driver)
    too_old = r"CUDA 12\.8.*driver on your system is too old \(found version 11040\)"
    with pytest.raises(DeviceUnavailable, match=too_old):
        resolve_worker_device("cuda", ["0"])
    assert "driver" in device_module.cuda_problem()


def test_config_refuses_devices_its_reservation_cannot_give(tmp_path, artifacts):
    path = config_file(tmp_path, artifacts, ["x.jsonl"], str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=r"model.device: 'cuda' needs resources.num_gpus_per_worker > 0"):
        load_config(path, ["model.device=cuda"])
    with pytest.raises(ConfigError, match=r"resources\.num_gpus_per_worker: reserves GPUs"):
        load_config(path, ["model.device=cpu", "resources.num_gpus_per_worker=1"])
    gpu = load_config(path, ["model.device=auto", "resources.num_gpus_per_worker=1"])
    assert planned_device(gpu).startswith("cuda (1 Ray GPU per worker")
    assert planned_device(load_config(path, ["model.device=auto"])).startswith("cpu (no GPU reserved")


def test_a_job_whose_workers_hold_an_unusable_gpu_stops_at_start_up(tmp_path, artifacts, ray_with_a_gpu, capsys):
    write_inputs(tmp_path / "in.jsonl", good=3)
    path = config_file(tmp_path, artifacts, [str(tmp_path / "in.jsonl")], str(tmp_path / "out"),
                       model__device="auto", resources__num_gpus_per_worker=1, resources__num_workers=1)
    assert main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.device: the cluster assigned this worker GPU(s) 0"), err
    assert f"torch {torch.__version__}" in err and len(err.splitlines()) == 1
    assert not list((tmp_path / "out").glob("*.parquet")) and not (tmp_path / "out" / SUMMARY_NAME).exists()
    # The probe runs while the inputs are read; when both fail, the device is still the error named.
    compressed = gzip.compress(b'{"id": "a", "prompt": "w5"}\n' * 2000)
    (tmp_path / "cut.jsonl.gz").write_bytes(compressed[: len(compressed) // 2])
    both = config_file(tmp_path, artifacts, [str(tmp_path / "cut.jsonl.gz")], str(tmp_path / "out"),
                       model__device="auto", resources__num_gpus_per_worker=1, resources__num_workers=1)
    assert main([str(both)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.device: the cluster assigned this worker GPU(s) 0"), err
    # ... and with a usable device the unreadable input is named, after the probe (no GPU reserved).
    assert main([str(both), "model.device=cpu", "resources.num_gpus_per_worker=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: input: cannot read file://{tmp_path}/cut.jsonl.gz"), err


def test_a_worker_that_fails_its_own_device_check_stops_the_job_with_its_line(
        tmp_path, artifacts, ray_with_a_gpu, monkeypatch):
    """The probe passed (say, another node), but a worker's own check fails: the actor dies in its
    constructor and the job stops with the worker's line, not an actor traceback."""
    import pipeline.run as run_module

    class PassedElsewhere:
        def result(self):
            return {"device": "cuda:0", "dtype": "float32", "node": "elsewhere", "kernels": {}}

    monkeypatch.setattr(run_module, "start_probe", lambda cfg: PassedElsewhere())
    write_inputs(tmp_path / "in.jsonl", good=2)
    path = config_file(tmp_path, artifacts, [str(tmp_path / "in.jsonl")], str(tmp_path / "out"),
                       model__device="auto", resources__num_gpus_per_worker=1, resources__num_workers=1)
    with pytest.raises(run_module.StartupError, match=r"^model.device: the cluster assigned this worker GPU"):
        run_pipeline(load_config(path))


def test_worker_failure_reads_the_line_from_remote_errors():
    line = "the cluster assigned this worker GPU(s) 0 (CUDA_VISIBLE_DEVICES=0), but torch x cannot use them"
    assert worker_failure(DeviceUnavailable(line)) == line
    wrapped = RuntimeError(f"actor died\nTraceback ...\ndart_worker.hardware.device.DeviceUnavailable: {line}\n")
    assert worker_failure(wrapped) == line
    assert worker_failure(RuntimeError("something else")) is None


def test_dry_run_names_the_device_and_checks_a_local_gpu(tmp_path, artifacts, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray.shutdown()
    write_inputs(tmp_path / "in.jsonl", good=2)
    path = config_file(tmp_path, artifacts, [str(tmp_path / "in.jsonl")], str(tmp_path / "out"))
    assert main([str(path), "--dry-run"]) == 0
    assert "device cpu (no GPU reserved" in capsys.readouterr().out
    gpu = ["model.device=auto", "resources.num_gpus_per_worker=1"]
    if torch.version.cuda is None:  # a local run's workers would hold GPUs this torch cannot use
        assert main([str(path), *gpu, "--dry-run"]) == 2
        assert "error: model.device: the cluster assigned this worker GPU(s) 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"


def test_a_worker_spreads_its_target_over_every_gpu_ray_assigned_it(monkeypatch, tmp_path):
    """num_gpus_per_worker=2: Ray assigns GPUs 3 and 5 and sets CUDA_VISIBLE_DEVICES=3,5, so torch
    sees them as cuda:0 and cuda:1; the worker loads its target over both (faked assignment: this
    machine has no GPU, so the load is stopped where it starts, with the arguments it got)."""
    from dart_worker.hardware.device import worker_devices
    from pipeline import worker as worker_module
    from pipeline.settings.config import to_dict

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert worker_devices(torch.device("cuda"), ["3", "5"]) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert worker_devices(torch.device("cuda"), ["5", "3"]) == [torch.device("cuda", 1), torch.device("cuda", 0)]
    assert worker_devices(torch.device("cuda"), ["3"]) == [torch.device("cuda")]  # one GPU: no split
    assert worker_devices(torch.device("cpu"), []) == [torch.device("cpu")]
    with pytest.raises(DeviceUnavailable, match=r"GPUs 3, 7 but GPU 7 is not among CUDA_VISIBLE_DEVICES=3,5"):
        worker_devices(torch.device("cuda"), ["3", "7"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert worker_devices(torch.device("cuda"), ["1", "2"]) == [torch.device("cuda", 1), torch.device("cuda", 2)]

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    loads = []

    class Stop(Exception):
        pass

    def fake_load_target(spec, **kwargs):
        loads.append(kwargs)
        raise Stop

    monkeypatch.setattr(worker_module, "assigned_gpus", lambda: ["3", "5"])
    monkeypatch.setattr(worker_module, "resolve_worker_device", lambda spec, gpus: torch.device("cuda", 0))
    monkeypatch.setattr(worker_module, "resolve_dtype", lambda dtype, device: torch.bfloat16)
    monkeypatch.setattr(worker_module, "load_target", fake_load_target)
    monkeypatch.setattr(worker_module, "check_target_fingerprint", lambda spec, expected: expected)
    cfg = load_config(None, [f"input.urls=[{tmp_path}/in.jsonl]", f"output.url={tmp_path}/out",
                             "model.target=default", "decoding.mode=ar"])
    with pytest.raises(Stop):
        worker_module.GenerationWorker(to_dict(cfg), {"run_id": "split", "head_dir": None, "trie_url": None})
    assert loads == [{"dtype": torch.bfloat16, "device": torch.device("cuda", 0),
                      "devices": [torch.device("cuda", 0), torch.device("cuda", 1)]}]
    loads.clear()
    monkeypatch.setattr(worker_module, "assigned_gpus", lambda: ["3"])
    with pytest.raises(Stop):
        worker_module.GenerationWorker(to_dict(cfg), {"run_id": "one", "head_dir": None, "trie_url": None})
    assert loads[0]["devices"] is None
