"""Loading the target LLM (and its tokenizer) from whatever the user points at.

A target spec is one of:
  "default"            the embedded default (Gemma-3-270M, see default_target.py)
  a local directory    a Hugging Face model directory (config.json + weights + tokenizer)
  a path ending .gguf  a GGUF file, dequantised through transformers (slow, at every load;
                       prefer converting once to a directory, as the default target does)
  a URL                any fsspec URL of such a directory or .gguf file (s3://, gs://, ...):
                       downloaded once per node into the project cache and verified
                       (target_store.py); file:// URLs are local paths
  a hub id "org/name"  only where the Hugging Face Hub is reachable; offline, only if it is
                       already in the local HF cache

Whatever the source, the result is checked before the engine sees it: a causal LM whose
decoder layers sit at `model.model.layers` (the engine taps hidden states per layer and
verifies draft trees with explicit 4D masks, hence attention implementation "sdpa"), in
eval mode with gradients off, on the requested device and dtype, with a tokenizer whose
vocabulary fits the model's embedding. Problems are reported as errors that name the spec
and what was found, before minutes are spent on a broken run.

`load_tokenizer` loads the tokenizer alone (tries are built and checked with it), and
`model_fingerprint` identifies the exact weights/config/tokenizer files behind a spec (the
hashing itself is in fingerprint.py), so outputs and artifacts can be stamped and checked
against each other. GGUF reading is in gguf.py, the embedded default in default_target.py.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from dart_worker.artifacts.fingerprint import model_files_fingerprint
from dart_worker.artifacts.gguf import load_gguf, load_gguf_tokenizer
from dart_worker.artifacts.target_store import fetch_model_dir, is_remote_url, local_path_of
from dart_worker.defaults import DEFAULT_DTYPE
from dart_worker.hardware.device import resolve_device, resolve_dtype

log = logging.getLogger(__name__)

DEFAULT_SPEC = "default"
ATTN_IMPLEMENTATION = "sdpa"

SourceKind = Literal["dir", "gguf", "hub"]


@dataclass(frozen=True)
class ModelSource:
    """Where a target spec points: a local model directory, a GGUF file, or a hub repository id."""

    kind: SourceKind
    location: str
    spec: str


def _truthy_env(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """True when the user asked for offline mode (huggingface_hub reads these only at import)."""
    from huggingface_hub import constants

    return _truthy_env("HF_HUB_OFFLINE") or _truthy_env("TRANSFORMERS_OFFLINE") or bool(constants.HF_HUB_OFFLINE)


def _looks_like_hub_id(spec: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if spec.startswith(("~", ".")) or "\\" in spec:
        return False
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def resolve_source(spec: str | os.PathLike) -> ModelSource:
    """Classify a target spec without loading weights (existing local paths win over hub ids).

    "default" resolves to the converted default directory, converting it first if needed.
    """
    spec_str = os.fspath(spec).strip()
    if not spec_str:
        raise ValueError("empty target spec; expected 'default', a model directory, a .gguf file, a URL or a "
                         "hub id")
    if spec_str == DEFAULT_SPEC:
        from dart_worker.artifacts.default_target import default_target_dir

        return ModelSource("dir", str(default_target_dir()), spec_str)
    if is_remote_url(spec_str):  # downloaded once per node, verified, content-addressed
        local = fetch_model_dir(spec_str, what="target")
        return ModelSource("gguf" if local.is_file() else "dir", str(local), spec_str)
    path = Path(local_path_of(spec_str)).expanduser()
    if spec_str.lower().endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"target GGUF file {spec_str!r} does not exist (resolved to {path.resolve()})")
        return ModelSource("gguf", str(path.resolve()), spec_str)
    if path.is_dir():
        if not (path / "config.json").is_file():
            entries = sorted(p.name for p in path.iterdir())[:10]
            raise ValueError(f"target directory {spec_str!r} is not a Hugging Face model directory: it has "
                             f"no config.json (found {entries or 'nothing'})")
        return ModelSource("dir", str(path.resolve()), spec_str)
    if path.exists():
        raise ValueError(f"target {spec_str!r} is a file but not a .gguf file; expected 'default', a model "
                         "directory, a .gguf file or a hub id")
    if _looks_like_hub_id(spec_str):
        return ModelSource("hub", spec_str, spec_str)
    raise FileNotFoundError(f"target path {spec_str!r} does not exist (resolved to {path.resolve()})")


def _hub_error(spec: str, err: Exception | None) -> OSError:
    why = "offline mode is on (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE) and it is not in the local HF cache" \
        if hub_offline() else f"the Hugging Face Hub could not provide it ({type(err).__name__}: {err})"
    return OSError(f"target {spec!r} is not a local path, so it was taken as a hub id, but {why}. "
                   "Pass a local model directory or a .gguf file instead (or 'default').")


def _check_causal_lm_config(config, source: ModelSource, trust_remote_code: bool) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    remote_causal = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not remote_causal:
        raise ValueError(f"target {source.spec!r} has model_type {model_type!r} ({type(config).__name__}), "
                         "which is not a causal language model (transformers' AutoModelForCausalLM has no "
                         "class for it)")


def validate_target(model: nn.Module, tokenizer: PreTrainedTokenizerBase, spec: str = "<model>") -> None:
    """Raise if `model`/`tokenizer` is not something the engine can drive (see module docstring)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"target {spec!r} ({type(model).__name__}) has no decoder layer list at model.model.layers; "
            "the engine needs a text-only decoder (multimodal checkpoints: load their text model)")
    attn = getattr(model.config, "_attn_implementation", None)
    if attn != ATTN_IMPLEMENTATION:
        raise ValueError(f"target {spec!r} uses attention implementation {attn!r}, the engine needs "
                         f"{ATTN_IMPLEMENTATION!r} (it passes explicit 4D tree masks)")
    embedding_rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embedding_rows:
        raise ValueError(f"target {spec!r}: tokenizer has {len(tokenizer)} tokens but the model's embedding "
                         f"has only {embedding_rows} rows; tokenizer and weights do not belong together")


