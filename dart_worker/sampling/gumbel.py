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
Vocabulary-sized noise costs many times a softmax over the row on a CPU (docs/benchmarks.md, issue
#48); this reads the row in two reductions and draws ~1.3k noise values.
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
# ... among the tokens of this many blocks, those of the largest maxima (`gumbel_sample_threshold`).
ALONE_BLOCKS = 8
# ... and of those at most this many, the heaviest (`gumbel_sample_threshold`).
ALONE_TOKENS = 64


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
    partition of the vocabulary that the row's weights decide. Among the tokens whose weight
    exceeds `alone_above` of their row's sum and that lie in one of the row's ALONE_BLOCKS blocks of
    GUMBEL_BLOCK ids with the largest maxima, the ALONE_TOKENS heaviest are each a cell of their
    own; every other token lies in its block (a vocabulary smaller than a block is one block). The winning cell is
    argmax(log mass + noise) (a token's noise from the token stream, a block's from the block
    stream); when a block wins, its token is argmax(log w_i + g_i) over the block's tokens outside
    the cells of their own (token stream). Exact for any partition the weights alone decide: a cell
    wins with probability mass / W, a token inside a block with w_i / mass. Zero-weight tokens are
    never drawn (log 0).

    Every shape is fixed by R and V: no step asks the device how many heavy tokens a row has (a
    `nonzero` would wait for it, on a GPU a synchronisation per draw; tests/test_round_syncs.py).
    Two reductions cross the whole vocabulary (block sums and block maxima); the ALONE_BLOCKS
    blocks with the largest maxima (all the blocks holding heavy tokens, unless they are more) are
    read again for their heavy tokens, and the winning block for the draw inside it: token noise
    for ALONE_TOKENS + GUMBEL_BLOCK ids a row. A heavy token beyond those caps is drawn through its
    block: exact still, only a drafter reading token noise (dart_worker.drafters.coupling) no
    longer predicts it."""
    rows, vocab = weights.shape
    device = weights.device
    width = min(GUMBEL_BLOCK, vocab)  # a vocabulary smaller than a block is one block of its own size
    blocks = -(-vocab // width)
    short = blocks * width - vocab  # a partial last block is padded with zeros (never drawn)
    by_block = (torch.nn.functional.pad(weights, (0, short)) if short else weights).reshape(rows, blocks, width)
    mass = by_block.sum(dim=-1)
    limit = mass.sum(dim=-1, keepdim=True) * alone_above  # [R, 1]
    ids = torch.arange(width, device=device)
    rows_index = torch.arange(rows, device=device)
    candidates = by_block.amax(dim=-1).topk(min(ALONE_BLOCKS, blocks), dim=-1).indices  # [R, F]
    inside = by_block[rows_index[:, None], candidates]  # [R, F, width]
    # The cells of their own: the ALONE_TOKENS heaviest tokens above the limit in those blocks.
    heavy = inside.masked_fill(inside <= limit[:, :, None], 0.0).reshape(rows, -1)
    alone_weight, at = heavy.topk(min(ALONE_TOKENS, heavy.shape[1]), dim=-1)  # weight 0: not a cell
    alone = torch.zeros_like(heavy, dtype=torch.bool).scatter(1, at, alone_weight > 0).view(inside.shape)
    mass = mass.scatter(1, candidates, inside.masked_fill(alone, 0.0).sum(dim=-1))  # the blocks' rest
    block_noise = gumbel_noise(block_seeds, torch.arange(blocks, device=device))
    block_score, block = (mass.double().log() + block_noise).max(dim=-1)
    columns = block[:, None] * width + ids
    chosen = by_block[rows_index, block]  # [R, width]
    alone_in_chosen = (alone & (candidates == block[:, None])[:, :, None]).any(dim=1)
    chosen = chosen.masked_fill(alone_in_chosen, 0.0).double()
    in_block = columns.gather(1, (chosen.log() + gumbel_noise(token_seeds, columns)).argmax(dim=-1, keepdim=True))[:, 0]
    alone_ids = candidates.gather(1, at // width) * width + at % width  # [R, ALONE_TOKENS]
    alone_scores = alone_weight.double().log() + gumbel_noise(token_seeds, alone_ids)  # log 0: no cell
    best, pick = alone_scores.max(dim=-1)
    return torch.where(best >= block_score, alone_ids.gather(1, pick[:, None])[:, 0], in_block)
