"""The draft head shipped for the embedded default target, as package data.

`dart_worker/artifacts/default_head/` holds config.json + model.safetensors of a head trained by
`python -m jobs.train_draft configs/train_default_head.yaml` for Gemma-3-270M. Until one is
shipped, `default_head_dir()` returns None and callers fall back to an untrained head (and
say so), which keeps every mode runnable but makes tau low.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def default_head_dir() -> Path | None:
    """Directory of the shipped default head, or None when this build ships none."""
    path = Path(str(files("dart_worker.artifacts").joinpath("default_head")))
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    return None
