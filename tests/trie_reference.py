"""Plain-Python references for the trie tests: brute-force counting, the DART estimate,
an independent writer of the documented file layout, and a writer of upstream DART's format.

Deliberately naive (dicts and sorted tuples) so that they are obviously right.
"""

from __future__ import annotations

import random
import struct
from collections import Counter

import numpy as np

from ngram_native import _core

HEADER_SIZE = 512
MAX_ORDER = 8
MAGIC = b"DARTTRIE"
VERSION = 1
BYTE_ORDER_MARK = 0x01020304
# Fixed part of the header up to the fingerprint, then the level table, then the root index
# fields.
HEADER_HEAD = struct.Struct("<8sIIIIIIQQQQQ64s")
LEVEL_ENTRY = struct.Struct("<QQQQBB6x")
ROOT_INDEX = struct.Struct("<QB7x")  # root_index_offset, root_index_bits; at offset 496
CHECKSUM_OFFSET = 48  # header_checksum field
PAYLOAD_CHECKSUM_OFFSET = 40


def brute_counts(docs: list[list[int]], order: int, min_count: int = 1) -> dict[tuple[int, ...], int]:
    """Every k-gram (1 <= k <= order) inside each document, dropping counts < min_count."""
    counts: Counter[tuple[int, ...]] = Counter()
    for doc in docs:
        doc = [int(t) for t in doc]
        for i in range(len(doc)):
            for k in range(1, order + 1):
                if i + k <= len(doc):
                    counts[tuple(doc[i : i + k])] += 1
    return {g: c for g, c in counts.items() if c >= min_count}


def brute_score(
    counts: dict[tuple[int, ...], int], order: int, context: list[int], candidates: list[int]
) -> np.ndarray:
    """DART estimate: longest stored context suffix first, each candidate scored once."""
    probs: list[float | None] = [None] * len(candidates)
    for length in range(min(len(context), order - 1), 0, -1):
        suffix = tuple(int(t) for t in context[len(context) - length :])
        if suffix not in counts:
            continue
        for i, cand in enumerate(candidates):
            gram = (*suffix, int(cand))
            if probs[i] is None and gram in counts:
                probs[i] = counts[gram] / counts[suffix]
    return np.array([0.0 if p is None else p for p in probs], dtype=np.float32)


def xxh64(data: bytes) -> int:
    return _core._xxh64(data, 0)


def _pad8(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 8)


def write_reference_trie(
    counts: dict[tuple[int, ...], int],
    *,
    order: int,
    vocab_size: int,
    fingerprint: str,
    total_tokens: int,
    min_count: int = 1,
    num_documents: int = 0,
    force_wide: bool = False,
) -> bytes:
    """The trie file for `counts`, written straight from docs/trie_format.md.

    With force_wide, every count and child offset is stored in 8 bytes (a legal choice the
    builder makes only for huge corpora), to exercise the reader's 64-bit paths.
    """
    levels = [[()]] + [sorted(g for g in counts if len(g) == k) for k in range(1, order + 1)]
    level_counts = [[total_tokens]] + [[counts[g] for g in levels[k]] for k in range(1, order + 1)]
    payload = b""
    entries = []
    for k in range(order + 1):
        n = len(levels[k])
        count_width = 8 if force_wide or max(level_counts[k], default=0) > 0xFFFFFFFF else 4
        offset_width = 0
        tokens_offset = counts_offset = child_offset = 0
        if k > 0:
            tokens_offset = HEADER_SIZE + len(payload)
            payload += _pad8(np.array([g[-1] for g in levels[k]], dtype="<u4").tobytes())
        counts_offset = HEADER_SIZE + len(payload)
        payload += _pad8(np.array(level_counts[k], dtype="<u8" if count_width == 8 else "<u4").tobytes())
        if k < order:
            children = levels[k + 1]
            offset_width = 8 if force_wide or len(children) > 0xFFFFFFFF else 4
            offsets, j = [0], 0
            for gram in levels[k]:
                while j < len(children) and children[j][:-1] == gram:
                    j += 1
                offsets.append(j)
            assert offsets[-1] == len(children)
            child_offset = HEADER_SIZE + len(payload)
            payload += _pad8(np.array(offsets, dtype="<u8" if offset_width == 8 else "<u4").tobytes())
        entries.append((n, tokens_offset, counts_offset, child_offset, count_width, offset_width))
    # root index: level-1 nodes bucketed by the top `bits` bits of a token id
    id_bits = (vocab_size - 1).bit_length()
    bits = min(id_bits, len(levels[1]).bit_length())
    buckets = np.array([g[0] >> (id_bits - bits) for g in levels[1]], dtype=np.int64)
    root_index = np.searchsorted(buckets, np.arange(2**bits + 1), side="left")
    root_index_offset = HEADER_SIZE + len(payload)
    payload += _pad8(root_index.astype("<u4").tobytes())
    header = make_header(
        order=order, vocab_size=vocab_size, fingerprint=fingerprint, file_size=HEADER_SIZE + len(payload),
        payload_checksum=xxh64(payload), min_count=min_count, num_documents=num_documents, levels=entries,
        root_index=(root_index_offset, bits),
    )
    return header + payload


