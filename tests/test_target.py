"""The target adapter against plain transformers: generate, full recomputation, compaction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dart_worker.target.adapter import TargetAdapter, default_tap_layers, prefill_groups
from tests.hypothesis_budget import examples
from tests.tiny_models import FAMILIES, TINY_VOCAB, tiny_model


def random_tree(num_nodes: int, seed: int) -> tuple[list[int], list[int]]:
    """Random parents (topological: parent index < own index) and tokens, siblings distinct."""
    gen = torch.Generator().manual_seed(seed)
    parents, tokens, used = [], [], {}
    for i in range(num_nodes):
        parent = int(torch.randint(-1, i, (1,), generator=gen)) if i else -1
        while True:
            token = int(torch.randint(3, TINY_VOCAB, (1,), generator=gen))
            if token not in used.setdefault(parent, set()):
                break
        used[parent].add(token)
        parents.append(parent)
        tokens.append(token)
    return parents, tokens


def tree_tensors(root: int, parents: list[int], tokens: list[int]):
    depth = [0]
    for p in parents:
        depth.append(depth[p + 1] + 1)
    size = len(parents) + 1
    ancestor = torch.eye(size, dtype=torch.bool)
    for i, p in enumerate(parents):
        ancestor[i + 1] |= ancestor[p + 1]
    return torch.tensor([[root, *tokens]]), torch.tensor([depth]), ancestor[None]


def path_to(node: int, parents: list[int], tokens: list[int]) -> list[int]:
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("family", FAMILIES)
def test_autoregressive_loop_matches_transformers_generate(family):
    model = tiny_model(family)
    adapter = TargetAdapter(model)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (7, 30, 12)]
    state = adapter.new_state(len(prompts))
    out = adapter.prefill(state, prompts)
    generated = [[int(t)] for t in out.logits[:, 0].argmax(-1)]
    for _ in range(30):  # longer than the sliding window (16) of the tiny Gemma3
        roots = torch.tensor([g[-1] for g in generated])[:, None]
        start = state.cache_len()
        zeros = torch.zeros_like(roots)
        out = adapter.verify(state, roots, zeros, torch.ones(len(prompts), 1, 1, dtype=torch.bool))
        adapter.commit(state, start, [[0]] * len(prompts))
        for g, logits in zip(generated, out.logits[:, 0]):
            g.append(int(logits.argmax()))
    for prompt, ours in zip(prompts, generated):
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=len(ours), do_sample=False)
        assert ours == reference[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_verify_logits_equal_full_recomputation(family):
    model = tiny_model(family)
    adapter = TargetAdapter(model)
    prompt = torch.randint(3, TINY_VOCAB, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    parents, tokens = random_tree(24, seed=2)
    root = 5
    state = adapter.new_state(1)
    adapter.prefill(state, [prompt])
    ids, depth, ancestor = tree_tensors(root, parents, tokens)
    out = adapter.verify(state, ids, depth, ancestor)
    for row in range(len(tokens) + 1):
        path = [root, *path_to(row - 1, parents, tokens)] if row else [root]
        with torch.no_grad():
            full = model(torch.tensor([prompt + path])).logits[0, -1]
        torch.testing.assert_close(out.logits[0, row], full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_deferred_logits_of_any_rows_equal_the_models_own(family):
    """defer_logits returns hidden states; logits_at of any rows equals the model's head on them."""
    model = tiny_model(family)
    model.config.final_logit_softcapping = 3.0 if family == "gemma3" else None  # exercise the cap
    prompt = torch.randint(3, TINY_VOCAB, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    parents, tokens = random_tree(24, seed=2)
    outs = []
    for defer in (False, True):
        adapter = TargetAdapter(model)
        state = adapter.new_state(1)
        adapter.prefill(state, [prompt])
        outs.append(adapter.verify(state, *tree_tensors(5, parents, tokens), defer_logits=defer))
    full, deferred = outs
    assert deferred.logits is None and deferred.hidden.shape[:2] == full.logits.shape[:2]
    rows = torch.tensor([0, 3, 7, len(tokens)])
    torch.testing.assert_close(adapter.logits_at(deferred.hidden[0, rows]), full.logits[0, rows], atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(deferred.taps, full.taps)
    # A strided [B, R, H] view (every other row) keeps its shape and row order.
    torch.testing.assert_close(adapter.logits_at(deferred.hidden[:, ::2]), full.logits[:, ::2], atol=1e-5, rtol=1e-5)
    assert isinstance(adapter.deferred_logits_pay(), bool) and adapter._deferral_pays is not None  # measured once


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sizes", [(0, 11, 4), (0, 11, 0, 0), (3, 0, 0, 0, 0, 2), (5, 6)])
@pytest.mark.parametrize("defer_logits", [False, True])
def test_packed_real_rows_of_unequal_trees_equal_the_padded_block(family, sizes, defer_logits):
    """A verify block of unequal trees (padding after the smaller ones) run as its real rows only
    (`TreeBatch.real_rows`, packed: `dart_worker.target.packed_rows`) gives every real row the logits
    (or final hidden states), the taps and the cached K/V of running the whole padded block, and
    only the real rows go through the decoder and the vocabulary projection. The sizes cover a
    block attended whole, one whose roots and trees attend apart (few sequences with a tree) and
    one without padding (run as it is)."""
    import numpy as np

    from dart_worker.target.tree_batch import TreeBatch
    from ngram_native.trees import DraftTree

    model = tiny_model(family)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (9, 17, 5, 12, 3, 8)[:len(sizes)]]
    trees = []
    for b, size in enumerate(sizes):
        parents, tokens = random_tree(size, seed=10 + b)
        depths = [0] * size
        for i, p in enumerate(parents):
            depths[i] = depths[p] + 1 if p >= 0 else 1
        trees.append(DraftTree(*(np.asarray(a, np.int32) for a in (tokens, parents, depths))))
    batch = TreeBatch.from_trees(list(range(5, 5 + len(sizes))), trees, "cpu")
    width = 1 + max(sizes)
    assert batch.num_real_rows == len(sizes) + sum(sizes)
    assert batch.real_rows.tolist() == [b * width + r for b, n in enumerate(sizes) for r in range(1 + n)]
    adapter = TargetAdapter(model)
    assert adapter.packs_rows
    embedded, projected = [], []
    adapter.model.get_input_embeddings().register_forward_hook(lambda m, args, out: embedded.append(out.shape[:2]))
    real_project = adapter.logits_at
    adapter.logits_at = lambda hidden: projected.append(hidden.reshape(-1, hidden.shape[-1]).shape[0]) or \
        real_project(hidden)
    outs, caches = [], []
    for rows in (None, batch.real_rows):  # padded, then packed
        state = adapter.new_state(len(sizes))
        adapter.prefill(state, prompts)
        start = state.cache_len()
        embedded.clear()
        projected.clear()
        outs.append(adapter.verify(state, batch.tokens, batch.depth, batch.ancestor, defer_logits=defer_logits,
                                   packed=None if rows is None else batch.packed))
        caches.append([(layer.keys[:, :, start:], layer.values[:, :, start:]) for layer in state.cache.layers])
    full, packed = outs
    assert embedded == [(1, batch.num_real_rows)]  # the real rows alone went through the decoder
    assert projected == ([] if defer_logits else [batch.num_real_rows])
    real = batch.real_rows
    for name in ("hidden", "taps") if defer_logits else ("logits", "taps"):
        mine, theirs = getattr(packed, name), getattr(full, name)
        assert mine.shape == theirs.shape, name
        flat = (x.reshape(-1, x.shape[-1])[real].float() for x in (mine, theirs))
        torch.testing.assert_close(*flat, atol=1e-4, rtol=1e-4)
    for (keys, values), (full_keys, full_values) in zip(caches[1], caches[0], strict=True):
        for mine, theirs in ((keys, full_keys), (values, full_values)):
            flat = (x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[-1])[real] for x in (mine, theirs))
            torch.testing.assert_close(*flat, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_commit_equals_recomputing_the_cache(family):
    model = tiny_model(family)
    adapter = TargetAdapter(model)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (19, 9)]
    state = adapter.new_state(2)
    adapter.prefill(state, prompts)
    trees = [random_tree(12, seed=4), random_tree(7, seed=5)]
    width = 1 + max(len(p) for p, _ in trees)
    ids = torch.zeros(2, width, dtype=torch.long)
    depth = torch.zeros(2, width, dtype=torch.long)
    ancestor = torch.eye(width, dtype=torch.bool).repeat(2, 1, 1)
    for b, (parents, tokens) in enumerate(trees):
        i, d, a = tree_tensors(7 + b, parents, tokens)
        n = i.shape[1]
        ids[b, :n], depth[b, :n], ancestor[b, :n, :n] = i[0], d[0], a[0]
    start = state.cache_len()
    adapter.verify(state, ids, depth, ancestor)
    # Accept the path to the deepest node of each tree (root row 0 included).
    accepted_rows, committed = [], []
    for b, (parents, tokens) in enumerate(trees):
        node = max(range(len(parents)), key=lambda i: (len(path_to(i, parents, tokens)), -i))
        rows, walk = [], node
        while walk >= 0:
            rows.append(walk + 1)
            walk = parents[walk]
        accepted_rows.append([0, *rows[::-1]])
        committed.append(prompts[b] + [7 + b, *path_to(node, parents, tokens)])
    adapter.commit(state, start, accepted_rows)
    assert state.lengths.tolist() == [len(c) for c in committed]

    fresh = adapter.new_state(2)
    adapter.prefill(fresh, committed)
    for ours, ref in zip(state.cache.layers, fresh.cache.layers):
        for b, n in enumerate(state.lengths.tolist()):
            torch.testing.assert_close(ours.keys[b, :, :n], ref.keys[b, :, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours.values[b, :, :n], ref.values[b, :, :n], atol=1e-5, rtol=1e-5)


def test_taps_are_the_inputs_of_the_chosen_layers():
    model = tiny_model("llama", num_layers=8)
    adapter = TargetAdapter(model)
    assert adapter.tap_layers == default_tap_layers(8) == (2, 4, 5)
    prompt = list(range(3, 20))
    state = adapter.new_state(1)
    out = adapter.prefill(state, [prompt])
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[2], hidden[4], hidden[5]], dim=-1)
    torch.testing.assert_close(out.taps, expected)


