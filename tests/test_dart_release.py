"""Upstream DART release directories (the layout of github.com/fvliang/DART's published heads) as
model.draft_head: mapped once into this project's layout, lossless with a tiny Qwen3 target
(greedy == `ar`, token for token), and refused with the reason when the target is another model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.head.draft_checkpoint import (
    EMBEDDING_PROBE,
    EMBEDDING_PROBE_ROWS,
    IMPORT_STAMP,
    DraftHeadLoadError,
    check_head_config_fits_target,
    load_draft_head,
    probe_rows,
    resolve_head_dir,
)
from dart_worker.head.draft_head import DartDraftHead
from dart_worker.sampling.params import SamplingParams
from ngram_native import TreeParams, build_trie
from tests.tiny_models import save_tiny_target, tiny_model, tiny_tokenizer

LAYERS = 8  # reference taps 2, 4, 5: distinct, as upstream's `idx == 2 or idx == L // 2 or idx == L - 3` needs


def write_release(directory: Path, model, seed: int = 0, draft_length: int = 3) -> dict[str, torch.Tensor]:
    """A head in the DART authors' layout: `DartConfig.save_pretrained`'s config.json (a LlamaConfig
    dump plus draft_length / draft_vocab_size / target_hidden_size, no head_dim, no tap_layers) and
    the `LlamaForCausalLMDart` state dict in bf16, embedding copy included, as their training saves it."""
    torch.manual_seed(seed)
    text = model.config
    kept = list(range(0, text.vocab_size, 2))  # a reduced draft vocabulary: d2t/t2d do something
    head = DartDraftHead.random_init(text, model.get_input_embeddings(), draft_length=draft_length,
                                     kept_target_ids=kept, head_dim=text.hidden_size // text.num_attention_heads)
    directory.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLMDart"], "model_type": "llama", "transformers_version": "4.57.1",
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
        "hidden_act": "silu", "hidden_size": text.hidden_size, "initializer_range": 0.02,
        "intermediate_size": head.config.intermediate_size, "max_position_embeddings": 256,
        "num_attention_heads": text.num_attention_heads, "num_hidden_layers": 1,
        "num_key_value_heads": text.num_key_value_heads, "pretraining_tp": 1, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "tie_word_embeddings": False, "use_cache": True, "vocab_size": text.vocab_size,
        "draft_length": draft_length, "draft_vocab_size": len(kept), "target_hidden_size": text.hidden_size,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {n: (t if n == "d2t" else t.to(torch.bfloat16)).contiguous() for n, t in head.state_dict().items()}
    tensors["t2d"] = head.t2d.contiguous()
    tensors["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().to(torch.bfloat16).contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "README.md").write_text("DART head for a tiny Qwen3\n")
    return tensors


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen3", num_layers=LAYERS, seed=5)


def test_release_is_mapped_once_and_keeps_every_tensor(tmp_path, target):
    release = tmp_path / "qwen-tiny-dart"
    source = write_release(release, target)
    mapped = resolve_head_dir(release)
    assert mapped != release and mapped.parent.name == "imported"
    tensors = load_file(mapped / "model.safetensors")
    assert "embed_tokens.weight" not in tensors
    for name, tensor in source.items():
        if name != "embed_tokens.weight":
            assert torch.equal(tensors[name], tensor), name
    rows = probe_rows(target.config.vocab_size)
    assert torch.equal(tensors[EMBEDDING_PROBE_ROWS], rows)
    assert torch.equal(tensors[EMBEDDING_PROBE], source["embed_tokens.weight"][rows].float())
    config = json.loads((mapped / "config.json").read_text())
    assert config[IMPORT_STAMP]["source"] == str(release.resolve())
    assert config["head_dim"] == 16 and config["rope_theta"] == 10000.0  # the reference defaults, written out

    stamp = (mapped / "model.safetensors").stat().st_mtime_ns
    assert resolve_head_dir(release) == mapped  # once: the second call maps nothing
    assert (mapped / "model.safetensors").stat().st_mtime_ns == stamp
    assert resolve_head_dir(mapped) == mapped  # an imported head is a head in this project's layout


def test_release_head_decodes_losslessly(tmp_path, target):
    release = tmp_path / "release"
    write_release(release, target)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(4, 96, size=7 + 3 * i)] for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    ar = build_engine(EngineParts.from_model(target), "ar")
    expected = [r.token_ids for r in ar.generate(prompts, greedy)]
    # a trie over the target's own continuations, so that trees hold accepted paths
    tokenizer = tiny_tokenizer()
    from dart_worker.artifacts.fingerprint import tokenizer_fingerprint

    build_trie([np.asarray(p + e, dtype=np.int32) for p, e in zip(prompts, expected, strict=True)],
               tmp_path / "self.ngram", order=3, vocab_size=96, tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
    parts = EngineParts.from_model(target, tokenizer, head=str(release), trie=str(tmp_path / "self.ngram"))
    assert parts.head.config.draft_vocab_size == 48
    for mode in ("chain", "dart"):
        results = build_engine(parts, mode, TreeParams(budget=16)).generate(prompts, greedy)
        assert [r.token_ids for r in results] == expected, mode
        if mode == "dart":
            assert sum(sum(r.stats.accept_lengths) for r in results) > 0, "no draft token was ever accepted"


def test_release_for_another_target_is_refused(tmp_path, target):
    release = tmp_path / "release"
    write_release(release, target)
    other = tiny_model("qwen3", num_layers=LAYERS, seed=6)  # same shapes, other weights: another model
    with pytest.raises(DraftHeadLoadError, match=r"trained with another target: its copy of the target's token "
                                                 r"embedding differs from model.target's in \d+ of \d+"):
        load_draft_head(release, other.config, other.get_input_embeddings())
    # the driver's start-up check reads the rows from the target's file, without loading it
    other_dir = save_tiny_target(tmp_path / "other", "qwen3", num_layers=LAYERS, seed=6)
    same_dir = save_tiny_target(tmp_path / "same", "qwen3", num_layers=LAYERS, seed=5)
    check_head_config_fits_target(release, target.config, target_dir=same_dir)
    with pytest.raises(DraftHeadLoadError, match="trained with another target"):
        check_head_config_fits_target(release, other.config, target_dir=other_dir)
    wider = tiny_model("llama", num_layers=LAYERS)
    wider.config.hidden_size = 80  # a config of another size
    with pytest.raises(DraftHeadLoadError, match="target_hidden_size is 64, but the target's hidden size is 80"):
        check_head_config_fits_target(release, wider.config)


def test_release_with_foreign_tensors_is_refused_naming_them(tmp_path, target):
    release = tmp_path / "release"
    tensors = write_release(release, target)
    tensors["midlayer.self_attn.q_norm.weight"] = torch.ones(16)
    del tensors["fc.weight"]
    save_file(tensors, release / "model.safetensors")
    with pytest.raises(DraftHeadLoadError, match=r"missing \['fc.weight'\], unexpected \['midlayer.self_attn.q_norm"):
        resolve_head_dir(release)