def make_header(
    *, order, vocab_size, fingerprint, file_size, payload_checksum, min_count, num_documents, levels,
    root_index, magic=MAGIC, version=VERSION, bom=BYTE_ORDER_MARK,
) -> bytes:
    head = HEADER_HEAD.pack(
        magic, version, bom, order, vocab_size, HEADER_SIZE, 0, file_size, payload_checksum, 0,
        min_count, num_documents, fingerprint.encode("ascii"),
    )
    table = b"".join(LEVEL_ENTRY.pack(*e) for e in levels)
    table += b"\0" * (LEVEL_ENTRY.size * (MAX_ORDER + 1) - len(table))
    header = head + table + ROOT_INDEX.pack(*root_index)
    assert len(header) == HEADER_SIZE
    return reseal_header(header)


def reseal_header(header: bytes) -> bytes:
    """Recomputes the header checksum (with the field itself zeroed)."""
    h = bytearray(header[:HEADER_SIZE])
    h[CHECKSUM_OFFSET : CHECKSUM_OFFSET + 8] = b"\0" * 8
    h[CHECKSUM_OFFSET : CHECKSUM_OFFSET + 8] = struct.pack("<Q", xxh64(bytes(h)))
    return bytes(h)


def reseal(data: bytes) -> bytes:
    """Recomputes both checksums of a whole trie file (to craft structurally bad files)."""
    h = bytearray(data[:HEADER_SIZE])
    h[PAYLOAD_CHECKSUM_OFFSET : PAYLOAD_CHECKSUM_OFFSET + 8] = struct.pack("<Q", xxh64(data[HEADER_SIZE:]))
    return reseal_header(bytes(h)) + data[HEADER_SIZE:]


def level_entry(data: bytes, level: int) -> tuple[int, int, int, int, int, int]:
    """(node_count, tokens_offset, counts_offset, child_offsets_offset, count_w, offset_w)."""
    return LEVEL_ENTRY.unpack_from(data, HEADER_HEAD.size + level * LEVEL_ENTRY.size)


# ----- upstream DART format ---------------------------------------------------------------

UPSTREAM_NODE = struct.Struct("<iQiQ")
UPSTREAM_CHILD = struct.Struct("<iQ")


def upstream_nodes(
    counts: dict[tuple[int, ...], int], root_freq: int, rng: random.Random
) -> list[dict]:
    """Nodes of an upstream trie for `counts`: root first, the others in shuffled order,
    each with its children listed in shuffled order. Each node: token, parent, freq, children
    (list of (token, index))."""
    grams = list(counts)
    rng.shuffle(grams)
    index = {(): 0}
    for i, g in enumerate(grams, start=1):
        index[g] = i
    nodes = [{"token": -1, "parent": 0, "freq": root_freq, "children": []}] + [
        {"token": g[-1], "parent": index[g[:-1]], "freq": counts[g], "children": []} for g in grams
    ]
    for g in grams:
        nodes[index[g[:-1]]]["children"].append((g[-1], index[g]))
    for node in nodes:
        rng.shuffle(node["children"])
    return nodes


def encode_upstream(order: int, nodes: list[dict]) -> bytes:
    out = [struct.pack("<QQ", order, len(nodes))]
    for node in nodes:
        out.append(UPSTREAM_NODE.pack(node["token"], node["parent"], node["freq"], len(node["children"])))
        out.extend(UPSTREAM_CHILD.pack(t, i) for t, i in node["children"])
    return b"".join(out)
