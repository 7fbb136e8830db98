"""Every benchmark, one front door: `python -m jobs.bench KIND [config.yaml] [key=value ...]`.

    python -m jobs.bench report configs/bench.yaml          # modes x temperatures x budgets: report.md + plots
    python -m jobs.bench engine num_prompts=3 max_new_tokens=48 dtype=fp32   # the engine's modes side by side
    python -m jobs.bench structured                         # a JSON schema on every row: ar vs the default mode
    python -m jobs.bench pipeline                           # the whole Ray Data job against the engine alone
    python -m jobs.bench ngram limit=2000                   # the N-gram trie on the real corpus
    python -m jobs.bench tune_tree mode=dart                # tree settings by replay

KIND picks the benchmark; the rest of the command line is that benchmark's own (`KIND --help`
where it takes flags). The measuring code is in dart_bench/ (one module per kind; what they
share, the target-and-prompts config included, in dart_bench/common.py); method and figures:
docs/benchmarks.md.

Commands written before the kinds were merged here (issue #30) map one to one:
`python -m jobs.bench_<kind> ...` is `python -m jobs.bench <kind> ...` (`bench_report` is `plots`),
`jobs.tune_tree` and `jobs.compare_heads` are the kinds of those names, and
`python -m jobs.bench CONFIG.yaml ...` (a config file first) still runs `report`.
"""

from __future__ import annotations

import importlib
import sys

# kind -> (module of dart_bench whose main(argv) runs it, what it measures)
KINDS = {
    "report": ("matrix", "every mode x temperature x budget on dev prompts: bench.json, plots, report.md"),
    "plots": ("report", "re-render a report from its bench.json, or plot a pipeline job (--job)"),
    "engine": ("engine", "the engine's modes side by side: batch sweeps, sizing, shared-prefill samples"),
    "structured": ("structured", "JSON-schema extraction rows: ar and the default mode with the same schema"),
    "templated": ("templated", "the lookup drafters' job cache on a templated job"),
    "verify_shapes": ("verify_shapes", "verify-forward cost by batch shape, projection and cache strategy"),
    "pipeline": ("pipeline_job", "the whole Ray Data job, and the engine alone on the same prompts"),
    "load": ("load", "the job's own machinery (read, dedup, write, resume) at 10^4-10^5 rows"),
    "ngram": ("ngram", "N-gram trie queries, tree builders and shared memory on the real corpus"),
    "tune_tree": ("tune_tree", "tree settings by coordinate search, tau by replay"),
    "job_ngram": ("job_ngram", "what the job n-gram adds as a job warms up, tau by replay"),
    "context_bound": ("context_bound", "the most any context drafter could add, tau by replay"),
    "compare_heads": ("compare_heads", "draft heads side by side: dev accuracy, replay tau, decoding"),
    "teacher_cache": ("teacher_cache", "training throughput live vs from the teacher cache"),
    "tree_merge": ("tree_merge", "the per-round tree merge (hybrid modes): C++ vs its Python definition"),
    "coupling": ("coupling", "draft/target agreement of sampled tokens per coupling of the randomness, by replay"),
    "equivalence": ("equivalence", "the engine before/after a change: every mode's outputs and sizing on tiny models"),
}


def usage() -> str:
    width = max(map(len, KINDS))
    return "usage: python -m jobs.bench KIND [args ...]\n\nKIND:\n" + "\n".join(
        f"  {kind:<{width}}  {what}" for kind, (_, what) in KINDS.items())


def main(argv: list[str] | None = None):
    """Run the benchmark KIND with the rest of `argv`; returns what its main returns."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    kind, rest = argv[0], argv[1:]
    if kind.endswith((".yaml", ".yml")):  # the form before the kinds: the report's config first
        kind, rest = "report", argv
    if kind not in KINDS:
        print(f"error: unknown benchmark {kind!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return importlib.import_module(f"dart_bench.{KINDS[kind][0]}").main(rest)


if __name__ == "__main__":
    result = main()
    sys.exit(result if isinstance(result, int) else 0)
