"""The acceptance run behind `python -m jobs.gpu_acceptance [config.yaml] [key=value ...]`: its config, the
sections it runs and the report it writes (see the package docstring)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dart_bench.gpu_acceptance.correctness import run_correctness
from dart_bench.gpu_acceptance.report import markdown
from dart_bench.gpu_acceptance.speed import run_shape
from dart_worker.defaults import DEFAULT_DTYPE, DEFAULT_MODE
from dart_worker.device import cpu_model_name, resolve_device, resolve_dtype


class AcceptanceConfigError(ValueError):
    """A bad key or value on the command line."""


@dataclass
class AcceptanceConfig:
    """Every list left null takes the device's default (real shapes and large batches on CUDA,
    small ones on a CPU, where the suite runs this in a minute or two)."""

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
    shapes: list[str] | None = None  # null: gemma3-270m and llama3-8b on CUDA; small-llama on a CPU
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
    # Speed sections that would start after this many seconds of the run are skipped and listed,
    # so the run fits one lent machine's call (8 minutes, with start-up and transfers).
    time_budget_s: float = 420.0


def load(argv: list[str]) -> AcceptanceConfig:
    from pipeline.config import load_structured

    path, overrides = (argv[0], argv[1:]) if argv and "=" not in argv[0] else (None, argv)
    cfg = load_structured(AcceptanceConfig, path, overrides, AcceptanceConfigError)
    unknown = set(cfg.sections) - {"correctness", "speed"}
    if unknown:
        raise AcceptanceConfigError(f"sections: unknown {sorted(unknown)}; expected correctness and/or speed")
    return cfg


def fill_device_defaults(cfg: AcceptanceConfig, device: torch.device) -> None:
    on_gpu = device.type == "cuda"
    defaults = {
        "shapes": ["gemma3-270m", "llama3-8b"] if on_gpu else ["small-llama"],
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


def run(cfg: AcceptanceConfig) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
    except (RuntimeError, ValueError) as exc:
        raise AcceptanceConfigError(f"device/dtype: {exc}") from None
    fill_device_defaults(cfg, device)
    report: dict[str, Any] = {"config": asdict(cfg), "environment": environment(device, dtype)}
    if "correctness" in cfg.sections:
        t0 = time.perf_counter()
        report["correctness"] = run_correctness(device, cfg.families, cfg.modes, cfg.prompts, cfg.new_tokens,
                                                cfg.chi_square_draws, cfg.chi_square_mode)
        report["correctness"]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"correctness: {'passed' if report['correctness']['passed'] else 'FAILED'} "
              f"in {report['correctness']['seconds']} s", flush=True)
    if "speed" in cfg.sections:
        deadline = started + cfg.time_budget_s
        report["speed"] = []
        for shape in cfg.shapes:
            t0 = time.perf_counter()
            report["speed"].append(run_shape(shape, device, dtype, cfg, deadline))
            print(f"speed {shape}: {time.perf_counter() - t0:.1f} s", flush=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["passed"] = report.get("correctness", {}).get("passed", True)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "acceptance.md").write_text(markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load(sys.argv[1:] if argv is None else argv)
        report = run(cfg)
    except AcceptanceConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(report))
    print(f"wrote {os.path.join(cfg.output_dir, 'acceptance.json')} and acceptance.md")
    return 0 if report["passed"] else 1
