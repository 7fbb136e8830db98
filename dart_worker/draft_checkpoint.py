"""Save and load DART draft heads: a directory holding config.json + model.safetensors.

The layout and tensor names are those of the published DART heads, so their checkpoints load
unchanged. Loading is strict because a head that silently half-loads, or that was trained for
another target, still produces plausible-looking logits: every mismatch is a `DraftHeadLoadError`
naming what was expected and what was found. Weights are read with safetensors only; nothing is
ever unpickled.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig

from dart_worker.draft_head import (
    DartDraftHead,
    DraftHeadConfig,
    DraftHeadConfigError,
    check_d2t,
    target_text_config,
)
from dart_worker.target import default_tap_layers

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# Keys a checkpoint may carry besides the head's own state dict.
OPTIONAL_KEYS = ("t2d", "embed_tokens.weight")


class DraftHeadLoadError(ValueError):
    """A draft-head checkpoint that is missing, malformed or does not fit the target."""


def save_draft_head(head: DartDraftHead, directory: str | os.PathLike) -> Path:
    """Write `head` as config.json + model.safetensors into `directory` (created if needed).

    Each file is written to a temporary name and renamed, so an interrupted save never leaves a
    half-written checkpoint under the real name. The target's embedding is not saved.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in head.state_dict().items()}
    _write_atomically(directory / WEIGHTS_NAME, lambda path: save_file(tensors, path, metadata={"format": "pt"}))
    text = json.dumps(head.config.to_dict(), indent=2, sort_keys=True) + "\n"
    _write_atomically(directory / CONFIG_NAME, lambda path: Path(path).write_text(text))
    return directory


