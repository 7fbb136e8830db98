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
from dataclasses import dataclass, field

from dart_worker.drafters.base import CommittedBlock, Composite, Drafter, Finished, ModelDrafter, Part, PerSequence
from dart_worker.drafters.lookup import ContextIndexes
from ngram_native.builders import TreeParams
from ngram_native.trees import DraftTree, graft

# A sequence's lookup tree is grafted while the tokens it would have had accepted average at
# least this many per round (EMA with weight LOOKUP_EMA per evaluated tree). Below one token a
# round the lookup nodes mostly take budget slots from the head's: a head tree at T=1 gains about
# 0.1-0.5 tokens a round, a repeating request's lookup several.
LOOKUP_MIN_TOKENS = 0.5
LOOKUP_EMA = 0.3


@dataclass
class _Payoff:
    """One sequence's record: `gain`, the EMA of the tokens its lookup trees would have had
    accepted, and `pending`, its lookup trees not judged yet: (tokens it had, tree, tree depth, the
    node its walk reached so far, tokens matched so far)."""

    gain: float = LOOKUP_MIN_TOKENS
    pending: deque = field(default_factory=deque)


class LookupPayoff(Part):
    """Per live sequence, whether its lookup tree is worth grafting (see the module docstring).

    A tree proposed when the sequence had L tokens is judged once its value is final: a committed
    token left its paths, or its every level is known; until then it waits, so a round where the
    grafted tree was cut short (or not grafted) does not cap what the lookup is credited with."""

    def __init__(self):
        self.records: PerSequence = PerSequence(_Payoff)

    def retire(self, finished: Finished, keep: Sequence[int]) -> None:
        self.records.retire(finished, keep)

    def wanted(self, b: int) -> bool:
        return self.records[b].gain >= LOOKUP_MIN_TOKENS

    def proposed(self, b: int, length: int, tree: DraftTree) -> None:
        """Sequence `b` had `length` tokens when its lookup proposed `tree`."""
        if tree.size:
            self.records[b].pending.append((length, tree, int(tree.depths.max()), -1, 0))

    def observe(self, block: CommittedBlock) -> None:
        """Walk each waiting tree on with the tokens committed since its last walk (from the node it
        had reached), so a tree costs its depth in steps over its life: walked again from the root
        every round, the waiting trees (one a round per sequence, 20-40 deep where a sequence
        repeats its prompt) made every round pay all their depths again, a Python step each."""
        first = self.records.observe(block)  # newcomers have nothing to judge yet
        for record, seq in zip(self.records[first:], block.tokens, strict=True):
            waiting = record.pending
            for _ in range(len(waiting)):
                length, tree, depth, node, matched = waiting.popleft()
                new = seq[length + matched:length + depth]
                node, more = tree.walk(new, node)
                matched += more
                if more < len(new) or matched == depth:  # final: a miss, or every level known
                    record.gain += LOOKUP_EMA * (matched - record.gain)
                else:
                    waiting.append((length, tree, depth, node, matched))


class HybridDrafter(Composite, ModelDrafter):
    """Runs `inner` (a head drafter) and the context indexes side by side and merges their trees."""

    def __init__(self, inner: Drafter, tree: TreeParams, eos_token_ids: Sequence[int]):
        self.inner = inner
        self.name = f"{inner.name}_lookup"
        self.budget = tree.budget
        self.context = ContextIndexes(tree, eos_token_ids)
        self.payoff = LookupPayoff()
        self.parts = (inner, self.context, self.payoff)

    @property
    def has_model(self) -> bool:
        return self.inner.has_model

    def run_model(self, on: bool) -> None:
        self.inner.run_model(on)

    def propose(self, tokens: Sequence[Sequence[int]], max_depths: Sequence[int]) -> list[DraftTree]:
        model_trees = self.inner.propose(tokens, max_depths)
        lookup_trees = self.context.propose(tokens, max_depths)
        payoff, out = self.payoff, []
        for b, (model_tree, lookup_tree) in enumerate(zip(model_trees, lookup_trees, strict=True)):
            payoff.proposed(b, len(tokens[b]), lookup_tree)
            out.append(graft(model_tree, lookup_tree, self.budget) if payoff.wanted(b) else model_tree)
        return out
