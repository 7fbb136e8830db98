"""Drafters: what proposes a draft tree per live sequence per round, behind one interface.

`registry` (import-light: no torch) names every drafter and what it needs; the config schema,
the engine factory, the benchmarks and the report read it. `base` holds the protocol the engine
drives (`observe`, `retire`, `propose`; `run_model` for a drafter with a model). Adding a drafter
= one module with a `Drafter` subclass (at least its `propose`) + one `register_drafter` call
(the built-ins register in `registry`; a user's drafter registers wherever it is defined).
"""

from dart_worker.drafters.registry import (
    SIZING_MODES,
    DrafterResources,
    DrafterSpec,
    drafter_names,
    drafter_spec,
    register_drafter,
    unregister_drafter,
)

__all__ = [
    "SIZING_MODES",
    "DrafterResources",
    "DrafterSpec",
    "drafter_names",
    "drafter_spec",
    "register_drafter",
    "unregister_drafter",
]
