"""The acceptance run behind `python -m jobs.gpu_acceptance [config.yaml] [key=value ...]`: its config, and
`main`, which checks it and runs the sections (`plan`: which, in what order) through `runner`
(the report written as it goes, one deadline, a watchdog). See the package docstring."""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dart_bench.gpu_acceptance.plan import ordered_sections
from dart_bench.gpu_acceptance.report import markdown
from dart_bench.gpu_acceptance.runner import AcceptanceRun, Deadline
from dart_bench.gpu_acceptance.speed import free_device_memory
from dart_worker.artifacts.random_models import SHAPES
from dart_worker.defaults import DEFAULT_DTYPE, DEFAULT_MODE
from dart_worker.drafters import drafter_names
from dart_worker.hardware import kernels
from dart_worker.hardware.device import cpu_model_name, resolve_device, resolve_dtype


class AcceptanceConfigError(ValueError):
    """A bad key or value on the command line."""


@dataclass
class AcceptanceConfig:
    """Every list left null takes the device's default (real shapes and large batches on CUDA,
    small ones on a CPU). `kernels` forces kernel strategies (`dart_worker.hardware.kernels.forced`) for
    the whole run, e.g. `kernels={shapes:bucketed,gqa:pack,logits:batched,warp:dense}`: the GPU's
    plan, run on a CPU by the test suite."""

    device: str = "cuda"  # cuda | cuda:N | cpu | auto
    output_dir: str = "gpu_acceptance"
    sections: list[str] = field(default_factory=lambda: ["correctness", "speed"])
    # correctness (tiny fp32 models)
    families: list[str] = field(default_factory=lambda: ["llama", "qwen3", "gemma3"])
    modes: list[str] | None = None  # null: every registered drafter
    prompts: int = 5
    new_tokens: int = 24
    chi_square_draws: int = 4000
    chi_square_mode: str = DEFAULT_MODE
    # speed (random weights at real shapes)
    # null: llama3-8b, then gemma3-270m on CUDA (the first one is timed right after the first family);
    # small-llama on a CPU
    shapes: list[str] | None = None
    dtype: str = DEFAULT_DTYPE  # of the timed models (auto: bf16 where the device computes it natively)
    context: int = 256  # prompt tokens before every timed step
    generate_tokens: int = 64
    repeats: int = 5
    verify_batches: list[int] | None = None  # null: [1, 8, 32, 64] on CUDA, [1, 4] on a CPU
    verify_rows: list[int] | None = None  # null: [1, 2, 4, 8, 16, 32, 64] on CUDA, [1, 4, 16] on a CPU
    gqa_batches: list[int] | None = None  # null: [1, 8, 32] on CUDA, [1, 2] on a CPU
    gqa_rows: list[int] | None = None  # null: [1, 16] on CUDA, [1, 4] on a CPU
    drafting_batches: list[int] | None = None  # null: [1, 8] on CUDA, [1] on a CPU
    drafting_tokens: int = 32
    budget: int = 32  # draft tree budget of the timed drafting modes
    throughput_batch: int | None = None  # null: 64 on CUDA, 4 on a CPU
    throughput_modes: list[str] = field(default_factory=lambda: ["ar", "dart_lookup"])
    kernels: dict[str, str] = field(default_factory=dict)  # strategy -> forced choice (dart_worker.hardware.kernels)
    # The run's one deadline, counted from process start: sections that would start after it are
    # skipped, a running one stops at its next result, and `watchdog_grace_s` later the watchdog
    # writes the report and ends the process. 540 s leaves a minute of a 10-minute command.
    time_budget_s: float = 540.0
    watchdog_grace_s: float = 10.0


def load(argv: list[str]) -> AcceptanceConfig:
    from pipeline.settings.config import load_structured

    path, overrides = (argv[0], argv[1:]) if argv and "=" not in argv[0] else (None, argv)
    cfg = load_structured(AcceptanceConfig, path, overrides, AcceptanceConfigError)
    check(cfg)
    return cfg


def check(cfg: AcceptanceConfig) -> None:
    """Every name in the config is known, before anything runs (a typo costs no GPU time)."""
    unknown = set(cfg.sections) - {"correctness", "speed"}
    if unknown:
        raise AcceptanceConfigError(f"sections: unknown {sorted(unknown)}; expected correctness and/or speed")
    bad_modes = [m for m in (cfg.modes or []) + [cfg.chi_square_mode] if m not in drafter_names()]
    if bad_modes:
        raise AcceptanceConfigError(f"modes: unknown {bad_modes}; registered: {list(drafter_names())}")
    bad_shapes = [s for s in cfg.shapes or [] if s not in SHAPES]
    if bad_shapes:
        raise AcceptanceConfigError(f"shapes: unknown {bad_shapes}; expected some of {sorted(SHAPES)}")
    try:
        with kernels.forced(**cfg.kernels):
            pass
    except ValueError as exc:
        raise AcceptanceConfigError(f"kernels: {exc}") from None
    if cfg.time_budget_s <= 0 or cfg.watchdog_grace_s < 0:
        raise AcceptanceConfigError("time_budget_s must be > 0 and watchdog_grace_s >= 0")


def fill_device_defaults(cfg: AcceptanceConfig, device: torch.device) -> None:
    on_gpu = device.type == "cuda"
    defaults = {
        "modes": list(drafter_names()),
        "shapes": ["llama3-8b", "gemma3-270m"] if on_gpu else ["small-llama"],
        "verify_batches": [1, 8, 32, 64] if on_gpu else [1, 4],
        "verify_rows": [1, 2, 4, 8, 16, 32, 64] if on_gpu else [1, 4, 16],
        "gqa_batches": [1, 8, 32] if on_gpu else [1, 2],
        "gqa_rows": [1, 16] if on_gpu else [1, 4],
        "drafting_batches": [1, 8] if on_gpu else [1],
        "throughput_batch": 64 if on_gpu else 4,
    }
    for name, value in defaults.items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, value)


def environment(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "transformers": transformers.__version__, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
           "cpu": cpu_model_name(), "cpu_threads": torch.get_num_threads(), "host": platform.node()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                "multiprocessors": props.multi_processor_count}
    return env


def run(cfg: AcceptanceConfig, started: float | None = None) -> dict[str, Any]:
    """The whole run (sections in `plan` order, the report written as it goes under
    `cfg.output_dir`); the final report. `started`: the `time.monotonic()` the deadline counts from
    (the process's start under `python -m jobs.gpu_acceptance`; now when None)."""
    deadline = Deadline(time.monotonic() if started is None else started, cfg.time_budget_s)
    try:
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
    except (RuntimeError, ValueError) as exc:
        raise AcceptanceConfigError(f"device/dtype: {exc}") from None
    fill_device_defaults(cfg, device)
    out = Path(cfg.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AcceptanceConfigError(f"output_dir: {exc}") from None
    with kernels.forced(**cfg.kernels):
        report: dict[str, Any] = {"config": asdict(cfg), "environment": environment(device, dtype)}
        runner = AcceptanceRun(report, ordered_sections(cfg, device, dtype), out, deadline, cfg.watchdog_grace_s,
                               markdown, free_memory=lambda: free_device_memory(device))
        runner.run()
    return report


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """Exit 0: no correctness check failed or raised; 1: one did; 2: a bad setting (nothing ran)."""
    try:
        cfg = load(sys.argv[1:] if argv is None else argv)
        report = run(cfg, started)
    except AcceptanceConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(report))
    print(f"wrote {os.path.join(cfg.output_dir, 'acceptance.json')} and acceptance.md")
    return report["exit_code"]
