"""Hybrid drafters (`dart_lookup`, `ddtree_lookup`): a head drafter's tree with the context
lookup tree of the same round (itself merged with the job cache's tree) grafted in, within the
same node budget.

The head drafts well where the text is new, lookup where it repeats; one merged tree
(`ngram_native.merge.merge_trees`: prefix-merged, no duplicate siblings, nodes kept by score)
lets a single verification try both without spending more nodes than either alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from dart_worker.drafters.base import CommittedBlock, Drafter
from dart_worker.drafters.lookup import ContextIndexes, graft
from ngram_native.trees import DraftTree, TreeParams


class HybridDrafter(Drafter):
    """Runs `inner` (a head drafter) and the context indexes side by side and merges their trees."""

    def __init__(self, inner: Drafter, tree: TreeParams, eos_token_ids: Sequence[int]):
        self.inner = inner
        self.name = f"{inner.name}_lookup"
        self.budget = tree.budget
        self.context = ContextIndexes(tree, eos_token_ids)

    def start(self, batch_size: int) -> None:
        self.inner.start(batch_size)
        self.context.start(batch_size)

    def observe(self, block: CommittedBlock) -> None:
        self.inner.observe(block)
        self.context.observe(block)

    @property
    def has_model(self) -> bool:
        return self.inner.has_model

    @property
    def job_ngram(self):
        return self.inner.job_ngram

    def warm(self, documents: Sequence[Sequence[int]], kinds: Sequence[str] = ("job_ngram",)) -> None:
        self.inner.warm(documents, kinds)
        if "job_cache" in kinds:
            self.context.warm(documents)

    def job_state(self) -> dict[str, tuple[int, int]]:
        return {**self.inner.job_state(), **self.context.job_state()}

    def catch_up(self) -> None:
        self.inner.catch_up()

    def pause_model(self, paused: bool) -> None:
        self.inner.pause_model(paused)

    def join(self, block: CommittedBlock) -> None:
        self.inner.join(block)
        self.context.join(block)

    def finish(self, tokens: Sequence[Sequence[int]], num_prompt: Sequence[int]) -> None:
        self.inner.finish(tokens, num_prompt)
        self.context.finish(tokens, num_prompt)

    def select(self, keep: Sequence[int]) -> None:
        self.inner.select(keep)
        self.context.select(keep)

    def propose(self, tokens: Sequence[Sequence[int]], max_depths: Sequence[int]) -> list[DraftTree]:
        model_trees = self.inner.propose(tokens, max_depths)
        lookup_trees = self.context.propose(tokens, max_depths)
        return [graft(m, c, self.budget) for m, c in zip(model_trees, lookup_trees, strict=True)]
