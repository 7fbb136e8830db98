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
p+i) predicts token p+2+i. The head keeps its own one-layer KV cache of committed rows only;
MASK rows are recomputed every round and never cached.

The layer code is split into small pieces (`DartAttention`, `DartMidLayer`) so that the training
job can run the same layer over whole sequences with its own attention masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    repeat_kv,
    rotate_half,
)

from dart_worker.projection import project
from dart_worker.shape_buckets import context_bucket, rows_bucket
from dart_worker.target import default_tap_layers
from dart_worker.transfer import to_device, to_device_packed


class DraftHeadConfigError(ValueError):
    """A draft-head config.json that is incomplete or inconsistent."""


# Fields a published config may omit, with the value the reference DART/EAGLE-3 loaders then use.
_DEFAULTS_FROM_REFERENCE = {
    "rope_theta": 10000.0,  # reference: getattr(config, "rope_theta", 10000)
    "rope_scaling": None,
    "hidden_act": "silu",  # LlamaConfig default
}


# Fields a config.json may omit without a reference default (None = "as the reference").
_OPTIONAL_FIELDS = ("tap_layers",)


@dataclass
class DraftHeadConfig:
    """Shape and hyper-parameters of a DART draft head, stored as the checkpoint's config.json.

    `extras` keeps keys of a published config that this code does not use (architectures,
    torch_dtype, ...), so that load -> save round-trips them; it is not part of the architecture.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    draft_length: int
    draft_vocab_size: int
    target_hidden_size: int
    # Target layers whose inputs the head reads (low, mid, high). Published heads omit it: they
    # were trained on the reference taps (`default_tap_layers`), which is what None means.
    tap_layers: list[int] | None = None
    extras: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "draft_length",
                     "draft_vocab_size", "target_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DraftHeadConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise DraftHeadConfigError(f"{name} must be a positive number, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DraftHeadConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise DraftHeadConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise DraftHeadConfigError(
                f"draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size})")
        if self.hidden_act not in ACT2FN:
            raise DraftHeadConfigError(f"unknown hidden_act {self.hidden_act!r}")
        if self.tap_layers is not None:
            taps = self.tap_layers
            if (not isinstance(taps, (list, tuple)) or len(taps) != 3
                    or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in taps)):
                raise DraftHeadConfigError(f"tap_layers must list 3 layer indices >= 0, got {taps!r}")
            self.tap_layers = list(taps)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise DraftHeadConfigError(f"rope_scaling must be null or an object, got {self.rope_scaling!r}")

    @property
    def num_rows(self) -> int:
        """D = draft_length + 1 rows of logits per proposal."""
        return self.draft_length + 1

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftHeadConfig:
        """Parse a config.json object. Unknown keys go to `extras`; a missing required key is an error.

        Optional keys follow the reference loaders: head_dim = hidden_size // num_attention_heads,
        num_key_value_heads = num_attention_heads, target_hidden_size = hidden_size, rope_theta =
        10000, rope_scaling = null, hidden_act = silu. A transformers>=5 style `rope_parameters`
        object is read when `rope_theta` is absent.
        """
        if not isinstance(data, dict):
            raise DraftHeadConfigError(f"config must be a JSON object, got {type(data).__name__}")
        names = [f.name for f in fields(cls) if f.name != "extras"]
        values = {name: data[name] for name in names if name in data}
        values.update({k: v for k, v in _DEFAULTS_FROM_REFERENCE.items() if k not in values})
        rope_parameters = data.get("rope_parameters")
        if "rope_theta" not in data and isinstance(rope_parameters, dict):
            params = dict(rope_parameters)
            values["rope_theta"] = params.pop("rope_theta", _DEFAULTS_FROM_REFERENCE["rope_theta"])
            if "rope_scaling" not in data and params.get("rope_type", "default") != "default":
                values["rope_scaling"] = params
        if "num_attention_heads" in values:
            values.setdefault("num_key_value_heads", values["num_attention_heads"])
            if "hidden_size" in values and "head_dim" not in values:
                heads, hidden = values["num_attention_heads"], values["hidden_size"]
                if isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
                    values["head_dim"] = hidden // heads
        if "hidden_size" in values:
            values.setdefault("target_hidden_size", values["hidden_size"])
        missing = [name for name in names if name not in values and name not in _OPTIONAL_FIELDS]
        if missing:
            raise DraftHeadConfigError(f"config is missing required field(s) {missing}")
        extras = {k: v for k, v in data.items() if k not in names}
        return cls(**values, extras=extras)

    def to_dict(self) -> dict[str, Any]:
        """The config.json object: kept unknown keys first, then every field of the architecture."""
        data = dict(self.extras)
        data.update({k: v for k, v in asdict(self).items()
                     if k != "extras" and not (k in _OPTIONAL_FIELDS and v is None)})
        return data

    def llama_config(self) -> LlamaConfig:
        """A LlamaConfig of the draft layer, so transformers' RoPE variants and MLP apply unchanged."""
        try:
            return LlamaConfig(
                vocab_size=self.vocab_size,
                hidden_size=self.hidden_size,
                intermediate_size=self.intermediate_size,
                num_hidden_layers=1,
                num_attention_heads=self.num_attention_heads,
                num_key_value_heads=self.num_key_value_heads,
                head_dim=self.head_dim,
                hidden_act=self.hidden_act,
                max_position_embeddings=self.max_position_embeddings,
                rms_norm_eps=self.rms_norm_eps,
                rope_theta=float(self.rope_theta),
                rope_scaling=dict(self.rope_scaling) if self.rope_scaling is not None else None,
            )
        except Exception as exc:  # transformers raises several types for a bad rope dict
            raise DraftHeadConfigError(f"transformers rejects this draft config: {exc}") from exc


