"""N-gram side benchmark on the real corpus: `python -m jobs.bench ngram [key=value ...]`.

    python -m jobs.bench ngram                       # ShareGPT train split, Gemma-3 tokenizer, order 3
    python -m jobs.bench ngram limit=2000 output=/tmp/quick.json   # a quick run

Measures, on the trie the project actually ships by default:

- build: tokenization throughput (reported on its own: the tokenized corpus is cached as npy
  shards under the cache dir, so reruns skip it) and counting throughput of the native builder;
- size: file bytes per stored node (upstream DART's layout: 36 B/node on disk, ~125 B/node once
  loaded in RAM; goal <= 12);
- open: a quick open (header and bounds, O(1)) and a verifying open (checksum + structure, O(size));
- query: latency of one 25-candidate `score` call from Python, median over real held-out contexts;
- trees: latency per sequence of the DART beam (top-25 x 8 positions, budget 60), DDTree and the
  chain, on draft distributions made from the trie's own next-token statistics plus noise
  (goal for DART < 0.3 ms);
- memory: summed PSS of 4 processes that map one trie, against the file size (one copy expected).

Prints a compact table and writes every figure to a JSON file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from dart_train.corpus import (
    DEFAULT_CORPUS,
    DEFAULT_DEV_FRACTION,
    SPLIT_SALT,
    CorpusReport,
    iter_conversations,
    tokenize_conversations,
)
from dart_train.ngram_build import count_documents, vocab_size_of
from dart_worker.artifacts.cache_dir import build_atomically, cache_dir
from dart_worker.artifacts.fingerprint import tokenizer_fingerprint
from dart_worker.artifacts.loading import load_tokenizer
from dart_worker.defaults import DEFAULT_BUDGET

TOKEN_CACHE_FORMAT = "dart-batch/tokenized-corpus/v2"
SHARD_TOKENS = 1 << 23  # 8M tokens (32 MB) per shard


@dataclass
class BenchNgramConfig:
    input: str = DEFAULT_CORPUS
    tokenizer: str = "default"
    order: int = 3
    min_count: int = 1
    limit: int | None = None  # at most this many train conversations (quick runs)
    eos_between_turns: bool = True
    memory_budget_mb: int = 2048
    trie: str | None = None  # where to write the trie; default: under the cache dir
    num_contexts: int = 5000  # query latency samples
    num_sequences: int = 400  # tree-build latency samples
    top_k: int = 25
    positions: int = 8
    budget: int = DEFAULT_BUDGET
    beam_width: int = 20
    processes: int = 4  # processes mapping one trie for the memory figure
    open_repeats: int = 20
    seed: int = 0
    output: str | None = "bench_ngram.json"


# ---------------------------------------------------------------------------------------------
# Tokenized corpus cache


@dataclass
class TokenizedCorpus:
    directory: Path
    documents: int
    tokens: int
    tokenize_seconds: float  # wall time, measured when the cache was written
    tokenize_cpu_seconds: float  # CPU time of this process (all tokenizer threads) for the same
    from_cache: bool
    report: dict[str, Any]

    def iter_documents(self) -> Iterator[np.ndarray]:
        """Documents as int32 views of memory-mapped shards (no copy, bounded memory)."""
        shard = 0
        while (self.directory / f"tokens-{shard:05d}.npy").exists():
            tokens = np.load(self.directory / f"tokens-{shard:05d}.npy", mmap_mode="r")
            lengths = np.load(self.directory / f"lengths-{shard:05d}.npy")
            start = 0
            for n in lengths.tolist():
                yield tokens[start : start + n]
                start += n
            shard += 1


def _corpus_key(cfg: BenchNgramConfig, split: str, fingerprint: str) -> str:
    key = json.dumps(
        [
            TOKEN_CACHE_FORMAT,
            cfg.input,
            split,
            DEFAULT_DEV_FRACTION,
            SPLIT_SALT,
            cfg.limit,
            fingerprint,
            cfg.eos_between_turns,
        ],
    )
    return hashlib.sha256(key.encode()).hexdigest()[:20]


def tokenized_corpus(cfg: BenchNgramConfig, tokenizer: Any, fingerprint: str, split: str) -> TokenizedCorpus:
    """Tokenize the split once and cache it as npy shards; later runs map the shards.

    The cache key is the input's name, the split, the tokenizer's fingerprint and the options:
    a local corpus edited in place keeps its key, so clear ``<cache>/tokenized`` after editing.
    """
    directory = cache_dir("tokenized") / _corpus_key(cfg, split, fingerprint)
    from_cache = (directory / "manifest.json").is_file()

    def write_shards(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        report = CorpusReport()
        limit = cfg.limit if split == "train" else None
        convs = iter_conversations(cfg.input, split=split, limit=limit, report=report)
        shard, buf, lengths, n_docs, n_tokens = 0, [], [], 0, 0

        def flush() -> None:
            nonlocal shard, buf, lengths
            np.save(tmp / f"tokens-{shard:05d}.npy", np.concatenate(buf))
            np.save(tmp / f"lengths-{shard:05d}.npy", np.asarray(lengths, dtype=np.int64))
            shard, buf, lengths = shard + 1, [], []

        start, cpu = time.perf_counter(), time.process_time()
        for doc in tokenize_conversations(convs, tokenizer, eos_between_turns=cfg.eos_between_turns):
            buf.append(doc)
            lengths.append(len(doc))
            n_docs += 1
            n_tokens += len(doc)
            if sum(lengths) >= SHARD_TOKENS:
                flush()
        if buf:
            flush()
        manifest = {
            "format": TOKEN_CACHE_FORMAT,
            "input": cfg.input,
            "split": split,
            "tokenizer_fingerprint": fingerprint,
            "documents": n_docs,
            "tokens": n_tokens,
            "tokenize_seconds": time.perf_counter() - start,
            "tokenize_cpu_seconds": time.process_time() - cpu,
            "report": report.to_dict(),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))  # last: marks completion

    build_atomically(directory, write_shards, is_valid=lambda d: (d / "manifest.json").is_file())
    m = json.loads((directory / "manifest.json").read_text())
    return TokenizedCorpus(
        directory,
        m["documents"],
        m["tokens"],
        m["tokenize_seconds"],
        m["tokenize_cpu_seconds"],
        from_cache,
        m["report"],
    )


# ---------------------------------------------------------------------------------------------
# Realistic inputs for queries and trees


class LevelIndex:
    """The trie's levels copied into numpy, to find a context's children outside the timed code."""

    def __init__(self, trie: Any, order: int):
        self.order = order
        self.levels = [trie.level_arrays(k) for k in range(order + 1)]

    def _children(self, level: int, node: int) -> tuple[np.ndarray, np.ndarray]:
        _, _, offsets = self.levels[level]
        lo, hi = int(offsets[node]), int(offsets[node + 1])
        tokens, counts, _ = self.levels[level + 1]
        return tokens[lo:hi], counts[lo:hi]

    def _find(self, ngram: list[int]) -> int | None:
        node = 0
        for level, token in enumerate(ngram):
            tokens, _ = self._children(level, node)
            i = int(np.searchsorted(tokens, token))
            if i >= len(tokens) or int(tokens[i]) != token:
                return None
            node = int(self.levels[level][2][node]) + i
        return node

    def next_tokens(self, context: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to k most frequent next tokens after the longest stored suffix of the context,
        backing off to shorter suffixes to fill k; with their relative frequencies."""
        ids: list[int] = []
        probs: list[float] = []
        ctx = context[-(self.order - 1) :] if self.order > 1 else []
        for start in range(len(ctx) + 1):
            suffix = ctx[start:]
            node = self._find(suffix)
            if node is None:
                continue
            tokens, counts = self._children(len(suffix), node)
            if len(tokens) == 0:
                continue
            top = np.argsort(-counts.astype(np.int64), kind="stable")[: 4 * k]
            total = float(counts.sum())
            for j in top.tolist():
                t = int(tokens[j])
                if t not in ids:
                    ids.append(t)
                    probs.append(float(counts[j]) / total * (0.5**start))
                if len(ids) >= k:
                    return np.asarray(ids, np.int32), np.asarray(probs)
        return np.asarray(ids, np.int32), np.asarray(probs)


