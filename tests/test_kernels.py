"""Every kernel strategy computes the same result, on CPU tensors, whatever device would pick it.

The GPU strategies (`linear` projection, `dense` warp, `batched` logits) never run on a CPU by
themselves; here they are forced (`dart_worker.hardware.kernels.forced`) and compared with the CPU ones and
with the model's own forward: prefill and verify logits for ragged batches, greedy and seeded
sampled decoding. A model whose head slices `logits_to_keep` the transformers 4.x way (which the
former GPU branch handed a [B, 1] tensor) must decode like any other.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from dart_worker.hardware import kernels
from dart_worker.target.adapter import TargetAdapter
from tests.test_engine import greedy, make_engine, random_prompts
from tests.test_target import random_tree, tree_tensors
from tests.tiny_models import FAMILIES, TINY_VOCAB, tiny_model

CPU_STRATEGIES = {"projection": "weight_first", "warp": "candidates", "logits": "deferred", "gqa": "repeat",
                  "shapes": "exact"}
GPU_STRATEGIES = {"projection": "linear", "warp": "dense", "logits": "batched", "gqa": "pack", "shapes": "bucketed"}
PLANS = {"cpu": CPU_STRATEGIES, "gpu": GPU_STRATEGIES, "enable_gqa": {**CPU_STRATEGIES, "gqa": "enable_gqa"}}
PROMPT_LENGTHS = (7, 30, 12)  # ragged: prefill groups and padding both happen


class Llama4xHead(LlamaForCausalLM):
    """A Llama whose forward computes `lm_head(hidden[:, logits_to_keep, :])`, as transformers 4.x
    model code (and many remote-code models) does: a [B, R] tensor gives [B, B, R, V] logits."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            **kwargs).last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, keep, :]))


def llama_4x_head(seed: int = 0) -> Llama4xHead:
    reference = tiny_model("llama", seed=seed)
    model = Llama4xHead(LlamaConfig(**reference.config.to_dict()))
    model.load_state_dict(reference.state_dict())
    return model.float().eval()


def prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def own_last_logits(model, sequence: list[int]) -> torch.Tensor:
    """The model's own logits after `sequence`, from a plain full forward (no cache, no masks)."""
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0, -1]


