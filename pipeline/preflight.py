"""Everything checked before generation starts, shared by the real run and `--dry-run`.

`resolve_artifacts` expands the inputs, checks the output location, resolves the target (the
embedded default is converted on first use), the draft head (checked against the target's
config: vocabulary, hidden size, tap layers) and the N-gram trie (header and tokenizer
fingerprint), and fixes their locations and fingerprints for the workers. Every problem is a
`StartupError` with a one-line message naming the config key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dart_worker.drafters import drafter_spec
from dart_worker.fingerprint import file_fingerprint, tokenizer_fingerprint
from pipeline.config import PipelineConfig
from pipeline.ngram_store import TrieUnavailableError, check_trie_url
from pipeline.storage import StorageError, expand_inputs, filesystem_for


class StartupError(RuntimeError):
    """Something the job needs is missing or broken; raised before any generation."""


def resolve_artifacts(cfg: PipelineConfig, run_id: str, *, create_output: bool = True) -> dict[str, Any]:
    """Check every artifact the workers will need and fix their locations and fingerprints.

    `create_output=False` (the dry run) only checks that the output's store answers and records
    whether the directory exists (`output_exists`) instead of creating it.
    """
    from dart_worker.loading import load_tokenizer, model_fingerprint, resolve_source

    resolved: dict[str, Any] = {"run_id": run_id}
    try:
        resolved["input_files"] = expand_inputs(cfg.input.urls)
    except (OSError, ValueError, StorageError) as exc:
        raise StartupError(f"input: {exc}") from None
    if not resolved["input_files"]:
        raise StartupError(f"input: no files match {cfg.input.urls}")
    try:
        fs, path = filesystem_for(cfg.output.url)
        if create_output:
            fs.makedirs(path, exist_ok=True)
        else:
            resolved["output_exists"] = bool(fs.exists(path))
    except Exception as exc:  # any storage error here means the job cannot write
        raise StartupError(f"output {cfg.output.url} is not writable: {exc}") from None

    try:
        source = resolve_source(cfg.model.target)
        resolved["target_location"] = str(source.location)
        resolved["target_fingerprint"] = model_fingerprint(source.location)
        tokenizer = load_tokenizer("default" if cfg.model.target == "default" else str(source.location))
    except (OSError, ValueError) as exc:
        raise StartupError(f"model.target {cfg.model.target!r}: {exc}") from None

    spec = drafter_spec(cfg.decoding.mode)
    if spec.needs_head:
        head_dir = _resolve_head(cfg.model.draft_head)
        if source.kind == "dir":
            _check_head_fits_target(head_dir, Path(source.location), cfg.model.tap_layers)
        resolved["head_dir"] = str(head_dir)
        resolved["head_fingerprint"] = file_fingerprint(head_dir / "model.safetensors")
    if spec.needs_trie:
        resolved["trie_url"], resolved["trie_fingerprint"] = _resolve_trie(cfg.model.trie, tokenizer)
    return resolved


def _resolve_head(spec: str | None) -> Path:
    from dart_worker.default_head import default_head_dir
    from dart_worker.draft_checkpoint import read_draft_config

    path = default_head_dir() if spec == "default" else Path(spec).expanduser() if spec else None
    if path is None:
        raise StartupError("model.draft_head=default, but this build ships no default draft head; "
                           "train one with jobs.train_draft and pass its directory, or use decoding.mode=ar")
    try:
        read_draft_config(path)
    except (OSError, ValueError) as exc:
        raise StartupError(f"model.draft_head {str(path)!r}: {exc}") from None
    if not (path / "model.safetensors").is_file():
        raise StartupError(f"model.draft_head {str(path)!r}: model.safetensors is missing")
    return path


def _check_head_fits_target(head_dir: Path, target_dir: Path, tap_layers: list[int] | None) -> None:
    """The head's config against the target's config.json (no weights loaded): the checks a worker's
    `load_draft_head` makes first, so that a head trained for another model stops the job here."""
    from transformers import AutoConfig

    from dart_worker.draft_checkpoint import check_head_config_fits_target

    try:
        target_config = AutoConfig.from_pretrained(str(target_dir))
        check_head_config_fits_target(head_dir, target_config, tap_layers)
    except (OSError, ValueError) as exc:
        raise StartupError(f"model.draft_head {str(head_dir)!r}: {exc}") from None


def _resolve_trie(spec: str | None, tokenizer) -> tuple[str, str]:
    """The trie URL and its fingerprint (the payload checksum from its header)."""
    if spec == "default":
        from dart_train.ngram_build import default_trie_path

        spec = str(default_trie_path())
    try:
        header = check_trie_url(spec, tokenizer_fingerprint(tokenizer))
    except (OSError, ValueError, TrieUnavailableError) as exc:
        raise StartupError(f"model.trie {spec!r}: {exc}") from None
    return spec, header.content_key


def cpu_budget_problem(cfg: PipelineConfig, total_cpus: float) -> str | None:
    """Why workers reserving their CPUs would leave none for the read and write tasks on a cluster
    of `total_cpus` CPUs (Ray Data then waits forever), or None when they leave at least one."""
    r = cfg.resources
    reserved = (r.min_workers or r.num_workers) * r.num_cpus_per_worker
    if total_cpus >= reserved + 1:
        return None
    return (f"resources: {r.min_workers or r.num_workers} workers x num_cpus_per_worker={r.num_cpus_per_worker} "
            f"reserve {reserved:g} of the cluster's {total_cpus:g} CPUs and leave none for reading and writing; "
            f"lower num_cpus_per_worker (resources.torch_threads still sets the engine's threads)")


def local_cpu_count() -> int:
    """The CPUs a Ray instance started here would have."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