def target_family(model: PreTrainedModel) -> str:
    """The model family as transformers names it (config.model_type), e.g. 'gemma3_text', 'llama'."""
    return str(model.config.model_type)


def _finish(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device, dtype: torch.dtype,
            source: ModelSource, started: float, split: bool = False,
            ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if not split:  # a model spread by a device map stays where accelerate placed each module
        model = model.to(device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    validate_target(model, tokenizer, source.spec)
    where = describe_placement(model) if split else str(device)
    log.info("loaded target %s (%s, %s): %d layers, hidden %d, vocab %d, %s on %s in %.1f s",
             source.spec, target_family(model), source.location, len(model.model.layers),
             model.config.hidden_size, model.get_input_embeddings().num_embeddings,
             str(dtype).removeprefix("torch."), where, time.monotonic() - started)
    return model, tokenizer


# --- one target over several devices -----------------------------------------------------------

# Share of each device's free memory left out of the weights' budget: the KV cache of a batch and
# the activations of a verify forward live there too (a 64-row tree over 16 sequences of 2k tokens
# of Llama-3-8B holds ~4 GB of KV in bf16).
DEFAULT_HEADROOM = 0.2


def split_device_map(config, devices, dtype: torch.dtype, max_memory: dict | None = None,
                     headroom: float = DEFAULT_HEADROOM, trust_remote_code: bool = False) -> dict[str, int | str]:
    """Which device each module of a target goes to when one worker spreads it over `devices`.

    Whole decoder layers in order (accelerate's `infer_auto_device_map` over an empty model, never
    splitting a `_no_split_modules` block), balanced over the devices (`get_balanced_memory`), the
    token embedding on the first device (the engine's tensors live where the embedding is) and
    tied weights together. `max_memory` {device index: bytes} defaults to each CUDA device's free
    memory less `headroom`. A target that does not fit on the devices is a ValueError giving its
    size and theirs: nothing is ever placed on the CPU or disk behind the user's back.
    """
    from accelerate import infer_auto_device_map, init_empty_weights
    from accelerate.utils import compute_module_sizes, get_balanced_memory

    devices = [torch.device(d) for d in devices]
    if not devices or any(d.type != "cuda" for d in devices) or len({d.index for d in devices}) != len(devices):
        raise ValueError(f"a target is split over distinct CUDA devices, got {[str(d) for d in devices]}")
    indices = [d.index if d.index is not None else 0 for d in devices]
    if max_memory is None:
        max_memory = {i: int(torch.cuda.mem_get_info(i)[0] * (1 - headroom)) for i in indices}
    if sorted(max_memory) != sorted(indices):
        raise ValueError(f"max_memory names devices {sorted(max_memory)}, the split is over {indices}")
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    no_split = list(getattr(empty, "_no_split_modules", None) or [type(empty.model.layers[0]).__name__])
    balanced = get_balanced_memory(empty, max_memory=dict(max_memory), no_split_module_classes=no_split,
                                   dtype=dtype, low_zero=False)
    device_map = dict(infer_auto_device_map(empty, max_memory=balanced, no_split_module_classes=no_split,
                                            dtype=dtype))
    tied = getattr(getattr(empty, "config", None), "tie_word_embeddings", False)
    if tied and "lm_head" in device_map and "model.embed_tokens" in device_map:
        device_map["lm_head"] = device_map["model.embed_tokens"]  # one weight, one home
    off = sorted(name for name, where in device_map.items() if where not in indices)
    if off:
        need = compute_module_sizes(empty, dtype=dtype)[""]
        raise ValueError(
            f"the target needs {need / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')} but "
            f"{len(indices)} device(s) offer {sum(max_memory.values()) / 2**30:.1f} GiB for weights "
            f"({', '.join(f'cuda:{i} {m / 2**30:.1f} GiB' for i, m in sorted(max_memory.items()))}, after "
            f"{headroom:.0%} headroom for the KV cache): {off[:3]} would not fit; give each worker more GPUs "
            "(resources.num_gpus_per_worker) or use a smaller dtype")
    return device_map


def describe_placement(model: PreTrainedModel) -> str:
    """"cuda:0 (embedding, layers 0-13), cuda:1 (layers 14-27, norm, lm_head)": where a spread
    target's modules are, from transformers' `hf_device_map`, for the log and the dry run."""
    device_map = getattr(model, "hf_device_map", None) or {"": str(model.get_input_embeddings().weight.device)}
    groups: dict[str, list[str]] = {}
    for name, where in device_map.items():
        label = f"cuda:{where}" if isinstance(where, int) else str(where)
        groups.setdefault(label, []).append(name)
    parts = []
    for label, names in groups.items():
        items: list[str] = []  # in model order, a run of decoder layers shown as one span
        layers: list[int] = []
        for name in [*names, None]:
            if name is not None and name.startswith("model.layers."):
                layers.append(int(name.split(".")[2]))
                continue
            if layers:
                items.append(f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}")
                layers = []
            if name is not None:
                items.append(name.rsplit(".", 1)[-1] if name else "all")
        parts.append(f"{label} ({', '.join(items)})")
    return ", ".join(parts)


def load_target(spec: str | os.PathLike = DEFAULT_SPEC, dtype: str | torch.dtype = DEFAULT_DTYPE,
                device: str | torch.device = "auto", trust_remote_code: bool = False,
                devices=None, device_map: dict | None = None, max_memory: dict | None = None,
                offload_folder: str | os.PathLike | None = None,
                ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) for a target spec (see module docstring), ready for the engine.

    `device`/`dtype` accept what device.resolve_device / resolve_dtype accept ("auto", "cpu",
    "cuda:1", "bf16", torch objects). `trust_remote_code` is passed to transformers for
    models that ship their own modelling code; keep it off unless you trust the source.

    A target larger than one device: `devices` (several CUDA devices, e.g. the GPUs Ray gave a
    worker) spreads it over them by whole layers (`split_device_map`, with `max_memory` per device
    index), or `device_map` places modules explicitly ({module name: device}, transformers'
    format). The model then stays where each module was placed; `device` is where the embedding
    is. `offload_folder` is where accelerate keeps modules an explicit map sends to "disk": the one
    placement over several "devices" a machine without GPUs has, used to test the split path on a
    CPU, never by a job. The engine drives a target spread this way (`TargetAdapter.device` is the
    embedding's device, `logits_device` the LM head's, each layer's KV cache on its own device):
    docs/your_model.md#targets-larger-than-one-gpu.
    """
    started = time.monotonic()
    if devices is not None and len(devices) > 1 and device_map is None:
        device = torch.device(devices[0])
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    source = resolve_source(spec)
    split = device_map is not None or (devices is not None and len(devices) > 1)

    if source.kind == "gguf":
        if split:
            raise ValueError(f"target {source.spec!r}: a GGUF file is loaded on one device; convert it to a "
                             "model directory (save_pretrained) to spread it over several")
        model, tokenizer = load_gguf(source.location, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        return _finish(model, tokenizer, device, dtype, source, started)

    local_only = source.kind == "hub" and hub_offline()
    common = dict(trust_remote_code=trust_remote_code, local_files_only=local_only)
    try:
        config = AutoConfig.from_pretrained(source.location, **common)
    except (OSError, ValueError, KeyError) as err:
        if source.kind == "hub":
            raise _hub_error(source.spec, err) from err
        raise ValueError(f"target {source.spec!r}: cannot read config.json in {source.location}: {err}") from err
    _check_causal_lm_config(config, source, trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.location, **common)
    except (OSError, ValueError) as err:
        raise ValueError(f"target {source.spec!r}: cannot load its tokenizer from {source.location}: {err}") from err
    if device_map is None and split:
        device_map = split_device_map(config, devices, dtype, max_memory=max_memory,
                                      trust_remote_code=trust_remote_code)
    elif device_map is None and device.type != "cpu" and importlib.util.find_spec("accelerate"):
        # Weights go straight to an accelerator instead of through host memory first (transformers
        # needs `accelerate` for that; without it they are loaded on CPU and moved).
        device_map = {"": device}
    try:
        extra = {"offload_folder": str(offload_folder)} if offload_folder is not None else {}
        model = AutoModelForCausalLM.from_pretrained(
            source.location, config=config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
            device_map=device_map, **common, **extra)
    except (OSError, ValueError, SafetensorError) as err:
        raise ValueError(f"target {source.spec!r}: cannot load its weights from {source.location} "
                         f"({type(err).__name__}: {err}); is a weights file truncated or corrupt?") from err
    if split:
        embedding_device = model.get_input_embeddings().weight.device
        if embedding_device != device:
            raise ValueError(f"target {source.spec!r}: the device map puts the token embedding on "
                             f"{embedding_device}, the engine's device is {device}; map model.embed_tokens there")
    return _finish(model, tokenizer, device, dtype, source, started, split=split)


# --- tokenizer alone and fingerprint -------------------------------------------------------

def load_tokenizer(spec: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer alone: "default" (the embedded target's), a local model/tokenizer directory, a
    .gguf file, or a URL of either (fetched like a target).

    No hub look-ups: this runs where there may be no network, so a name that is not a local
    path is an error rather than a download attempt.
    """
    spec_str = os.fspath(spec)
    if spec_str == DEFAULT_SPEC:
        from dart_worker.artifacts.default_target import default_tokenizer

        return default_tokenizer()
    if is_remote_url(spec_str):
        spec_str = str(fetch_model_dir(spec_str, what="tokenizer"))
    path = Path(local_path_of(spec_str)).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf_tokenizer(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer {spec_str!r} is not a local directory or .gguf file (use 'default' for the embedded target)")
    return AutoTokenizer.from_pretrained(str(path))


def model_fingerprint(spec_or_dir: str | os.PathLike) -> str:
    """A sha256 hex digest identifying the model behind a spec (directory, .gguf, 'default', hub id).

    Resolves the spec to local files (a hub id: its snapshot in the local HF cache), then
    `fingerprint.model_files_fingerprint` (what counts, and the cached per-file hashes).
    """
    source = resolve_source(spec_or_dir)
    if source.kind != "hub":
        return model_files_fingerprint(source.location)
    from huggingface_hub import snapshot_download

    try:
        directory = snapshot_download(source.location, local_files_only=True)
    except Exception as err:  # huggingface_hub raises several unrelated types here
        raise _hub_error(source.spec, err) from err
    return model_files_fingerprint(directory)
