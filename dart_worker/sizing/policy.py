"""The engine's sizing policy: the two calls a round makes of it, plan and learn.

A round asks its policy once to plan its trees (`plan`: whether to draft, whether to run the
drafter's model, how big each tree may be) and hands it the round's record once it has
committed (`learn`). `FixedSizing` (`decoding.sizing: fixed`) verifies the trees as the drafter
builds them and learns nothing; `TreeSizer` (`auto`) sizes them with the measured cost model
(dart_worker/sizing/sizer.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ngram_native.trees import DraftTree

if TYPE_CHECKING:
    from dart_worker.decode_round import Draft, RoundRecord


class SizingPolicy(Protocol):
    def plan(self, record: RoundRecord, draft: Draft) -> list[DraftTree]:
        """The round's trees: `draft` them (with or without the model, or not at all) and cut them."""

    def learn(self, record: RoundRecord) -> None:
        """What the round's record teaches (acceptances, the verify forward's cost, the overhead)."""


class FixedSizing:
    """Trees as the drafter builds them, its model every round; nothing to learn."""

    def plan(self, record: RoundRecord, draft: Draft) -> list[DraftTree]:
        return draft(True)

    def learn(self, record: RoundRecord) -> None:
        return None


FIXED_SIZING = FixedSizing()
