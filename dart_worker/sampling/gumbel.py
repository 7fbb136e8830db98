"""The engine's sampler (issue #48): exact Gumbel-max draws with counter-based noise.

A sampled token is argmax_i(log p_i + g_i) with g standard Gumbel noise that belongs to the
token's position: distributed exactly as p, and a deterministic function of (p, noise). A drafter
told the noise of the positions it drafts (`dart_worker.drafters.base.Dice`) can rank its own
candidates the same way (`dart_worker.drafters.coupling.GumbelCoupler`) and so name the token the
target will draw about as often as greedy drafting names the argmax; the inverse-CDF draw this
replaced could not be exploited so (docs/benchmarks.md, issue #48).

The noise: a row of the draw at generated index t has a 64-bit seed per *stream* (`row_seeds`:
splitmix64 of (key, t, stream), the key `params.request_key`), and element i of that row (a token,
or a block of GUMBEL_BLOCK tokens) the i-th output of the splitmix64 generator started there,
mix(seed + (i + 1) * golden): a function of (key, t, stream, i) alone, computed with int64 torch
ops on whatever device holds the logits (`gumbel_noise`; numpy's `params._splitmix64` is its
reference). So every device gives the same bits, the seeds are one small upload and no
vocabulary-sized array crosses to or from the host.

The draw (`gumbel_sample_threshold`): Gumbel-max over a partition of the vocabulary that the
weights decide - each token above 1/256 of its row's mass a cell of its own (token noise), the
rest in blocks of GUMBEL_BLOCK ids (block noise for the block, then token noise inside it).
Vocabulary-sized noise would cost 20-37 ms a row on a 2-core CPU; this reads the row in two
reductions and draws ~1.3k noise values.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dart_worker.sampling.params import _GOLDEN, _U64, _splitmix64

# Names the draw a seed's text depends on: saved sampled text (the replay benchmarks' cached replies)
# is reused only under the sampler that drew it. Before #48 the draw was the inverse CDF.
SAMPLER = "gumbel-threshold"
TOKEN_STREAM = 0  # noise of tokens
BLOCK_STREAM = 1  # noise of blocks of GUMBEL_BLOCK tokens
GUMBEL_BLOCK = 1024
# Tokens drawn as cells of their own: those above this share of their row's mass (at most
# 1 / ALONE_ABOVE of them).
ALONE_ABOVE = 1.0 / 256


def _signed64(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it (two's complement)."""
    value &= 2**64 - 1
    return value - 2**64 if value >= 2**63 else value


_GOLDEN_I64 = _signed64(0x9E3779B97F4A7C15)
_MIX1_I64 = _signed64(0xBF58476D1CE4E5B9)
_MIX2_I64 = _signed64(0x94D049BB133111EB)
_STREAM_SALT = (0x0, 0xB10C_B10C_B10C_B10C)


def row_seeds(key: int | np.ndarray, positions: np.ndarray | Sequence[int], stream: int = TOKEN_STREAM) -> np.ndarray:
    """The int64 seeds (host, one per row) of the noise rows of generated indices `positions`.
    `key`: one request's key, or a uint64 array of one key per position (the rows of several
    requests in one pass: verification draws a whole batch's rows at once)."""
    t = np.asarray(positions, dtype=np.int64).astype(_U64)
    salt = _U64(_STREAM_SALT[stream])
    keys = key.astype(_U64) if isinstance(key, np.ndarray) else _U64(key & (2**64 - 1))
    with np.errstate(over="ignore"):
        bits = _splitmix64(_splitmix64(t * _GOLDEN + _U64(3)) ^ (keys ^ salt))
    return np.asarray(bits).view(np.int64)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors (products wrap modulo 2**64, as in C)."""
    z = (z ^ _shift_right(z, 30)) * _MIX1_I64
    z = (z ^ _shift_right(z, 27)) * _MIX2_I64
    return z ^ _shift_right(z, 31)


def noise_bits(seeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 bits of element ids[r, j] (or ids[j]) of noise row r: mix(seeds[r] + (id + 1) * golden)."""
    ids = ids.to(torch.int64)
    return _mix(seeds.to(torch.int64)[:, None] + (ids + 1) * _GOLDEN_I64)