def _write_atomically(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        # mkstemp creates 0600 files; a checkpoint is meant to be read by other users and
        # processes (package data, shared model dirs), so give it the usual umask-based mode.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_draft_config(directory: str | os.PathLike) -> DraftHeadConfig:
    """The DraftHeadConfig of a checkpoint directory (config.json only; no weights are read)."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise DraftHeadLoadError(f"draft head checkpoint {directory}: no {CONFIG_NAME} found")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DraftHeadLoadError(f"{path}: not a readable JSON file ({exc})") from exc
    try:
        return DraftHeadConfig.from_dict(data)
    except DraftHeadConfigError as exc:
        raise DraftHeadLoadError(f"{path}: {exc}") from exc


def load_draft_head(directory: str | os.PathLike, target_config: PretrainedConfig, embed_tokens: nn.Module,
                    device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None,
                    tap_layers: Sequence[int] | None = None) -> DartDraftHead:
    """Load and verify a draft head for the target described by `target_config` / `embed_tokens`.

    `embed_tokens` is the target's input embedding module (used by the head, never copied).
    device/dtype default to those of the embedding. Raises DraftHeadLoadError on: missing files,
    a non-safetensors weights file, missing config fields, a vocab_size or target_hidden_size
    that does not match the target, missing or unexpected tensors, wrong shapes or dtypes, and a
    d2t that maps outside the target vocabulary; and, when `tap_layers` (the taps the target
    adapter will feed) is given, a head trained on other taps.
    """
    directory = Path(directory)
    config = read_draft_config(directory)
    text_config = target_text_config(target_config)
    _check_config_fits_target(config, text_config, embed_tokens, directory)
    if tap_layers is not None:
        check_tap_layers(config, tap_layers, text_config.num_hidden_layers, f"draft head {directory / CONFIG_NAME}")
    tensors = _read_safetensors(directory)
    reference = next(iter(embed_tokens.parameters()), None)
    device = device if device is not None else (reference.device if reference is not None else "cpu")
    dtype = dtype if dtype is not None else (reference.dtype if reference is not None else torch.float32)

    try:
        with torch.device("meta"):  # shapes only: the real tensors come from the file
            head = DartDraftHead(config, embed_tokens)
    except DraftHeadConfigError as exc:
        raise DraftHeadLoadError(f"{directory}: {exc}") from exc
    expected = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    _check_keys(expected, tensors, directory)
    _check_embedding_copy(tensors.get("embed_tokens.weight"), embed_tokens, directory)
    _check_shapes_and_dtypes(expected, tensors, config, directory)
    problem = check_d2t(tensors["d2t"], config.draft_vocab_size, config.vocab_size)
    if problem:
        raise DraftHeadLoadError(f"{directory / WEIGHTS_NAME}: {problem}")

    # Tensors read from the file may start at any 8-byte offset of one buffer; MKL's products
    # round differently by the weight's alignment, so each gets its own (64-byte aligned) storage:
    # a loaded head computes exactly what the saved one did.
    weights = {name: tensors[name].clone() for name in expected}
    weights["d2t"] = weights["d2t"].long()
    head.load_state_dict(weights, strict=True, assign=True)
    if "t2d" in tensors:
        head.t2d = tensors["t2d"].bool()
    return head.to(device=device, dtype=dtype).eval()


def check_head_config_fits_target(directory: str | os.PathLike, target_config: PretrainedConfig,
                                  tap_layers: Sequence[int] | None = None) -> None:
    """The config-level checks of `load_draft_head`, without reading weights or building the target:
    the head's vocabulary, hidden sizes and tap layers against the target's config (a driver's
    start-up check). `tap_layers` None: the taps the target adapter uses by default."""
    directory = Path(directory)
    config = read_draft_config(directory)
    text_config = target_text_config(target_config)
    _check_config_fits_target(config, text_config, None, directory)
    layers = text_config.num_hidden_layers
    check_tap_layers(config, tap_layers if tap_layers is not None else default_tap_layers(layers), layers,
                     f"draft head {directory / CONFIG_NAME}")


def check_tap_layers(config: DraftHeadConfig, tap_layers: Sequence[int], num_layers: int, where: str) -> None:
    """A head reads the taps it was trained on: refuse one recorded (or, if unrecorded, the
    reference taps) that differ from the taps the target adapter feeds."""
    trained = tuple(config.tap_layers) if config.tap_layers is not None else default_tap_layers(num_layers)
    if trained != tuple(tap_layers):
        source = "recorded in its config" if config.tap_layers is not None else "the reference taps (none recorded)"
        raise DraftHeadLoadError(
            f"{where}: the head was trained on the inputs of target layers {list(trained)} ({source}), but "
            f"the target is tapped at {list(tap_layers)}: set model.tap_layers to {list(trained)} or use a "
            f"head trained on these taps")


def _check_config_fits_target(config: DraftHeadConfig, target: PretrainedConfig, embed_tokens: nn.Module,
                              directory: Path) -> None:
    where = f"draft head {directory / CONFIG_NAME}"
    if config.vocab_size != target.vocab_size:
        raise DraftHeadLoadError(f"{where}: vocab_size is {config.vocab_size}, but the target's vocabulary "
                                 f"has {target.vocab_size} tokens; this head was trained for another model")
    if config.target_hidden_size != target.hidden_size:
        raise DraftHeadLoadError(
            f"{where}: target_hidden_size is {config.target_hidden_size}, but the target's hidden size is "
            f"{target.hidden_size}; this head was trained for another model")
    embedding_dim = getattr(embed_tokens, "embedding_dim", target.hidden_size)
    if config.hidden_size != embedding_dim:
        raise DraftHeadLoadError(f"{where}: hidden_size is {config.hidden_size}, but the target's token "
                                 f"embeddings are {embedding_dim} wide (the head consumes them directly)")


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    path = directory / WEIGHTS_NAME
    if not path.is_file():
        others = sorted(p.name for p in directory.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".json"))
        raise DraftHeadLoadError(f"draft head checkpoint {directory}: no {WEIGHTS_NAME} found (present: "
                                 f"{others}); only single-file safetensors checkpoints are loaded")
    try:  # safetensors parses a JSON header and raw buffers: it never executes or unpickles anything
        return load_file(path, device="cpu")
    except Exception as exc:  # safetensors raises its own error type for any malformed file
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"PK\x03\x04" or (magic[:1] == b"\x80" and magic[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):
            raise DraftHeadLoadError(
                f"{path} is a pickle / torch.save archive, not safetensors; it is not unpickled for safety. "
                f"Convert it with safetensors.torch.save_file on a trusted machine.") from exc
        raise DraftHeadLoadError(f"{path} is not a valid safetensors file: {exc}") from exc


def _check_keys(expected: dict[str, tuple], tensors: dict[str, torch.Tensor], directory: Path) -> None:
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - set(OPTIONAL_KEYS))
    if missing or unexpected:
        raise DraftHeadLoadError(
            f"{directory / WEIGHTS_NAME}: tensor names do not match a DART head: missing {missing}, "
            f"unexpected {unexpected} (expected exactly {sorted(expected)} plus optional {list(OPTIONAL_KEYS)})")


def _check_embedding_copy(weight: torch.Tensor | None, embed_tokens: nn.Module, directory: Path) -> None:
    """A checkpoint may carry a copy of the target's embedding; it is ignored but must fit."""
    if weight is None:
        return
    target_shape = (getattr(embed_tokens, "num_embeddings", None), getattr(embed_tokens, "embedding_dim", None))
    if None in target_shape:
        return
    if tuple(weight.shape) != target_shape:
        raise DraftHeadLoadError(
            f"{directory / WEIGHTS_NAME}: embed_tokens.weight has shape {tuple(weight.shape)}, but the "
            f"target's embedding is {target_shape}; this head was trained for another model")


def _check_shapes_and_dtypes(expected: dict[str, tuple], tensors: dict[str, torch.Tensor],
                             config: DraftHeadConfig, directory: Path) -> None:
    where = directory / WEIGHTS_NAME
    for name, shape in expected.items():
        found = tuple(tensors[name].shape)
        if found != shape:
            hint = ""
            if name == "fc.weight":
                hint = f" (fc reads 3 x target_hidden_size = {3 * config.target_hidden_size} features)"
            raise DraftHeadLoadError(f"{where}: {name} has shape {found}, expected {shape}{hint}")
        if name != "d2t" and not tensors[name].dtype.is_floating_point:
            raise DraftHeadLoadError(f"{where}: {name} has dtype {tensors[name].dtype}, expected floating point")
    t2d = tensors.get("t2d")
    if t2d is not None:
        if tuple(t2d.shape) != (config.vocab_size,):
            raise DraftHeadLoadError(f"{where}: t2d has shape {tuple(t2d.shape)}, expected ({config.vocab_size},)")
        if t2d.dtype != torch.bool and not (t2d.dtype == torch.uint8 and int(t2d.max()) <= 1):
            raise DraftHeadLoadError(f"{where}: t2d has dtype {t2d.dtype}, expected bool")
