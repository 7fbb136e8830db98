"""Hybrid drafters (`dart_lookup`, `ddtree_lookup`): a head drafter's tree with the context
lookup tree of the same round (itself merged with the job cache's tree) grafted in, within the
same node budget.

The head drafts well where the text is new, lookup where it repeats; one merged tree
(`ngram_native.trees.graft`: prefix-merged, no duplicate siblings, nodes kept by score)
lets a single verification try both without spending more nodes than either alone.

Grafting pays per request, not per job: a request that quotes its prompt (code edits,
summaries) accepts long lookup paths, one sampled at T=1 from a chat prompt almost never does,
and there its lookup nodes only push head nodes out of the budget. `LookupPayoff` decides per
live sequence from what the lookup tree *would* have had accepted (every round's lookup tree is
built, cheaply, and compared with the tokens the target then committed, which do not depend on
the tree greedy or with coupled sampling), so a request whose lookup stops paying stops grafting
and starts again as soon as its text repeats, without verifying a single extra node to find out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from dart_worker.drafters.base import CommittedBlock, Drafter
from dart_worker.drafters.lookup import ContextIndexes
from ngram_native.builders import TreeParams
from ngram_native.trees import DraftTree, graft

# A sequence's lookup tree is grafted while the tokens it would have had accepted average at
# least this many per round (EMA with weight LOOKUP_EMA per evaluated tree). Below one token a
# round the lookup nodes mostly take budget slots from the head's: a head tree at T=1 gains about
# 0.1-0.5 tokens a round, a repeating request's lookup several.
LOOKUP_MIN_TOKENS = 0.5
LOOKUP_EMA = 0.3


class LookupPayoff:
    """Per live sequence, whether its lookup tree is worth grafting (see the module docstring).

    A tree proposed when the sequence had L tokens is judged once its value is final: a committed
    token left its paths, or its every level is known; until then it waits, so a round where the
    grafted tree was cut short (or not grafted) does not cap what the lookup is credited with."""

    def __init__(self):
        self.gain: list[float] = []
        self.pending: list[deque] = []

    def start(self, batch_size: int) -> None:
        self.gain = [LOOKUP_MIN_TOKENS] * batch_size
        self.pending = [deque() for _ in range(batch_size)]

    def join(self, count: int) -> None:
        self.gain.extend([LOOKUP_MIN_TOKENS] * count)
        self.pending.extend(deque() for _ in range(count))

    def select(self, keep: Sequence[int]) -> None:
        self.gain = [self.gain[b] for b in keep]
        self.pending = [self.pending[b] for b in keep]

    def wanted(self, b: int) -> bool:
        return self.gain[b] >= LOOKUP_MIN_TOKENS

    def proposed(self, b: int, length: int, tree: DraftTree) -> None:
        """Sequence `b` had `length` tokens when its lookup proposed `tree`."""
        if tree.size:
            self.pending[b].append((length, tree, int(tree.depths.max())))

    def observe(self, tokens: Sequence[Sequence[int]]) -> None:
        for b, seq in enumerate(tokens):
            waiting = self.pending[b]
            for _ in range(len(waiting)):
                length, tree, depth = entry = waiting.popleft()
                known = seq[length:length + depth]
                matched = tree.matched_length(known)
                if matched < len(known) or len(known) == depth:  # final: a miss, or every level known
                    self.gain[b] += LOOKUP_EMA * (matched - self.gain[b])
                else:
                    waiting.append(entry)


class HybridDrafter(Drafter):
    """Runs `inner` (a head drafter) and the context indexes side by side and merges their trees."""

    def __init__(self, inner: Drafter, tree: TreeParams, eos_token_ids: Sequence[int]):
        self.inner = inner
        self.name = f"{inner.name}_lookup"
        self.budget = tree.budget
        self.context = ContextIndexes(tree, eos_token_ids)
        self.payoff = LookupPayoff()

    def start(self, batch_size: int) -> None:
        self.inner.start(batch_size)
        self.context.start(batch_size)
        self.payoff.start(batch_size)

    def observe(self, block: CommittedBlock) -> None:
        self.inner.observe(block)
        self.context.observe(block)
        self.payoff.observe(block.tokens)

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
        self.payoff.join(len(block.rows))

    def finish(self, tokens: Sequence[Sequence[int]], num_prompt: Sequence[int]) -> None:
        self.inner.finish(tokens, num_prompt)
        self.context.finish(tokens, num_prompt)

    def select(self, keep: Sequence[int]) -> None:
        self.inner.select(keep)
        self.context.select(keep)
        self.payoff.select(keep)

    def propose(self, tokens: Sequence[Sequence[int]], max_depths: Sequence[int]) -> list[DraftTree]:
        model_trees = self.inner.propose(tokens, max_depths)
        lookup_trees = self.context.propose(tokens, max_depths)
        payoff, out = self.payoff, []
        for b, (model_tree, lookup_tree) in enumerate(zip(model_trees, lookup_trees, strict=True)):
            payoff.proposed(b, len(tokens[b]), lookup_tree)
            out.append(graft(model_tree, lookup_tree, self.budget) if payoff.wanted(b) else model_tree)
        return out
