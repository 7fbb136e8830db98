"""The KV-cache bound `--dry-run` prints holds for what a decoding engine allocates."""

from __future__ import annotations

import torch

from dart_worker.artifacts.random_models import SHAPES
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.sampling.params import SamplingParams
from dart_worker.target.adapter import TargetAdapter
from dart_worker.target.kv_budget import kv_budget, kv_bytes_per_token
from ngram_native.builders import TreeParams
from tests.tiny_models import tiny_model


def test_bytes_per_token_of_known_shapes():
    # Llama-3-8B: 32 layers x 8 KV heads x 128 dims x K and V x 2 bytes = 128 KiB per token in bf16.
    assert kv_bytes_per_token(SHAPES["llama3-8b"](), torch.bfloat16) == 128 * 2**10
    # Gemma-3-270M: 18 layers x 1 KV head x 256 dims x 2 x 4 bytes in fp32.
    assert kv_bytes_per_token(SHAPES["gemma3-270m"](), torch.float32) == 18 * 256 * 2 * 4


def test_an_engine_never_holds_more_cache_than_the_bound():
    """Ragged prompts up to the bound's prompt length, continuous batching with more requests
    than slots: the buffers the target's cache allocated stay within the bound."""
    model = tiny_model("llama")
    target = TargetAdapter(model)
    engine = build_engine(EngineParts(target=target), "ar")
    allocated = _record_allocations(target)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (int(n),), generator=gen).tolist() for n in (40, 3, 17, 40, 9, 33, 1)]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    results = engine.generate(prompts, params, max_live=3)
    assert all(r.error is None for r in results)
    budget = kv_budget(model.config, torch.float32, max_live=3, max_prompt_tokens=40, max_new_tokens=12, tree_rows=0)
    assert 0 < max(allocated) <= budget.bound_bytes
    assert budget.bytes_per_token == kv_bytes_per_token(model.config, torch.float32)


def test_bucketed_shapes_stay_within_their_bound_and_outgrow_the_exact_one():
    """Bucketed verify shapes (the CUDA strategy, run here on CPU tensors) widen the cached context
    to its bucket and pad the block: the bucketed bound holds what they allocate, and the exact
    bound would not have: past 2048 tokens the context's bucket (3072) outgrows the buffer's spare
    room, and the exact bound under-predicts the memory by 1.4x."""
    model = tiny_model("qwen3", num_layers=2, max_position_embeddings=4096)
    target = TargetAdapter(model)
    tree = TreeParams(budget=8)
    engine = build_engine(EngineParts(target=target), "lookup", tree, sizing="fixed", shapes="bucketed")
    allocated = _record_allocations(target)
    gen = torch.Generator().manual_seed(1)
    # Repetitive prompts, so prompt lookup drafts trees and the block is padded too.
    prompts = [(torch.randint(3, 9, (int(n) // 2,), generator=gen).tolist() * 2)[:n] for n in (2050, 7, 2050, 61)]
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12), max_live=2)
    assert all(r.error is None for r in results)
    args = dict(max_live=2, max_prompt_tokens=2050, max_new_tokens=12, tree_rows=tree.budget)
    bucketed = kv_budget(model.config, torch.float32, bucketed=True, **args)
    exact = kv_budget(model.config, torch.float32, **args)
    assert max(allocated) <= bucketed.bound_bytes
    assert max(allocated) > exact.bound_bytes


def _record_allocations(target: TargetAdapter) -> list[int]:
    """After every verify forward of `target`, the bytes its cache's K and V buffers hold."""
    allocated = []
    original = target.verify

    def verify(state, *args, **kwargs):
        out = original(state, *args, **kwargs)
        allocated.append(sum(layer._key_buffer.numel() * layer._key_buffer.element_size() * 2
                             for layer in state.cache.layers))
        return out

    target.verify = verify
    return allocated
