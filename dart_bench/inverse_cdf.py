"""The sampler before issue #48, kept for `jobs.bench coupling`'s comparison only: every sampled
token was the inverse-CDF draw of one uniform per position (`position_uniforms`, a counter-based
hash of (key, t)) from the warped distribution (`inverse_cdf_sample`). The engine now draws with
Gumbel-max (dart_worker.sampling.gumbel), which a drafter can couple to; the inverse CDF runs in
token-id order, so a drafter reading the same uniform gained nothing (docs/benchmarks.md, #48)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dart_worker.sampling.params import _GOLDEN, _U64, _splitmix64


def position_uniforms(key: int | np.ndarray, positions: np.ndarray | Sequence[int]) -> np.ndarray:
    """u_t in [0, 1) (float64, 53 random bits) for every generated-token index t in `positions`:
    splitmix64 of (key, t), a counter-based generator (as in Philox or JAX's threefry keys), so
    any position's uniform is available in any order, independent of every other position's.
    `key`: one request's key, or a uint64 array of one key per position (the rows of several
    requests in one pass: verification draws a whole batch's rows at once)."""
    t = np.asarray(positions, dtype=np.int64).astype(_U64)
    keys = key.astype(_U64) if isinstance(key, np.ndarray) else _U64(key & (2**64 - 1))
    with np.errstate(over="ignore"):
        bits = _splitmix64(_splitmix64(t * _GOLDEN + _U64(1)) ^ keys)
    return (bits >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))



# Tokens per block of the two-level inverse-CDF draw (`inverse_cdf_sample`).
_CDF_BLOCK = 1024


def inverse_cdf_sample(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row of `weights` [R, V] (unnormalised, >= 0, positive sum) from uniforms [R].

    The first token whose cumulative weight exceeds u * total (see below for the rounding): what
    torch.multinomial does for one sample, but for every row at once with each row's own uniform.
    Tokens of weight 0 own an empty interval, so they are never drawn; should rounding push
    u * total to the very end, the last token of positive weight is taken.

    In two levels, so the whole row is read once (block sums) instead of being copied to float64
    and scanned several times (over a 262k vocabulary that was most of a sampled round's
    non-model time on a CPU): pick the block of `_CDF_BLOCK` tokens whose cumulative mass
    crosses u * total, then the token inside it.
    """
    rows, vocab = weights.shape
    device = weights.device
    full = vocab - vocab % _CDF_BLOCK
    # Block sums in the weights' dtype (a float64 reduction over [16, 262k] is many times dearer
    # than the float32 one on a CPU), accumulated in float64: a block's sum is off by float32 rounding
    # of its own mass at most, which moves the odds of a draw by as little as the float32
    # probabilities themselves are exact.
    sums = [weights[:, :full].reshape(rows, -1, _CDF_BLOCK).sum(dim=-1)] if full else []
    if full < vocab:
        sums.append(weights[:, full:].sum(dim=-1, keepdim=True))
    block_cdf = torch.cat(sums, dim=-1).double().cumsum(dim=-1)
    total = block_cdf[:, -1:].contiguous()
    target = uniforms[:, None] * total
    # The crossing block, or the last block of positive mass (the first to reach the total).
    # (The clamps only matter for non-finite weights, which the caller reports after the draw.)
    block = torch.minimum(torch.searchsorted(block_cdf, target, right=True),
                          torch.searchsorted(block_cdf, total, right=False)).clamp(max=block_cdf.shape[-1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    # A vocabulary within one block is scanned at its own width, not padded out to a whole block.
    width = min(_CDF_BLOCK, vocab)
    columns = block * _CDF_BLOCK + torch.arange(width, device=device)
    inside = torch.where(columns < vocab, weights.gather(1, columns.clamp(max=vocab - 1)), 0.0)
    cdf = before + inside.double().cumsum(dim=-1)
    # Rounding between the two levels can leave u * total past the block's own cumulative end:
    # then the block's last token of positive weight, as at the end of the row.
    offset = torch.minimum(torch.searchsorted(cdf, target, right=True),
                           torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)).clamp(max=width - 1)
    return (columns.gather(1, offset))[:, 0]

