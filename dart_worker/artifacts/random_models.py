"""Random-weight causal LMs of named shapes: tiny ones for correctness, real ones for timing.

Correctness checks need real transformers code paths (GQA, Qwen3's q/k norms, Gemma3's sliding
windows and scaled embeddings) but no trained weights: a tiny model of each family with a wide
init range, whose peaked distributions make greedy paths non-trivial, is compared with its own
`generate`. Timing needs only the shapes: a model built from a real model's config with random
weights costs exactly what the trained one costs per forward, and fits a machine that cannot
download the weights. The shapes below are copied from the published configs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TINY_FAMILIES = ("llama", "qwen3", "gemma3")


def tiny_config(family: str, vocab_size: int = 96, num_layers: int = 6, max_position_embeddings: int = 256,
                sliding_window: int = 16, initializer_range: float = 0.2) -> PretrainedConfig:
    """A 6-layer, 64-wide config of `family` with GQA (4 query heads, 2 KV heads); Gemma3's has
    sliding-window layers (every third layer full) with a window shorter than the tests' texts."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=max_position_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False, initializer_range=initializer_range)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen3":
        return Qwen3Config(**common)
    if family == "gemma3":
        layer_types = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_layers)]
        return Gemma3TextConfig(**common, sliding_window=sliding_window, layer_types=layer_types,
                                query_pre_attn_scalar=16)
    raise ValueError(f"unknown family {family!r}; expected one of {TINY_FAMILIES}")


def gemma3_270m_config() -> Gemma3TextConfig:
    """google/gemma-3-270m (the embedded default target): 18 layers of 640, 4 query heads of 256
    over 1 KV head, a 262k vocabulary (tied head: 60% of the weights), every sixth layer full
    attention and the rest a 512-token sliding window."""
    layers = 18
    return Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
        sliding_window=512, query_pre_attn_scalar=256, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)


def llama3_8b_config() -> LlamaConfig:
    """meta-llama/Meta-Llama-3-8B: 32 layers of 4096, 32 query heads over 8 KV heads, 128k vocabulary."""
    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500_000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)


def small_llama_config() -> LlamaConfig:
    """A small Llama (4 layers of 256, 16k vocabulary) that a CPU times in seconds: the timing
    section's shape when it runs on a CPU in the test suite."""
    return LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


SHAPES: dict[str, Callable[[], PretrainedConfig]] = {
    "gemma3-270m": gemma3_270m_config,
    "llama3-8b": llama3_8b_config,
    "small-llama": small_llama_config,
    **{f"tiny-{family}": (lambda f=family: tiny_config(f)) for family in TINY_FAMILIES},
}

_MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM, "gemma3_text": Gemma3ForCausalLM}


def random_model(config: PretrainedConfig | str, *, seed: int = 0, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A model of `config` (or a name in SHAPES) with random weights, built directly on `device`
    in `dtype` (an 8B model never passes through host memory), in eval mode."""
    if isinstance(config, str):
        if config not in SHAPES:
            raise ValueError(f"unknown model shape {config!r}; expected one of {sorted(SHAPES)}")
        config = SHAPES[config]()
    cls = _MODEL_CLASSES.get(config.model_type)
    if cls is None:
        raise ValueError(f"no random-weight builder for model type {config.model_type!r}")
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed_all(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.to(dtype=dtype).eval().requires_grad_(False)
