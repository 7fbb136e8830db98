"""The draft head's reduced vocabulary and its map into the target's ids.

A DART head predicts over the target's most frequent tokens only (its `draft_vocab_size`); `d2t`
maps a draft id to its target id (target_id = draft_id + d2t[draft_id], as in EAGLE-3/DART) and
`t2d` marks the target ids the draft vocabulary keeps. Built for a new head, checked for a loaded
one: a map that sends two draft ids to one target id, or outside the target's vocabulary, would
make drafts the target can never accept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def make_d2t(kept_target_ids: Sequence[int] | torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """d2t for a reduced draft vocabulary: target_id = draft_id + d2t[draft_id].

    `kept_target_ids` are the target ids the draft vocabulary keeps (typically the most frequent
    ones, in any order). As in EAGLE-3/DART, draft ids follow ascending target id, so d2t[i] =
    sorted(kept)[i] - i.
    """
    kept = torch.as_tensor(kept_target_ids, dtype=torch.long).flatten()
    if kept.numel() == 0:
        raise ValueError("kept_target_ids is empty")
    kept = kept.sort().values
    if bool((kept[1:] == kept[:-1]).any()):
        raise ValueError("kept_target_ids contains duplicates")
    if int(kept[0]) < 0 or (vocab_size is not None and int(kept[-1]) >= vocab_size):
        raise ValueError(f"kept_target_ids must lie in [0, {vocab_size}), got {int(kept[0])}..{int(kept[-1])}")
    return kept - torch.arange(kept.numel())


def make_t2d(kept_target_ids: Sequence[int] | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d: a bool mask over the target vocabulary, True for ids the draft vocabulary keeps."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.as_tensor(kept_target_ids, dtype=torch.long)] = True
    return t2d


def check_d2t(d2t: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> str | None:
    """Why `d2t` is not a valid injective map of the draft vocabulary into the target's, or None."""
    if d2t.dtype.is_floating_point or d2t.dtype.is_complex or d2t.dtype == torch.bool:
        return f"d2t must hold integers, found dtype {d2t.dtype}"
    if tuple(d2t.shape) != (draft_vocab_size,):
        return f"d2t must have shape ({draft_vocab_size},), found {tuple(d2t.shape)}"
    target_ids = torch.arange(draft_vocab_size, device=d2t.device) + d2t.long()
    low, high = int(target_ids.min()), int(target_ids.max())
    if low < 0 or high >= vocab_size:
        return (f"d2t maps draft ids to target ids {low}..{high}, outside the target vocabulary "
                f"[0, {vocab_size})")
    if target_ids.unique().numel() != draft_vocab_size:
        return "d2t maps two draft ids to the same target id"
    return None
