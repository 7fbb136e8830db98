"""The grammar as a drafter: a structured-output request's tree, shaped by its grammar.

Grafted into every mode's trees by the engine (as the lookup tree is grafted into a head's), for
the requests that carry a constraint:

- drafts the grammar forbids are cut: verification draws from masked rows, so such a node can
  never be accepted and would only cost its row in the verify forward;
- the text the grammar allows alone from the committed text (`{"name": "`, `", "age": `, a
  closing `"}`) enters the tree as a chain of nodes scored 0 (certain, so a merge ranks them
  first) and marked `SOURCE_GRAMMAR`, whose acceptance the cost model learns as its own source.

`ar` gets neither graft (`Drafter.speculates`): it stays plain decoding, the baseline.
"""

from __future__ import annotations

from collections.abc import Sequence

from dart_worker.grammar import GrammarState
from ngram_native.trees import DraftTree, graft


def constrain_trees(trees: Sequence[DraftTree], grammars: Sequence[GrammarState | None], caps: Sequence[int], *,
                    draft_forced: bool) -> list[DraftTree]:
    """Each constrained sequence's tree cut to what its grammar allows, with its forced text grafted
    in (`draft_forced`; no deeper than caps[b]); unconstrained sequences' trees as they are."""
    out = []
    for tree, grammar, cap in zip(trees, grammars, caps, strict=True):
        if grammar is not None:
            tree = grammar.cut(tree)
            if draft_forced:
                forced = grammar.forced_tree(cap)
                tree = graft(tree, forced, tree.size + forced.size)
        out.append(tree)
    return out
