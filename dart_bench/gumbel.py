"""Gumbel-max noise and the partitioned Gumbel-max draw that `jobs.bench coupling` measures
couplings with (issue #48). Not the engine's sampler: switching it was measured and reverted
(docs/benchmarks.md), so this lives with the benchmark, over the engine's own counter-based
generator (dart_worker.sampling.params's splitmix64)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dart_worker.sampling.params import _GOLDEN, _U64, _splitmix64

# The same counter-based generator as `position_uniforms`, one level further: a row of the draw at
# generated index t has a 64-bit seed per *stream* (`row_seeds`: splitmix64 of (key, t, stream)),
# and token (or block) i of that row the i-th output of the splitmix64 generator started there,
# mix(seed + (i + 1) * golden) - a function of (key, t, stream, i) alone, computed with int64
# torch ops on whatever device holds the logits (`gumbel_noise`; numpy's `_splitmix64` is its
# reference), so the same bits on every device and no vocabulary-sized host transfer.
TOKEN_STREAM = 0  # noise of tokens
BLOCK_STREAM = 1  # noise of blocks of GUMBEL_BLOCK tokens (the two-level draw)
GUMBEL_BLOCK = 1024


def _signed64(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it (two's complement)."""
    value &= 2**64 - 1
    return value - 2**64 if value >= 2**63 else value


_GOLDEN_I64 = _signed64(0x9E3779B97F4A7C15)
_MIX1_I64 = _signed64(0xBF58476D1CE4E5B9)
_MIX2_I64 = _signed64(0x94D049BB133111EB)
_STREAM_SALT = (0x0, 0xB10C_B10C_B10C_B10C)


def row_seeds(key: int, positions: np.ndarray | Sequence[int], stream: int = TOKEN_STREAM) -> np.ndarray:
    """The int64 seeds of the noise rows of generated indices `positions` (host, one per row)."""
    t = np.asarray(positions, dtype=np.int64).astype(_U64)
    salt = _U64((key ^ _STREAM_SALT[stream]) & (2**64 - 1))
    with np.errstate(over="ignore"):
        bits = _splitmix64(_splitmix64(t * _GOLDEN + _U64(3)) ^ salt)
    return bits.view(np.int64)


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


