"""The trie file format: layout vs an independent Python writer, checksums, and every
corruption or mismatch giving a clear TrieFormatError (never a crash or garbage)."""

from __future__ import annotations

import ctypes
import ctypes.util
import random
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_native import _core
from ngram_native.trie import (
    TRIE_HEADER_SIZE,
    NgramTrie,
    TokenizerMismatchError,
    TrieFormatError,
    build_trie,
    read_trie_header,
)
from tests.hypothesis_budget import examples
from tests.trie_reference import (
    HEADER_SIZE,
    brute_counts,
    brute_score,
    level_entry,
    reseal,
    reseal_header,
    write_reference_trie,
    xxh64,
)

FP = "f" * 64


@pytest.fixture
def trie_file(tmp_path) -> Path:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 20, size=rng.integers(0, 60)) for _ in range(10)]
    path = tmp_path / "t.trie"
    build_trie(docs, path, vocab_size=20, tokenizer_fingerprint=FP)
    return path


def _write(tmp_path: Path, data: bytes, name: str = "x.trie") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


# ----- layout -----------------------------------------------------------------------------


@settings(max_examples=examples(40), deadline=None)
@given(
    st.integers(1, 8).flatmap(
        lambda vocab: st.tuples(
            st.just(vocab),
            st.lists(st.lists(st.integers(0, vocab - 1), max_size=12), max_size=6),
            st.integers(1, 4),
            st.sampled_from([1, 2]),
        )
    )
)
def test_builder_writes_exactly_the_documented_layout(tmp_path_factory, case):
    vocab, docs, order, min_count = case
    path = tmp_path_factory.mktemp("layout") / "t.trie"
    build_trie(docs, path, vocab_size=vocab, tokenizer_fingerprint="tok", order=order, min_count=min_count)
    expected = write_reference_trie(
        brute_counts(docs, order, min_count), order=order, vocab_size=vocab, fingerprint="tok",
        total_tokens=sum(map(len, docs)), min_count=min_count, num_documents=len(docs),
    )
    assert path.read_bytes() == expected


def test_sizes_are_12_bytes_per_inner_node_and_8_per_leaf(trie_file):
    data = trie_file.read_bytes()
    with NgramTrie.open(trie_file) as trie:
        sizes = trie.level_sizes
    inner = sum(sizes[:-1]) - 1
    padding = 8 * (3 * len(sizes) + 1)
    root_index = 4 * (2 * sizes[1] + 1)  # at most 2 buckets per level-1 node
    assert len(data) <= HEADER_SIZE + 4 + 8 + 12 * inner + 8 * sizes[-1] + root_index + padding
    assert (len(data) - HEADER_SIZE) / (sum(sizes) - 1) <= 12


def test_64_bit_counts_and_offsets_are_read(tmp_path):
    # counts beyond 2^32 cannot come from a test-sized corpus: write such a file directly
    big = 5 * 2**32
    counts = {(1,): big + 7, (2,): 3, (1, 2): big, (1, 1): 5, (2, 1): 3, (1, 2, 1): big - 1}
    for force_wide in (False, True):
        data = write_reference_trie(counts, order=3, vocab_size=4, fingerprint=FP, total_tokens=big + 10,
                                    force_wide=force_wide)
        assert level_entry(data, 1)[4] == 8  # level 1 needs 8-byte counts
        path = _write(tmp_path, data, f"wide{force_wide}.trie")
        with NgramTrie.open(path, verify=True) as trie:
            assert trie.count_width(1) == 8 and trie.count_width(2) == 8
            assert trie.count_width(0) == 8 and trie.count([]) == big + 10
            assert trie.ngram_counts() == counts
            np.testing.assert_array_equal(trie.score([1], [2, 1, 3]), brute_score(counts, 3, [1], [2, 1, 3]))
            np.testing.assert_array_equal(trie.score([1, 2], [1]), np.float32([(big - 1) / big]))


# ----- checksum ---------------------------------------------------------------------------


