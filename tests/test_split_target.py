"""A target spread over several devices (dart_worker/artifacts/loading.py: split_device_map, load_target's
`devices` / `device_map`). Without GPUs this checks what a CPU can: the placement accelerate computes
for two CUDA devices (whole layers, in order, balanced, embedding first, nothing on CPU or disk, a
clear error when the target does not fit), and that a target loaded through a per-module device map
decodes exactly like one loaded whole. Two real GPUs are what jobs.gpu_acceptance is for."""

from __future__ import annotations

import warnings

import pytest
import torch

from dart_worker.artifacts.loading import describe_placement, load_target, split_device_map
from dart_worker.artifacts.random_models import tiny_config
from tests.tiny_models import save_tiny_target

TWO_GPUS = [torch.device("cuda:0"), torch.device("cuda:1")]


def _split(config, memory):
    with warnings.catch_warnings():  # accelerate warns that the devices are not present here
        warnings.simplefilter("ignore")
        return split_device_map(config, TWO_GPUS, torch.float32, max_memory=memory)


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_split_places_whole_layers_in_order_over_both_devices(family):
    config = tiny_config(family, num_layers=8)
    device_map = _split(config, {0: 2_000_000, 1: 2_000_000})
    layers = [device_map[f"model.layers.{i}"] for i in range(8)]
    assert layers == sorted(layers) and set(layers) == {0, 1}, layers  # contiguous, both used
    assert abs(layers.count(0) - layers.count(1)) <= 2  # balanced
    assert device_map["model.embed_tokens"] == 0
    assert set(device_map.values()) <= {0, 1}
    if config.tie_word_embeddings:
        assert device_map["lm_head"] == device_map["model.embed_tokens"]
    else:
        assert device_map["lm_head"] == 1


def test_split_refuses_a_target_that_does_not_fit():
    with pytest.raises(ValueError, match=r"the target needs 0\.0 GiB in float32 but 2 device\(s\) offer .* give each "
                                         r"worker more GPUs \(resources.num_gpus_per_worker\)"):
        _split(tiny_config("qwen3", num_layers=8), {0: 200_000, 1: 200_000})
    with pytest.raises(ValueError, match="distinct CUDA devices"):
        split_device_map(tiny_config("qwen3"), ["cpu", "cpu"], torch.float32)


def test_target_spread_by_a_module_map_decodes_like_one_loaded_whole(tmp_path):
    """The computed two-device map, with device 0 -> the CPU and device 1 -> disk (accelerate's
    offload: the one second "device" a CPU machine has): the weights of the second half are loaded
    layer by layer through accelerate's hooks, as they would be moved to cuda:1."""
    directory = save_tiny_target(tmp_path / "t", "qwen3", num_layers=8, seed=4)
    computed = _split(tiny_config("qwen3", num_layers=8), {0: 2_000_000, 1: 2_000_000})
    device_map = {name: "cpu" if where == 0 else "disk" for name, where in computed.items()}
    spread, _ = load_target(directory, dtype="fp32", device="cpu", device_map=device_map,
                            offload_folder=tmp_path / "offload")
    whole, _ = load_target(directory, dtype="fp32", device="cpu")
    assert spread.hf_device_map == device_map
    assert spread.model.layers[7].self_attn.q_proj.weight.device.type == "meta"  # not resident: offloaded
    assert describe_placement(spread) == "cpu (embed_tokens, layers 0-3), disk (layers 4-7, norm, rotary_emb, lm_head)"
    prompt = torch.tensor([[1, 7, 19, 40, 3, 11]])
    assert spread.generate(prompt, max_new_tokens=16, do_sample=False).tolist() == \
        whole.generate(prompt, max_new_tokens=16, do_sample=False).tolist()
    with pytest.raises(ValueError, match="puts the token embedding on meta, the engine's device is cpu"):
        load_target(directory, dtype="fp32", device="cpu", offload_folder=tmp_path / "offload2",
                    device_map={**device_map, "model.embed_tokens": "disk"})


def test_gguf_targets_are_not_split(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="a GGUF file is loaded on one device"):
        load_target(path, device="cpu", device_map={"": "cpu"})
