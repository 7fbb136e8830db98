"""`ar`: no draft at all; every round verifies the root alone (plain autoregressive decoding).

It runs through the same engine, KV cache and verification as every other drafter, which makes
it the baseline that the lossless tests and the benchmarks compare against.
"""

from __future__ import annotations

from collections.abc import Sequence

from dart_worker.drafters.base import Drafter, empty_tree
from ngram_native.trees import DraftTree


class AutoregressiveDrafter(Drafter):
    name = "ar"
    speculates = False

    def propose(self, tokens: Sequence[Sequence[int]], max_depths: Sequence[int]) -> list[DraftTree]:
        return [empty_tree() for _ in tokens]
