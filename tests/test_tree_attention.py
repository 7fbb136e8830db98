"""Masked attention over grouped K/V heads: every `gqa` strategy is transformers' own attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import eager_attention_forward

from dart_worker.hardware import kernels
from dart_worker.target.adapter import TargetAdapter
from dart_worker.target.tree_attention import NAME, tree_attention_forward
from tests.hypothesis_budget import examples
from tests.tiny_models import tiny_model


class Module(torch.nn.Module):
    """What the attention functions read off the attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@settings(max_examples=examples(40), deadline=None)
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 3), groups=st.sampled_from([1, 2, 4]),
       rows=st.integers(1, 9), cached=st.integers(0, 12), seed=st.integers(0, 2**16))
def test_every_strategy_equals_transformers_attention(batch, kv_heads, groups, rows, cached, seed):
    gen = torch.Generator().manual_seed(seed)
    dim, keys = 8, cached + rows
    query = torch.randn(batch, kv_heads * groups, rows, dim, generator=gen)
    key = torch.randn(batch, kv_heads, keys, dim, generator=gen)
    value = torch.randn(batch, kv_heads, keys, dim, generator=gen)
    mask = torch.rand(batch, 1, rows, keys, generator=gen) < 0.6
    mask[..., cached + torch.arange(rows), ] = False
    mask[:, :, torch.arange(rows), cached + torch.arange(rows)] = True  # every row sees itself
    module = Module(groups)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    eager, _ = eager_attention_forward(module, query, key, value, additive, scaling=0.3)
    torch.testing.assert_close(eager, expected, atol=1e-5, rtol=1e-5)
    for gqa in kernels.GQAS:
        with kernels.forced(gqa=gqa):
            ours, _ = tree_attention_forward(module, query, key, value, mask, scaling=0.3)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5, msg=gqa)


def test_without_a_mask_it_is_transformers_sdpa():
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen),
                         torch.randn(2, 2, 5, 8, generator=gen))
    module = Module(2)
    ours, _ = tree_attention_forward(module, query, key, value, None, scaling=0.5)
    theirs, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.5)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_adapter_installs_it_and_the_models_own_generate_still_works(family):
    model = tiny_model(family)
    before = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=12, do_sample=False)
    TargetAdapter(model)
    assert model.config._attn_implementation == NAME
    after = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=12, do_sample=False)
    assert torch.equal(before, after)