def test_xxh64_known_value_and_streaming_equals_one_shot():
    assert xxh64(b"") == 0xEF46DB3751D8E999  # the published XXH64 of the empty input


def test_xxh64_matches_the_reference_library():
    name = ctypes.util.find_library("xxhash")
    if name is None:
        pytest.skip("libxxhash not installed")
    lib = ctypes.CDLL(name)
    lib.XXH64.restype = ctypes.c_uint64
    lib.XXH64.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
    rng = random.Random(0)
    for length in [*range(0, 80), 1000, 4099]:
        data = rng.randbytes(length)
        seed = rng.choice([0, 1, 2**64 - 1, rng.getrandbits(64)])
        assert _core._xxh64(data, seed) == lib.XXH64(data, length, seed), (length, seed)


# ----- corruption and mismatch ------------------------------------------------------------


@pytest.mark.parametrize("keep", [0, 3, 8, 11, 15, 100, 511, 512, 600, -9, -1])
def test_truncated_file_is_a_format_error(tmp_path, trie_file, keep):
    data = trie_file.read_bytes()
    path = _write(tmp_path, data[:keep] if keep >= 0 else data[: len(data) + keep])
    for verify in (False, True):
        with pytest.raises(TrieFormatError, match=r"truncated|empty|magic"):
            NgramTrie.open(path, verify=verify)
    _header_check_agrees_with_open(path)


def test_appended_bytes_are_a_format_error(tmp_path, trie_file):
    path = _write(tmp_path, trie_file.read_bytes() + b"\0" * 8)
    with pytest.raises(TrieFormatError, match="trailing data"):
        NgramTrie.open(path)


