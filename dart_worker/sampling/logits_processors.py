"""The one seam through which a request changes its distributions: per-request logits processors,
applied to every tree row by that row's own path.

A request's next-token distribution is the target's logits changed by what the request asks for,
in vLLM's order: the grammar's mask (tokens a structured-output constraint forbids get -inf),
then the penalties (which count the tokens before the row), then the warp (temperature, min-p,
top-k, top-p: `sampling.warp_logits_to_probs`, shared by requests with equal settings). In a
draft tree every row predicts a different position after a different path, so each of these is a
function of the row's node: the grammar's state after the node's ancestors, the penalties' counts
including them. Verification, the first token after a prefill and the reported logprobs all read
rows through `controlled_logits`, so a row is always changed exactly as plain decoding would
change it at that position, which keeps every drafter lossless.

`RowControls` holds what one request brings to a round; `PROCESSORS` is the chain, each a batched
function over the rows of many requests (one gather and scatter per kind, not one per row). A new
control is one more processor here and one more field of `RowControls`; the round does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dart_worker.sampling.params import SamplingParams, TokenHistory, apply_penalties

# One request's rows in a call: (its tree, its controls, the nodes of the rows: -1 = the root).
RequestRows = tuple[object, "RowControls", np.ndarray]


@dataclass(frozen=True)
class RowControls:
    """What changes one request's logits this round.

    params: its sampling settings (the penalties' strengths; the warp is applied after the chain).
    history: its committed tokens (prompt and generated), which the penalties count; None when it
    has no penalties. masks: its grammar's allowed tokens per row of this round's tree, an int32
    bitmask [N + 1, ceil(V / 32)] (row 0 = the root, i + 1 = node i; `grammar.GrammarState.masks`),
    or None when it is unconstrained.
    """

    params: SamplingParams
    history: TokenHistory | None = None
    masks: torch.Tensor | None = None

    @property
    def changes_logits(self) -> bool:
        return self.masks is not None or self.params.has_penalties


def controlled_logits(rows_logits: torch.Tensor, requests: Sequence[RequestRows]) -> torch.Tensor:
    """`rows_logits` [R, V] (the rows of `requests`, in order: request k's len(nodes_k) rows) with
    every processor of the chain applied; the input itself when no request changes its logits."""
    if not any(controls.changes_logits for _, controls, _ in requests):
        return rows_logits
    out = rows_logits
    for processor in PROCESSORS:
        out = processor(out, requests)
    return out


def mask_by_grammar(rows_logits: torch.Tensor, requests: Sequence[RequestRows]) -> torch.Tensor:
    """Forbidden tokens to -inf, each row by its own node's grammar state (a float32 copy; rows of
    unconstrained requests unchanged). One bitmask for all rows, applied in one call."""
    if not any(controls.masks is not None for _, controls, _ in requests):
        return rows_logits
    import xgrammar

    width = next(c.masks.shape[-1] for _, c, _ in requests if c.masks is not None)
    bitmask = torch.full((rows_logits.shape[0], width), -1, dtype=torch.int32)  # -1: every token allowed
    offset = 0
    for _, controls, nodes in requests:
        if controls.masks is not None:
            bitmask[offset : offset + len(nodes)] = controls.masks[torch.as_tensor(np.asarray(nodes, np.int64) + 1)]
        offset += len(nodes)
    out = rows_logits.float().clone()
    xgrammar.apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True), vocab_size=out.shape[-1])
    return out


def penalise(rows_logits: torch.Tensor, requests: Sequence[RequestRows]) -> torch.Tensor:
    """Each request's penalties, every row counting the committed output plus its own path
    (`sampling.apply_penalties`); unchanged when no request has penalties."""
    if not any(controls.params.has_penalties for _, controls, _ in requests):
        return rows_logits
    row_params, row_histories, row_paths = [], [], []
    for tree, controls, nodes in requests:
        if controls.params.has_penalties and controls.history is None:
            raise ValueError("a request with penalties needs its token history")
        paths = path_tokens(tree, nodes)
        row_params += [controls.params] * len(paths)
        row_histories += [controls.history] * len(paths)
        row_paths += paths
    return apply_penalties(rows_logits, row_params, row_histories, row_paths)


def path_tokens(tree, nodes: Sequence[int] | np.ndarray) -> list[list[int]]:
    """For each node (-1 = the root) the tokens from the root down to it, itself included: what a
    row generates after the committed text (empty for the root's row)."""
    parents = np.asarray(tree.parents).tolist()
    tokens = np.asarray(tree.tokens).tolist()
    out = []
    for node in np.asarray(nodes).tolist():
        path = []
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        out.append(path[::-1])
    return out


# The chain, in vLLM's order: the grammar's mask first (penalties never revive a forbidden token:
# -inf stays -inf), then the penalties. The warp follows in verification.
PROCESSORS: tuple[Callable[[torch.Tensor, Sequence[RequestRows]], torch.Tensor], ...] = (mask_by_grammar, penalise)
