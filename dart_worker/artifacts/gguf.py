"""GGUF files through transformers: the tokenizer, and the weights dequantised to plain tensors.

Used by `loading.load_target` for a .gguf target, and by `default_target` to convert the
embedded default once (reading a GGUF rebuilds the tokenizer from its vocabulary and
dequantises every weight, far slower than loading a converted directory's safetensors).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def load_gguf_tokenizer(gguf_path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer stored in a GGUF file."""
    gguf_path = Path(gguf_path)
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    log.info("tokenizer read from %s in %.1f s", gguf_path.name, time.monotonic() - started)
    return tokenizer


def load_gguf(gguf_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
              attn_implementation: str = "sdpa",
              progress: Callable[[], None] | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Tokenizer + dequantised model from a GGUF file, on CPU in `dtype`.

    `progress`, if given, is called before reading the tokenizer and before reading the weights.
    """
    if progress is not None:
        progress()
    tokenizer = load_gguf_tokenizer(gguf_path)
    if progress is not None:
        progress()
    return load_gguf_model(gguf_path, dtype, attn_implementation), tokenizer


def load_gguf_model(gguf_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                    attn_implementation: str = "sdpa") -> PreTrainedModel:
    """The dequantised model of a GGUF file (its weights alone), on CPU in `dtype`.

    transformers keeps GGUF weights in their packed blocks by default; dequantize=True gives
    plain nn.Linear weights the engine (and save_pretrained) can work with. The default
    attention implementation is the one the engine needs (loading.ATTN_IMPLEMENTATION).
    """
    from transformers import GgufConfig

    gguf_path = Path(gguf_path)
    started = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype, attn_implementation=attn_implementation,
        quantization_config=GgufConfig(dequantize=True))
    # Dequantised weights are plain tensors: drop any trace of the GGUF quantizer so that a
    # saved copy loads as an ordinary model.
    for attr in ("quantization_config",):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.hf_quantizer = None
    log.info("model weights read and dequantised from %s in %.1f s", gguf_path.name, time.monotonic() - started)
    return model