def test_flipped_payload_byte_fails_verify_but_not_quick_open(tmp_path, trie_file):
    data = bytearray(trie_file.read_bytes())
    data[HEADER_SIZE + (len(data) - HEADER_SIZE) // 2] ^= 0x10
    path = _write(tmp_path, bytes(data))
    # quick open trusts the payload... until asked
    with NgramTrie.open(path) as trie, pytest.raises(TrieFormatError, match="payload checksum mismatch"):
        trie.verify()
    with pytest.raises(TrieFormatError, match="payload checksum mismatch"):
        NgramTrie.open(path, verify=True)


def test_flipped_header_byte_is_caught_on_quick_open(tmp_path, trie_file):
    data = bytearray(trie_file.read_bytes())
    data[20] ^= 0x01  # vocab_size
    with pytest.raises(TrieFormatError, match="header checksum mismatch"):
        NgramTrie.open(_write(tmp_path, bytes(data)))


def test_wrong_magic(tmp_path, trie_file):
    data = b"GGUF\x03\0\0\0" + trie_file.read_bytes()[8:]
    with pytest.raises(TrieFormatError, match=r"magic is 'GGUF\\x03\\x00\\x00\\x00', expected 'DARTTRIE'"):
        NgramTrie.open(_write(tmp_path, data))


def test_wrong_version_names_both_versions(tmp_path, trie_file):
    data = bytearray(trie_file.read_bytes())
    data[8:12] = struct.pack("<I", 2)
    with pytest.raises(TrieFormatError, match=r"unsupported format version 2 \(this build reads version 1\)"):
        NgramTrie.open(_write(tmp_path, reseal_header(bytes(data)) + bytes(data[HEADER_SIZE:])))


def test_byte_swapped_file(tmp_path, trie_file):
    data = bytearray(trie_file.read_bytes())
    data[12:16] = struct.pack(">I", 0x01020304)
    with pytest.raises(TrieFormatError, match="big-endian"):
        NgramTrie.open(_write(tmp_path, bytes(data)))


def test_tokenizer_mismatch_names_both_fingerprints(trie_file):
    with pytest.raises(TokenizerMismatchError, match=f"built for tokenizer fingerprint '{FP}', expected 'abc'"):
        NgramTrie.open(trie_file, expected_tokenizer_fingerprint="abc")
    assert issubclass(TokenizerMismatchError, TrieFormatError) and issubclass(TrieFormatError, ValueError)
    with NgramTrie.open(trie_file, expected_tokenizer_fingerprint=FP) as trie:
        assert trie.tokenizer_fingerprint == FP


def test_missing_file_and_directory_are_os_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        NgramTrie.open(tmp_path / "missing.trie")
    with pytest.raises(IsADirectoryError):
        NgramTrie.open(tmp_path)


def _patch_level(data: bytes, level: int, field: str, index: int, value: int) -> bytes:
    """Overwrites one element of a level's section and reseals both checksums."""
    _, tokens_off, counts_off, offsets_off, count_w, offset_w = level_entry(data, level)
    offset, width = {
        "tokens": (tokens_off, 4),
        "counts": (counts_off, count_w),
        "child_offsets": (offsets_off, offset_w),
    }[field]
    out = bytearray(data)
    out[offset + index * width : offset + (index + 1) * width] = value.to_bytes(width, "little")
    return reseal(bytes(out))


@pytest.mark.parametrize(
    ("level", "field", "index", "value", "message"),
    [
        (2, "tokens", 0, 19, "not strictly sorted"),  # first child of (0,) is now after its sibling
        (1, "tokens", 3, 20, ">= vocab_size"),
        (2, "counts", 0, 0, "count 0"),
        (3, "counts", 0, 0, "count 0"),
        (1, "counts", 0, 1, "less than the sum of its children"),
        (1, "child_offsets", 1, 0, "not strictly sorted"),  # node 1 now owns node 0's children
        (1, "child_offsets", 1, 10**6, "not contiguous"),
    ],
)
def test_verify_finds_structural_damage_behind_valid_checksums(tmp_path, level, field, index, value, message):
    # A fixed corpus where node 0 of every level has >= 2 children and unigram 0 count >= 2.
    docs = [[0, 1, 2, 0, 3, 4, 0, 1, 5, 6, 0, 3, 7]]
    data = write_reference_trie(brute_counts(docs, 3), order=3, vocab_size=20, fingerprint=FP, total_tokens=13)
    path = _write(tmp_path, _patch_level(data, level, field, index, value))
    # header and bounds are fine: quick open succeeds, verify() does not
    with NgramTrie.open(path) as trie, pytest.raises(TrieFormatError, match=message):
        trie.verify()


@pytest.mark.parametrize(("bucket", "value", "message"), [(3, 0, "root index decreases at bucket 2"),
                                                       (1, 0, "root index does not cover node 0 of level 1")])
def test_verify_checks_the_root_index(tmp_path, trie_file, bucket, value, message):
    data = bytearray(trie_file.read_bytes())
    offset = struct.unpack_from("<Q", data, 496)[0] + 4 * bucket
    data[offset : offset + 4] = struct.pack("<I", value)
    with NgramTrie.open(_write(tmp_path, reseal(bytes(data)))) as trie, pytest.raises(TrieFormatError, match=message):
        trie.verify()


def test_child_offsets_must_span_the_next_level_even_on_quick_open(tmp_path, trie_file):
    data = trie_file.read_bytes()
    n = level_entry(data, 1)[0]
    with pytest.raises(TrieFormatError, match="child offsets of level 1 span"):
        NgramTrie.open(_write(tmp_path, _patch_level(data, 1, "child_offsets", n, 10**6)))


def test_header_fields_are_checked_against_the_file(tmp_path, trie_file):
    data = trie_file.read_bytes()

    def patched(offset: int, fmt: str, value: int) -> Path:
        h = bytearray(data[:HEADER_SIZE])
        struct.pack_into(fmt, h, offset, value)
        return _write(tmp_path, reseal_header(bytes(h)) + data[HEADER_SIZE:])

    cases = [
        (16, "<I", 0, "order 0 outside 1..8"),
        (16, "<I", 9, "order 9 outside 1..8"),
        (20, "<I", 0, "vocab_size is 0"),
        (24, "<I", 256, "header_size is 256"),
        (136 + 40 + 0, "<Q", 2**62, "runs past the end"),  # level 1 node_count
        (136 + 40 + 8, "<Q", 520, "tokens of level 1 is at offset 520"),
        (136 + 40 * 2 + 32, "<B", 3, "count width of level 2 is 3"),
        (136 + 0, "<Q", 2, "level 0 \\(root\\) has 2 nodes"),
        (136 + 40 * 5, "<Q", 1, "level 5 beyond order is set"),
        (496, "<Q", 4096, "root index of level 0 is at offset 4096"),
        (504, "<B", 3, "root index has 3 bits, expected 5"),
        (505, "<B", 1, "reserved header fields"),
    ]
    for offset, fmt, value, message in cases:
        with pytest.raises(TrieFormatError, match=message):
            NgramTrie.open(patched(offset, fmt, value))
        _header_check_agrees_with_open(patched(offset, fmt, value))


# ----- the header alone (read_trie_header) --------------------------------------------------


def _header_check_agrees_with_open(path: Path) -> None:
    """read_trie_header on the first bytes fails exactly as NgramTrie.open fails on the file."""
    data = path.read_bytes()
    with pytest.raises(TrieFormatError) as opened:
        NgramTrie.open(path)
    with pytest.raises(TrieFormatError) as from_head:
        read_trie_header(data[:TRIE_HEADER_SIZE], len(data))
    assert str(opened.value) == f"trie file '{path}': {from_head.value}"
    with pytest.raises(TrieFormatError, match=r"^trie file 's3://b/t\.trie': "):
        read_trie_header(data[:TRIE_HEADER_SIZE], len(data), name="s3://b/t.trie")


def test_read_trie_header_reads_what_open_reads(trie_file):
    data = trie_file.read_bytes()
    header = read_trie_header(data[:TRIE_HEADER_SIZE], len(data))
    assert read_trie_header(data, len(data)) == header  # extra bytes are ignored
    with NgramTrie.open(trie_file) as trie:
        assert (header.order, header.vocab_size, header.tokenizer_fingerprint, header.file_size,
                header.min_count, header.num_documents, header.level_sizes) == \
            (trie.order, trie.vocab_size, trie.tokenizer_fingerprint, trie.file_size,
             trie.min_count, trie.num_documents, trie.level_sizes)
    assert header.format_version == 1 and TRIE_HEADER_SIZE == HEADER_SIZE
    assert header.payload_checksum == xxh64(data[HEADER_SIZE:])
    assert header.content_key == f"{header.payload_checksum:016x}"


def test_read_trie_header_needs_the_whole_header(trie_file):
    data = trie_file.read_bytes()
    with pytest.raises(ValueError, match="needs the first 512 bytes") as err:
        read_trie_header(data[:100], len(data))
    assert not isinstance(err.value, TrieFormatError)  # the caller's mistake, not the file's
    with pytest.raises(TrieFormatError, match="shorter than the 512-byte header"):
        read_trie_header(data[:100], 100)


def test_quick_open_of_random_damage_never_crashes(tmp_path, trie_file):
    """Queries on a quick-opened file with a damaged payload return something or raise,
    but never read out of bounds (a crash here kills the test process)."""
    data = trie_file.read_bytes()
    rng = random.Random(0)
    for trial in range(30):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 20)):
            damaged[rng.randrange(HEADER_SIZE, len(damaged))] = rng.randrange(256)
        path = _write(tmp_path, reseal(bytes(damaged)), f"d{trial}.trie")
        try:
            trie = NgramTrie.open(path)
        except TrieFormatError:
            continue
        with trie:
            for _ in range(50):
                context = [rng.randrange(20) for _ in range(rng.randrange(4))]
                probs = trie.score(context, list(range(20)))
                assert probs.shape == (20,)
                trie.count([rng.randrange(20) for _ in range(rng.randrange(4))])
            with pytest.raises(TrieFormatError):
                trie.verify()
