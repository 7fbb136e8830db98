"""The packed layout of a verify block's real rows (`dart_worker.target.packed_rows`) against brute force."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_worker.target.packed_rows import PackedRows
from tests.hypothesis_budget import examples

sizes_strategy = st.lists(st.integers(0, 6), min_size=1, max_size=7)


def layout_for(sizes: list[int]) -> PackedRows:
    width = 1 + max(sizes)
    return PackedRows([torch.from_numpy(a) for a in PackedRows.layout(sizes, width)], sizes, width)


@given(sizes_strategy)
@settings(max_examples=examples(60), deadline=None)
def test_the_layout_places_every_real_row_where_the_padded_block_has_it(sizes):
    layout = layout_for(sizes)
    width = layout.width
    expected = [b * width + s for b, n in enumerate(sizes) for s in range(1 + n)]
    assert layout.rows.tolist() == expected
    block = torch.randn(len(sizes), width, 3)
    packed = layout.pack(block)
    assert torch.equal(packed, block.reshape(-1, 3)[expected])
    spread = layout.spread(packed)
    valid = torch.zeros(len(sizes) * width, dtype=torch.bool)
    valid[expected] = True
    assert torch.equal(spread.reshape(-1, 3)[valid], block.reshape(-1, 3)[valid])
    assert not spread.reshape(-1, 3)[~valid].any()  # padding is zeros
    heads = torch.randn(1, 2, len(expected), 4)
    assert torch.equal(layout.spread_heads(heads).transpose(1, 2).reshape(-1, 2, 4)[valid], heads[0].transpose(0, 1))
    assert layout.node_batch == sum(1 for n in sizes if n)


@given(sizes_strategy, st.integers(0, 5), st.integers(0, 2**31 - 1))
@settings(max_examples=examples(60), deadline=None)
def test_packed_attention_equals_the_padded_blocks_at_every_real_row(sizes, cached, seed):
    """`attend` (the block whole, or roots and trees apart when few sequences have a tree) gives
    every real row what attending over the padded block gives it, for an ancestor-style mask."""
    layout = layout_for(sizes)
    batch, width = len(sizes), layout.width
    gen = torch.Generator().manual_seed(seed)
    slots = cached + width
    key = torch.randn(batch, 2, slots, 8, generator=gen)
    value = torch.randn(batch, 2, slots, 8, generator=gen)
    # Row s of a sequence may attend to its cache and to block rows <= s (padding rows too: they
    # are masked by being never attended by real rows in the engine's masks; here any mask with a
    # True per row will do, and each real row's own entries decide its output).
    mask = torch.rand(batch, 1, width, slots, generator=gen) < 0.6
    mask[..., torch.arange(width), cached + torch.arange(width)] = True
    block_query = torch.randn(batch, 4, width, 8, generator=gen)
    packed_query = layout.pack(block_query.transpose(1, 2)).transpose(0, 1)[None]  # [1, Hq, R, D]

    def attention(q, k, v, m):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              attn_mask=m).transpose(1, 2)

    padded = attention(block_query, key, value, mask)  # [B, S, Hq, D]
    packed = layout.attend(attention, packed_query, key, value, mask)
    torch.testing.assert_close(packed[0], layout.pack(padded), atol=1e-5, rtol=1e-5)