def _gumbel(bits: torch.Tensor) -> torch.Tensor:
    u = (_shift_right(bits, 11).double() + 0.5) * (1.0 / (1 << 53))  # 53 bits, in (0, 1)
    return -torch.log(-torch.log(u))


def gumbel_noise(seeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise (float64) of elements `ids` ([R, n] or [n]) of rows with `seeds` [R]."""
    return _gumbel(noise_bits(seeds, ids))


def pair_gumbel_noise(seeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise of element ids[j] of the row with seed seeds[j] (both [n]): the same
    value `gumbel_noise` gives that (row, id)."""
    return _gumbel(_mix(seeds.to(torch.int64) + (ids.to(torch.int64) + 1) * _GOLDEN_I64))


def gumbel_sample_threshold(weights: torch.Tensor, token_seeds: torch.Tensor, block_seeds: torch.Tensor,
                            alone_above: float = ALONE_ABOVE) -> torch.Tensor:
    """One draw per row of `weights` [R, V] (unnormalised, >= 0, positive sum): Gumbel-max over a
    partition of the vocabulary that the row's weights decide. The tokens whose weight exceeds
    `alone_above` of their row's sum are each a cell of their own (at most 1 / alone_above of
    them), the rest lie in blocks of GUMBEL_BLOCK ids (a vocabulary smaller than that: one block).
    The winning cell is argmax(log mass + noise)
    (a token's noise from the token stream, a block's from the block stream); when a block wins,
    its token is argmax(log w_i + g_i) over the block's tokens outside the heavy ones (token
    stream). Exact for any partition the weights alone decide: a cell wins with probability
    mass / W, a token inside a block with w_i / mass. Zero-weight tokens are never drawn (log 0).

    Two reductions cross the whole vocabulary (block sums and block maxima); only the blocks whose
    maximum is above the threshold (the ones holding heavy tokens: at most 1 / alone_above of them,
    usually a few) are read again, to find those tokens and their blocks' remaining mass, and the
    winning block's ids for the draw inside it. An elementwise compare or a `nonzero` over the
    vocabulary costs several times a reduction on a CPU (docs/benchmarks.md)."""
    rows, vocab = weights.shape
    device = weights.device
    width = min(GUMBEL_BLOCK, vocab)  # a vocabulary smaller than a block is one block of its own size
    blocks = -(-vocab // width)
    short = blocks * width - vocab  # a partial last block is padded with zeros (never drawn)
    by_block = (torch.nn.functional.pad(weights, (0, short)) if short else weights).reshape(rows, blocks, width)
    mass = by_block.sum(dim=-1)
    limit = mass.sum(dim=-1) * alone_above  # [R]
    flagged_row, flagged_block = (by_block.amax(dim=-1) > limit[:, None]).nonzero(as_tuple=True)
    ids = torch.arange(width, device=device)
    if len(flagged_row):
        inside = by_block[flagged_row, flagged_block]  # [F, width]
        heavy = inside > limit[flagged_row, None]
        mass = mass.index_put((flagged_row, flagged_block), inside.masked_fill(heavy, 0.0).sum(dim=-1))
    block_noise = gumbel_noise(block_seeds, torch.arange(blocks, device=device))
    block_score, block = (mass.double().log() + block_noise).max(dim=-1)
    columns = block[:, None] * width + ids
    chosen = by_block[torch.arange(rows, device=device), block]  # [R, width]
    chosen = chosen.masked_fill(chosen > limit[:, None], 0.0).double()
    in_block = columns.gather(1, (chosen.log() + gumbel_noise(token_seeds, columns)).argmax(dim=-1, keepdim=True))[:, 0]
    if not len(flagged_row):
        return in_block
    member, column = heavy.nonzero(as_tuple=True)
    row = flagged_row[member]
    token = flagged_block[member] * width + column
    score = inside[member, column].double().log() + pair_gumbel_noise(token_seeds.to(device)[row], token)
    best = torch.full((rows,), -torch.inf, dtype=torch.float64, device=device).scatter_reduce(0, row, score, "amax")
    winner = score == best[row]
    single = torch.full((rows,), -1, dtype=torch.int64, device=device).scatter_reduce(
        0, row[winner], token[winner], "amax")
    return torch.where(best >= block_score, single, in_block)
