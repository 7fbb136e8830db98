"""The modes the benchmarks know, from the drafter registry plus transformers' own baselines.

A module of its own (torch-free, import-light) because the config check (`jobs.bench report`), the
measuring code and the report (dart_bench.report) all order and select modes the same way.
"""

from __future__ import annotations

from dart_worker.drafters import drafter_names, drafter_spec

HF_MODES = ("hf", "hf_prompt_lookup")  # transformers' own generate: outside baselines
GREEDY_ONLY = ("hf_prompt_lookup",)


def all_modes() -> tuple[str, ...]:
    """Every mode the benchmark knows, in report order: `ar`, the baselines, then the drafters."""
    return ("ar", *HF_MODES, *(m for m in drafter_names() if m != "ar"))


def tree_modes() -> tuple[str, ...]:
    """The drafters whose cost and tau depend on the tree parameters: they run once per budget."""
    return tuple(m for m in drafter_names() if drafter_spec(m).uses_tree)
