"""The grammar as a drafter: a structured-output request's tree, shaped by its grammar.

Grafted into every mode's trees by the engine (as the lookup tree is grafted into a head's), for
the requests that carry a constraint:

- drafts the grammar forbids are cut: verification draws from masked rows, so such a node can
  never be accepted and would only cost its row in the verify forward;
- the text the grammar allows alone after each leaf of what is left (`{"name": "` at the start,
  `", "age": ` after a drafted value, a closing `"}`), or after the committed text when nothing is
  left, enters the tree as a chain of nodes each scored as its leaf (its own step is certain) and
  marked `SOURCE_GRAMMAR`, whose acceptance the cost model learns as its own source.

`ar` gets neither graft (`Drafter.speculates`): it stays plain decoding, the baseline.
"""

from __future__ import annotations

from collections.abc import Sequence

from dart_worker.sampling.grammar import GrammarState
from ngram_native.trees import DraftTree


def constrain_trees(trees: Sequence[DraftTree], grammars: Sequence[GrammarState | None], caps: Sequence[int], *,
                    draft_forced: bool) -> list[DraftTree]:
    """Each constrained sequence's tree cut to what its grammar allows, with its forced text grafted
    in (`draft_forced`; no deeper than caps[b]); unconstrained sequences' trees as they are."""
    out = []
    for tree, grammar, cap in zip(trees, grammars, caps, strict=True):
        if grammar is not None:
            tree = grammar.shape(tree, cap, FORCED_NODES + tree.size) if draft_forced else grammar.cut(tree)
        out.append(tree)
    return out


# Forced nodes a round may add to a tree, beyond one per node it already has (a record's forced text
# between two values is a few tokens; the cost model then sizes the tree as a whole).
FORCED_NODES = 16
