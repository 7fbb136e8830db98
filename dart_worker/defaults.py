"""The defaults a user meets first, each written once: the decoding mode, the tree budget, the dtype.

Import-light (no torch). The pipeline's config schema, the engine factory, the model loaders and
the benchmark jobs take their defaults from these names; a job that measures something else on
purpose (a study of `dart` alone, budget 32 for a faster run) says so with its own value.
tests/test_defaults.py checks that none of the three values is written out again as a default and
that docs/config.md states them.
"""

from __future__ import annotations

from ngram_native.builders import DEFAULT_BUDGET

# A registered drafter (dart_worker/drafters/registry.py lists them all): the DART head + trie tree
# with the request's own text grafted in, the fastest mode measured (docs/benchmarks.md).
DEFAULT_MODE = "dart_lookup"
# "auto": bf16 where the device computes it natively (CUDA with bf16, CPUs with AVX512-BF16 or
# AMX), else fp32 (dart_worker.hardware.device.resolve_dtype). A figure measured in bf16 names dtype=bf16.
DEFAULT_DTYPE = "auto"

__all__ = ["DEFAULT_BUDGET", "DEFAULT_DTYPE", "DEFAULT_MODE"]
