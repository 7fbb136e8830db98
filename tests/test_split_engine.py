"""The engine over a target spread across devices (issue #31): every place that assumes one device
uses the right one. Without GPUs, two kinds of check:

- end to end: a tiny target spread by the two-device map `split_device_map` computes, the second
  "device" being accelerate's disk offload (the one a CPU machine has: its weights are on "meta"
  and accelerate's hooks load them in each forward), decodes exactly like the whole target, in
  every drafting mode, with continuous batching and shared prefills;
- where the code computes a device: a cache layer, LM head or tapped layer made to report another
  device, so that code which uses the embedding's device for everything fails.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from dart_worker.artifacts.loading import load_target, split_device_map
from dart_worker.artifacts.random_models import tiny_config
from dart_worker.target.adapter import TargetAdapter, module_device
from tests.test_engine import greedy, make_engine, random_prompts
from tests.tiny_models import save_tiny_target, tiny_model

VOCAB = 96
LAYERS = 8


def _spread_and_whole(tmp_path, family):
    directory = save_tiny_target(tmp_path / family, family, num_layers=LAYERS, seed=4, vocab_size=VOCAB)
    with warnings.catch_warnings():  # accelerate warns that the CUDA devices are not present here
        warnings.simplefilter("ignore")
        computed = split_device_map(tiny_config(family, num_layers=LAYERS, vocab_size=VOCAB),
                                    ["cuda:0", "cuda:1"], torch.float32, max_memory={0: 2_000_000, 1: 2_000_000})
    device_map = {name: "cpu" if where == 0 else "disk" for name, where in computed.items()}
    spread, _ = load_target(directory, dtype="fp32", device="cpu", device_map=device_map,
                            offload_folder=tmp_path / f"{family}-offload")
    whole, _ = load_target(directory, dtype="fp32", device="cpu")
    return spread, whole


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_spread_target_decodes_like_the_whole_one_in_every_mode(tmp_path, family):
    spread, whole = _spread_and_whole(tmp_path, family)
    assert spread.lm_head.weight.device.type == "meta"  # the LM head is offloaded: only its hook has it
    prompts = random_prompts(3, seed=3, vocab=VOCAB)
    reference = make_engine(whole, "ar").generate(prompts, greedy(16))
    first = whole.generate(torch.tensor([prompts[0]]), max_new_tokens=16, do_sample=False)[0, len(prompts[0]):]
    assert reference[0].token_ids[: len(first)] == first.tolist()[: len(reference[0].token_ids)]
    for mode, defer in [("ar", None), ("chain", False), ("dart", True)]:
        engine = make_engine(spread, mode, defer_logits=defer, budget=8)
        got = engine.generate(prompts, greedy(16), max_live=2)  # rows join and leave a running batch
        assert [r.token_ids for r in got] == [r.token_ids for r in reference], mode
    # Two completions of one prompt share its prefill: the cache rows are copied per layer.
    samples = make_engine(spread, "chain").generate_samples(prompts[:1], [[greedy(16), greedy(16)]])
    assert [r.token_ids for r in samples[0]] == [reference[0].token_ids] * 2


class _Hook:
    """What accelerate's AlignDevicesHook tells about a module: where it runs."""

    def __init__(self, execution_device):
        self.execution_device = execution_device


