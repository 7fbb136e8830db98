"""The per-round tree merge, C++ vs its Python definition: `python -m jobs.bench tree_merge [key=value ...]`.

The default mode (`dart_lookup`) grafts every live sequence's lookup tree into its DART tree each
round (`ngram_native.trees.graft` -> `merge_trees`), so the merge is paid B times per round on
the host, where on a GPU the rest of the round takes milliseconds. This times one round's merges
at several batch sizes - the C++ `merge_trees` against the pure-Python reference it is tested
against (tests/tree_reference.py, the merge as first written; needs the repository checkout) -
on trees shaped like the default mode's: a DART tree of `budget` nodes from `build_dart_trees`
over random top-k logits (no trie), and a lookup tree of about 10-30 nodes whose branches follow
the DART tree's best path for a while before they leave it, scored ln(count / occurrences) like
the context index's. Both implementations run on the same trees, alternating round by round, and
must give the same trees. Printed: the median time of one round's merges (over `repeats` rounds)
per batch size, and the speedup.

Keys: batches (default [1, 4, 16]), repeats, budget (the tree budget; default the shipped one),
positions (draft depth), top_k, vocab, seed.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
from omegaconf import OmegaConf

from dart_worker.hardware.device import cpu_model_name
from ngram_native.builders import DEFAULT_BUDGET, build_dart_trees
from ngram_native.trees import SOURCE_CONTEXT, SOURCE_HEAD, DraftTree, merge_trees


@dataclass
class TreeMergeConfig:
    batches: list[int] = field(default_factory=lambda: [1, 4, 16])
    repeats: int = 200
    budget: int = DEFAULT_BUDGET
    positions: int = 8
    top_k: int = 8
    vocab: int = 32000
    seed: int = 0


def _best_path(tree: DraftTree) -> list[int]:
    """Tokens of the path that always takes the first (best-scored) child."""
    offsets, kids = tree.children()
    path, node = [], -1
    while offsets[node + 2] > offsets[node + 1]:
        node = int(kids[offsets[node + 1]])
        path.append(int(tree.tokens[node]))
    return path


def lookup_tree(rng: np.random.Generator, model: DraftTree, vocab: int) -> DraftTree:
    """A context-lookup-like tree: a few earlier occurrences' continuations, each following the
    model's best path for a random number of tokens, scored ln(count / occurrences)."""
    best = _best_path(model)
    occurrences = int(rng.integers(2, 6))
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(occurrences):
        shared = best[: int(rng.integers(0, len(best) + 1))]
        length = max(len(shared), int(rng.integers(4, 9)))
        seq = shared + rng.integers(0, vocab, size=length - len(shared)).tolist()
        for depth in range(1, len(seq) + 1):
            path = tuple(seq[:depth])
            counts[path] = counts.get(path, 0) + 1
    paths = sorted(counts, key=len)
    index = {path: i for i, path in enumerate(paths)}
    raw = DraftTree(np.array([p[-1] for p in paths], np.int32),
                    np.array([index.get(p[:-1], -1) for p in paths], np.int32),
                    np.array([len(p) for p in paths], np.int32),
                    np.array([math.log(counts[p] / occurrences) for p in paths]))
    empty = DraftTree(*(np.zeros(0, np.int32) for _ in range(3)))
    return merge_trees(raw, empty, raw.size)  # canonical order


def round_trees(cfg: TreeMergeConfig, batch: int, rng: np.random.Generator) -> list[tuple[DraftTree, DraftTree]]:
    """`batch` (DART tree, lookup tree) pairs, marked with their sources as the hybrid drafter does."""
    ids = np.stack([np.stack([rng.choice(cfg.vocab, size=cfg.top_k, replace=False) for _ in range(cfg.positions)])
                    for _ in range(batch)]).astype(np.int32)
    values = (2.0 * rng.normal(size=ids.shape)).astype(np.float32)
    models = build_dart_trees(ids, values, budget=cfg.budget, top_k=cfg.top_k)
    return [(m.from_source(SOURCE_HEAD), lookup_tree(rng, m, cfg.vocab).from_source(SOURCE_CONTEXT)) for m in models]


def _same(a: DraftTree, b: DraftTree) -> bool:
    return all(np.array_equal(getattr(a, n), getattr(b, n)) for n in ("tokens", "parents", "depths", "sources")) \
        and a.scores.tobytes() == b.scores.tobytes()


def measure(cfg: TreeMergeConfig) -> list[dict]:
    try:
        from tests.tree_reference import merge_trees_reference
    except ImportError as e:  # an installed package without the repository's tests/
        raise SystemExit(f"tree_merge needs the repository checkout (tests/tree_reference.py): {e}") from e
    rng = np.random.default_rng(cfg.seed)
    rows = []
    for batch in cfg.batches:
        pairs = round_trees(cfg, batch, rng)
        for a, b in pairs:
            if not _same(merge_trees(a, b, cfg.budget), merge_trees_reference(a, b, cfg.budget)):
                raise AssertionError("C++ merge_trees differs from the Python reference")
        seconds: dict[str, list[float]] = {"python": [], "cpp": []}
        for _ in range(cfg.repeats):  # alternating, so drift in the machine's load hits both alike
            for name, merge in (("python", merge_trees_reference), ("cpp", merge_trees)):
                t0 = time.perf_counter()
                for a, b in pairs:
                    merge(a, b, cfg.budget)
                seconds[name].append(time.perf_counter() - t0)
        py, cpp = (1e6 * statistics.median(seconds[k]) for k in ("python", "cpp"))
        rows.append({"batch": batch, "model_nodes": statistics.mean(a.size for a, _ in pairs),
                     "lookup_nodes": statistics.mean(b.size for _, b in pairs),
                     "merged_nodes": statistics.mean(merge_trees(a, b, cfg.budget).size for a, b in pairs),
                     "python_us_per_round": py, "cpp_us_per_round": cpp, "speedup": py / cpp})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    cfg: TreeMergeConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TreeMergeConfig),
                                                               OmegaConf.from_cli(argv)))
    if cfg.repeats < 1 or not cfg.batches or min(cfg.batches) < 1:
        raise ValueError("repeats and every batch size must be >= 1")
    rows = measure(cfg)
    print(f"tree merge per round, budget {cfg.budget}, median of {cfg.repeats} rounds, {cpu_model_name()}")
    print("batch  model nodes  lookup nodes  merged   python us/round   C++ us/round   speedup")
    for r in rows:
        print(f"{r['batch']:>5}  {r['model_nodes']:>11.1f}  {r['lookup_nodes']:>12.1f}  {r['merged_nodes']:>6.1f}"
              f"  {r['python_us_per_round']:>16.1f}  {r['cpp_us_per_round']:>13.1f}  {r['speedup']:>7.1f}x")
    return rows