def ragged_trees(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """`count` random trees of different sizes padded into one verify block (padding rows see
    themselves only), plus each tree's (parents, tokens)."""
    shapes = [random_tree(n, seed=seed + k) for k, n in enumerate((9, 3, 14)[:count])]
    width = max(len(parents) for parents, _ in shapes) + 1
    ids = torch.zeros(count, width, dtype=torch.long)
    depth = torch.zeros(count, width, dtype=torch.long)
    ancestor = torch.eye(width, dtype=torch.bool).repeat(count, 1, 1)
    for b, (parents, tokens) in enumerate(shapes):
        i, d, a = tree_tensors(5 + b, parents, tokens)
        n = i.shape[1]
        ids[b, :n], depth[b, :n], ancestor[b, :n, :n] = i[0], d[0], a[0]
    return ids, depth, ancestor, shapes


def path_to(node: int, parents: list[int], tokens: list[int]) -> list[int]:
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def prefill_and_verify(model, plan: dict[str, str], defer: bool):
    """Prefill logits [B, V] and verify logits [B, rows, V] of a ragged batch under `plan`."""
    with kernels.forced(**plan):
        adapter = TargetAdapter(model)
        state = adapter.new_state(len(PROMPT_LENGTHS))
        prefill = adapter.prefill(state, prompts()).logits[:, 0]
        ids, depth, ancestor, shapes = ragged_trees(len(PROMPT_LENGTHS), seed=3)
        out = adapter.verify(state, ids, depth, ancestor, defer_logits=defer)
        verify = adapter.logits_at(out.hidden) if defer else out.logits
    return prefill.float(), verify.float(), ids, shapes


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("defer", [False, True])
def test_every_strategy_gives_the_models_own_logits_for_ragged_batches(family, plan, defer):
    model = tiny_model(family)
    prefill, verify, ids, shapes = prefill_and_verify(model, PLANS[plan], defer)
    for b, prompt in enumerate(prompts()):
        torch.testing.assert_close(prefill[b], own_last_logits(model, prompt), atol=1e-4, rtol=1e-4)
        parents, tokens = shapes[b]
        root = int(ids[b, 0])
        for row in range(len(tokens) + 1):
            path = [root, *path_to(row - 1, parents, tokens)] if row else [root]
            torch.testing.assert_close(verify[b, row], own_last_logits(model, prompt + path), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_and_cpu_strategies_agree(family):
    model = tiny_model(family)
    cpu = prefill_and_verify(model, CPU_STRATEGIES, defer=True)
    gpu = prefill_and_verify(model, GPU_STRATEGIES, defer=False)
    torch.testing.assert_close(cpu[0], gpu[0], atol=1e-4, rtol=1e-4)  # float rounding of other kernels only
    torch.testing.assert_close(cpu[1], gpu[1], atol=1e-4, rtol=1e-4)


def test_a_4x_style_head_decodes_like_its_weights_under_every_strategy():
    """The former GPU branch passed a [B, 1] `logits_to_keep` tensor to the model's forward: a 4.x
    style head then returns [B, B, 1, V] (every sequence's row for every sequence). The adapter
    no longer relies on that argument, so prefill and verify are the weights' own logits."""
    model = llama_4x_head()
    with torch.no_grad():
        hazard = model(torch.zeros(3, 4, dtype=torch.long), logits_to_keep=torch.tensor([[3], [1], [2]])).logits
    assert hazard.shape == (3, 3, 1, TINY_VOCAB)  # what the former GPU branch would have received
    reference = tiny_model("llama")
    for plan in PLANS.values():
        for defer in (False, True):
            prefill, verify, *_ = prefill_and_verify(model, plan, defer)
            expected_prefill, expected_verify, *_ = prefill_and_verify(reference, plan, defer)
            torch.testing.assert_close(prefill, expected_prefill, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(verify, expected_verify, atol=1e-5, rtol=1e-5)
    expected = [r.token_ids for r in make_engine(reference, "ar").generate(prompts(), greedy(20))]
    for plan in PLANS.values():
        with kernels.forced(**plan):
            for mode in ("ar", "ddtree"):
                decoded = make_engine(model, mode).generate(prompts(), greedy(20), max_live=2)
                assert [r.token_ids for r in decoded] == expected


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_under_gpu_strategies_equals_cpu_strategies(family):
    """Greedy (ragged batch, continuous batching) and seeded top-p sampling commit the same
    tokens under either plan, and greedy equals `ar`."""
    from dart_worker.sampling.params import SamplingParams

    model = tiny_model(family, vocab_size=32)
    requests = random_prompts(5, seed=7)
    expected = [r.token_ids for r in make_engine(model, "ar").generate(requests, greedy(24))]
    sampled = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_new_tokens=16) for s in range(5)]
    outputs = {}
    for name, plan in PLANS.items():
        with kernels.forced(**plan):
            engine = make_engine(model, "ddtree", budget=12)
            assert engine.defer_logits == (plan["logits"] == "deferred")
            assert engine.bucketed == (plan["shapes"] == "bucketed")
            assert [r.token_ids for r in engine.generate(requests, greedy(24), max_live=3)] == expected
            outputs[name] = [r.token_ids for r in engine.generate(requests, sampled, max_live=2)]
            outputs[name + " ar"] = [r.token_ids for r in make_engine(model, "ar").generate(requests, sampled)]
    assert outputs["cpu"] == outputs["gpu"] == outputs["cpu ar"] == outputs["gpu ar"]


@pytest.mark.parametrize("family", FAMILIES)
def test_sdpa_and_eager_attention_verify_alike(family):
    sdpa = tiny_model(family)
    eager = tiny_model(family)
    eager.set_attn_implementation("eager")
    assert eager.config._attn_implementation == "eager"
    for plan in PLANS.values():
        a = prefill_and_verify(sdpa, plan, defer=False)
        b = prefill_and_verify(eager, plan, defer=False)
        torch.testing.assert_close(a[0], b[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a[1], b[1], atol=1e-4, rtol=1e-4)


class ScaledLogits(LlamaForCausalLM):
    """A head with an extra logit scale (as Cohere's `logit_scale`): not LM head over hidden."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.25
        return out


def test_a_model_with_another_logit_transform_is_refused():
    reference = tiny_model("llama")
    model = ScaledLogits(reference.config)
    model.load_state_dict(reference.state_dict())
    with pytest.raises(ValueError, match="not the LM head"):
        TargetAdapter(model.eval())


def test_attention_that_ignores_tree_masks_is_refused():
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"flash_attention_2.*tree masks"):
        TargetAdapter(model)


def test_forced_names_are_checked_and_scoped():
    cpu = torch.device("cpu")
    assert kernels.projection_for(cpu, torch.float32) == "weight_first"
    assert kernels.projection_for(cpu, torch.bfloat16) == "linear"
    assert kernels.warp_for(torch.device("cuda", 0)) == "dense"
    assert kernels.logits_for(torch.device("cuda", 0), lambda: True) == "batched"
    assert kernels.gqa_for(torch.device("cuda", 0)) == "pack" and kernels.gqa_for(cpu) == "repeat"
    assert kernels.shapes_for(torch.device("cuda", 0)) == "bucketed" and kernels.shapes_for(cpu) == "exact"
    with kernels.forced(projection="linear", logits="batched"):
        assert kernels.projection_for(cpu, torch.float32) == "linear"
        assert kernels.logits_for(cpu, lambda: True) == "batched"
        with kernels.forced(warp="dense"):
            assert kernels.describe(cpu, torch.float32) == {"projection": "linear", "warp": "dense",
                                                             "logits": "batched", "gqa": "repeat", "shapes": "exact"}
        assert kernels.warp_for(cpu) == "candidates"
    assert kernels.projection_for(cpu, torch.float32) == "weight_first"
    with pytest.raises(ValueError, match="unknown warp strategy 'fast'"), kernels.forced(warp="fast"):
        pass
    with pytest.raises(ValueError, match="unknown kernel choice 'attention'"), kernels.forced(attention="x"):
        pass
