"""`GrowingCache` against transformers' `DynamicCache` under what `TargetState` does to a cache."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from dart_worker.target.kv_cache import GrowingCache, GrowingLayer, retire_order
from tests.hypothesis_budget import examples

OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 300)),  # a forward's new rows (past SPARE_SLOTS too)
    st.tuples(st.just("crop"), st.integers(0, 40)),  # drop the last k slots (commit's crop)
    st.tuples(st.just("compact"), st.integers(0, 2**16)),  # in-place gather into earlier slots
    st.tuples(st.just("select"), st.integers(0, 2**16)),  # finished sequences leave
    st.tuples(st.just("join"), st.integers(1, 3)),  # newly prefilled sequences join (fresh tensors)
), min_size=1, max_size=14)


@settings(max_examples=examples(60), deadline=None)
@given(ops=OPS, batch=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_growing_cache_holds_what_a_dynamic_cache_holds(ops, batch, seed):
    gen = torch.Generator().manual_seed(seed)
    caches = [DynamicCache(), GrowingCache()]
    heads, dim, layers = 2, 3, 2

    def every_layer(fn):
        for cache in caches:
            for layer in cache.layers:
                fn(layer)

    for op, arg in ops:
        slots = caches[0].get_seq_length() if caches[0].layers else 0
        if op == "append":
            for index in range(layers):
                keys = torch.randn(batch, heads, arg, dim, generator=gen)
                values = torch.randn(batch, heads, arg, dim, generator=gen)
                outs = [cache.update(keys, values, index) for cache in caches]
                torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        elif not slots:
            continue
        elif op == "crop":
            keep = max(0, slots - arg)

            def crop(layer, keep=keep):
                layer.keys, layer.values = layer.keys[:, :, :keep], layer.values[:, :, :keep]
            every_layer(crop)
        elif op == "compact":
            g = torch.Generator().manual_seed(arg)
            b = torch.randint(0, batch, (4,), generator=g)
            src = torch.randint(0, slots, (4,), generator=g)
            dst = torch.minimum(src, torch.randint(0, slots, (4,), generator=g))

            def compact(layer, b=b, src=src, dst=dst):
                layer.keys[b, :, dst] = layer.keys[b, :, src]
                layer.values[b, :, dst] = layer.values[b, :, src]
            every_layer(compact)
        elif op == "select" and batch > 1:
            keep = torch.randperm(batch, generator=torch.Generator().manual_seed(arg))[: batch - 1]
            caches[0].batch_select_indices(keep)
            caches[1].keep_sequences(keep.tolist())
            batch -= 1
        elif op == "join":
            extra_keys = [torch.randn(arg, heads, slots, dim, generator=gen) for _ in range(layers)]
            for layer, extra in zip(caches[0].layers, extra_keys, strict=True):
                layer.keys = torch.cat([layer.keys, extra])
                layer.values = torch.cat([layer.values, -extra])
            for layer, extra in zip(caches[1].layers, extra_keys, strict=True):
                layer.append_sequences(extra, -extra)
            batch += arg
        for ours, theirs in zip(caches[1].layers, caches[0].layers, strict=True):
            assert isinstance(ours, GrowingLayer)
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        assert caches[1].get_seq_length() == caches[0].get_seq_length()


def test_appends_write_in_place_until_the_spare_slots_run_out():
    cache = GrowingCache()
    cache.update(torch.zeros(2, 1, 10, 4), torch.zeros(2, 1, 10, 4), 0)
    layer = cache.layers[0]
    buffer = layer._key_buffer
    for _ in range(5):
        cache.update(torch.ones(2, 1, 3, 4), torch.ones(2, 1, 3, 4), 0)
    assert layer._key_buffer is buffer and layer.keys.shape[-2] == 25  # no copy of the cache per forward
    layer.keys, layer.values = layer.keys[:, :, :20], layer.values[:, :, :20]  # a crop keeps the buffer
    cache.update(torch.ones(2, 1, 1, 4), torch.ones(2, 1, 1, 4), 0)
    assert layer._key_buffer is buffer and layer.keys.shape[-2] == 21
    cache.batch_select_indices(torch.tensor([1]))  # a fresh tensor: adopted into a new buffer
    cache.update(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4), 0)
    assert layer._key_buffer is not buffer and layer.keys.shape == (1, 1, 22, 4)


@given(finished=st.lists(st.booleans(), min_size=1, max_size=12))
def test_retire_order_keeps_survivors_in_place_and_fills_holes_from_the_end(finished):
    order = retire_order(finished)
    survivors = [i for i, done in enumerate(finished) if not done]
    assert sorted(order) == survivors
    keep = len(survivors)
    assert all(order[i] == i for i in range(keep) if not finished[i])  # nobody below the cut moves
    assert sum(order[i] != i for i in range(keep)) == sum(finished[:keep])  # one copy per hole filled


def test_finishing_and_joining_copy_only_the_moved_and_the_new_sequences():
    cache = GrowingCache()
    keys = torch.arange(4 * 2 * 5 * 3, dtype=torch.float32).reshape(4, 2, 5, 3)
    cache.update(keys, -keys, 0)
    layer = cache.layers[0]
    buffer = layer._key_buffer
    cache.keep_sequences(retire_order([False, True, False, False]))  # row 1 leaves, row 3 moves into it
    assert layer._key_buffer is buffer and layer.keys.shape == (3, 2, 5, 3)
    assert torch.equal(layer.keys, keys[[0, 3, 2]]) and torch.equal(layer.values, -keys[[0, 3, 2]])
    joiner = torch.full((2, 2, 7, 3), 9.0)  # longer than the live ones: their extra slots are stale
    layer.append_sequences(joiner, -joiner)
    assert layer._key_buffer is not buffer  # 5 rows > the 4 the buffer had: it grows once ...
    grown = layer._key_buffer
    assert layer.keys.shape == (5, 2, 7, 3) and torch.equal(layer.keys[:3, :, :5], keys[[0, 3, 2]])
    assert torch.equal(layer.keys[3:], joiner)
    cache.keep_sequences([0, 4, 2, 3])
    layer.append_sequences(joiner[:1], -joiner[:1])
    assert layer._key_buffer is grown and layer.keys.shape == (5, 2, 7, 3)  # ... and is reused after


def test_stale_slots_are_finite_whatever_memory_held(monkeypatch):
    """Slots past a sequence's length are masked out, but a masked NaN still poisons attention
    (its weight is 0, and 0 * NaN = NaN): every slot in the views must hold a finite value even
    where fresh buffers came from memory full of garbage (here: NaN from every allocation)."""
    real_new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *size, **kw: real_new_empty(self, *size, **kw)
                        .fill_(float("nan")))
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *size, **kw: real_empty(*size, **kw).fill_(float("nan")))
    cache = GrowingCache()
    keys = torch.randn(2, 2, 5, 3)
    cache.update(keys, keys, 0)
    layer = cache.layers[0]
    layer.append_sequences(torch.randn(3, 2, 9, 3), torch.randn(3, 2, 9, 3))  # ragged: the live rows' 5..8 stale
    cache.keep_sequences([4, 1, 2])
    layer.append_sequences(torch.randn(2, 2, 400, 3), torch.randn(2, 2, 400, 3))  # grows past the spare slots
    cache.update(torch.randn(5, 2, 1, 3), torch.randn(5, 2, 1, 3), 0)
    assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()


def test_resizing_the_batch_keeps_the_live_rows_and_copies_nothing_it_can_view():
    """Bucketed shapes pad the batch with sequences after the live ones (`resize_batch`): narrowing
    and widening within the buffer's rows are views of it, widening past them grows it once, and
    the live sequences' rows are the same throughout (a cache not viewing its buffer is adopted)."""
    cache = GrowingCache()
    keys = torch.arange(3 * 2 * 5 * 3, dtype=torch.float32).reshape(3, 2, 5, 3)
    cache.update(keys, -keys, 0)
    layer = cache.layers[0]
    buffer = layer._key_buffer
    cache.resize_batch(2)
    assert layer._key_buffer is buffer and layer.keys.shape == (2, 2, 5, 3)
    cache.resize_batch(3)  # the dropped row's stale K/V, not cleared: padding has no context
    assert layer._key_buffer is buffer and torch.equal(layer.keys, keys) and torch.equal(layer.values, -keys)
    cache.resize_batch(4)
    assert layer._key_buffer is not buffer and layer.keys.shape == (4, 2, 5, 3)
    assert torch.equal(layer.keys[:3], keys) and torch.isfinite(layer.keys).all()
    cache.repeat_sequences([0, 1])  # fresh tensors, no buffer
    cache.resize_batch(3)
    assert layer._views_buffer() and torch.equal(layer.keys[:2], keys[:2]) and torch.equal(layer.values[:2], -keys[:2])
    cache.update(torch.ones(3, 2, 1, 3), torch.ones(3, 2, 1, 3), 0)  # the forward writes after the views
    assert layer.keys.shape == (3, 2, 6, 3) and torch.equal(layer.keys[:2, :, :5], keys[:2])
