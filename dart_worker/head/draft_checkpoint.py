"""Save and load DART draft heads: a directory holding config.json + model.safetensors.

The layout and tensor names are those of the published DART heads (github.com/fvliang/DART,
`LlamaForCausalLMDart`: `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`; config.json a
`DartConfig`, a LlamaConfig plus `draft_length`, `draft_vocab_size`, `target_hidden_size`).
Loading is strict because a head that silently half-loads, or that was trained for another
target, still produces plausible-looking logits: every mismatch is a `DraftHeadLoadError`
naming what was expected and what was found. Weights are read with safetensors only; nothing is
ever unpickled.

A head spec may be a directory, an fsspec URL of one (fetched once per node, like a target:
dart_worker/artifacts/target_store.py) or an upstream release directory as published (`resolve_head_dir`).
A release differs from this project's checkpoints in two ways: its config is a transformers
`DartConfig` dump (model_type, architectures, dtype, token ids, ... beside the architecture; the
head's own defaults where it omits a field), and its weights carry a full copy of the target's
token embedding (`embed_tokens.weight`: vocab x hidden, 1.2 GB for Qwen3-8B in bf16), which DART
replaces with the target's own at load. A release is mapped once per node into the cache
(`heads/imported/<its fingerprint>`): the config is parsed and written complete, the embedding copy
becomes a probe of a few rows (`target_embedding_probe`), so that every later load reads the head
alone and can still tell whether the target is the model the head was trained with. A head whose
embedding copy or probe differs from the target's embedding is refused, naming the rows.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig

from dart_worker.artifacts.target_store import fetch_model_dir, is_remote_url, local_path_of
from dart_worker.head.draft_head import DartDraftHead
from dart_worker.head.draft_head_config import DraftHeadConfig, DraftHeadConfigError, target_text_config
from dart_worker.head.draft_vocab import check_d2t
from dart_worker.target.adapter import default_tap_layers

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
EMBEDDING_COPY = "embed_tokens.weight"
# Rows of the target embedding an imported head keeps (float32) to recognise its target by.
EMBEDDING_PROBE = "target_embedding_probe"
EMBEDDING_PROBE_ROWS = "target_embedding_probe_rows"
PROBE_ROW_COUNT = 64
# Keys a checkpoint may carry besides the head's own state dict.
OPTIONAL_KEYS = ("t2d", EMBEDDING_COPY, EMBEDDING_PROBE, EMBEDDING_PROBE_ROWS)
IMPORT_STAMP = "dart_import"


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


def resolve_head_dir(spec: str | os.PathLike) -> Path:
    """The local directory, in this project's layout, behind a head spec: a checkpoint directory
    (as is), an fsspec URL of one (downloaded once per node and verified, like a target), or an
    upstream DART release directory (mapped once into the cache, `import_release`)."""
    text = os.fspath(spec)
    if is_remote_url(text):
        directory = fetch_model_dir(text, what="draft head", store="heads")
    else:
        directory = Path(local_path_of(text)).expanduser()
    return import_release(directory) if is_release_layout(directory) else directory


def is_release_layout(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a head as the DART authors' training saves it: weights with a copy
    of the target's embedding, which every load would read again and which is the one record of
    which model the head was trained with. (A release without the copy has exactly this project's
    names and loads as it is; its extra config keys are kept as extras.)"""
    directory = Path(directory)
    try:
        data = json.loads((directory / CONFIG_NAME).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False  # read_draft_config reports it, naming the file
    if not isinstance(data, dict) or IMPORT_STAMP in data:
        return False
    try:
        with safe_open(directory / WEIGHTS_NAME, framework="pt") as f:
            return EMBEDDING_COPY in set(f.keys())
    except Exception:  # missing or not safetensors: _read_safetensors reports it
        return False


def import_release(directory: str | os.PathLike) -> Path:
    """Map an upstream DART release directory once into this project's layout, in the cache.

    The copy is named by the release's file fingerprint, built under a lock and renamed into place
    (`cache_dir.build_atomically`), so concurrent workers on a node map it once and a later load
    finds it. Its config is the parsed `DraftHeadConfig` (the release's other keys kept as extras,
    plus an `dart_import` stamp naming the source); its weights are the release's tensors as they
    are, except the embedding copy, replaced by `PROBE_ROW_COUNT` of its rows in float32. A release
    that is not a DART head (missing config fields, other tensor names or shapes) is refused here
    with the problem named.
    """
    from dart_worker.artifacts.cache_dir import build_atomically, cache_dir
    from dart_worker.artifacts.fingerprint import model_files_fingerprint

    directory = Path(directory)
    config = read_draft_config(directory)
    fingerprint = model_files_fingerprint(directory)
    final = cache_dir("heads", "imported") / fingerprint

    def build(tmp: Path) -> None:
        tensors = _read_safetensors(directory)
        with torch.device("meta"):  # shapes only
            reference = DartDraftHead(config, nn.Embedding(config.vocab_size, config.hidden_size))
        shapes = {n: tuple(t.shape) for n, t in reference.state_dict().items()}
        _check_keys(shapes, tensors, directory)
        _check_shapes_and_dtypes(shapes, tensors, config, directory)
        copy = tensors.pop(EMBEDDING_COPY, None)
        if copy is not None:
            if copy.shape != (config.vocab_size, config.hidden_size):
                raise DraftHeadLoadError(
                    f"{directory / WEIGHTS_NAME}: {EMBEDDING_COPY} has shape {tuple(copy.shape)}, but the target's "
                    f"embedding is ({config.vocab_size}, {config.hidden_size}) by its {CONFIG_NAME}; this head was "
                    "trained for another model")
            rows = probe_rows(copy.shape[0])
            tensors[EMBEDDING_PROBE] = copy[rows].float().contiguous()
            tensors[EMBEDDING_PROBE_ROWS] = rows
        config.extras[IMPORT_STAMP] = {"source": str(directory.resolve()), "source_fingerprint": fingerprint,
                                       "layout": "DART release (github.com/fvliang/DART LlamaForCausalLMDart)"}
        tmp.mkdir()
        save_file({n: t.contiguous() for n, t in tensors.items()}, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")

    return build_atomically(final, build, is_valid=lambda p: (p / CONFIG_NAME).is_file()
                            and (p / WEIGHTS_NAME).is_file())


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
    directory = resolve_head_dir(directory)
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
    weight = getattr(embed_tokens, "weight", None)
    if weight is not None and weight.device.type != "meta":
        _check_embedding(tensors, weight, directory)
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
                                  tap_layers: Sequence[int] | None = None,
                                  target_dir: str | os.PathLike | None = None) -> None:
    """The checks of `load_draft_head` a driver makes at start-up without building the target: the
    head's vocabulary, hidden sizes and tap layers against the target's config (`tap_layers` None:
    the taps the target adapter uses by default) and, with `target_dir` (a model directory in
    safetensors) and a head that recorded its target's embedding, those embedding rows against the
    target's file (only those rows are read)."""
    directory = resolve_head_dir(directory)
    config = read_draft_config(directory)
    text_config = target_text_config(target_config)
    _check_config_fits_target(config, text_config, None, directory)
    layers = text_config.num_hidden_layers
    check_tap_layers(config, tap_layers if tap_layers is not None else default_tap_layers(layers), layers,
                     f"draft head {directory / CONFIG_NAME}")
    if target_dir is not None:
        with safe_open(directory / WEIGHTS_NAME, framework="pt") as f:
            names = set(f.keys())
            probe = {n: f.get_tensor(n) for n in (EMBEDDING_PROBE, EMBEDDING_PROBE_ROWS) if n in names}
        if len(probe) == 2:
            rows = _target_embedding_rows(Path(target_dir), probe[EMBEDDING_PROBE_ROWS])
            if rows is not None:
                _compare_embedding_rows(probe[EMBEDDING_PROBE], rows, probe[EMBEDDING_PROBE_ROWS], directory)


def _target_embedding_rows(target_dir: Path, rows: torch.Tensor) -> torch.Tensor | None:
    """Rows `rows` of the token embedding in a model directory's safetensors (sharded or not), read
    without loading the rest; None where the file layout is not one we can read that way."""
    index = target_dir / "model.safetensors.index.json"
    names = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")
    files = [target_dir / WEIGHTS_NAME]
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [target_dir / weight_map[n] for n in names if n in weight_map]
    for path in files:
        if not path.is_file():
            continue
        with safe_open(path, framework="pt") as f:
            present = set(f.keys())
            for name in names:
                if name in present:
                    embedding = f.get_slice(name)
                    if int(rows.max()) >= embedding.get_shape()[0]:
                        return None
                    return torch.stack([embedding[int(r): int(r) + 1][0] for r in rows])
    return None


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


def _check_embedding(tensors: dict[str, torch.Tensor], weight: torch.Tensor, directory: Path) -> None:
    """A checkpoint may carry a copy of its target's embedding (an upstream release) or a probe of
    some of its rows (an imported one). The head is used with the target's own embedding, so the
    copy is not loaded; but it says which model the head was trained with, and a different one
    (another size, or the base model of an instruct target: same shapes, other values) is refused."""
    copy = tensors.get(EMBEDDING_COPY)
    if copy is not None:
        if tuple(copy.shape) != tuple(weight.shape):
            raise DraftHeadLoadError(
                f"{directory / WEIGHTS_NAME}: {EMBEDDING_COPY} has shape {tuple(copy.shape)}, but the "
                f"target's embedding is {tuple(weight.shape)}; this head was trained for another model")
        rows = probe_rows(copy.shape[0])
        _compare_embedding_rows(copy[rows], weight[rows.to(weight.device)], rows, directory)
    probe, rows = tensors.get(EMBEDDING_PROBE), tensors.get(EMBEDDING_PROBE_ROWS)
    if probe is not None and rows is not None:
        if int(rows.max()) >= weight.shape[0] or probe.shape[-1] != weight.shape[1]:
            raise DraftHeadLoadError(
                f"{directory / WEIGHTS_NAME}: the head records a target embedding of width {probe.shape[-1]} "
                f"with row {int(rows.max())}, the target's is {tuple(weight.shape)}; this head was trained for "
                "another model")
        _compare_embedding_rows(probe, weight[rows.to(weight.device)], rows, directory)


def probe_rows(vocab_size: int, count: int = PROBE_ROW_COUNT) -> torch.Tensor:
    """The embedding rows an imported head keeps: evenly spread over the vocabulary (special
    tokens at the start, rare merges at the end), fixed for a vocabulary size."""
    return torch.unique(torch.linspace(0, vocab_size - 1, steps=min(count, vocab_size)).round().long())


def _compare_embedding_rows(recorded: torch.Tensor, target: torch.Tensor, rows: torch.Tensor,
                            directory: Path) -> None:
    """Equal up to the rounding of a dtype change (a bf16 release against an fp32 or bf16 target)."""
    recorded, target = recorded.detach().float().cpu(), target.detach().float().cpu()
    if recorded.shape != target.shape:
        raise DraftHeadLoadError(f"{directory / WEIGHTS_NAME}: the recorded target embedding rows have shape "
                                 f"{tuple(recorded.shape)}, the target's {tuple(target.shape)}")
    scale = max(float(target.abs().max()), 1e-12)
    bad = ((recorded - target).abs() > 1e-2 * target.abs() + 1e-3 * scale).any(dim=-1)
    if bool(bad.any()):
        which = rows[bad].tolist()
        raise DraftHeadLoadError(
            f"{directory / WEIGHTS_NAME}: this head was trained with another target: its copy of the target's "
            f"token embedding differs from model.target's in {len(which)} of {len(rows)} compared rows "
            f"(token ids {which[:8]}{' ...' if len(which) > 8 else ''}; largest difference "
            f"{float((recorded - target).abs().max()):.3g}, target values up to {scale:.3g}). Use the head "
            f"published for this exact target (base and instruct variants differ) or train one (jobs.train_draft)")


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
