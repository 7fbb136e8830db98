"""First-run messages: before each slow one-time step (assembling the GGUF, converting the default
target, caching its tokenizer, building the default trie) one line says what, why, where it is
cached and roughly how long, and the conversion reports its steps. The slow work itself is replaced
by tiny stand-ins on a fresh cache dir; the message path is the real one."""

from __future__ import annotations

import hashlib
import json
import shutil
import types
from pathlib import Path

import numpy as np
import pytest

import dart_train.ngram_build as ngram_build
import dart_worker.artifacts.default_target as default_target
from dart_worker.artifacts.cache_dir import CACHE_ENV_VAR
from dart_worker.artifacts.fingerprint import tokenizer_fingerprint
from ngram_native import build_trie
from tests.tiny_models import TINY_VOCAB, tiny_model, tiny_tokenizer


def gemma_like_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [default_target.END_OF_TURN_TOKEN]})
    return tokenizer


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache root and a stand-in for the GGUF package (one small 'chunk')."""
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    package_dir = tmp_path / "pkg"
    package_dir.mkdir()
    chunk = package_dir / "chunk-0"
    chunk.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    package = types.SimpleNamespace(
        MODEL_NAME="fake-gemma.gguf", EXPECTED_SHA256=hashlib.sha256(chunk.read_bytes()).hexdigest(),
        __file__=str(package_dir / "__init__.py"), chunk_paths=lambda: [chunk],
        assemble=lambda output_path: shutil.copyfile(chunk, output_path))
    monkeypatch.setattr(default_target, "_source_package", lambda: package)
    return tmp_path / "cache"


def first_run_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[dart-batch] ")]


def test_default_target_conversion_announces_itself_and_its_steps(fresh_cache, monkeypatch, capsys):
    read = []

    def fake_load_gguf_model(path, dtype):
        assert Path(path).is_file()
        read.append("weights")
        return tiny_model("llama")

    def fake_load_gguf_tokenizer(path):
        read.append("tokenizer")
        return gemma_like_tokenizer()

    monkeypatch.setattr(default_target, "load_gguf_model", fake_load_gguf_model)
    monkeypatch.setattr(default_target, "load_gguf_tokenizer", fake_load_gguf_tokenizer)
    path = default_target.default_target_dir()
    lines = first_run_lines(capsys.readouterr().err)
    converting = next(i for i, line in enumerate(lines) if "first run: converting the default target" in line)
    assert str(path) in lines[converting] and "about a minute, once" in lines[converting]
    assert "every worker loads it in seconds" in lines[converting]  # why
    assembling = next(line for line in lines if "first run: assembling fake-gemma.gguf" in line)
    assert str(fresh_cache / "gguf" / "fake-gemma.gguf") in assembling and "once" in assembling
    steps = [line for line in lines if "default target conversion " in line and "/4:" in line]
    assert [s.split("conversion ")[1][:3] for s in steps] == ["1/4", "2/4", "3/4", "4/4"]
    assert "tokenizer" in steps[1] and "dequantising" in steps[2]
    assert "finished in" in lines[-1] and str(path) in lines[-1]

    assert default_target.default_target_dir() == path  # cached: silent
    assert first_run_lines(capsys.readouterr().err) == []
    # the GGUF's tokenizer was read once, for the tokenizer-only copy the conversion took it from
    assert read == ["tokenizer", "weights"]
    default_target.default_tokenizer()
    assert read == ["tokenizer", "weights"]


def test_the_conversion_takes_the_tokenizer_a_trie_build_already_read(fresh_cache, monkeypatch):
    """default_tokenizer first (a trie build, a driver), then the model: the GGUF's tokenizer, ~20 s
    for Gemma-3's vocabulary, is read once."""
    read = []
    monkeypatch.setattr(default_target, "load_gguf_model",
                        lambda path, dtype: read.append("weights") or tiny_model("llama"))
    monkeypatch.setattr(default_target, "load_gguf_tokenizer",
                        lambda path: read.append("tokenizer") or gemma_like_tokenizer())
    default_target.default_tokenizer()
    default_target.default_target_dir()
    assert read == ["tokenizer", "weights"]


def test_default_tokenizer_announces_itself_once(fresh_cache, monkeypatch, capsys):
    monkeypatch.setattr(default_target, "load_gguf_tokenizer", lambda path: gemma_like_tokenizer())
    default_target.default_tokenizer()
    lines = first_run_lines(capsys.readouterr().err)
    assert any("first run: reading the default tokenizer" in line and str(fresh_cache / "tokenizers") in line
               and "about 20 s" in line for line in lines), lines
    default_target.default_tokenizer()
    assert first_run_lines(capsys.readouterr().err) == []


def test_default_trie_build_announces_itself_once(fresh_cache, monkeypatch, capsys):
    tokenizer = tiny_tokenizer()

    def fake_build(cfg, tokenizer):
        docs = [np.arange(4, TINY_VOCAB, dtype=np.int32)]
        build_trie(docs, cfg.output, order=3, vocab_size=TINY_VOCAB,
                   tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
        Path(cfg.output + ".json").write_text(json.dumps({"fake": True}))

    monkeypatch.setattr(ngram_build, "default_tokenizer", lambda: tokenizer)
    monkeypatch.setattr(ngram_build, "build_ngram", fake_build)
    path = ngram_build.default_trie_path()
    assert path.is_file()
    lines = first_run_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "first run: building the default N-gram trie" in lines[0]
    assert str(path) in lines[0] and "model.trie=default" in lines[0] and "about a minute" in lines[0]
    ngram_build.default_trie_path()
    assert first_run_lines(capsys.readouterr().err) == []


def test_a_drafting_jobs_driver_loads_and_fingerprints_the_default_tokenizer_once(fresh_cache, monkeypatch, tmp_path):
    """The driver of a job on the default target with the default trie has the default tokenizer
    loaded already: finding the trie must not load it again (~7 s for Gemma-3's vocabulary) nor
    fingerprint it afresh on every start (~6 s); that was most of a drafting job's extra start-up
    against an `ar` job (+14.9 s on a 2-core EPYC)."""
    from transformers import AutoTokenizer

    import dart_worker.artifacts.fingerprint as fingerprint
    from pipeline.startup import preflight

    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))  # from a directory, as the default's is
    fingerprints = []
    real_fingerprint = fingerprint.tokenizer_fingerprint
    monkeypatch.setattr(fingerprint, "tokenizer_fingerprint", lambda t: fingerprints.append(t) or real_fingerprint(t))

    def fake_build(cfg, tokenizer):
        build_trie([np.arange(4, TINY_VOCAB, dtype=np.int32)], cfg.output, order=3, vocab_size=TINY_VOCAB,
                   tokenizer_fingerprint=real_fingerprint(tokenizer))
        Path(cfg.output + ".json").write_text("{}")

    def no_second_load():
        raise AssertionError("the default tokenizer was loaded again")

    monkeypatch.setattr(ngram_build, "default_tokenizer", no_second_load)
    monkeypatch.setattr(ngram_build, "build_ngram", fake_build)
    first = preflight._resolve_trie("default", tokenizer, tokenizer_is_default=True)
    assert len(fingerprints) == 1  # computed once, then read from the cache by the trie check
    assert preflight._resolve_trie("default", tokenizer, tokenizer_is_default=True) == first
    assert len(fingerprints) == 1  # the next start computes none
    with pytest.raises(AssertionError, match="loaded again"):  # another target's tokenizer is not used
        preflight._resolve_trie("default", tokenizer, tokenizer_is_default=False)
