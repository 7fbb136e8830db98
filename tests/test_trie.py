"""Trie builder and queries against brute-force Python references (tests/trie_reference.py)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngram_native import _core
from ngram_native.trie import (
    NgramTrie,
    TrieBuilder,
    TrieClosedError,
    build_trie,
)
from tests.hypothesis_budget import examples
from tests.trie_reference import brute_counts, brute_score

FP = "0123456789abcdef" * 4  # a 64-hex-character fingerprint
HYPOTHESIS = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def corpora(draw, max_vocab: int = 6, max_docs: int = 8, max_len: int = 15):
    vocab = draw(st.integers(1, max_vocab))
    docs = draw(st.lists(st.lists(st.integers(0, vocab - 1), max_size=max_len), max_size=max_docs))
    order = draw(st.integers(1, 4))
    min_count = draw(st.sampled_from([1, 1, 2, 3]))
    return vocab, docs, order, min_count


def _build(tmp: Path, name: str, docs, vocab: int, order: int = 3, **kw) -> tuple[Path, object]:
    path = tmp / name
    stats = build_trie(docs, path, vocab_size=vocab, tokenizer_fingerprint=FP, order=order, **kw)
    return path, stats


@HYPOTHESIS
@given(corpora(), st.integers(1, 20), st.randoms(use_true_random=False))
def test_counts_match_brute_force_and_do_not_depend_on_chunking(corpus, chunk_tokens, rng):
    vocab, docs, order, min_count = corpus
    expected = brute_counts(docs, order, min_count)
    total = sum(len(d) for d in docs)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        one_run, s1 = _build(tmp, "one.trie", docs, vocab, order, min_count=min_count)
        many_runs, s2 = _build(tmp, "many.trie", docs, vocab, order, min_count=min_count,
                               chunk_tokens=chunk_tokens, tmp_dir=tmp)
        assert one_run.read_bytes() == many_runs.read_bytes()
        assert s1.num_runs == (1 if total else 0)
        assert s2.num_runs == -(-total // chunk_tokens)
        assert s1.num_documents == len(docs) and s1.num_tokens == total
        assert sorted(os.listdir(tmp)) == ["many.trie", "one.trie"]  # no temporary left behind
        with NgramTrie.open(one_run, verify=True, expected_tokenizer_fingerprint=FP) as trie:
            assert trie.ngram_counts() == expected
            assert trie.count([]) == total
            assert trie.level_sizes == s1.level_sizes
            assert trie.level_sizes == (1, *(sum(len(g) == k for g in expected) for k in range(1, order + 1)))
            assert trie.num_nodes == 1 + len(expected)
            assert trie.min_count == min_count and trie.num_documents == len(docs)
            for _ in range(20):
                gram = [rng.randrange(-1, vocab + 1) for _ in range(rng.randrange(1, order + 2))]
                assert trie.count(gram) == expected.get(tuple(gram), 0)


@HYPOTHESIS
@given(corpora(), st.data())
def test_score_matches_brute_force_dart_estimate(corpus, data):
    vocab, docs, order, min_count = corpus
    expected = brute_counts(docs, order, min_count)
    ids = st.integers(-2, vocab + 1)
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = _build(Path(tmp), "t.trie", docs, vocab, order, min_count=min_count)
        with NgramTrie.open(path) as trie:
            for _ in range(5):
                # contexts drawn from the corpus hit long suffixes; random ones test misses
                doc = data.draw(st.sampled_from(docs)) if docs else []
                cut = data.draw(st.integers(0, len(doc)))
                context = doc[max(0, cut - data.draw(st.integers(0, 5))) : cut]
                if data.draw(st.booleans()):
                    context = data.draw(st.lists(ids, max_size=5))
                candidates = data.draw(st.lists(ids, max_size=12))
                got = trie.score(np.array(context, dtype=np.int64), np.array(candidates, dtype=np.int32))
                assert got.dtype == np.float32
                np.testing.assert_array_equal(got, brute_score(expected, order, context, candidates))


def test_score_known_values(tmp_path):
    # "a b c a b d" and "a b c": after (a, b): c twice, d once, out of 3 occurrences of (a, b).
    path, _ = _build(tmp_path, "t.trie", [[0, 1, 2, 0, 1, 3], [0, 1, 2]], vocab=4)
    with NgramTrie.open(path) as trie:
        np.testing.assert_array_equal(trie.score([0, 1], [2, 3, 0, 1]), np.float32([2 / 3, 1 / 3, 0, 0]))
        # (9, 2) is unseen: falls back to suffix (2,), followed by a once out of twice
        np.testing.assert_array_equal(trie.score([3, 2], [0, 1]), np.float32([0.5, 0]))
        np.testing.assert_array_equal(trie.score([], [0, 1]), np.float32([0, 0]))  # no suffix, no score
        assert trie.score([0], []).shape == (0,)


@pytest.mark.parametrize("docs", [[], [[], [], []]])
def test_empty_corpus_gives_valid_empty_trie(tmp_path, docs):
    path, stats = _build(tmp_path, "empty.trie", docs, vocab=10)
    assert stats.level_sizes == (1, 0, 0, 0) and stats.num_tokens == 0
    with NgramTrie.open(path, verify=True) as trie:
        assert trie.ngram_counts() == {}
        assert trie.count([]) == 0 and trie.count([1, 2]) == 0
        np.testing.assert_array_equal(trie.score([1, 2], [1, 2, 3]), np.zeros(3, np.float32))


def test_out_of_vocabulary_id_names_id_position_and_document(tmp_path):
    builder = TrieBuilder(vocab_size=5, tokenizer_fingerprint=FP)
    builder.add_documents([[1, 2], [3]])
    with pytest.raises(ValueError, match=r"token id 5 at position 2 of document 2 .*\[0, 5\)"):
        builder.add_document([0, 4, 5, 1])
    with pytest.raises(ValueError, match=r"token id -1 at position 0 of document 2"):
        builder.add_document(np.array([-1], dtype=np.int32))
    # the rejected documents left no trace
    builder.add_document([4])
    stats = builder.finish(tmp_path / "t.trie")
    assert stats.num_documents == 3 and stats.num_tokens == 4
    with NgramTrie.open(tmp_path / "t.trie") as trie:
        assert trie.ngram_counts() == brute_counts([[1, 2], [3], [4]], 3)


def test_rejects_non_integer_and_non_flat_documents():
    builder = TrieBuilder(vocab_size=5, tokenizer_fingerprint=FP)
    with pytest.raises(TypeError, match="integer token ids"):
        builder.add_document(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="1-D"):
        builder.add_document(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="out of range"):
        builder.add_document(np.array([2**64 - 1], dtype=np.uint64))


def test_accepts_any_integer_sequence(tmp_path):
    docs = [[1, 2, 3, 1], [2, 2]]
    reference, _ = _build(tmp_path, "ref.trie", docs, vocab=4)
    variants = [
        [np.array(d, dtype=np.int32) for d in docs],
        [np.array(d, dtype=np.uint16) for d in docs],
        [tuple(d) for d in docs],
        [iter(d) for d in docs],
        (list(d) for d in docs),  # a generator of documents
    ]
    for i, variant in enumerate(variants):
        path, _ = _build(tmp_path, f"v{i}.trie", variant, vocab=4)
        assert path.read_bytes() == reference.read_bytes()


def test_many_runs_need_multi_pass_merge_and_give_identical_bytes(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50, size=rng.integers(0, 120)) for _ in range(60)]
    total = sum(len(d) for d in docs)
    single, _ = _build(tmp_path, "single.trie", docs, vocab=50, order=4)
    again, _ = _build(tmp_path, "again.trie", docs, vocab=50, order=4)
    spilled, s2 = _build(tmp_path, "spilled.trie", docs, vocab=50, order=4, chunk_tokens=16)
    assert s2.num_runs == -(-total // 16) > 64  # more runs than one merge pass takes
    assert single.read_bytes() == again.read_bytes() == spilled.read_bytes()
    with NgramTrie.open(spilled, verify=True) as trie:
        assert trie.ngram_counts() == brute_counts([d.tolist() for d in docs], 4)


@pytest.mark.parametrize(("vocab", "order"), [(2**31, 3), (2**31, 8), (2**21 - 1, 3), (2**21, 3), (1, 8)])
def test_key_packing_at_vocabulary_and_order_limits(tmp_path, vocab, order):
    # Exercises every key width (ids near the top of the vocabulary use every key bit).
    top = vocab - 1
    docs = [[top, 0, top, top, 0, top, top, top, 0, top][: 3 + order], [top] * 9, [0]]
    path, _ = _build(tmp_path, "t.trie", docs, vocab=vocab, order=order)
    with NgramTrie.open(path, verify=True) as trie:
        assert trie.ngram_counts() == brute_counts(docs, order)


def test_invalid_builder_arguments():
    for kwargs, message in [
        ({"order": 0}, "order must be in 1..8"),
        ({"order": 9}, "order must be in 1..8"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"tokenizer_fingerprint": "x" * 65}, "at most 64"),
        ({"tokenizer_fingerprint": "é"}, "printable ASCII"),
        ({"min_count": 0}, "min_count"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
    ]:
        args = {"vocab_size": 5, "tokenizer_fingerprint": FP, **kwargs}
        with pytest.raises(ValueError, match=message):
            TrieBuilder(**args)


def test_finish_is_once_only_and_atomic(tmp_path):
    builder = TrieBuilder(vocab_size=5, tokenizer_fingerprint=FP)
    builder.add_document([1, 2, 3])
    with pytest.raises(FileNotFoundError):
        builder.finish(tmp_path / "missing_dir" / "t.trie")
    with pytest.raises(RuntimeError, match="already called"):
        builder.finish(tmp_path / "t.trie")
    with pytest.raises(RuntimeError, match="already called"):
        builder.add_document([1])
    assert os.listdir(tmp_path) == []


def test_close_context_manager_and_closed_access(tmp_path):
    path, _ = _build(tmp_path, "t.trie", [[1, 2, 3]], vocab=4)
    with NgramTrie.open(path) as trie:
        assert not trie.closed
    assert trie.closed
    for call in (lambda: trie.score([1], [2]), lambda: trie.count([1]), trie.verify,
                 lambda: trie.level_arrays(0), trie.ngram_counts):
        with pytest.raises(TrieClosedError, match="closed"):
            call()
    trie.close()  # idempotent
    assert trie.order == 3 and "closed" in repr(trie)


def test_close_while_another_thread_queries(tmp_path):
    """close() waits for queries in flight (they run without the GIL); later ones raise."""
    rng = np.random.default_rng(2)
    path, _ = _build(tmp_path, "t.trie", [rng.integers(0, 50, size=5000)], vocab=50)
    trie = NgramTrie.open(path)
    context, candidates = np.array([1, 2], np.int32), np.arange(50, dtype=np.int32)
    outcome: list[BaseException | int] = []

    def query_until_closed() -> None:
        calls = 0
        try:
            while True:
                trie.score(context, candidates)
                calls += 1
        except TrieClosedError:
            outcome.append(calls)
        except BaseException as e:  # anything else is a failure, reported below
            outcome.append(e)

    worker = threading.Thread(target=query_until_closed)
    worker.start()
    time.sleep(0.05)
    trie.close()
    worker.join(timeout=10)
    assert not worker.is_alive() and len(outcome) == 1 and isinstance(outcome[0], int) and outcome[0] > 0


def test_missing_tmp_dir_fails_at_construction(tmp_path):
    with pytest.raises(FileNotFoundError, match="tmp_dir"):
        TrieBuilder(vocab_size=5, tokenizer_fingerprint=FP, tmp_dir=tmp_path / "nope")


def test_is_an_ngram_scorer_and_pickles_as_its_path(tmp_path):
    path, _ = _build(tmp_path, "t.trie", [[1, 2, 3, 1, 2]], vocab=4)
    with NgramTrie.open(path) as trie:
        assert isinstance(trie, _core.NgramScorer)
        clone = pickle.loads(pickle.dumps(trie))
        assert isinstance(clone, NgramTrie) and clone.path == str(path)
        np.testing.assert_array_equal(clone.score([1, 2], [3, 1]), trie.score([1, 2], [3, 1]))
        clone.close()


def test_query_arguments_are_checked(tmp_path):
    path, _ = _build(tmp_path, "t.trie", [[1, 2, 3]], vocab=4)
    with NgramTrie.open(path) as trie:
        with pytest.raises(ValueError, match="int32"):
            trie.score([1], np.array([2**40], dtype=np.int64))
        with pytest.raises(TypeError, match="integer"):
            trie.score([1.5], [2])
        assert trie.count([1, 2, 3, 1, 2]) == 0  # longer than the order


def test_two_processes_map_the_same_file(tmp_path):
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 30, size=200) for _ in range(5)]
    path, _ = _build(tmp_path, "t.trie", docs, vocab=30)
    context, candidates = docs[0][:2], np.arange(30)
    code = (
        "import sys, numpy as np\n"
        "from ngram_native.trie import NgramTrie\n"
        f"t = NgramTrie.open({str(path)!r})\n"
        f"sys.stdout.write(t.score(np.array({context.tolist()}), np.arange(30)).tobytes().hex())\n"
    )
    repo = Path(__file__).resolve().parents[1]
    with NgramTrie.open(path) as trie:  # mapped here while the child maps it too
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo)
        assert bytes.fromhex(child.stdout) == trie.score(context, candidates).tobytes()