def target_text_config(target_config: PretrainedConfig) -> PretrainedConfig:
    """The decoder text config of a target (itself for text-only models)."""
    get_text_config = getattr(target_config, "get_text_config", None)
    return get_text_config() if get_text_config is not None else target_config


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


class DraftKVCache:
    """The head's one-layer KV cache of committed rows, ragged over the batch.

    Sequence b owns slots 0..lengths[b]-1 of `keys[b]`/`values[b]` ([B, kv_heads, T, hd] with
    T = max(lengths)); slots past its length are stale and always masked out. `keys`/`values` are
    views of buffers with spare capacity, so appending is amortised O(new rows); an append
    invalidates views taken before it. `lengths` is host data (numpy int64): where rows go is
    decided on the host, so appending and selecting never wait for the device.

    `skipped[b]`: committed rows of sequence b that were never read into the cache (a head paused
    for long reads only the latest rows when it resumes, `HeadDrafter.catch_up`); the next row's
    absolute position is `lengths + skipped` (`next_positions`), so RoPE distances stay true.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, lengths, skipped=None) -> None:
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.detach().cpu().numpy()
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if keys.shape != values.shape or keys.dim() != 4 or lengths.shape != (keys.shape[0],):
            raise ValueError(f"inconsistent cache shapes: keys {tuple(keys.shape)}, values "
                             f"{tuple(values.shape)}, lengths {tuple(lengths.shape)}")
        self._key_buffer, self._value_buffer = keys, values
        self._used = keys.shape[2]
        self.lengths = lengths
        self.skipped = np.zeros_like(lengths) if skipped is None else np.asarray(skipped, dtype=np.int64).copy()
        if self.skipped.shape != lengths.shape:
            raise ValueError(f"skipped {self.skipped.shape} must match lengths {lengths.shape}")

    def next_positions(self) -> np.ndarray:
        """Per sequence, the absolute position of its next committed row."""
        return self.lengths + self.skipped

    def skip(self, rows) -> None:
        """Sequence b's next `rows[b]` committed rows will never be read (see the class doc)."""
        self.skipped = self.skipped + np.asarray(rows, dtype=np.int64)

    @property
    def keys(self) -> torch.Tensor:
        return self._key_buffer[:, :, : self._used]

    @property
    def values(self) -> torch.Tensor:
        return self._value_buffer[:, :, : self._used]

    def __len__(self) -> int:
        return self.lengths.shape[0]

    @torch.inference_mode()
    def append(self, keys: torch.Tensor, values: torch.Tensor, num_new: np.ndarray,
               index: torch.Tensor | None = None) -> None:
        """Write row i < num_new[b] of keys/values [B, kv_heads, n, hd] to slot lengths[b] + i.

        `index`: `self.append_index(num_new)` already on the device (the head uploads it with its
        other inputs); made here when not given.
        """
        num_new = np.asarray(num_new, dtype=np.int64)
        new_max_length = int((self.lengths + num_new).max(initial=0))
        capacity = self._key_buffer.shape[2]
        if new_max_length > capacity:
            self._grow(max(new_max_length, 2 * capacity, 16))
        if index is None:
            index = to_device(self.append_index(num_new), keys.device)
        batch_idx, row_idx, slots = index.unbind(0)
        self._key_buffer[batch_idx, :, slots] = keys[batch_idx, :, row_idx]
        self._value_buffer[batch_idx, :, slots] = values[batch_idx, :, row_idx]
        self._used = max(self._used, new_max_length)
        self.lengths = self.lengths + num_new

    def widened(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys and values over the first `slots` slots (>= the used ones), the buffers grown if
        needed: a bucketed read-out attends over a bucket's slots, the ones past a sequence's
        length masked out as stale slots always are."""
        if slots < self._used:
            raise ValueError(f"cannot view {slots} slots of a cache using {self._used}")
        if slots > self._key_buffer.shape[2]:
            self._grow(slots)
        return self._key_buffer[:, :, :slots], self._value_buffer[:, :, :slots]

    def _grow(self, capacity: int) -> None:
        """New zeroed buffers of `capacity` slots holding the used ones (stale slots stay masked)."""
        grown_keys = self._key_buffer.new_zeros(*self._key_buffer.shape[:2], capacity, self._key_buffer.shape[3])
        grown_values = torch.zeros_like(grown_keys)
        grown_keys[:, :, : self._used] = self.keys
        grown_values[:, :, : self._used] = self.values
        self._key_buffer, self._value_buffer = grown_keys, grown_values

    def append_index(self, num_new: np.ndarray) -> np.ndarray:
        """[3, sum(num_new)] int64: (sequence, row of the new block, destination slot) per new row."""
        num_new = np.asarray(num_new, dtype=np.int64)
        batch_idx = np.repeat(np.arange(len(num_new)), num_new)
        row_idx = np.arange(batch_idx.shape[0]) - np.repeat(np.cumsum(num_new) - num_new, num_new)
        return np.stack([batch_idx, row_idx, self.lengths[batch_idx] + row_idx])

    @torch.inference_mode()
    def select(self, index: torch.Tensor | Sequence[int]) -> None:
        """Keep only sequences `index` (in that order), in place, cropped to their longest length.

        For batch bookkeeping alongside the target's state: drop finished sequences, reorder.
        """
        if isinstance(index, torch.Tensor):
            index = index.tolist()
        order = np.asarray(index, dtype=np.int64).reshape(-1)
        lengths = self.lengths[order]
        length = int(lengths.max(initial=0))
        device_index = to_device(order, self._key_buffer.device)
        self._key_buffer = self.keys[device_index, :, :length].contiguous()
        self._value_buffer = self.values[device_index, :, :length].contiguous()
        self._used = length
        self.lengths = lengths
        self.skipped = self.skipped[order]

    @staticmethod
    @torch.inference_mode()
    def concat(caches: Sequence[DraftKVCache]) -> DraftKVCache:
        """One cache holding the sequences of `caches` in order (e.g. to add newly prefilled ones)."""
        if not caches:
            raise ValueError("concat needs at least one cache")
        length = max(c.keys.shape[2] for c in caches)

        def padded(t: torch.Tensor) -> torch.Tensor:
            return F.pad(t, (0, 0, 0, length - t.shape[2]))

        return DraftKVCache(torch.cat([padded(c.keys) for c in caches]),
                            torch.cat([padded(c.values) for c in caches]),
                            np.concatenate([c.lengths for c in caches]), np.concatenate([c.skipped for c in caches]))


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
    def propose(self, features: torch.Tensor, next_tokens, num_new, cache: DraftKVCache,
                bucketed: bool = False) -> torch.Tensor:
        """Commit new rows to the cache and return float32 draft logits [B, D, draft_vocab_size].

        features [B, n, 3*H_t] and next_tokens [B, n] hold, for sequence b, num_new[b] real rows
        (absolute positions cache.next_positions()[b] + i) followed by padding that is ignored. Row 0 of
        the result comes from b's last real row, rows 1..m from m MASK rows at the following
        positions. Works for prefill (n = prompt length) and decoding rounds alike.

        `bucketed` (the `shapes` strategy, `dart_worker.kernels`: on CUDA): the block's rows are
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