class Elsewhere(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1: code that picks devices from tensors (a cache
    layer's keys) sees a second device; the arithmetic still runs on the CPU."""

    @property
    def device(self):
        return torch.device("cuda", 1)


def test_kv_cache_is_indexed_on_each_layers_own_device(monkeypatch):
    """Compaction, retiring rows and repeating them upload their indices once per device of the
    cache's layers, and each layer is indexed with the copy for its own device."""
    model = tiny_model("llama", vocab_size=VOCAB, num_layers=4)
    target = TargetAdapter(model)

    def prefilled():
        state = target.new_state(3)
        target.prefill(state, random_prompts(3, seed=5, vocab=VOCAB))
        tree = torch.tensor([[1, 5, 6, 7]] * 3)
        ancestor = torch.tril(torch.ones(4, 4, dtype=torch.bool))[None].expand(3, 4, 4)
        target.verify(state, tree, torch.arange(4)[None].expand(3, 4), ancestor)
        return state

    reference, moved = prefilled(), prefilled()

    def second_half_elsewhere(state):  # the second half of the layers "on cuda:1"
        if state is moved:
            for layer in state.cache.layers[2:]:
                layer.keys, layer.values = layer.keys.as_subclass(Elsewhere), layer.values.as_subclass(Elsewhere)

    uploads = []
    import dart_worker.target.kv_cache as kv_cache

    real_to_device = kv_cache.to_device

    def recording_to_device(array, device, dtype=None):
        uploads.append(torch.device(device))
        return real_to_device(array, "cpu", dtype)

    monkeypatch.setattr(kv_cache, "to_device", recording_to_device)
    for state in (reference, moved):
        second_half_elsewhere(state)
        target.commit(state, state.cache_len() - 4, [[0, 1], [0], [0, 1, 2]])
        second_half_elsewhere(state)
        state.select([2, 0])
        second_half_elsewhere(state)
        state.repeat([0, 1, 1])
    assert torch.device("cuda", 1) in uploads and torch.device("cpu") in uploads
    assert uploads.count(torch.device("cuda", 1)) == 3  # once per operation, not once per layer
    for a, b in zip(reference.cache.layers, moved.cache.layers, strict=True):
        assert torch.equal(a.keys.as_subclass(torch.Tensor), b.keys.as_subclass(torch.Tensor))
        assert torch.equal(a.values.as_subclass(torch.Tensor), b.values.as_subclass(torch.Tensor))
    assert reference.lengths.tolist() == moved.lengths.tolist()


def test_logits_are_computed_on_the_lm_heads_device():
    """An LM head that accelerate runs elsewhere than the embedding (its hook's execution device;
    here "meta", a device a CPU has): the final hidden states are moved there before the
    projection, which bypasses the hook (`projection.project`), so logits are where the head runs."""
    model = tiny_model("qwen3", vocab_size=VOCAB, num_layers=4)
    target = TargetAdapter(model)
    model.lm_head._hf_hook = _Hook("meta")
    assert target.logits_device == torch.device("meta") and target.device == torch.device("cpu")
    state = target.new_state(2)
    out = target.prefill(state, [[1, 5, 9], [4, 4, 7, 8]])
    assert out.logits.device.type == "meta" and tuple(out.logits.shape) == (2, 1, VOCAB)
    assert out.taps.device.type == "cpu"
    assert target.logits_at(torch.zeros(3, model.config.hidden_size)).device.type == "meta"


def test_taps_from_layers_on_another_device_are_moved_to_the_engines():
    """Each tap is captured on its layer's device and moved to the engine's (the embedding's, where
    the draft head reads them) before the three are fused: the last tapped layer's input is made
    to say it is on cuda:1 (and to become a plain CPU tensor when moved to the CPU)."""
    model = tiny_model("llama", vocab_size=VOCAB, num_layers=6)
    target = TargetAdapter(model)

    class Tap(Elsewhere):
        def to(self, *args, **kwargs):
            return self.as_subclass(torch.Tensor).to(*args, **kwargs)

    def relabel(_module, args, kwargs):  # prepended: runs before the adapter's tap hook
        return ((args[0].as_subclass(Tap), *args[1:]) if args else args), kwargs

    high = model.model.layers[target.tap_layers[2]]
    handle = high.register_forward_pre_hook(relabel, with_kwargs=True, prepend=True)
    try:
        out = target.prefill(target.new_state(1), [[1, 5, 9, 4]])
    finally:
        handle.remove()
    assert type(out.taps) is torch.Tensor and out.taps.device == target.device, type(out.taps)
    assert type(out.logits) is torch.Tensor


def test_module_device_follows_accelerates_execution_device():
    layer = torch.nn.Linear(2, 2)
    assert module_device(layer) == torch.device("cpu")
    layer._hf_hook = _Hook(1)
    assert module_device(layer) == torch.device("cuda", 1)
    layer._hf_hook = _Hook("cpu")
    assert module_device(layer) == torch.device("cpu")
    layer._hf_hook = _Hook(torch.device("cuda", 3))
    assert module_device(layer) == torch.device("cuda", 3)
    assert module_device(torch.nn.ReLU()) == torch.device("cpu")
