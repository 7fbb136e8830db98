"""Tiny random-weight causal LMs of each supported family (Llama, Qwen3, Gemma3), fp32.

They keep engine tests fast while exercising the real transformers code paths: GQA,
q/k norms (Qwen3), sliding-window layers and scaled embeddings (Gemma3).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from dart_worker.artifacts.random_models import TINY_FAMILIES, random_model, tiny_config

FAMILIES = TINY_FAMILIES
TINY_VOCAB = 96


def tiny_model(family: str, seed: int = 0, vocab_size: int = TINY_VOCAB, num_layers: int = 6,
               max_position_embeddings: int = 256, sliding_window: int = 16,
               initializer_range: float = 0.2) -> PreTrainedModel:
    """A randomly initialised model of `family` in fp32 and eval mode (`dart_worker.artifacts.random_models`).

    A larger init range than the default (0.02) makes the output distributions peaked and
    varied, so greedy paths are non-trivial instead of repeating one token.
    """
    config = tiny_config(family, vocab_size=vocab_size, num_layers=num_layers,
                         max_position_embeddings=max_position_embeddings, sliding_window=sliding_window,
                         initializer_range=initializer_range)
    return random_model(config, seed=seed)


def tiny_tokenizer(vocab_size: int = TINY_VOCAB) -> PreTrainedTokenizerFast:
    """A word-level tokenizer built offline: <pad>=0 <bos>=1 <eos>=2 <unk>=3, then w4..w{n-1}."""
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


def save_tiny_target(directory: Path, family: str = "llama", tokenizer_vocab: int = TINY_VOCAB, **kwargs) -> Path:
    """A tiny model plus its tokenizer as a normal model directory (what `load_target` reads)."""
    tiny_model(family, **kwargs).save_pretrained(directory)
    tiny_tokenizer(tokenizer_vocab).save_pretrained(directory)
    return directory


def save_tiny_artifacts(root: Path) -> dict[str, str]:
    """A tiny fp32 target dir, a random draft head checkpoint and a trie for its tokenizer:
    everything a pipeline or benchmark config names, small enough for fast tests."""
    import numpy as np

    from dart_worker.artifacts.fingerprint import tokenizer_fingerprint
    from dart_worker.head.draft_checkpoint import save_draft_head
    from dart_worker.head.draft_head import DartDraftHead
    from ngram_native import build_trie

    target_dir = save_tiny_target(root / "target", "llama")
    model = tiny_model("llama")
    torch.manual_seed(0)
    save_draft_head(DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=3),
                    root / "head")
    tokenizer = tiny_tokenizer()
    rng = np.random.default_rng(0)
    docs = [rng.integers(4, TINY_VOCAB, size=50).astype(np.int32) for _ in range(30)]
    build_trie(docs, root / "tiny.ngram", order=3, vocab_size=len(tokenizer),
               tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
    return {"target": str(target_dir), "head": str(root / "head"), "trie": str(root / "tiny.ngram")}


def tiny_worker_config(artifacts: dict[str, str]):
    """A pipeline config for a GenerationWorker built in the test process on `artifacts`
    (save_tiny_artifacts): fp32 on the CPU, one thread, mode dart_lookup; tests set the rest."""
    from pipeline.settings.config import PipelineConfig

    cfg = PipelineConfig()
    cfg.input.urls, cfg.output.url = ["unused.jsonl"], "unused"
    cfg.model.target, cfg.model.draft_head, cfg.model.trie = artifacts["target"], artifacts["head"], artifacts["trie"]
    cfg.model.dtype, cfg.model.device = "fp32", "cpu"
    cfg.decoding.mode = "dart_lookup"
    cfg.resources.torch_threads = 1
    return cfg


def input_row(key: str, prompt: str, **settings) -> dict:
    """An input row as the readers make it (pipeline.data.inputs.INPUT_SCHEMA), with per-row settings."""
    import json

    return {"row_key": f"id:{key}", "id": key, "prompt": prompt, "prompt_kind": "text", "source": "f",
            "error": None, "settings": json.dumps(settings) if settings else None}
