"""Coupled drafting (issue #48): the head's per-depth logits re-ranked by the sampler's own noise.

The target's token at generated index t is argmax_i(log p_i + g_t,i) over its partition's cells
(`dart_worker.sampling.gumbel.gumbel_sample_threshold`; a heavy token's cell is itself, with the
token noise g_t,i): a deterministic function of g_t, like greedy decoding's argmax. With g_t known
(`Dice`), the head's best guess at depth d is argmax(log q_d + g_d), q_d its distribution at the
request's temperature. So a head drafter's builders get (log q_d + a g_d) / s as logits for the
sampled sequences and build exactly as for greedy decoding: DART's beam over its top-k of those
(the N-gram guidance still on top), DDTree's heap over their log-softmax, the chain's argmax.

`scale` s: how sure the head is of each coupled candidate (its error against the target's log p);
`noise_weight` a < 1 hedges towards q's own ranking (a head whose q is flatter than p). The engine's
head drafters build one from their tree settings (`TreeParams.coupling_scale`,
`coupling_noise_weight`: 0 turns coupling off). By replay on ShareGPT dev prompts, s = 1 and
a = 0.75 were best: +19% tau at T=1 budget 16 for DART, +17%
DDTree, about nothing at T=0.7 (docs/benchmarks.md, #48 twelfth session). A drafter reading the
wrong dice loses acceptance, never exactness: verification commits the target's draw whatever was
proposed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dart_worker.drafters.base import Dice
from dart_worker.hardware.transfer import to_device_packed
from dart_worker.sampling.gumbel import ALONE_ABOVE, gumbel_noise, row_seeds

# The head's tokens ranked by the dice at each depth: its 1 / ALONE_ABOVE most probable (see
# `GumbelCoupler`).
COUPLED_CANDIDATES = round(1 / ALONE_ABOVE)


class GumbelCoupler:
    """(head logits [B, D, draft vocab], the batch's `Dice`) -> the logits the builders read: for a
    sampled sequence b, (log_softmax(logits[b] / T) + a g) / s over the head's COUPLED_CANDIDATES most
    probable tokens at each depth (-inf elsewhere), g the target sampler's token noise of those
    tokens (their target ids) at positions dice.position + depth; greedy sequences (dice None or
    temperature 0) keep the head's logits. g is computed on the logits' device from one small
    upload of the rows' seeds.

    Why only the head's most probable tokens: the target draws a token by its own noise only when
    it is one of the (at most ALONE_TOKENS) heaviest tokens holding more than ALONE_ABOVE of the
    mass; the rest are drawn through their block's noise (`gumbel_sample_threshold`), which ranking
    by token noise cannot predict. So the candidates worth coupling are the tokens that may be among
    those, and the head's 1 / ALONE_ABOVE most probable hold every token above that share of its
    own mass. Over the whole draft vocabulary the noise and the ranking cost milliseconds a round on
    a CPU (16,384 ids x depths x rows of int64 hashing), the rest of the round's tree building many
    times over (docs/benchmarks.md, #48)."""

    def __init__(self, head, scale: float, noise_weight: float = 1.0):
        if not scale > 0 or not 0 <= noise_weight <= 1:
            raise ValueError(f"scale must be > 0 and noise_weight in [0, 1], got {scale} and {noise_weight}")
        self.head, self.scale, self.noise_weight = head, float(scale), float(noise_weight)

    def __call__(self, logits: torch.Tensor, dice: Sequence[Dice | None]) -> torch.Tensor:
        sampled = [b for b, d in enumerate(dice) if d is not None and d.temperature > 0]
        if not sampled:
            return logits
        device = logits.device
        depth, vocab = logits.shape[1], logits.shape[-1]
        keys = np.repeat(np.asarray([dice[b].key for b in sampled], dtype=np.uint64), depth)
        positions = np.concatenate([dice[b].position + np.arange(depth) for b in sampled])
        seeds, temperatures, index = to_device_packed(  # one upload
            [row_seeds(keys, positions), np.asarray([dice[b].temperature for b in sampled], dtype=np.float64),
             np.asarray(sampled, dtype=np.int64)], device)
        log_q = torch.log_softmax(logits[index].float() / temperatures.float().view(-1, 1, 1), dim=-1)
        top_log_q, top_ids = log_q.topk(min(COUPLED_CANDIDATES, vocab), dim=-1)  # [S, D, m]
        noise = gumbel_noise(seeds, self.head.to_target_ids(top_ids).view(len(sampled) * depth, -1))
        coupled = (top_log_q + self.noise_weight * noise.view(top_ids.shape).float()) / self.scale
        out = logits.float().clone()
        out[index] = torch.full_like(log_q, -torch.inf).scatter_(-1, top_ids, coupled)
        return out
