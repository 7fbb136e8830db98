"""The acceptance run's sections, in the order they run: the most valuable first.

A GPU window may end at any minute, so what it must not miss comes first:

1. `correctness/<first family>` (llama): every drafter against transformers' `generate` and
   seeded sampling against `ar` on the device - the one answer a GPU run exists to give;
2. the first shape's (llama3-8b on CUDA) `build`, `per_token` (`ar` against `generate`) and
   `verify` (the verify forward over 1-64 tree rows at batch 1-64): what a round costs at the
   size that matters;
3. `correctness/<other families>` (qwen3, gemma3) and `correctness/chi-square`;
4. the first shape's `gqa`, `drafting`, `syncs`, `throughput`;
5. every other shape (gemma3-270m on CUDA), all of its sections.

A shape's model is built once by its `build` section, kept while the other sections run (tiny
correctness models beside an 8B model fit any GPU this is meant for) and released after its last.
"""

from __future__ import annotations

from typing import Any

import torch

from dart_bench.gpu_acceptance.correctness import chi_square_case, family_cases
from dart_bench.gpu_acceptance.runner import CORRECTNESS, SPEED, Section
from dart_bench.gpu_acceptance.speed import MEASUREMENTS, ShapeBench, peak_memory_gib

FIRST_MEASUREMENTS = ("per_token", "verify")  # the first shape's, right after the first correctness family


def correctness_sections(cfg, device: torch.device) -> list[Section]:
    sections = [Section(f"correctness/{family}", CORRECTNESS,
                        lambda family=family: family_cases(family, device, cfg.modes, cfg.prompts, cfg.new_tokens))
                for family in cfg.families]
    if cfg.chi_square_draws:
        sections.append(Section("correctness/chi-square", CORRECTNESS,
                                 lambda: chi_square_case(device, cfg.chi_square_mode, cfg.chi_square_draws)))
    return sections


def shape_sections(bench: ShapeBench) -> list[Section]:
    """`build`, then every measurement; each records the peak device memory so far, and the last
    releases the model."""

    def finish(record: dict[str, Any]) -> None:
        record["peak_memory_gib"] = round(peak_memory_gib(bench.device), 3)

    sections = [Section(f"speed/{bench.shape}/build", SPEED, bench.build, finish)]
    sections += [Section(f"speed/{bench.shape}/{name}", SPEED, lambda name=name: bench.measure(name), finish)
                 for name in MEASUREMENTS]

    def finish_last(record: dict[str, Any]) -> None:
        finish(record)
        bench.release()

    sections[-1].finish = finish_last
    return sections


def ordered_sections(cfg, device: torch.device, dtype: torch.dtype) -> list[Section]:
    """Every section `cfg.sections` asks for, most valuable first (module docstring)."""
    correctness = correctness_sections(cfg, device) if "correctness" in cfg.sections else []
    shapes = [shape_sections(ShapeBench(shape, device, dtype, cfg))
              for shape in (cfg.shapes if "speed" in cfg.sections else [])]
    first = shapes[0] if shapes else []
    early = [s for s in first if s.name.rsplit("/", 1)[1] in ("build", *FIRST_MEASUREMENTS)]
    late = [s for s in first if s not in early]
    return [*correctness[:1], *early, *correctness[1:], *late, *(section for rest in shapes[1:] for section in rest)]
