"""Tokenizer fingerprints: equal for the same tokenizer however it is loaded, different otherwise."""

from __future__ import annotations

import hashlib
import json

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dart_worker.artifacts import fingerprint
from dart_worker.artifacts.fingerprint import (
    FINGERPRINT_HEX_CHARS,
    cached_tokenizer_fingerprint,
    check_tokenizer_fingerprint,
    file_fingerprint,
    tokenizer_fingerprint,
)

TINY_SENTENCES = [
    "the cat sat on the mat",
    "the dog ate the cat food",
    "a cat and a dog sat on a log",
    "hello world , hello cat !",
    "the quick brown fox jumps over the lazy dog",
]


def make_tiny_tokenizer(
    sentences: list[str] = TINY_SENTENCES, vocab_size: int = 80, lowercase: bool = False
) -> PreTrainedTokenizerFast:
    """A real BPE tokenizer trained in-process in milliseconds (no files, no network)."""
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    if lowercase:
        tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<eos>", "<pad>"])
    tk.train_from_iterator(sentences, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>", pad_token="<pad>")


def _edited(tok: PreTrainedTokenizerFast, edit) -> PreTrainedTokenizerFast:
    spec = json.loads(tok.backend_tokenizer.to_str())
    edit(spec)
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
    )


def test_fingerprint_is_sha256_hex_and_stable_across_loads(tmp_path):
    tok = make_tiny_tokenizer()
    fp = tokenizer_fingerprint(tok)
    assert len(fp) == FINGERPRINT_HEX_CHARS and int(fp, 16) >= 0
    assert tokenizer_fingerprint(tok) == fp
    assert tokenizer_fingerprint(make_tiny_tokenizer()) == fp  # retrained identically
    # Saved and reloaded from two different directories: paths and file times do not count.
    for name in ("a", "b"):
        tok.save_pretrained(tmp_path / name)
        assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path / name)) == fp


def test_modified_vocab_changes_fingerprint():
    tok = make_tiny_tokenizer()
    fp = tokenizer_fingerprint(tok)

    def swap_two_ids(spec):
        vocab = spec["model"]["vocab"]
        a, b = "cat", "dog"
        vocab[a], vocab[b] = vocab[b], vocab[a]

    swapped = _edited(tok, swap_two_ids)
    assert swapped.convert_tokens_to_ids("cat") == tok.convert_tokens_to_ids("dog")
    assert tokenizer_fingerprint(swapped) != fp

    grown = make_tiny_tokenizer()
    grown.add_tokens(["<new_token>"])
    assert tokenizer_fingerprint(grown) != fp


def test_segmentation_rules_and_special_tokens_count():
    base = make_tiny_tokenizer()
    fp = tokenizer_fingerprint(base)
    # Same vocab, one merge fewer: the same text can become different ids.
    fewer_merges = _edited(base, lambda spec: spec["model"]["merges"].pop())
    assert tokenizer_fingerprint(fewer_merges) != fp
    lowercased = _edited(base, lambda spec: spec.__setitem__("normalizer", {"type": "Lowercase"}))
    assert tokenizer_fingerprint(lowercased) != fp
    other_eos = make_tiny_tokenizer()
    other_eos.eos_token = "<pad>"
    assert tokenizer_fingerprint(other_eos) != fp


def test_bare_backend_tokenizer_is_accepted():
    tok = make_tiny_tokenizer()
    fp = tokenizer_fingerprint(tok.backend_tokenizer)
    assert len(fp) == FINGERPRINT_HEX_CHARS
    assert fp == tokenizer_fingerprint(Tokenizer.from_str(tok.backend_tokenizer.to_str()))


def test_check_names_both_fingerprints():
    tok = make_tiny_tokenizer()
    check_tokenizer_fingerprint(tokenizer_fingerprint(tok), tok)
    with pytest.raises(ValueError, match=r"built for tokenizer fingerprint 0{64}.*fingerprint [0-9a-f]{64}"):
        check_tokenizer_fingerprint("0" * 64, tok, what="trie")


def test_file_fingerprint_streams_and_matches_hashlib(tmp_path):
    data = bytes(range(256)) * 9000  # > 2 chunks
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    expected = hashlib.sha256(data).hexdigest()
    assert file_fingerprint(path) == expected
    assert file_fingerprint(str(path)) == expected
    assert file_fingerprint(f"file://{path}") == expected
    path.write_bytes(data[:-1] + b"\x00")
    assert file_fingerprint(path) != expected


def test_a_loaded_tokenizers_fingerprint_is_computed_once_per_files(tmp_path, monkeypatch):
    """A drafting job's start-up (the driver's trie check, every worker's) reads the fingerprint of a
    tokenizer loaded from unchanged files from the cache; changed files, added tokens or a
    tokenizer from no directory are fingerprinted anew."""
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "cache"))
    tok = make_tiny_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    computed = []
    real = fingerprint.tokenizer_fingerprint

    def counting(t):
        computed.append(1)
        return real(t)

    monkeypatch.setattr(fingerprint, "tokenizer_fingerprint", counting)
    expected = real(tok)
    assert cached_tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path / "tok")) == expected
    assert cached_tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path / "tok")) == expected  # a new load
    assert len(computed) == 1
    grown = AutoTokenizer.from_pretrained(tmp_path / "tok")
    grown.add_tokens(["zebra"])
    assert cached_tokenizer_fingerprint(grown) == real(grown) != expected and len(computed) == 2
    other = make_tiny_tokenizer(lowercase=True)
    other.save_pretrained(tmp_path / "tok")  # the same directory, other files
    assert cached_tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path / "tok")) == real(other) != expected
    assert len(computed) == 3
    assert cached_tokenizer_fingerprint(tok) == expected and len(computed) == 4  # not loaded from files
