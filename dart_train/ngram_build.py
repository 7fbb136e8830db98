"""Building an N-gram trie from a corpus: the library behind `python -m jobs.build_ngram`.

Reads conversations from any fsspec URL (or the packaged ShareGPT train split), tokenizes them
in batches with the target's Hugging Face tokenizer (the Rust backend spreads a batch over every
core), and streams one document per conversation into the native TrieBuilder, whose memory is
bounded by `memory_budget_mb` (beyond it, sorted runs spill to `tmp_dir` and are merged).
Writes the trie file and `<output>.json`, a sidecar recording what was built from what: source,
split, tokenizer name and fingerprint, order, min_count, counts per level, skipped records by
reason, timings and the trie file's sha256. A remote `output` (s3://...) is built locally in
`tmp_dir` and uploaded at the end.

`default_trie_path()` is the embedded default trie, built with this code on first use: the
pipeline driver asks for it when a job runs with `model.trie: default`.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dart_train.corpus import (
    DEFAULT_CORPUS,
    DEFAULT_DEV_FRACTION,
    SPLIT_SALT,
    CorpusReport,
    iter_conversations,
    tokenize_conversations,
)
from dart_worker.artifacts.cache_dir import announce, build_atomically, cache_dir, write_text_atomically
from dart_worker.artifacts.default_target import default_tokenizer
from dart_worker.artifacts.fingerprint import cached_tokenizer_fingerprint, file_fingerprint, tokenizer_fingerprint
from dart_worker.artifacts.loading import load_tokenizer
from ngram_native.trie import TrieBuilder

SIDECAR_FORMAT = "dart-batch/ngram-sidecar/v1"


@dataclass
class BuildNgramConfig:
    input: str = DEFAULT_CORPUS  # corpus URL / path / glob / directory, or "default" (ShareGPT package)
    output: str | None = None  # trie path or URL; the sidecar is <output>.json
    tokenizer: str = "default"  # a local HF tokenizer dir, a .gguf file, or "default" (Gemma-3-270M)
    split: str = "train"  # train | dev | all
    dev_fraction: float = DEFAULT_DEV_FRACTION
    format: str = "auto"  # auto | jsonl | json | parquet
    text_field: str = "text"
    id_field: str = "id"
    limit: int | None = None  # at most this many conversations (quick runs)
    order: int = 3
    min_count: int = 1  # N-grams seen fewer times are dropped (with their extensions)
    eos_between_turns: bool = True
    memory_budget_mb: int = 1024  # RAM for counting before sorted runs spill to tmp_dir
    tmp_dir: str | None = None  # spilled runs; default: next to a local output, else the system tmp
    batch_turns: int = 4096  # turns tokenized per batch
    progress: bool = True
    storage_options: dict[str, Any] = field(default_factory=dict)  # for remote input/output (fsspec)


# ---------------------------------------------------------------------------------------------
# Counting (also used by jobs.bench ngram)


def vocab_size_of(tokenizer: Any) -> int:
    """Ids the trie must accept: the full vocabulary, added tokens included."""
    return len(tokenizer)


def key_bytes(order: int, vocab_size: int) -> int:
    """RAM per counted position in the native builder: one sort key of `order` ids packed
    vocab_size.bit_length() bits each, as many per 64-bit word as fit (see trie_builder.cpp)."""
    per_word = 64 // int(vocab_size).bit_length()
    return 8 * -(-order // per_word)


def chunk_tokens_for(memory_budget_mb: int, order: int, vocab_size: int) -> int:
    """Positions counted in RAM before the builder spills a sorted run to disk."""
    if memory_budget_mb <= 0:
        raise ValueError(f"memory_budget_mb must be positive, got {memory_budget_mb}")
    return max(1 << 12, memory_budget_mb * (1 << 20) // key_bytes(order, vocab_size))


@dataclass
class CountResult:
    documents: int
    tokens: int
    level_sizes: list[int]  # nodes per level 0..order (level 0 = the root)
    file_bytes: int
    add_seconds: float  # time inside add_document
    finish_seconds: float  # sort/merge/write
    source_seconds: float  # time spent producing documents (reading + tokenizing)
    count_cpu_seconds: float  # CPU time of add_document + finish (immune to other processes' load)


class NoDocumentsError(ValueError):
    pass


class _Timed:
    """Wraps an iterator and adds up the time spent producing its items."""

    def __init__(self, items: Iterable[np.ndarray]):
        self._items = iter(items)
        self.seconds = 0.0

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            start = time.perf_counter()
            try:
                item = next(self._items)
            except StopIteration:
                self.seconds += time.perf_counter() - start
                return
            self.seconds += time.perf_counter() - start
            yield item


def count_documents(
    documents: Iterable[np.ndarray],
    path: str | Path,
    *,
    order: int,
    vocab_size: int,
    tokenizer_fingerprint: str,
    min_count: int = 1,
    memory_budget_mb: int = 1024,
    tmp_dir: str | None = None,
    progress: Any = None,
) -> CountResult:
    """Feed token documents to the native streaming builder and write the trie to ``path``.

    ``progress``, if given, is called with the length of each document added (a tqdm update).
    """
    builder = TrieBuilder(
        order=order,
        vocab_size=vocab_size,
        tokenizer_fingerprint=tokenizer_fingerprint,
        min_count=min_count,
        chunk_tokens=chunk_tokens_for(memory_budget_mb, order, vocab_size),
        tmp_dir=str(tmp_dir or tempfile.gettempdir()),
    )
    timed = _Timed(documents)
    add_seconds = cpu_seconds = 0.0
    for doc in timed:
        start, cpu = time.perf_counter(), time.process_time()
        builder.add_document(doc)
        add_seconds += time.perf_counter() - start
        cpu_seconds += time.process_time() - cpu
        if progress is not None:
            progress(len(doc))
    if builder.num_documents == 0:  # nothing to write: leave no empty trie behind
        raise NoDocumentsError("no documents to count")
    start, cpu = time.perf_counter(), time.process_time()
    stats = builder.finish(str(path))
    finish_seconds = time.perf_counter() - start
    cpu_seconds += time.process_time() - cpu
    return CountResult(
        documents=int(stats.num_documents),
        tokens=int(stats.num_tokens),
        level_sizes=[int(n) for n in stats.level_sizes],
        file_bytes=int(stats.file_size),
        add_seconds=add_seconds,
        finish_seconds=finish_seconds,
        source_seconds=timed.seconds,
        count_cpu_seconds=cpu_seconds,
    )


# ---------------------------------------------------------------------------------------------
# One build


def _is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def _local_path(url: str) -> Path:
    return Path(url[len("file://") :] if url.startswith("file://") else url).expanduser()


def _versions() -> dict[str, str]:
    import tokenizers
    import transformers

    return {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__, "numpy": np.__version__}


def build_ngram(cfg: BuildNgramConfig, tokenizer: Any = None) -> dict[str, Any]:
    """Run one build; returns the sidecar dict (also written to ``<output>.json``).

    ``tokenizer`` overrides ``cfg.tokenizer`` with an already loaded one (tests, callers that
    hold one); the sidecar then names it by its ``name_or_path``.
    """
    if not cfg.output:
        raise ValueError("output is required: where to write the trie (a path or an fsspec URL)")
    if not 1 <= cfg.order <= 8:
        raise ValueError(f"order must be in 1..8, got {cfg.order}")
    if cfg.min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {cfg.min_count}")
    started = time.perf_counter()

    t0 = time.perf_counter()
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.tokenizer)
        tokenizer_name = cfg.tokenizer
    else:
        tokenizer_name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    fingerprint = tokenizer_fingerprint(tokenizer)
    tokenizer_seconds = time.perf_counter() - t0

    if not _is_remote(cfg.output):
        local_trie = _local_path(cfg.output)
        local_trie.parent.mkdir(parents=True, exist_ok=True)
        return _build(cfg, tokenizer, tokenizer_name, fingerprint, local_trie, tokenizer_seconds, started)
    # A remote output is built in a local scratch directory, then uploaded: trie first, so
    # that a sidecar never describes a trie that is not there yet.
    from dart_worker.artifacts.url_filesystem import url_filesystem

    fs, remote_path = url_filesystem(cfg.output, cfg.storage_options)
    with tempfile.TemporaryDirectory(prefix="build_ngram-", dir=cfg.tmp_dir) as work_dir:
        local_trie = Path(work_dir) / os.path.basename(remote_path.rstrip("/"))
        sidecar = _build(cfg, tokenizer, tokenizer_name, fingerprint, local_trie, tokenizer_seconds, started)
        fs.put_file(str(local_trie), remote_path)
        fs.put_file(str(local_trie) + ".json", remote_path + ".json")
    return sidecar


def _build(
    cfg: BuildNgramConfig,
    tokenizer: Any,
    tokenizer_name: str,
    fingerprint: str,
    local_trie: Path,
    tokenizer_seconds: float,
    started: float,
) -> dict[str, Any]:
    vocab_size = vocab_size_of(tokenizer)
    tmp_dir = cfg.tmp_dir or str(local_trie.parent)
    report = CorpusReport()
    conversations = iter_conversations(
        cfg.input,
        split=cfg.split,
        dev_fraction=cfg.dev_fraction,
        format=cfg.format,
        text_field=cfg.text_field,
        id_field=cfg.id_field,
        limit=cfg.limit,
        report=report,
        storage_options=dict(cfg.storage_options) or None,
    )
    documents = tokenize_conversations(
        conversations, tokenizer, eos_between_turns=cfg.eos_between_turns, batch_turns=cfg.batch_turns
    )
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(desc="build_ngram", unit="tok", unit_scale=True, total=None, file=sys.stderr)
    try:
        result = count_documents(
            documents,
            local_trie,
            order=cfg.order,
            vocab_size=vocab_size,
            tokenizer_fingerprint=fingerprint,
            min_count=cfg.min_count,
            memory_budget_mb=cfg.memory_budget_mb,
            tmp_dir=tmp_dir,
            progress=bar.update if bar is not None else None,
        )
    except NoDocumentsError:
        raise NoDocumentsError(
            f"no documents to count in {cfg.input!r} (split={cfg.split}): {report.summary()}"
        ) from None
    finally:
        if bar is not None:
            bar.close()

    checksum = file_fingerprint(local_trie)
    total_seconds = time.perf_counter() - started
    count_seconds = result.add_seconds + result.finish_seconds
    sidecar = {
        "format": SIDECAR_FORMAT,
        "trie": os.path.basename(str(local_trie)),
        "trie_sha256": checksum,
        "trie_bytes": result.file_bytes,
        "source": {
            "input": cfg.input,
            "split": cfg.split,
            "dev_fraction": cfg.dev_fraction,
            "split_salt": SPLIT_SALT,
            "limit": cfg.limit,
            "text_field": cfg.text_field,
            "format": cfg.format,
        },
        "tokenizer": {
            "name": tokenizer_name,
            "fingerprint": fingerprint,
            "vocab_size": vocab_size,
            "eos_token_id": getattr(tokenizer, "eos_token_id", None),
        },
        "order": cfg.order,
        "min_count": cfg.min_count,
        "eos_between_turns": cfg.eos_between_turns,
        "counts": {
            "documents": result.documents,
            "tokens": result.tokens,
            "nodes_per_level": result.level_sizes,
            "nodes": sum(result.level_sizes[1:]),
            "bytes_per_node": result.file_bytes / max(1, sum(result.level_sizes[1:])),
        },
        "corpus": report.to_dict(),
        "timing": {
            "total_s": round(total_seconds, 3),
            "load_tokenizer_s": round(tokenizer_seconds, 3),  # with its fingerprint
            "read_and_tokenize_s": round(result.source_seconds, 3),
            "count_s": round(result.add_seconds, 3),
            "finish_s": round(result.finish_seconds, 3),
            "tokens_per_s": round(result.tokens / max(1e-9, total_seconds - tokenizer_seconds)),
            "tokenize_tokens_per_s": round(result.tokens / max(1e-9, result.source_seconds)),
            "count_tokens_per_s": round(result.tokens / max(1e-9, count_seconds)),
            "count_cpu_s": round(result.count_cpu_seconds, 3),
        },
        "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
    }
    write_text_atomically(Path(str(local_trie) + ".json"), json.dumps(sidecar, indent=2) + "\n")
    return sidecar


def default_trie_path(tokenizer=None) -> Path:
    """The embedded default trie (ShareGPT train split, default tokenizer, order 3), cached.

    Built on first use (about a minute, with progress) under the cache dir, once per machine
    even when several processes ask at the same time; the name carries the tokenizer
    fingerprint, so a different default tokenizer never picks up a stale trie.

    `tokenizer`: the default tokenizer (`default_tokenizer()`), when the caller has loaded it
    already: loading Gemma-3's 262k-token tokenizer again costs ~7 s on a 2-core CPU, and a
    drafting job's driver used to pay that plus an uncached fingerprint (~6 s) on every start
    where an `ar` job pays neither.
    """
    tokenizer = tokenizer if tokenizer is not None else default_tokenizer()
    fingerprint = cached_tokenizer_fingerprint(tokenizer)
    order = BuildNgramConfig.order
    final = cache_dir("tries") / f"sharegpt-train-{order}gram-{fingerprint[:16]}.ngram"

    def build(tmp: Path) -> None:
        announce(f"first run: building the default N-gram trie (ShareGPT train split, order {order}, the default "
                 f"tokenizer) for model.trie=default; cached at {final}; about a minute, once (progress below)")
        build_ngram(BuildNgramConfig(output=str(tmp), tmp_dir=str(final.parent)), tokenizer=tokenizer)
        os.replace(str(tmp) + ".json", str(final) + ".json")

    return build_atomically(final, build)