def gumbel_noise(seeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise (float64) of elements `ids` ([R, n] or [n]) of rows with `seeds` [R]:
    -log(-log(u)), u = (53 bits + 1/2) / 2**53 in (0, 1)."""
    u = (_shift_right(noise_bits(seeds, ids), 11).double() + 0.5) * (1.0 / (1 << 53))
    return -torch.log(-torch.log(u))


# Tokens drawn as themselves in the partitioned draw (`gumbel_sample`): each row's most probable ones.
GUMBEL_SINGLES = 64


def gumbel_sample(weights: torch.Tensor, token_seeds: torch.Tensor, block_seeds: torch.Tensor,
                  singles: int = GUMBEL_SINGLES) -> torch.Tensor:
    """One draw per row of `weights` [R, V] (unnormalised, >= 0, positive sum): Gumbel-max over a
    partition of the vocabulary that the row's weights decide.

    The cells are the row's `singles` heaviest tokens, each alone, and the rest in blocks of
    GUMBEL_BLOCK consecutive ids. The cell is argmax(log mass + noise) (a single token's noise from
    the token stream, a block's from the block stream), and when a block wins, its token is
    argmax(log w_i + g_i) over the block's tokens outside the singles (token stream). Exact for any
    partition that depends on the weights alone: the cell wins with probability mass / W, the token
    within it with w_i / mass. A drafter whose q names the same likely tokens gets the same noise
    for them (`coupled_candidates`), so wherever p and q share their heavy tokens this is Gumbel-max
    coupling itself (agreement near 1 - TV(p, q)); the tail, rarely drawn by both, is coupled
    through its blocks. Vocabulary-sized noise would cost 20-37 ms a row on a 2-core CPU
    (docs/benchmarks.md); this needs singles + V / GUMBEL_BLOCK + GUMBEL_BLOCK values a row.
    Zero-weight tokens and cells are never drawn (log 0 = -inf)."""
    rows, vocab = weights.shape
    device = weights.device
    singles = min(singles, vocab)
    tail = weights
    if singles:
        single_w, single_ids = weights.topk(singles, dim=-1)
        tail = weights.scatter(1, single_ids, 0.0)
    blocks = -(-vocab // GUMBEL_BLOCK)
    full = vocab - vocab % GUMBEL_BLOCK
    sums = [tail[:, :full].reshape(rows, -1, GUMBEL_BLOCK).sum(dim=-1)] if full else []
    if full < vocab:
        sums.append(tail[:, full:].sum(dim=-1, keepdim=True))
    mass = torch.cat(sums, dim=-1).double()
    block_score, block = (mass.log() + gumbel_noise(block_seeds, torch.arange(blocks, device=device))).max(dim=-1)
    columns = block[:, None] * GUMBEL_BLOCK + torch.arange(GUMBEL_BLOCK, device=device)
    inside = torch.where(columns < vocab, tail.gather(1, columns.clamp(max=vocab - 1)), 0.0).double()
    in_block = columns.gather(1, (inside.log() + gumbel_noise(token_seeds, columns)).argmax(dim=-1, keepdim=True))[:, 0]
    if not singles:
        return in_block
    single_score, best = (single_w.double().log() + gumbel_noise(token_seeds, single_ids)).max(dim=-1)
    return torch.where(single_score >= block_score, single_ids.gather(1, best[:, None])[:, 0], in_block)


def coupled_candidates(log_q: torch.Tensor, ids: torch.Tensor, token_seeds: torch.Tensor,
                       k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's guess at the target's `gumbel_sample` draw: of its candidates (target ids `ids`
    [R, n] with log-probabilities `log_q` [R, n], typically its top tokens), the k best by
    log q + g under the token noise of the row's position (`token_seeds` [R]). Returns (ids, their
    log q) [R, k], best first. Where q names the target's heavy tokens with probabilities close to
    p's, the best is the target's draw with probability near 1 - TV(p, q); its tail is ignored (a
    draw from the tail is rarely anyone's guess)."""
    scores = log_q.double() + gumbel_noise(token_seeds, ids)
    best = scores.topk(min(k, ids.shape[-1]), dim=-1).indices
    return ids.gather(1, best), log_q.gather(1, best)


# Tokens drawn as themselves in the threshold draw (`gumbel_sample_threshold`): those above this
# share of their row's mass (at most 1 / ALONE_ABOVE of them).
ALONE_ABOVE = 1.0 / 256


def pair_gumbel_noise(seeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise of element ids[j] of the row with seed seeds[j] (both [n]): the same
    value `gumbel_noise` gives that (row, id)."""
    bits = _mix(seeds.to(torch.int64) + (ids.to(torch.int64) + 1) * _GOLDEN_I64)
    u = (_shift_right(bits, 11).double() + 0.5) * (1.0 / (1 << 53))
    return -torch.log(-torch.log(u))


def gumbel_sample_threshold(weights: torch.Tensor, token_seeds: torch.Tensor, block_seeds: torch.Tensor,
                            alone_above: float = ALONE_ABOVE) -> torch.Tensor:
    """`gumbel_sample` with the heavy cells found without a top-k: the tokens whose weight exceeds
    `alone_above` of their row's sum are each a cell of their own (at most 1 / alone_above of
    them), the rest lie in blocks of GUMBEL_BLOCK ids. The partition depends on the weights alone,
    so the draw is exact for the same reason (a cell wins with probability mass / W, a token
    inside a block with w_i / mass).

    Two reductions cross the whole vocabulary (block sums and block maxima); only the blocks whose
    maximum is above the threshold (the ones holding heavy tokens: at most 1 / alone_above of them,
    usually a few) are read again, to find those tokens and their blocks' remaining mass, and the
    winning block's ids for the draw inside it. An elementwise compare or a `nonzero` over the
    vocabulary costs several times a reduction on a CPU (docs/benchmarks.md)."""
    rows, vocab = weights.shape
    device = weights.device
    blocks = -(-vocab // GUMBEL_BLOCK)
    short = blocks * GUMBEL_BLOCK - vocab  # a partial last block is padded with zeros (never drawn)
    by_block = (torch.nn.functional.pad(weights, (0, short)) if short else weights).reshape(rows, blocks, GUMBEL_BLOCK)
    mass = by_block.sum(dim=-1)
    limit = mass.sum(dim=-1) * alone_above  # [R]
    flagged_row, flagged_block = (by_block.amax(dim=-1) > limit[:, None]).nonzero(as_tuple=True)
    ids = torch.arange(GUMBEL_BLOCK, device=device)
    if len(flagged_row):
        inside = by_block[flagged_row, flagged_block]  # [F, GUMBEL_BLOCK]
        heavy = inside > limit[flagged_row, None]
        mass = mass.index_put((flagged_row, flagged_block), inside.masked_fill(heavy, 0.0).sum(dim=-1))
    block_noise = gumbel_noise(block_seeds, torch.arange(blocks, device=device))
    block_score, block = (mass.double().log() + block_noise).max(dim=-1)
    columns = block[:, None] * GUMBEL_BLOCK + ids
    chosen = by_block[torch.arange(rows, device=device), block]  # [R, GUMBEL_BLOCK]
    chosen = chosen.masked_fill(chosen > limit[:, None], 0.0).double()
    in_block = columns.gather(1, (chosen.log() + gumbel_noise(token_seeds, columns)).argmax(dim=-1, keepdim=True))[:, 0]
    if not len(flagged_row):
        return in_block
    member, column = heavy.nonzero(as_tuple=True)
    row = flagged_row[member]
    token = flagged_block[member] * GUMBEL_BLOCK + column
    score = inside[member, column].double().log() + pair_gumbel_noise(token_seeds.to(device)[row], token)
    best = torch.full((rows,), -torch.inf, dtype=torch.float64, device=device).scatter_reduce(0, row, score, "amax")
    winner = score == best[row]
    single = torch.full((rows,), -1, dtype=torch.int64, device=device).scatter_reduce(
        0, row[winner], token[winner], "amax")
    return torch.where(best >= block_score, single, in_block)
