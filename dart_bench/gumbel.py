"""The partitioned Gumbel-max draw with a top-64 partition and the drafter's top-k guesses that
`jobs.bench coupling` compares couplings with (issue #48). The engine's sampler and its noise
generator live in dart_worker.sampling.gumbel (the threshold draw); this module adds only what
the benchmark alone uses, over that module's noise (read through the module, so a test that
changes its block size changes both draws)."""

from __future__ import annotations

import torch

from dart_worker.sampling import gumbel as engine_gumbel
from dart_worker.sampling.gumbel import (  # noqa: F401  (re-exported for the benchmark)
    ALONE_ABOVE,
    BLOCK_STREAM,
    GUMBEL_BLOCK,
    TOKEN_STREAM,
    gumbel_noise,
    gumbel_sample_threshold,
    noise_bits,
    pair_gumbel_noise,
    row_seeds,
)

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
    block_size, noise = engine_gumbel.GUMBEL_BLOCK, engine_gumbel.gumbel_noise
    singles = min(singles, vocab)
    tail = weights
    if singles:
        single_w, single_ids = weights.topk(singles, dim=-1)
        tail = weights.scatter(1, single_ids, 0.0)
    blocks = -(-vocab // block_size)
    full = vocab - vocab % block_size
    sums = [tail[:, :full].reshape(rows, -1, block_size).sum(dim=-1)] if full else []
    if full < vocab:
        sums.append(tail[:, full:].sum(dim=-1, keepdim=True))
    mass = torch.cat(sums, dim=-1).double()
    block_score, block = (mass.log() + noise(block_seeds, torch.arange(blocks, device=device))).max(dim=-1)
    columns = block[:, None] * block_size + torch.arange(block_size, device=device)
    inside = torch.where(columns < vocab, tail.gather(1, columns.clamp(max=vocab - 1)), 0.0).double()
    in_block = columns.gather(1, (inside.log() + noise(token_seeds, columns)).argmax(dim=-1, keepdim=True))[:, 0]
    if not singles:
        return in_block
    single_score, best = (single_w.double().log() + noise(token_seeds, single_ids)).max(dim=-1)
    return torch.where(single_score >= block_score, single_ids.gather(1, best[:, None])[:, 0], in_block)


def coupled_candidates(log_q: torch.Tensor, ids: torch.Tensor, token_seeds: torch.Tensor,
                       k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's guess at the target's `gumbel_sample` draw: of its candidates (target ids `ids`
    [R, n] with log-probabilities `log_q` [R, n], typically its top tokens), the k best by
    log q + g under the token noise of the row's position (`token_seeds` [R]). Returns (ids, their
    log q) [R, k], best first. Where q names the target's heavy tokens with probabilities close to
    p's, the best is the target's draw with probability near 1 - TV(p, q); its tail is ignored (a
    draw from the tail is rarely anyone's guess)."""
    scores = log_q.double() + engine_gumbel.gumbel_noise(token_seeds, ids)
    best = scores.topk(min(k, ids.shape[-1]), dim=-1).indices
    return ids.gather(1, best), log_q.gather(1, best)
