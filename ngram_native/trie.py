"""The N-gram trie file: build it, open it (mmap), score draft candidates with it.

A trie file is flat, read-only and memory-mapped, so every process on a node shares one
copy through the page cache and opening costs O(1) whatever the size; the layout is
documented in ngram_native/csrc/trie.h and docs/trie_format.md. The heavy lifting (k-gram
counting with bounded memory, the file writer, the queries) is C++ in `ngram_native._core`;
this module adds argument checking, numpy conversion and documentation.

    stats = build_trie(docs, "corpus.trie", vocab_size=tok.vocab_size, tokenizer_fingerprint=fp)
    with NgramTrie.open("corpus.trie", verify=True, expected_tokenizer_fingerprint=fp) as trie:
        probs = trie.score(context_ids, candidate_ids)   # float32, DART estimate
    header = read_trie_header(first_512_bytes, file_size)  # check a remote trie cheaply

An `NgramTrie` is an `ngram_native._core.NgramScorer`, so it can be handed directly to the
C++ draft-tree builders.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ngram_native import _core

TrieFormatError = _core.TrieFormatError
TrieFormatError.__doc__ = (
    "The file is not a valid trie of this format (wrong magic or version, truncated, altered, "
    "inconsistent). A ValueError."
)
TokenizerMismatchError = _core.TokenizerMismatchError
TokenizerMismatchError.__doc__ = "The trie was built for another tokenizer. A TrieFormatError."
TrieClosedError = _core.TrieClosedError
TrieClosedError.__doc__ = "A query on a closed trie. A ValueError."

DEFAULT_ORDER = 3
# 2^24 positions per in-RAM chunk: ~128 MiB of sort keys for order <= 3 (8 bytes per
# position while the key fits one 64-bit word, 16/24/32 bytes for longer keys).
DEFAULT_CHUNK_TOKENS = 1 << 24

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

PathLike = str | os.PathLike


TRIE_HEADER_SIZE: int = _core.TRIE_HEADER_SIZE  # bytes; read this many to check a trie's header
TRIE_FORMAT_VERSION: int = _core.TRIE_FORMAT_VERSION


@dataclass(frozen=True)
class TrieHeader:
    """What a trie file's header says, once validated (see `read_trie_header`).

    level_sizes counts nodes per level, level 0 being the root. payload_checksum is the XXH64
    of everything after the header: it names the trie's content, whatever file or URL holds it.
    """

    format_version: int
    order: int
    vocab_size: int
    tokenizer_fingerprint: str
    file_size: int
    payload_checksum: int
    min_count: int
    num_documents: int
    level_sizes: tuple[int, ...]

    @property
    def content_key(self) -> str:
        """The payload checksum as 16 hex chars: equal for equal contents, different otherwise."""
        return f"{self.payload_checksum:016x}"


def read_trie_header(head: bytes, file_size: int, name: str = "") -> TrieHeader:
    """Validate a trie's header from its first bytes, without the rest of the file.

    `head` is the file's first TRIE_HEADER_SIZE bytes (or all of a shorter file), `file_size`
    its real size: enough to check a remote object with one ranged read. Checks all that
    `NgramTrie.open` checks in O(1) (magic, version, byte order, header checksum, file size,
    and every section's offset and bounds); not the payload checksum. Raises TrieFormatError,
    prefixed with "trie file '<name>': " when `name` is given; ValueError when `head` is
    shorter than min(file_size, TRIE_HEADER_SIZE).
    """
    return TrieHeader(**_core.read_trie_header(bytes(head), int(file_size), name))


@dataclass(frozen=True)
class TrieBuildStats:
    """What a build or an import produced.

    num_runs is the number of sorted chunks counted (1: everything fit in one chunk, no spill).
    level_sizes counts nodes per level, level 0 being the root (always 1).
    """

    path: str
    num_documents: int
    num_tokens: int
    num_runs: int
    file_size: int
    level_sizes: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        return sum(self.level_sizes)

    @property
    def bytes_per_node(self) -> float:
        """File bytes per stored node, header and root included (the format's size metric)."""
        return self.file_size / self.num_nodes


def _ids_array(ids: Any, what: str) -> np.ndarray:
    """Token ids as a 1-D int64 array; rejects non-integer data instead of truncating it."""
    if isinstance(ids, np.ndarray):
        arr = ids
    else:
        if not isinstance(ids, (list, tuple)):
            ids = list(ids)  # iterables and generators of ints
        arr = np.asarray(ids) if len(ids) > 0 else np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        raise TypeError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size > 0 and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{what}: token id {int(arr.max())} is out of range")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _int32_ids(ids: Any, what: str) -> np.ndarray:
    """Token ids as a contiguous int32 array (the query API's width), range-checked."""
    if isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.ndim == 1 and ids.flags.c_contiguous:
        return ids  # the common case, kept cheap: score() is called in loops
    arr = _ids_array(ids, what)
    if arr.size and (int(arr.min()) < _INT32_MIN or int(arr.max()) > _INT32_MAX):
        raise ValueError(f"{what}: token ids must fit in int32, got range [{arr.min()}, {arr.max()}]")
    return arr.astype(np.int32)


class NgramTrie(_core.NgramTrie):
    """A read-only, memory-mapped trie file implementing the DART N-gram estimate.

    Open with `NgramTrie.open`. Properties: order, vocab_size, tokenizer_fingerprint,
    level_sizes (nodes per level, root first), num_nodes, file_size, min_count,
    num_documents, path, closed. Queries after `close()` raise TrieClosedError.
    Pickles as its path (Ray tasks re-map the file instead of copying it).
    """

    @classmethod
    def open(
        cls,
        path: PathLike,
        verify: bool = False,
        expected_tokenizer_fingerprint: str | None = None,
    ) -> NgramTrie:
        """Map `path`.

        Always checks the header (magic, version, byte order, header checksum) and that every
        section lies inside the file, in O(1). `verify=True` also hashes the whole payload and
        checks every structural invariant (O(file size)); do it once per node after a
        download, not in every worker. With `expected_tokenizer_fingerprint`, a trie built
        for another tokenizer raises TokenizerMismatchError naming both fingerprints.
        """
        return cls(os.fspath(path), verify, expected_tokenizer_fingerprint or "")

    @property
    def num_nodes(self) -> int:
        """All nodes, root included."""
        return sum(self.level_sizes)

    def score(self, context: Any, candidates: Any) -> np.ndarray:
        """DART estimate of each candidate following `context`, as float32.

        From the longest context suffix of at most order - 1 tokens that is in the trie down
        to length 1, a candidate not yet scored gets count(suffix + candidate) / count(suffix);
        a candidate never seen after any suffix gets 0.
        """
        return _core._ngram_probs(self, _int32_ids(context, "context"), _int32_ids(candidates, "candidates"))

    def count(self, ngram: Any) -> int:
        """Occurrences of `ngram` in the corpus (0 if not stored; the empty n-gram: all tokens)."""
        return self._count(_ids_array(ngram, "ngram"))

    def ngram_counts(self) -> dict[tuple[int, ...], int]:
        """Every stored n-gram with its count. For small tries (tests, debugging)."""
        result: dict[tuple[int, ...], int] = {}
        prefixes: list[tuple[int, ...]] = [()]
        for level in range(1, self.order + 1):
            parent_offsets = self.level_arrays(level - 1)[2]
            tokens, counts, _ = self.level_arrays(level)
            grams = []
            for parent, prefix in enumerate(prefixes):
                for i in range(int(parent_offsets[parent]), int(parent_offsets[parent + 1])):
                    gram = (*prefix, int(tokens[i]))
                    result[gram] = int(counts[i])
                    grams.append(gram)
            prefixes = grams
        return result

    def __enter__(self) -> NgramTrie:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (NgramTrie.open, (self.path, False, self.tokenizer_fingerprint))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.num_nodes} nodes, {self.file_size} bytes"
        return f"NgramTrie({self.path!r}, order={self.order}, vocab_size={self.vocab_size}, {state})"


class TrieBuilder:
    """Streams documents of token ids into a trie file with bounded memory.

    Every k-gram (k <= order) inside a document is counted with 64-bit counts; n-grams never
    span two documents. Memory is about chunk_tokens x 8 bytes (x2..4 for long keys: order
    above 3 or a vocabulary above 2^21); beyond that, sorted runs are spilled to `tmp_dir`
    and merged at `finish`, so the corpus may be larger than RAM. The output bytes do not
    depend on chunk_tokens. Counting runs in C++ with the GIL released.

    Pruning: with min_count > 1, every n-gram (of any length) seen fewer than min_count times
    is dropped. Since an n-gram never occurs more often than its prefix, the trie stays
    prefix-closed, and the estimate count(ctx + t) / count(ctx) of every kept pair is
    unchanged. The root keeps the total token count.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        tokenizer_fingerprint: str,
        order: int = DEFAULT_ORDER,
        min_count: int = 1,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        tmp_dir: PathLike | None = None,
    ) -> None:
        if tmp_dir is not None and not os.path.isdir(tmp_dir):
            # fail now, not after hours of tokenizing, when the first run is spilled
            raise FileNotFoundError(f"tmp_dir {os.fspath(tmp_dir)!r} is not an existing directory")
        self._core = _core.TrieBuilder(
            order, vocab_size, tokenizer_fingerprint, chunk_tokens, min_count,
            os.fspath(tmp_dir) if tmp_dir is not None else "",
        )

    @property
    def num_documents(self) -> int:
        return self._core.num_documents

    @property
    def num_tokens(self) -> int:
        return self._core.num_tokens

    def add_document(self, ids: Any) -> None:
        """Count one document (numpy integer array or iterable of ints).

        An id outside [0, vocab_size) raises ValueError naming the id, its position and the
        document's index, and leaves the builder unchanged.
        """
        self._core.add_document(_ids_array(ids, f"document {self.num_documents}"))

    def add_documents(self, documents: Iterable[Any]) -> int:
        """Count every document of an iterable (streamed: nothing is kept). Returns how many."""
        n = 0
        for doc in documents:
            self.add_document(doc)
            n += 1
        return n

    def finish(self, path: PathLike) -> TrieBuildStats:
        """Write the trie to `path` (atomically: temporary name, then rename). Once only."""
        path = os.fspath(path)
        return TrieBuildStats(path=path, **self._core.finish(path))


def build_trie(
    documents: Iterable[Any],
    path: PathLike,
    *,
    vocab_size: int,
    tokenizer_fingerprint: str,
    order: int = DEFAULT_ORDER,
    min_count: int = 1,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    tmp_dir: PathLike | None = None,
) -> TrieBuildStats:
    """Count `documents` (iterable of token-id sequences) into a trie file at `path`."""
    builder = TrieBuilder(
        vocab_size=vocab_size, tokenizer_fingerprint=tokenizer_fingerprint, order=order,
        min_count=min_count, chunk_tokens=chunk_tokens, tmp_dir=tmp_dir,
    )
    builder.add_documents(documents)
    return builder.finish(path)


def import_upstream_trie(
    src_path: PathLike,
    dst_path: PathLike,
    *,
    vocab_size: int,
    tokenizer_fingerprint: str,
    tmp_dir: PathLike | None = None,
) -> TrieBuildStats:
    """Convert a trie file of upstream DART's C++ format into this format.

    Upstream layout (little-endian): u64 order, u64 node_count, then per node: i32 token,
    u64 parent, i32 freq, u64 n_children, n_children x {i32 child_token, u64 child_index};
    node 0 is the root. Every index, parent/child link, depth and count is validated;
    problems raise TrieFormatError naming the node.
    """
    dst_path = os.fspath(dst_path)
    stats = _core.import_upstream_trie(
        os.fspath(src_path), dst_path, vocab_size, tokenizer_fingerprint,
        os.fspath(tmp_dir) if tmp_dir is not None else "",
    )
    return TrieBuildStats(path=dst_path, **stats)


__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_ORDER",
    "TRIE_FORMAT_VERSION",
    "TRIE_HEADER_SIZE",
    "NgramTrie",
    "TokenizerMismatchError",
    "TrieBuildStats",
    "TrieBuilder",
    "TrieClosedError",
    "TrieFormatError",
    "TrieHeader",
    "build_trie",
    "import_upstream_trie",
    "read_trie_header",
]
