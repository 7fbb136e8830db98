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
from dart_worker.sampling.gumbel import gumbel_noise, row_seeds


class GumbelCoupler:
    """(head logits [B, D, draft vocab], the batch's `Dice`) -> the logits the builders read: for a
    sampled sequence b, ((log_softmax(logits[b] / T) + a g) / s) with g the target sampler's token
    noise of the head's vocabulary (its target ids) at positions dice.position + depth; greedy
    sequences (dice None or temperature 0) keep the head's logits. g is computed on the logits'
    device from one small upload of the rows' seeds."""

    def __init__(self, head, scale: float, noise_weight: float = 1.0):
        if not scale > 0 or not 0 <= noise_weight <= 1:
            raise ValueError(f"scale must be > 0 and noise_weight in [0, 1], got {scale} and {noise_weight}")
        self.head, self.scale, self.noise_weight = head, float(scale), float(noise_weight)
        self._target_ids: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, dice: Sequence[Dice | None]) -> torch.Tensor:
        sampled = [b for b, d in enumerate(dice) if d is not None and d.temperature > 0]
        if not sampled:
            return logits
        device = logits.device
        if self._target_ids is None or self._target_ids.device != device:
            self._target_ids = self.head.to_target_ids(torch.arange(logits.shape[-1], device=device))
        depth = logits.shape[1]
        keys = np.repeat(np.asarray([dice[b].key for b in sampled], dtype=np.uint64), depth)
        positions = np.concatenate([dice[b].position + np.arange(depth) for b in sampled])
        seeds, temperatures, index = to_device_packed(  # one upload
            [row_seeds(keys, positions), np.asarray([dice[b].temperature for b in sampled], dtype=np.float64),
             np.asarray(sampled, dtype=np.int64)], device)
        noise = gumbel_noise(seeds, self._target_ids).view(len(sampled), depth, -1)
        temperatures = temperatures.view(-1, 1, 1)
        log_q = torch.log_softmax(logits[index].double() / temperatures, dim=-1)
        out = logits.float().clone()
        out[index] = ((log_q + self.noise_weight * noise) / self.scale).float()
        return out