def test_bad_tap_layers_are_rejected():
    with pytest.raises(ValueError, match="tap_layers"):
        TargetAdapter(tiny_model("llama"), tap_layers=(0, 1, 99))


@settings(max_examples=examples(25), deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12),
       max_padding=st.sampled_from([1.0, 1.25, 2.0]))
def test_prefill_groups_partition_prompts_within_the_padding_bound(lengths, max_padding):
    groups = prefill_groups(lengths, max_padding)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        longest = lengths[group[0]]
        assert all(lengths[i] <= longest for i in group)
        assert len(group) == 1 or len(group) * longest <= max_padding * sum(lengths[i] for i in group)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=examples(6), deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=2, max_size=7))
def test_grouped_prefill_equals_one_padded_block(family, lengths):
    """Prefilling prompts of very different lengths in groups gives what one right-padded block
    gives: the same last-token logits, taps of every prompt row, cache slots and lengths, in the
    prompts' order."""
    assume(len(prefill_groups(lengths)) > 1)
    model = tiny_model(family)
    adapter = TargetAdapter(model)
    gen = torch.Generator().manual_seed(sum(lengths))
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in lengths]
    grouped, block = adapter.new_state(len(prompts)), adapter.new_state(len(prompts))
    ours = adapter.prefill(grouped, prompts)
    reference = adapter._prefill_block(block, prompts)
    assert grouped.lengths.tolist() == block.lengths.tolist() == lengths
    torch.testing.assert_close(ours.logits, reference.logits, atol=1e-4, rtol=1e-4)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(ours.taps[b, :n], reference.taps[b, :n], atol=1e-4, rtol=1e-4)
        for mine, theirs in zip(grouped.cache.layers, block.cache.layers):
            torch.testing.assert_close(mine.keys[b, :, :n], theirs.keys[b, :, :n], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(mine.values[b, :, :n], theirs.values[b, :, :n], atol=1e-4, rtol=1e-4)
