"""Tree attention that keeps grouped-query attention unexpanded: the `dart_tree` attention function.

A tree-verify forward hands every layer an explicit mask (ancestor-only inside the tree, per
layer type for sliding windows). Given a mask, transformers' `sdpa` attention repeats every K/V
head once per query head of its group (`repeat_kv`): a copy of the layer's whole cache per layer
per round, 4x for Llama-3-8B, 4x for Gemma-3-270M. Three ways to avoid or keep that copy, all the
same attention (tests/test_tree_attention.py checks each against transformers' own `sdpa` and
`eager` on CPU tensors); which one runs is the `gqa` strategy of `dart_worker.hardware.kernels`:

- `repeat`: transformers' own (`repeat_kv`, then SDPA): the reference;
- `pack`: fold each group's query heads into the rows of its K/V head, [B, Hq, S, D] ->
  [B, Hkv, g*S, D], and repeat the (boolean, small) mask g times along its rows instead: one SDPA
  per K/V head over the unexpanded cache, which CUDA's memory-efficient kernel runs with a mask;
- `enable_gqa`: SDPA's own grouped-query support (torch >= 2.5).

Without a mask (transformers' own `generate` on the same model), or without grouping, the call is
transformers' `sdpa` as it would have been. `TargetAdapter` installs the function on the models
it drives (`install`), which keeps the model's boolean masks and everything else unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dart_worker.hardware.kernels import gqa_for
from dart_worker.target import packed_rows

NAME = "dart_tree"


def tree_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, Hq, S, D], key/value [B, Hkv, T, D],
    a boolean mask [B, 1, S, T] (True = may attend); returns ([B, S, Hq, D], None). In a forward
    of packed rows (`dart_worker.target.packed_rows`) the query is [1, Hq, R, D] and so is the output's
    [1, R, Hq, D]: the queries are spread into their block and attend as in a padded forward."""
    layout = packed_rows.active()
    if layout is None:
        return _block_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    def attention(q, k, v, mask):
        return _block_attention(module, q, k, v, mask, dropout, scaling, **kwargs)[0]

    return layout.attend(attention, query, key, value, attention_mask), None


def _block_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """`tree_attention_forward` over a [B, Hq, S, D] block of queries."""
    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is None or groups == 1 or attention_mask.dtype != torch.bool:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    strategy = gqa_for(query.device)
    if strategy == "repeat":
        out = F.scaled_dot_product_attention(query, repeat_kv(key, groups), repeat_kv(value, groups),
                                             attn_mask=attention_mask, scale=scaling)
    elif strategy == "enable_gqa":
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
    else:
        out = packed_attention(query, key, value, attention_mask, groups, scaling)
    return out.transpose(1, 2).contiguous(), None


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     groups: int, scaling: float | None) -> torch.Tensor:
    """SDPA with each group's query heads folded into its K/V head's rows: [B, Hq, S, D] output.

    Query head h reads K/V head h // groups (transformers' `repeat_kv` order), so heads
    [k * groups, (k + 1) * groups) become rows [0, groups * S) of K/V head k, and every row keeps
    the mask row of its position.
    """
    batch, heads, rows, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    folded = query.reshape(batch, kv_heads, groups * rows, dim)
    # One mask for every head (the adapter's masks are [B, 1, S, T]), repeated for each folded head.
    mask = mask.expand(batch, 1, rows, keys)
    folded_mask = mask[:, :, None].expand(batch, 1, groups, rows, keys).reshape(batch, 1, groups * rows, keys)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=folded_mask, scale=scaling)
    return out.reshape(batch, heads, rows, value.shape[-1])


def install(model) -> None:
    """Run `model`'s attention through `tree_attention_forward`, registered once as NAME (with
    sdpa's mask builder, for the model's own forwards without ready-made masks)."""
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, tree_attention_forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
