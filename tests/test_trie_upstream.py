"""Import of upstream DART `.trie` files: round trip against our builder, and every kind of
damage giving a TrieFormatError that names the problem."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_native.trie import NgramTrie, TrieFormatError, build_trie, import_upstream_trie
from tests.hypothesis_budget import examples
from tests.trie_reference import HEADER_SIZE, brute_counts, encode_upstream, upstream_nodes

FP = "upstream-test"
DOCS = [[0, 1, 2, 0, 1, 3, 2], [1, 2, 0], [], [3, 3, 3, 1]]


def _import(tmp_path: Path, data: bytes, vocab: int = 4) -> Path:
    src, dst = tmp_path / "up.trie", tmp_path / "ours.trie"
    src.write_bytes(data)
    import_upstream_trie(src, dst, vocab_size=vocab, tokenizer_fingerprint=FP)
    return dst


def _nodes(order: int = 3, root_freq: int | None = None, seed: int = 0) -> list[dict]:
    counts = brute_counts(DOCS, order)
    total = sum(map(len, DOCS))
    return upstream_nodes(counts, total if root_freq is None else root_freq, random.Random(seed))


@settings(max_examples=examples(30), deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda vocab: st.tuples(
            st.just(vocab),
            st.lists(st.lists(st.integers(0, vocab - 1), max_size=12), max_size=6),
            st.integers(1, 4),
            st.sampled_from([1, 2]),
            st.booleans(),
            st.randoms(use_true_random=False),
        )
    )
)
def test_import_round_trip_equals_our_builder(tmp_path_factory, case):
    vocab, docs, order, min_count, root_freq_known, rng = case
    tmp = tmp_path_factory.mktemp("up")
    counts = brute_counts(docs, order, min_count)
    total = sum(map(len, docs))
    # upstream builders may leave the root's freq at 0: the importer then sums level 1
    root_freq = total if root_freq_known or min_count > 1 else 0
    src = tmp / "up.trie"
    src.write_bytes(encode_upstream(order, upstream_nodes(counts, root_freq, rng)))
    stats = import_upstream_trie(src, tmp / "imported.trie", vocab_size=vocab, tokenizer_fingerprint=FP)
    build_trie(docs, tmp / "built.trie", vocab_size=vocab, tokenizer_fingerprint=FP, order=order,
               min_count=min_count)
    # the payload is identical; the headers differ only in build metadata (min_count, documents)
    imported, built = (tmp / "imported.trie").read_bytes(), (tmp / "built.trie").read_bytes()
    assert imported[HEADER_SIZE:] == built[HEADER_SIZE:]
    with NgramTrie.open(tmp / "imported.trie", verify=True) as a, NgramTrie.open(tmp / "built.trie") as b:
        assert a.ngram_counts() == counts == b.ngram_counts()
        assert a.level_sizes == b.level_sizes == stats.level_sizes
        assert a.count([]) == total and a.num_documents == 0 and a.min_count == 0
        for _ in range(10):
            context = [rng.randrange(vocab) for _ in range(rng.randrange(4))]
            np.testing.assert_array_equal(a.score(context, range(vocab)), b.score(context, range(vocab)))


@pytest.mark.parametrize("cut", [0, 8, 15, 16, 20, 39, 41, -13, -1])
def test_truncated_upstream_file(tmp_path, cut):
    data = encode_upstream(3, _nodes())
    with pytest.raises(TrieFormatError, match=r"truncated|declares|no root"):
        _import(tmp_path, data[:cut])


def _mutate(nodes: list[dict], predicate, change) -> None:
    """Applies `change` to the first node matching `predicate` (nodes other than the root)."""
    for node in nodes[1:]:
        if predicate(node):
            change(node)
            return
    raise AssertionError("no node to mutate")


def _child_of_root(nodes: list[dict]) -> int:
    return nodes[0]["children"][0][1]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda n: n[0]["children"].__setitem__(0, (n[0]["children"][0][0], 10**6)), "index 1000000, outside"),
        (lambda n: n[0]["children"].__setitem__(0, (n[0]["children"][0][0], 0)), "index 0, outside"),
        (lambda n: n[_child_of_root(n)].__setitem__("parent", 5), "whose parent field says 5"),
        (lambda n: n[_child_of_root(n)].__setitem__("token", 3 - n[_child_of_root(n)]["token"]),
         "is listed with token"),
        (lambda n: n[_child_of_root(n)].__setitem__("freq", 0), "has freq 0"),
        (lambda n: n[_child_of_root(n)].__setitem__("freq", 1), "less than the sum"),
        (lambda n: n[0]["children"].append(n[0]["children"][0]), r"has two children with token|reached twice"),
        (lambda n: n[0]["children"].pop(), "unreachable from the root"),
    ],
)
def test_inconsistent_upstream_trie_is_rejected(tmp_path, damage, message):
    nodes = _nodes()
    damage(nodes)
    with pytest.raises(TrieFormatError, match=message):
        _import(tmp_path, encode_upstream(3, nodes))
    assert not (tmp_path / "ours.trie").exists()


def test_token_outside_vocabulary(tmp_path):
    with pytest.raises(TrieFormatError, match=r"token 3, outside the vocabulary \[0, 3\)"):
        _import(tmp_path, encode_upstream(3, _nodes()), vocab=3)


def test_deeper_than_order(tmp_path):
    nodes = _nodes(order=3)
    with pytest.raises(TrieFormatError, match="has children, deeper than the order 2"):
        _import(tmp_path, encode_upstream(2, nodes))


def test_bad_header_fields(tmp_path):
    data = encode_upstream(3, _nodes())
    with pytest.raises(TrieFormatError, match="order 0 outside"):
        _import(tmp_path, struct.pack("<Q", 0) + data[8:])
    with pytest.raises(TrieFormatError, match="order 9 outside"):
        _import(tmp_path, struct.pack("<Q", 9) + data[8:])
    with pytest.raises(TrieFormatError, match="declares 4611686018427387904 nodes"):
        _import(tmp_path, data[:8] + struct.pack("<Q", 2**62) + data[16:])
    with pytest.raises(TrieFormatError, match="2 trailing bytes"):
        _import(tmp_path, data + b"\0\0")


def test_cycle_back_to_an_ancestor_is_rejected(tmp_path):
    nodes = _nodes()
    child = _child_of_root(nodes)
    grandchild = nodes[child]["children"][0][1]
    # the grandchild lists the root's child as its own child: reached twice / parent mismatch
    nodes[grandchild]["children"].append((nodes[child]["token"], child))
    with pytest.raises(TrieFormatError, match=r"parent field says|reached twice"):
        _import(tmp_path, encode_upstream(3, nodes))
