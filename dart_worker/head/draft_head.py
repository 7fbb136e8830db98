"""The DART draft head: one Llama-style decoder layer that drafts D = m + 1 rows of logits in one forward.

Architecture (checkpoint-compatible with the published DART heads, which extend EAGLE-3's
`LlamaDecoderLayeremb`; parameter names below are the checkpoint keys):

    hidden   = fc(features)                              # [3*H_t] fused target taps -> [H]
    emb      = target.embed_tokens(next_token)           # the TARGET's (frozen) embedding module
    x        = cat(input_layernorm(emb), hidden_norm(hidden))    # [2H] attention input of a real row
    residual = hidden                                    # the fc output, not normed (as in EAGLE-3)
    MASK row: x = mask_rep [2H], residual = mask_rep[:H]
    h   = residual + o_proj(causal_attention(x))         # q/k/v take 2H inputs; RoPE at absolute positions
    h   = h + mlp(post_attention_layernorm(h))           # only on the D rows that are read out
    logits = lm_head(norm(norm(h)))                      # the published model applies `norm` twice

"Shifted logits": prefix row j pairs the features of position j with the embedding of token j+1.
After a round that committed positions ..p (the bonus token is token p+1), row 0 is the last real
row (features of p, embedding of the bonus token) and predicts token p+2; MASK row i (positions
p+i) predicts token p+2+i. The head keeps its own one-layer KV cache of committed rows only
(`draft_kv_cache.DraftKVCache`); MASK rows are recomputed every round and never cached.

The layer code is split into small pieces (`DartAttention`, `DartMidLayer`) so that the training
job can run the same layer over whole sequences with its own attention masks. The head's config
(`draft_head_config`), its reduced vocabulary's map into the target's (`draft_vocab`) and its KV
cache (`draft_kv_cache`) are modules of their own; checkpoints are `draft_checkpoint`'s job.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    repeat_kv,
    rotate_half,
)

from dart_worker.hardware.transfer import to_device_packed
from dart_worker.head.draft_head_config import DraftHeadConfig, DraftHeadConfigError, target_text_config
from dart_worker.head.draft_kv_cache import DraftKVCache
from dart_worker.head.draft_vocab import check_d2t, make_d2t, make_t2d
from dart_worker.target.adapter import default_tap_layers
from dart_worker.target.projection import project
from dart_worker.target.shape_buckets import context_bucket, rows_bucket


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, heads, R, hd] with cos/sin [B, R, hd] (transformers' rotate_half convention)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DartAttention(nn.Module):
    """Multi-head attention whose q/k/v projections read the 2H-wide (embedding, hidden) input.

    Split into `queries`, `keys_values` and `attend` so a caller can project only the rows it
    needs (the cache path queries D rows but projects K/V for every new row).
    """

    def __init__(self, config: DraftHeadConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def _split_heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        batch, rows, _ = x.shape
        return x.view(batch, rows, heads, self.head_dim).transpose(1, 2)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, R, 2H] -> rotated queries [B, heads, R, hd]."""
        return _rotate(self._split_heads(self.q_proj(x), self.num_heads), cos, sin)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, R, 2H] -> rotated keys and values, each [B, kv_heads, R, hd]."""
        keys = _rotate(self._split_heads(self.k_proj(x), self.num_kv_heads), cos, sin)
        return keys, self._split_heads(self.v_proj(x), self.num_kv_heads)

    def attend(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               allowed: torch.Tensor) -> torch.Tensor:
        """Attention of queries [B, heads, R, hd] over keys/values [B, kv_heads, S, hd].

        `allowed` is a boolean mask [B, 1, R, S] (True = may attend); every row needs at least one
        True entry. Returns o_proj(output) [B, R, H].
        """
        groups = self.num_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(
            queries, repeat_kv(keys, groups), repeat_kv(values, groups), attn_mask=allowed)
        batch, _, rows, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, rows, self.num_heads * self.head_dim))


class DartMidLayer(nn.Module):
    """The single decoder layer (checkpoint prefix `midlayer.`) with the learned MASK representation."""

    def __init__(self, config: DraftHeadConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.mask_rep = nn.Parameter(torch.randn(2 * config.hidden_size))
        self.self_attn = DartAttention(config)
        self.mlp = LlamaMLP(config.llama_config())
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Attention input of real rows: cat(input_layernorm(emb), hidden_norm(fc output)) [.., 2H]."""
        return torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)

    def mask_rows(self, batch_size: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention input [B, count, 2H] and residual [B, count, H] of `count` MASK rows."""
        rows = self.mask_rep.view(1, 1, -1).expand(batch_size, count, -1)
        return rows, rows[..., : self.hidden_size]

    def feed_forward(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Residual add after attention, then the post-attention-normed MLP with its residual."""
        hidden = residual + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, attn_in: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """All rows at once without a cache (training path): attn_in [B, R, 2H] -> hidden [B, R, H].

        `allowed` [B, 1, R, R] is the caller's boolean attention mask (e.g. causal, or causal per
        MASK block); cos/sin [B, R, hd] come from `DartDraftHead.rope`.
        """
        attn = self.self_attn
        keys, values = attn.keys_values(attn_in, cos, sin)
        return self.feed_forward(attn.attend(attn.queries(attn_in, cos, sin), keys, values, allowed),
                                 residual)


class DartDraftHead(nn.Module):
    """fc + one DART decoder layer + norm + lm_head over a reduced draft vocabulary.

    `embed_tokens` is the target's embedding module; it is deliberately not registered as a
    submodule: it is frozen, never saved with the head, and `head.to(dtype)` must not convert it.
    """

    def __init__(self, config: DraftHeadConfig, embed_tokens: nn.Module) -> None:
        super().__init__()
        embedding_dim = getattr(embed_tokens, "embedding_dim", None)
        if embedding_dim is not None and embedding_dim != config.hidden_size:
            raise DraftHeadConfigError(
                f"the draft hidden_size ({config.hidden_size}) must equal the target embedding width "
                f"({embedding_dim}): the embedding feeds input_layernorm")
        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = DartMidLayer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", None)
        self.__dict__["embed_tokens"] = embed_tokens
        # RoPE lives outside the module tree as well, in float32: head.to(bfloat16) must not round
        # its frequencies. It is built on first use, on the device of the positions, which also
        # lets a checkpoint loader construct the head on the meta device.
        llama_config = config.llama_config()
        self.__dict__["_rotary"] = None
        self._per_sequence_rope = llama_config.rope_parameters["rope_type"] in ("dynamic", "longrope")

    @classmethod
    def random_init(cls, target_config: PretrainedConfig, embed_tokens: nn.Module, *,
                    draft_length: int = 7, draft_vocab_size: int | None = None,
                    kept_target_ids: Sequence[int] | None = None, hidden_size: int | None = None,
                    intermediate_size: int | None = None, num_attention_heads: int | None = None,
                    num_key_value_heads: int | None = None, head_dim: int | None = None,
                    rope_theta: float = 10000.0, rope_scaling: dict | None = None,
                    max_position_embeddings: int | None = None, rms_norm_eps: float = 1e-6,
                    seed: int | None = None, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None,
                    tap_layers: Sequence[int] | None = None) -> DartDraftHead:
        """An untrained head shaped after the target (for tests and as the start of training).

        Sizes default to the target's; `tap_layers` (recorded in the config) to the reference
        taps. Without a reduced vocabulary the draft vocabulary is the target's and d2t is all
        zeros; `kept_target_ids` builds d2t/t2d (`make_d2t`).
        """
        text = target_text_config(target_config)
        if kept_target_ids is not None:
            if draft_vocab_size is not None and draft_vocab_size != len(kept_target_ids):
                raise ValueError(f"draft_vocab_size {draft_vocab_size} != len(kept_target_ids) "
                                 f"{len(kept_target_ids)}")
            draft_vocab_size = len(kept_target_ids)
        heads = num_attention_heads or text.num_attention_heads
        hidden = hidden_size or text.hidden_size
        config = DraftHeadConfig(
            vocab_size=text.vocab_size,
            hidden_size=hidden,
            intermediate_size=intermediate_size or text.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=num_key_value_heads or getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim or getattr(text, "head_dim", None) or hidden // heads,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=rms_norm_eps,
            hidden_act="silu",
            max_position_embeddings=max_position_embeddings or text.max_position_embeddings,
            draft_length=draft_length,
            draft_vocab_size=draft_vocab_size or text.vocab_size,
            target_hidden_size=text.hidden_size,
            tap_layers=list(tap_layers if tap_layers is not None else default_tap_layers(text.num_hidden_layers)),
        )
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            head = cls(config, embed_tokens)
        if kept_target_ids is not None:
            head.set_vocab_map(make_d2t(kept_target_ids, config.vocab_size),
                               make_t2d(kept_target_ids, config.vocab_size))
        return head.to(device=device, dtype=dtype)

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor | None = None) -> None:
        """Install the draft->target id map (validated) and optionally the target-vocab mask."""
        problem = check_d2t(d2t, self.config.draft_vocab_size, self.config.vocab_size)
        if problem:
            raise ValueError(problem)
        self.d2t = d2t.to(device=self.d2t.device, dtype=torch.long)
        if t2d is not None:
            if tuple(t2d.shape) != (self.config.vocab_size,):
                raise ValueError(f"t2d must have shape ({self.config.vocab_size},), found {tuple(t2d.shape)}")
            self.t2d = t2d.to(device=self.d2t.device, dtype=torch.bool)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids (any shape) to target ids: draft_id + d2t[draft_id]."""
        return draft_ids + self.d2t[draft_ids]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, R, hd] for absolute positions [B, R] (computed in float32, cast to dtype)."""
        rotary = self._rotary
        if rotary is None or rotary.inv_freq.device != positions.device:
            with torch.device(positions.device):
                rotary = LlamaRotaryEmbedding(self.config.llama_config())
            self.__dict__["_rotary"] = rotary
        probe = torch.empty(0, device=positions.device, dtype=torch.float32)
        if self._per_sequence_rope:
            # These variants pick frequencies from the longest position in the call; per sequence
            # keeps a sequence's drafts independent of what else is in the batch.
            pairs = [rotary(probe, positions[b : b + 1]) for b in range(positions.shape[0])]
            cos, sin = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        else:
            cos, sin = rotary(probe, positions)
        return cos.to(dtype), sin.to(dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 draft logits of the layer output: lm_head(norm(norm(h))) as in the published head."""
        return project(self.norm(self.norm(hidden)), self.lm_head).float()

    @torch.inference_mode()
    def new_cache(self, batch_size: int) -> DraftKVCache:
        """An empty cache for `batch_size` sequences on the head's device and dtype."""
        attn = self.midlayer.self_attn
        keys = torch.zeros(batch_size, attn.num_kv_heads, 0, attn.head_dim, device=self.device,
                           dtype=self.dtype)
        return DraftKVCache(keys, keys.clone(), np.zeros(batch_size, dtype=np.int64))

    @torch.inference_mode()
    def draft_logits(self, features: torch.Tensor, next_tokens, num_new, cache: DraftKVCache,
                     bucketed: bool = False) -> torch.Tensor:
        """Commit new rows to the cache and return float32 draft logits [B, D, draft_vocab_size].

        features [B, n, 3*H_t] and next_tokens [B, n] hold, for sequence b, num_new[b] real rows
        (absolute positions cache.next_positions()[b] + i) followed by padding that is ignored. Row 0 of
        the result comes from b's last real row, rows 1..m from m MASK rows at the following
        positions. Works for prefill (n = prompt length) and decoding rounds alike.

        `bucketed` (the `shapes` strategy, `dart_worker.hardware.kernels`: on CUDA): the block's rows are
        padded to `shape_buckets.rows_bucket(n)` and the read-out attends over
        `context_bucket(slots)` cache slots, so the head's forwards take a few shapes a CUDA
        graph can capture instead of a new one every round; padding rows are ignored and padded
        slots masked like any stale slot, so the logits are those of the exact shapes.

        next_tokens and num_new are host data (numpy arrays or lists: the engine's drafters pass
        them so, and they are checked and turned into positions on the host, then uploaded in
        one non-blocking copy); tensors are accepted too and read back first.
        """
        next_tokens, num_new = _host_ints(next_tokens), _host_ints(num_new)
        batch, n = self._check_inputs(features, next_tokens, num_new, cache)
        if bucketed and rows_bucket(n) > n:
            pad = rows_bucket(n) - n
            features = F.pad(features, (0, 0, 0, pad))
            next_tokens = np.pad(next_tokens, ((0, 0), (0, pad)))
            n += pad
        cfg, attn, device, dtype = self.config, self.midlayer.self_attn, self.device, self.dtype
        m = cfg.draft_length
        real = np.arange(n)[None, :] < num_new[:, None]  # [B, n]
        self._check_tokens(next_tokens, real)
        new_lengths = cache.lengths + num_new
        start = cache.next_positions()
        # Padding rows are projected too (one batched matmul) but never cached nor read out, so
        # whatever they hold cannot leak; pad token ids are replaced only to keep the lookup valid.
        tokens, positions, out_positions, last, lengths, append_index = to_device_packed([
            np.where(real, next_tokens, 0),
            start[:, None] + np.arange(n)[None, :],
            (start + num_new - 1)[:, None] + np.arange(m + 1)[None, :],
            num_new - 1,
            new_lengths,
            cache.append_index(num_new),
        ], device)

        hidden = self.fc(features.to(device=device, dtype=dtype, non_blocking=True))
        x_real = self.midlayer.attention_input(self.embed_tokens(tokens).to(dtype), hidden)
        cos, sin = self.rope(positions, dtype)
        keys, values = attn.keys_values(x_real, cos, sin)
        cache.append(keys, values, num_new, append_index)

        # Read-out rows: the last real row, then m MASK rows at the next positions.
        batch_idx = torch.arange(batch, device=device)
        x_mask, residual_mask = self.midlayer.mask_rows(batch, m)
        x_out = torch.cat((x_real[batch_idx, last][:, None], x_mask), dim=1)
        residual = torch.cat((hidden[batch_idx, last][:, None], residual_mask), dim=1)
        cos, sin = self.rope(out_positions, dtype)
        queries = attn.queries(x_out, cos, sin)
        mask_keys, mask_values = attn.keys_values(x_mask, cos[:, 1:], sin[:, 1:])

        # Every read-out row sees all committed slots of its sequence; MASK row i also sees MASK
        # rows 1..i (causal inside the block); nothing sees stale slots or later rows.
        cached_keys, cached_values = (cache.widened(context_bucket(cache.keys.shape[2])) if bucketed
                                      else (cache.keys, cache.values))
        slots = torch.arange(cached_keys.shape[2], device=device)
        committed = (slots[None, :] < lengths[:, None])[:, None, :].expand(batch, m + 1, -1)
        in_block = torch.ones(m + 1, m, dtype=torch.bool, device=device).tril(-1)
        allowed = torch.cat((committed, in_block[None].expand(batch, -1, -1)), dim=-1)[:, None]
        out = attn.attend(queries, torch.cat((cached_keys, mask_keys), dim=2),
                          torch.cat((cached_values, mask_values), dim=2), allowed)
        return self.logits(self.midlayer.feed_forward(out, residual))

    def _check_inputs(self, features: torch.Tensor, next_tokens: np.ndarray, num_new: np.ndarray,
                      cache: DraftKVCache) -> tuple[int, int]:
        batch = len(cache)
        width = 3 * self.config.target_hidden_size
        if features.dim() != 3 or features.shape[0] != batch or features.shape[2] != width:
            raise ValueError(f"features must have shape [B={batch}, n, 3*H_t={width}], "
                             f"found {tuple(features.shape)}")
        n = features.shape[1]
        if n < 1:
            raise ValueError("features has no rows (n = 0); every sequence needs num_new >= 1")
        if next_tokens.shape != (batch, n):
            raise ValueError(f"next_tokens must be an integer array of shape {(batch, n)}, "
                             f"found {next_tokens.dtype} {tuple(next_tokens.shape)}")
        if num_new.shape != (batch,):
            raise ValueError(f"num_new must be an integer array of shape ({batch},), "
                             f"found {num_new.dtype} {tuple(num_new.shape)}")
        low, high = int(num_new.min()), int(num_new.max())
        if low < 1 or high > n:
            raise ValueError(f"num_new must lie in [1, n={n}], found values {low}..{high}")
        return batch, n

    def _check_tokens(self, next_tokens: np.ndarray, real: np.ndarray) -> None:
        """Out-of-vocabulary tokens are caller errors.

        Positions past max_position_embeddings are not: RoPE extends to any position, and MASK
        rows near the target's context limit are never verified anyway. A draft that runs past
        the length it was trained on only loses accuracy; verification keeps the output exact.
        """
        real_tokens = next_tokens[real]
        token_low, token_high = int(real_tokens.min()), int(real_tokens.max())
        if token_low < 0 or token_high >= self.config.vocab_size:
            raise ValueError(f"next_tokens of real rows must lie in [0, {self.config.vocab_size}), "
                             f"found {token_low}..{token_high}")


def _host_ints(values) -> np.ndarray:
    """Integer host data as a numpy int64 array (a tensor is read back: callers outside the engine)."""
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise ValueError(f"expected an integer tensor, found {values.dtype}")
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        raise ValueError(f"expected integers, found {array.dtype}")
    return array.astype(np.int64, copy=False)