def draft_inputs(
    index: LevelIndex, dev_docs: list[np.ndarray], n: int, cfg: BenchNgramConfig, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """[n, positions, top_k] ids and logits, and contexts, for n sequences cut from dev documents.

    Position j's candidates are the trie's most frequent continuations of the true text so far,
    with log-frequency logits plus Gaussian noise (sigma 1): a drafter that is right about as often
    as the corpus statistics, with its own errors. The true next token is always among them.
    """
    ids = np.zeros((n, cfg.positions, cfg.top_k), np.int32)
    logits = np.zeros((n, cfg.positions, cfg.top_k), np.float32)
    contexts = []
    long_docs = [d for d in dev_docs if len(d) > 64 + cfg.positions]
    for s in range(n):
        doc = long_docs[int(rng.integers(len(long_docs)))]
        p = int(rng.integers(16, len(doc) - cfg.positions))
        contexts.append(np.ascontiguousarray(doc[max(0, p - 8) : p], dtype=np.int32))
        for j in range(cfg.positions):
            context = doc[: p + j].tolist()[-8:]
            cand, prob = index.next_tokens(context, cfg.top_k)
            true_next = int(doc[p + j])
            row_ids = [t for t in cand.tolist() if t != true_next][: cfg.top_k - 1]
            row_p = [q for t, q in zip(cand.tolist(), prob.tolist(), strict=True) if t != true_next][: cfg.top_k - 1]
            row_ids.append(true_next)
            row_p.append(max(row_p) if row_p else 1.0)
            filler = 0
            while len(row_ids) < cfg.top_k:  # a context with few continuations: pad with unseen ids
                while filler in row_ids:
                    filler += 1
                row_ids.append(filler)
                row_p.append(1e-6)
            ids[s, j] = row_ids
            logits[s, j] = np.log(np.asarray(row_p) + 1e-6) + rng.normal(0.0, 1.0, cfg.top_k)
    return ids, logits, contexts


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def time_calls(calls: list[Any]) -> dict[str, float]:
    """Median wall and CPU time of each zero-argument call, in microseconds.

    The CPU time is the calling thread's (the native code runs in it, GIL released): it shows
    the work itself even when other processes share the cores; the wall time is what a caller
    waits. Both are reported so that a loaded machine is visible in the figures.
    """
    wall, cpu = [], []
    for call in calls:
        w, c = time.perf_counter(), time.thread_time()
        call()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    return {
        "wall_us_median": _median_us(wall),
        "wall_us_p90": float(np.percentile(wall, 90) * 1e6),
        "cpu_us_median": _median_us(cpu),
    }


# ---------------------------------------------------------------------------------------------
# Memory of several processes mapping one trie

_MAPPER = textwrap.dedent(
    """
    import sys
    from ngram_native.trie import NgramTrie
    trie = NgramTrie.open(sys.argv[1], verify=True)  # the checksum pass touches every page
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def _smaps_pss_kib(pid: int, path: str) -> tuple[int, int]:
    """(PSS of the whole process, PSS of the mappings of `path`) in KiB, from /proc."""
    total = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            total = int(line.split()[1])
    mapped, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1] == path
        elif inside and line.startswith("Pss:"):
            mapped += int(fields[1])
    return total, mapped


def shared_memory(path: str, processes: int) -> dict[str, Any]:
    real = os.path.realpath(path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), *sys.path]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _MAPPER, real], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        for _ in range(processes)
    ]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a trie-mapping process failed to start")
        pss = [_smaps_pss_kib(p.pid, real) for p in procs]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
    size = os.path.getsize(real)
    trie_pss = sum(m for _, m in pss) * 1024
    return {
        "processes": processes,
        "file_bytes": size,
        "pss_total_bytes": sum(t for t, _ in pss) * 1024,
        "pss_trie_mapping_bytes": trie_pss,
        "trie_copies": trie_pss / size,
    }


# ---------------------------------------------------------------------------------------------
# The benchmark


def run(cfg: BenchNgramConfig) -> dict[str, Any]:
    from ngram_native.builders import build_chain_trees, build_dart_trees, build_ddtree_trees
    from ngram_native.trie import NgramTrie

    rng = np.random.default_rng(cfg.seed)
    results: dict[str, Any] = {"config": asdict(cfg), "load_average_at_start": os.getloadavg()}

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.tokenizer)
    fingerprint = tokenizer_fingerprint(tokenizer)
    results["tokenizer"] = {"name": cfg.tokenizer, "fingerprint": fingerprint, "load_s": time.perf_counter() - t0}

    train = tokenized_corpus(cfg, tokenizer, fingerprint, "train")
    dev = tokenized_corpus(cfg, tokenizer, fingerprint, "dev")
    results["corpus"] = {
        "train_documents": train.documents,
        "train_tokens": train.tokens,
        "dev_documents": dev.documents,
        "dev_tokens": dev.tokens,
        "skipped": train.report["skipped"],
        "tokenize_s": train.tokenize_seconds,
        "tokenize_cpu_s": train.tokenize_cpu_seconds,
        "tokenize_tokens_per_s": train.tokens / train.tokenize_seconds,
        "tokenize_tokens_per_cpu_s": train.tokens / train.tokenize_cpu_seconds,
        "tokenized_from_cache": train.from_cache,
    }

    trie_path = Path(cfg.trie) if cfg.trie else cache_dir("bench") / f"bench-{cfg.order}gram.trie"
    trie_path.parent.mkdir(parents=True, exist_ok=True)
    built = count_documents(
        train.iter_documents(),
        trie_path,
        order=cfg.order,
        vocab_size=vocab_size_of(tokenizer),
        tokenizer_fingerprint=fingerprint,
        min_count=cfg.min_count,
        memory_budget_mb=cfg.memory_budget_mb,
        tmp_dir=str(trie_path.parent),
    )
    count_s = built.add_seconds + built.finish_seconds
    nodes = sum(built.level_sizes[1:])
    results["build"] = {
        "documents": built.documents,
        "tokens": built.tokens,
        "nodes_per_level": built.level_sizes,
        "nodes": nodes,
        "file_bytes": built.file_bytes,
        "bytes_per_node": built.file_bytes / nodes,
        "count_s": count_s,
        "count_tokens_per_s": built.tokens / count_s,
        "count_cpu_s": built.count_cpu_seconds,
        "count_tokens_per_cpu_s": built.tokens / built.count_cpu_seconds,
        "read_cached_tokens_s": built.source_seconds,
        "end_to_end_tokens_per_s": built.tokens / (count_s + train.tokenize_seconds),
    }

    quick = time_calls(
        [lambda: NgramTrie.open(str(trie_path), verify=False, expected_tokenizer_fingerprint=fingerprint).close()]
        * cfg.open_repeats
    )
    start = time.perf_counter()
    trie = NgramTrie.open(str(trie_path), verify=True, expected_tokenizer_fingerprint=fingerprint)
    verified_s = time.perf_counter() - start
    results["open"] = {"quick": quick, "verified_s": verified_s}

    dev_docs = [np.asarray(d) for d in dev.iter_documents()]
    index = LevelIndex(trie, cfg.order)

    # Query latency: the true next token plus the context's frequent continuations, 25 in all.
    calls = []
    long_docs = [d for d in dev_docs if len(d) > 32]
    for _ in range(cfg.num_contexts):
        doc = long_docs[int(rng.integers(len(long_docs)))]
        p = int(rng.integers(cfg.order, len(doc)))
        cand, _ = index.next_tokens(doc[:p].tolist()[-8:], cfg.top_k)
        cand = np.unique(np.concatenate([cand[: cfg.top_k - 1], doc[p : p + 1]]).astype(np.int32))
        ctx = np.ascontiguousarray(doc[p - cfg.order + 1 : p], dtype=np.int32)
        calls.append(lambda ctx=ctx, cand=cand: trie.score(ctx, cand))
    results["query"] = {"calls": len(calls), "candidates": cfg.top_k, **time_calls(calls)}

    # Trees: per sequence (batch of 1, what a one-sequence worker pays) and amortised over 16.
    ids, logits, contexts = draft_inputs(index, dev_docs, cfg.num_sequences, cfg, rng)
    eos = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    builders = {
        "dart": lambda sl: build_dart_trees(
            topk_ids=ids[sl],
            topk_values=logits[sl],
            contexts=contexts[sl],
            scorer=trie,
            budget=cfg.budget,
            top_k=cfg.top_k,
            beam_width=cfg.beam_width,
            eos_ids=eos,
        ),
        "ddtree": lambda sl: build_ddtree_trees(
            topk_ids=ids[sl], topk_values=logits[sl], values="logits", budget=cfg.budget, eos_ids=eos
        ),
        "chain": lambda sl: build_chain_trees(
            topk_ids=ids[sl], topk_values=logits[sl], values="logits", budget=cfg.budget, eos_ids=eos
        ),
    }
    trees: dict[str, Any] = {}
    n = cfg.num_sequences
    for name, build in builders.items():
        sizes = [build(slice(s, s + 1))[0].size for s in range(n)]
        single = time_calls([lambda s=s, build=build: build(slice(s, s + 1)) for s in range(n)])
        batched = time_calls([lambda s=s, build=build: build(slice(s, s + 16)) for s in range(0, n - 15, 16)])
        trees[name] = {
            "batch1": single,
            "batch16_per_sequence": {k: v / 16 for k, v in batched.items()},
            "nodes_median": statistics.median(sizes),
        }
    results["trees"] = {"budget": cfg.budget, "top_k": cfg.top_k, "positions": cfg.positions, **trees}
    trie.close()

    results["memory"] = shared_memory(str(trie_path), cfg.processes)
    results["trie"] = str(trie_path)
    results["load_average_at_end"] = os.getloadavg()
    return results


def print_table(r: dict[str, Any]) -> None:
    b, c, o, q, m = r["build"], r["corpus"], r["open"], r["query"], r["memory"]

    def lat(t: dict[str, float]) -> str:
        return f"{t['wall_us_median']:.1f} us (cpu {t['cpu_us_median']:.1f} us)"

    rows = [
        (
            "corpus",
            f"{c['train_documents']} train docs, {c['train_tokens'] / 1e6:.1f} M tokens; "
            f"dev {c['dev_documents']} docs; skipped {c['skipped']}",
        ),
        (
            "tokenize",
            f"{c['tokenize_s']:.1f} s = {c['tokenize_tokens_per_s'] / 1e6:.2f} M tok/s "
            f"(cpu {c['tokenize_cpu_s']:.1f} s = {c['tokenize_tokens_per_cpu_s'] / 1e6:.2f} M tok/cpu-s)"
            + (", cached" if c["tokenized_from_cache"] else ""),
        ),
        (
            "count + write",
            f"{b['count_s']:.1f} s = {b['count_tokens_per_s'] / 1e6:.2f} M tok/s "
            f"(cpu {b['count_cpu_s']:.1f} s = {b['count_tokens_per_cpu_s'] / 1e6:.2f} M tok/cpu-s)",
        ),
        ("nodes", f"{b['nodes'] / 1e6:.2f} M, per level {b['nodes_per_level'][1:]}"),
        (
            "file",
            f"{b['file_bytes'] / 1e6:.1f} MB = {b['bytes_per_node']:.2f} B/node "
            "(upstream: 36 on disk, ~125 in RAM; goal <= 12)",
        ),
        ("open quick", lat(o["quick"])),
        ("open verified", f"{o['verified_s'] * 1e3:.0f} ms"),
        (f"score {q['candidates']} cands", lat(q)),
    ]
    for name in ("dart", "ddtree", "chain"):
        t = r["trees"][name]
        rows.append(
            (
                f"tree {name}",
                f"{lat(t['batch1'])} per seq at batch 1, "
                f"{lat(t['batch16_per_sequence'])} at batch 16; {t['nodes_median']:.0f} nodes",
            )
        )
    rows.append(
        (
            "memory",
            f"{m['processes']} processes map it: trie PSS {m['pss_trie_mapping_bytes'] / 1e6:.1f} MB "
            f"= {m['trie_copies']:.2f} x the file; all PSS {m['pss_total_bytes'] / 1e6:.0f} MB",
        )
    )
    rows.append(
        (
            "load average",
            f"{r['load_average_at_start'][0]:.1f} at start, {r['load_average_at_end'][0]:.1f} "
            f"at end ({os.cpu_count()} cores)",
        )
    )
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def parse_config(argv: list[str] | None = None) -> BenchNgramConfig:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench ngram", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. limit=2000")
    args = parser.parse_args(argv)
    merged = OmegaConf.merge(OmegaConf.structured(BenchNgramConfig), OmegaConf.from_dotlist(args.overrides))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    results = run(cfg)
    print_table(results)
    if cfg.output:
        Path(cfg.output).write_text(json.dumps(results, indent=2, default=float) + "\n")
        print(f"figures written to {cfg.output}")
    return 0
