"""Tests of the DART draft head (dart_worker/head/draft_head.py) and its checkpoints (draft_checkpoint.py).

The central check is `reference_logits`: a plain float64 re-implementation of the architecture
text (full causal attention over the whole committed prefix + MASK block, no cache, no batching),
against which the cached, ragged-batched `draft_logits` must agree round after round.
"""

from __future__ import annotations

import functools
import json
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from dart_worker.head.draft_checkpoint import (
    DraftHeadLoadError,
    load_draft_head,
    read_draft_config,
    save_draft_head,
)
from dart_worker.head.draft_head import DartDraftHead
from dart_worker.head.draft_head_config import DraftHeadConfig, DraftHeadConfigError
from dart_worker.head.draft_kv_cache import DraftKVCache
from dart_worker.head.draft_vocab import make_d2t
from tests.hypothesis_budget import examples
from tests.tiny_models import FAMILIES, TINY_VOCAB, tiny_model

DRAFT_LENGTH = 3
ATOL = 2e-5


@functools.cache
def target(family: str = "llama"):
    return tiny_model(family)


def make_head(family: str = "llama", seed: int = 0, embed_tokens=None, **kwargs) -> DartDraftHead:
    """A random head whose RMSNorm weights are random too: with unit weights norm(norm(x)) equals
    norm(x), and a test could not tell whether the final norm is applied twice."""
    model = target(family)
    kwargs.setdefault("draft_length", DRAFT_LENGTH)
    head = DartDraftHead.random_init(model.config, embed_tokens or model.get_input_embeddings(),
                                     seed=seed, **kwargs).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=gen) * 1.5 + 0.25)
    return head


def random_stream(head: DartDraftHead, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [length, 3*H_t] and next tokens [length] of one sequence's committed rows."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(length, 3 * head.config.target_hidden_size, generator=gen)
    tokens = torch.randint(0, head.config.vocab_size, (length,), generator=gen)
    return features, tokens


# ----------------------------------------------------------------------------------------------
# Reference: the architecture text, written out directly in float64.


def reference_logits(head: DartDraftHead, features: torch.Tensor, tokens: torch.Tensor,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [D, draft_vocab] after committing rows (features[j], token[j]) for j < N, from scratch.
    `positions`: the rows' absolute positions (default 0..N-1); the MASK rows follow the last."""
    cfg = head.config
    w = {name: t.detach().double() for name, t in head.state_dict().items() if t.is_floating_point()}
    n_rows, m, hidden_size = features.shape[0], cfg.draft_length, cfg.hidden_size
    heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def rms(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    hidden = features.double() @ w["fc.weight"].T
    embeds = head.embed_tokens(tokens).detach().double()  # the target's module (Gemma3 scales it)
    x = torch.cat((rms(embeds, w["midlayer.input_layernorm.weight"]),
                   rms(hidden, w["midlayer.hidden_norm.weight"])), dim=-1)
    mask_rep = w["midlayer.mask_rep"]
    x = torch.cat((x, mask_rep.expand(m, -1)))
    residual = torch.cat((hidden, mask_rep[:hidden_size].expand(m, -1)))
    rows = n_rows + m

    if positions is None:
        positions = torch.arange(n_rows)
    positions = torch.cat((positions.double(), positions[-1] + 1 + torch.arange(m, dtype=torch.float64)))
    if cfg.rope_scaling is not None:
        assert cfg.rope_scaling["rope_type"] == "linear"
        positions = positions / cfg.rope_scaling["factor"]
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]

    def rope(t):  # t [rows, heads, hd]; pairs (i, i + hd/2) rotate together
        t1, t2 = t[..., : hd // 2], t[..., hd // 2 :]
        return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1)

    q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(rows, heads, hd))
    k = rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(rows, kv_heads, hd))
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(rows, kv_heads, hd)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("rhd,shd->hrs", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(rows, rows, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hrs,shd->rhd", scores.softmax(-1), v).reshape(rows, heads * hd)
    h = (residual + attn @ w["midlayer.self_attn.o_proj.weight"].T)[n_rows - 1 :]

    g = rms(h, w["midlayer.post_attention_layernorm.weight"])
    gate = g @ w["midlayer.mlp.gate_proj.weight"].T
    up = g @ w["midlayer.mlp.up_proj.weight"].T
    h = h + (gate * torch.sigmoid(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    h = rms(rms(h, w["norm.weight"]), w["norm.weight"])
    return h @ w["lm_head.weight"].T


def run_batched(head: DartDraftHead, streams, schedule, pad_with_garbage: bool = True, bucketed: bool = False):
    """Run `draft_logits` round by round; schedule[r][b] = rows sequence b commits in round r.

    Padding rows get NaN features and token -1: they must be ignored, not merely down-weighted.
    Returns per round the logits [B, D, V] and the cache.
    """
    batch = len(streams)
    cache = head.new_cache(batch)
    done = [0] * batch
    results = []
    for counts in schedule:
        n = max(counts)
        features = torch.full((batch, n, streams[0][0].shape[1]), float("nan") if pad_with_garbage else 0.0)
        tokens = torch.full((batch, n), -1 if pad_with_garbage else 0, dtype=torch.long)
        for b, count in enumerate(counts):
            features[b, :count] = streams[b][0][done[b] : done[b] + count]
            tokens[b, :count] = streams[b][1][done[b] : done[b] + count]
            done[b] += count
        results.append(head.draft_logits(features, tokens, torch.tensor(counts), cache, bucketed=bucketed))
    return results, cache


# ----------------------------------------------------------------------------------------------
# Exactness of the cache and of ragged batching.


@pytest.mark.parametrize("family", FAMILIES)
def test_bucketed_shapes_give_the_exact_logits(family):
    """The `bucketed` shapes strategy (CUDA) pads a round's rows to their bucket and attends over
    a bucket of cache slots (growing the buffers past what is used): the logits and the cache's
    contents are those of the exact shapes, over ragged rounds that cross several buckets."""
    head = make_head(family)
    schedule = [[30, 7, 1], [1, 3, 2], [40, 1, 5], [3, 60, 1], [1, 1, 1]]
    streams = [random_stream(head, sum(r[b] for r in schedule), seed=b) for b in range(3)]
    exact, exact_cache = run_batched(head, streams, schedule)
    seen = []
    attend = head.midlayer.self_attn.attend
    head.midlayer.self_attn.attend = lambda q, k, v, allowed: seen.append(k.shape[2] - DRAFT_LENGTH) or attend(
        q, k, v, allowed)
    try:
        bucketed, bucketed_cache = run_batched(head, streams, schedule, bucketed=True)
    finally:
        del head.midlayer.self_attn.attend
    for got, expected in zip(bucketed, exact, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    assert bucketed_cache.lengths.tolist() == exact_cache.lengths.tolist()
    torch.testing.assert_close(bucketed_cache.keys, exact_cache.keys)
    assert seen == [64, 64, 96, 96, 96]  # cache slots read: context buckets, not the used slots


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_draft_logits_matches_full_reference(family):
    head = make_head(family)
    counts = [7, 1, 4, 2, 3, 1]
    stream = random_stream(head, sum(counts), seed=1)
    results, cache = run_batched(head, [stream], [[c] for c in counts])
    committed = 0
    for count, logits in zip(counts, results, strict=True):
        committed += count
        expected = reference_logits(head, stream[0][:committed], stream[1][:committed])
        assert logits.dtype == torch.float32 and logits.shape == (1, DRAFT_LENGTH + 1, TINY_VOCAB)
        torch.testing.assert_close(logits[0].double(), expected, atol=ATOL, rtol=0)
    assert cache.lengths.tolist() == [sum(counts)]


@pytest.mark.parametrize("family", FAMILIES)
def test_skipped_rows_keep_the_positions_of_the_rows_after_them(family):
    """A cache told to skip rows (a head resuming after a long pause reads only the latest) puts
    the rows after them at their true positions: the logits are those of the sequence without the
    skipped rows but with every other row where it stood, not those of the rows moved up."""
    head = make_head(family)
    features, tokens = random_stream(head, 20, seed=4)
    cache = head.new_cache(1)
    head.draft_logits(features[None, :6], tokens[None, :6], [6], cache)
    cache.skip([9])  # rows 6..14 are never read
    logits = head.draft_logits(features[None, 15:], tokens[None, 15:], [5], cache)
    kept = torch.cat((torch.arange(6), torch.arange(15, 20)))
    expected = reference_logits(head, features[kept], tokens[kept], positions=kept)
    torch.testing.assert_close(logits[0].double(), expected, atol=ATOL, rtol=0)
    moved_up = reference_logits(head, features[kept], tokens[kept])
    assert not torch.allclose(logits[0].double(), moved_up, atol=ATOL, rtol=0)
    assert cache.lengths.tolist() == [11] and cache.next_positions().tolist() == [20]
    cache.select([0, 0])
    assert cache.skipped.tolist() == [9, 9]
    assert type(cache).concat([cache, head.new_cache(1)]).next_positions().tolist() == [20, 20, 0]
    with pytest.raises(ValueError, match=r"skipped .* must match lengths"):
        type(cache)(cache.keys, cache.values, cache.lengths, skipped=[1, 2, 3])


class ShiftedEmbedding(torch.nn.Embedding):
    """An embedding whose output is not a plain row of `.weight` (like Gemma3's scaled one, but a
    shift, which input_layernorm cannot normalise away)."""

    def forward(self, ids):
        return super().forward(ids) + 0.75


def test_head_calls_the_target_embedding_module():
    plain = target("llama").get_input_embeddings()
    shifted = ShiftedEmbedding(plain.num_embeddings, plain.embedding_dim)
    shifted.weight.data.copy_(plain.weight.data)
    head, head_plain = make_head("llama", embed_tokens=shifted), make_head("llama")
    stream = random_stream(head, 7, seed=3)
    results, _ = run_batched(head, [stream], [[7]])
    torch.testing.assert_close(results[0][0].double(), reference_logits(head, *stream), atol=ATOL, rtol=0)
    assert not torch.allclose(results[0], run_batched(head_plain, [stream], [[7]])[0][0], atol=1e-3)


def test_reference_is_sensitive_to_rope_scaling_and_head_matches_it():
    """The rope_scaling dict reaches transformers' RoPE (linear: positions / factor)."""
    head = make_head("llama", rope_scaling={"rope_type": "linear", "factor": 4.0})
    plain = make_head("llama")
    stream = random_stream(head, 9, seed=2)
    results, _ = run_batched(head, [stream], [[6], [3]])
    expected = reference_logits(head, *stream)
    torch.testing.assert_close(results[-1][0].double(), expected, atol=ATOL, rtol=0)
    unscaled, _ = run_batched(plain, [stream], [[6], [3]])
    assert not torch.allclose(unscaled[-1], results[-1], atol=1e-3)


@settings(max_examples=examples(20), deadline=None)
@given(st.data())
def test_ragged_batch_equals_each_sequence_alone(data):
    batch = data.draw(st.integers(1, 4), label="batch")
    rounds = data.draw(st.integers(1, 4), label="rounds")
    prefill = st.integers(1, 9)
    step = st.integers(1, DRAFT_LENGTH + 1)
    schedule = [[data.draw(prefill if r == 0 else step) for _ in range(batch)] for r in range(rounds)]
    head = make_head("qwen3")
    streams = [random_stream(head, sum(row[b] for row in schedule), seed=10 + b) for b in range(batch)]

    batched, cache = run_batched(head, streams, schedule)
    for b in range(batch):
        alone, alone_cache = run_batched(head, [streams[b]], [[row[b]] for row in schedule])
        for r in range(rounds):
            torch.testing.assert_close(batched[r][b], alone[r][0], atol=ATOL, rtol=0)
        length = int(alone_cache.lengths[0])
        torch.testing.assert_close(cache.keys[b, :, :length], alone_cache.keys[0], atol=ATOL, rtol=0)
    assert cache.lengths.tolist() == [sum(row[b] for row in schedule) for b in range(batch)]
    assert cache.keys.shape[2] == max(cache.lengths.tolist())


def test_ragged_batch_matches_reference_directly():
    head = make_head("gemma3")
    schedule = [[5, 1, 8], [2, 4, 1], [4, 3, 2]]
    streams = [random_stream(head, sum(row[b] for row in schedule), seed=20 + b) for b in range(3)]
    results, _ = run_batched(head, streams, schedule)
    for b in range(3):
        total = sum(row[b] for row in schedule)
        expected = reference_logits(head, streams[b][0][:total], streams[b][1][:total])
        torch.testing.assert_close(results[-1][b].double(), expected, atol=ATOL, rtol=0)


def test_cache_select_and_concat_keep_sequences_exact():
    """Dropping / reordering / adding sequences between rounds leaves every sequence's drafts exact."""
    head = make_head("llama")
    streams = [random_stream(head, 12, seed=30 + b) for b in range(3)]
    first, cache_a = run_batched(head, streams[:2], [[4, 6], [2, 1]])
    _, cache_b = run_batched(head, streams[2:], [[5], [3]])
    cache_a.select([1])
    cache = DraftKVCache.concat([cache_b, cache_a])  # sequences 2, 1
    assert cache.lengths.tolist() == [8, 7]
    done = {2: 8, 1: 7}
    features = torch.stack([streams[2][0][8:10], streams[1][0][7:9]])
    tokens = torch.stack([streams[2][1][8:10], streams[1][1][7:9]])
    logits = head.draft_logits(features, tokens, torch.tensor([2, 1]), cache)
    for row, (b, extra) in enumerate([(2, 2), (1, 1)]):
        total = done[b] + extra
        expected = reference_logits(head, streams[b][0][:total], streams[b][1][:total])
        torch.testing.assert_close(logits[row].double(), expected, atol=ATOL, rtol=0)
    assert first[0].shape == (2, DRAFT_LENGTH + 1, TINY_VOCAB)


def test_uncached_layer_forward_matches_reference():
    """DartMidLayer.forward (the training path: all rows, caller's mask) is the same function."""
    head = make_head("qwen3")
    features, tokens = random_stream(head, 8, seed=35)
    m, layer = DRAFT_LENGTH, head.midlayer
    with torch.no_grad():
        hidden = head.fc(features[None])
        mask_in, mask_residual = layer.mask_rows(1, m)
        attn_in = torch.cat((layer.attention_input(head.embed_tokens(tokens[None]), hidden), mask_in), dim=1)
        residual = torch.cat((hidden, mask_residual), dim=1)
        cos, sin = head.rope(torch.arange(8 + m)[None], torch.float32)
        causal = torch.ones(8 + m, 8 + m, dtype=torch.bool).tril()[None, None]
        logits = head.logits(layer(attn_in, residual, cos, sin, causal)[:, 8 - 1 :])
    torch.testing.assert_close(logits[0].double(), reference_logits(head, features, tokens), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------
# MASK rows: never cached, causal among themselves.


def test_mask_rows_never_enter_the_cache():
    head = make_head("llama")
    other = make_head("llama")
    with torch.no_grad():
        other.midlayer.mask_rep.add_(1.0)  # same weights except the MASK representation
    streams = [random_stream(head, 10, seed=40 + b) for b in range(2)]
    schedule = [[6, 3], [2, 4]]
    ours, cache = run_batched(head, streams, schedule)
    theirs, other_cache = run_batched(other, streams, schedule)
    assert cache.lengths.tolist() == [8, 7] and cache.keys.shape[2] == 8
    torch.testing.assert_close(cache.keys, other_cache.keys, atol=0, rtol=0)
    torch.testing.assert_close(cache.values, other_cache.values, atol=0, rtol=0)
    for r in range(len(schedule)):
        # Row 0 (the last real row) never sees MASK rows, past or present ...
        torch.testing.assert_close(ours[r][:, 0], theirs[r][:, 0], atol=0, rtol=0)
        # ... while the MASK rows themselves do depend on mask_rep.
        assert not torch.allclose(ours[r][:, 1:], theirs[r][:, 1:], atol=1e-3)


@pytest.mark.parametrize("perturbed", range(1, DRAFT_LENGTH + 1))
def test_mask_block_is_causal(perturbed, monkeypatch):
    """Changing MASK row `perturbed` changes exactly the output rows >= perturbed."""
    head = make_head("llama")
    stream = random_stream(head, 6, seed=50)
    features, tokens = stream[0][None], stream[1][None]
    baseline = head.draft_logits(features, tokens, torch.tensor([6]), head.new_cache(1))

    original = head.midlayer.mask_rows

    def perturbed_rows(batch_size, count):
        attn_in, residual = (t.clone() for t in original(batch_size, count))
        attn_in[:, perturbed - 1] += 0.5
        residual[:, perturbed - 1] -= 0.5
        return attn_in, residual

    monkeypatch.setattr(head.midlayer, "mask_rows", perturbed_rows)
    changed = head.draft_logits(features, tokens, torch.tensor([6]), head.new_cache(1))
    torch.testing.assert_close(changed[:, :perturbed], baseline[:, :perturbed], atol=0, rtol=0)
    for row in range(perturbed, DRAFT_LENGTH + 1):
        assert not torch.allclose(changed[:, row], baseline[:, row], atol=1e-4), row


# ----------------------------------------------------------------------------------------------
# Inputs, vocab maps, config.


def test_draft_logits_rejects_bad_inputs():
    head = make_head("llama", max_position_embeddings=12)
    features, tokens = random_stream(head, 10, seed=60)
    with pytest.raises(ValueError, match=r"num_new must lie in \[1, n=4\]"):
        head.draft_logits(features[None, :4], tokens[None, :4], torch.tensor([0]), head.new_cache(1))
    with pytest.raises(ValueError, match=r"num_new must lie"):
        head.draft_logits(features[None, :4], tokens[None, :4], torch.tensor([5]), head.new_cache(1))
    with pytest.raises(ValueError, match=r"features must have shape \[B=1, n, 3\*H_t=192\]"):
        head.draft_logits(features[None, :4, :64], tokens[None, :4], torch.tensor([4]), head.new_cache(1))
    with pytest.raises(ValueError, match=r"next_tokens must be an integer array of shape \(1, 4\)"):
        head.draft_logits(features[None, :4], tokens[None, :3], torch.tensor([4]), head.new_cache(1))
    bad_tokens = tokens[None, :4].clone()
    bad_tokens[0, 1] = TINY_VOCAB
    with pytest.raises(ValueError, match=r"next_tokens of real rows must lie in \[0, 96\)"):
        head.draft_logits(features[None, :4], bad_tokens, torch.tensor([4]), head.new_cache(1))
    # Running past max_position_embeddings (10 + 3 MASK rows > 12) is allowed: RoPE extends,
    # and the engine never verifies drafts past the target's context limit.
    logits = head.draft_logits(features[None, :10], tokens[None, :10], torch.tensor([10]), head.new_cache(1))
    assert torch.isfinite(logits).all()


def test_reduced_draft_vocabulary_maps_to_target_ids():
    kept = [17, 3, 90, 42, 5]
    d2t = make_d2t(kept, TINY_VOCAB)
    assert (torch.arange(5) + d2t).tolist() == sorted(kept)
    head = make_head("llama", kept_target_ids=kept)
    assert head.to_target_ids(torch.tensor([[0, 4], [2, 1]])).tolist() == [[3, 90], [17, 5]]
    assert head.t2d.nonzero().flatten().tolist() == sorted(kept)
    logits = head.draft_logits(*(t[None] for t in random_stream(head, 4, seed=61)), torch.tensor([4]),
                          head.new_cache(1))
    assert logits.shape == (1, DRAFT_LENGTH + 1, len(kept))
    with pytest.raises(ValueError, match="duplicates"):
        make_d2t([1, 2, 2])
    with pytest.raises(ValueError, match=r"\[0, 96\)"):
        make_d2t([1, 96], TINY_VOCAB)


def test_full_vocabulary_head_is_identity_map():
    head = make_head("qwen3")
    ids = torch.arange(TINY_VOCAB)
    assert torch.equal(head.to_target_ids(ids), ids)


def test_bfloat16_head_returns_float32_logits():
    head = make_head("llama", dtype=torch.bfloat16)
    features, tokens = random_stream(head, 6, seed=62)
    logits = head.draft_logits(features[None].bfloat16(), tokens[None], torch.tensor([6]), head.new_cache(1))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    expected = reference_logits(head, features.bfloat16().float(), tokens)
    assert (logits[0].double() - expected).abs().max() < 0.25  # bf16 rounding only


def test_random_init_is_seeded_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b = make_head("llama", seed=5), make_head("llama", seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_embedding_is_not_part_of_the_head():
    head = make_head("gemma3", dtype=torch.bfloat16)
    assert not any(name.startswith("embed_tokens") for name in head.state_dict())
    assert target("gemma3").get_input_embeddings().weight.dtype == torch.float32  # not converted


def config_dict(**changes):
    data = make_head("llama").config.to_dict()
    data.update(changes)
    return data


def test_config_round_trips_and_keeps_unknown_keys():
    data = config_dict(architectures=["LlamaForCausalLMDart"], torch_dtype="bfloat16")
    config = DraftHeadConfig.from_dict(data)
    assert config.to_dict() == data
    assert config.extras == {"architectures": ["LlamaForCausalLMDart"], "torch_dtype": "bfloat16"}


def test_config_optional_fields_follow_the_reference_loader():
    data = config_dict()
    for key in ("head_dim", "rope_theta", "rope_scaling", "hidden_act", "target_hidden_size"):
        del data[key]
    data["num_attention_heads"] = 8
    data["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    config = DraftHeadConfig.from_dict(data)
    assert config.head_dim == 64 // 8 and config.target_hidden_size == 64 and config.hidden_act == "silu"
    assert config.rope_theta == 5e5 and config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("changes, message", [
    ({"draft_length": 0}, "draft_length must be a positive integer"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"draft_vocab_size": 97}, r"draft_vocab_size \(97\) exceeds vocab_size \(96\)"),
    ({"hidden_act": "nope"}, "unknown hidden_act"),
    ({"rms_norm_eps": True}, "rms_norm_eps must be a positive number"),
])
def test_config_rejects_bad_values(changes, message):
    with pytest.raises(DraftHeadConfigError, match=message):
        DraftHeadConfig.from_dict(config_dict(**changes))


# ----------------------------------------------------------------------------------------------
# Checkpoints.


def draft_logits_rounds(head, seed=70):
    streams = [random_stream(head, 12, seed=seed + b) for b in range(2)]
    return run_batched(head, streams, [[5, 7], [3, 1], [2, 4]])[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_round_trip_gives_identical_outputs(family, tmp_path):
    head = make_head(family, kept_target_ids=list(range(0, TINY_VOCAB, 3)))
    head.config.extras["architectures"] = ["LlamaForCausalLMDart"]
    save_draft_head(head, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    model = target(family)
    loaded = load_draft_head(tmp_path, model.config, model.get_input_embeddings(), "cpu", torch.float32)
    assert loaded.config == head.config and loaded.config.extras == head.config.extras
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    for ours, theirs in zip(draft_logits_rounds(head), draft_logits_rounds(loaded), strict=True):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def test_load_converts_dtype_and_checks_an_embedding_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "cache"))  # a head with a copy is mapped once there
    head = make_head("llama")
    save_draft_head(head, tmp_path / "head")
    model = target("llama")
    tensors = load_file(tmp_path / "head" / "model.safetensors")
    tensors["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()  # published heads carry one
    save_file(tensors, tmp_path / "head" / "model.safetensors")
    loaded = load_draft_head(tmp_path / "head", model.config, model.get_input_embeddings(), dtype=torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.d2t.dtype == torch.long
    assert read_draft_config(tmp_path / "head") == head.config
    tensors["embed_tokens.weight"] = torch.zeros(TINY_VOCAB, 64)  # fits the shapes, but another model's
    save_file(tensors, tmp_path / "head" / "model.safetensors")
    with pytest.raises(DraftHeadLoadError, match="this head was trained with another target"):
        load_draft_head(tmp_path / "head", model.config, model.get_input_embeddings())


def edit_tensors(edit):
    def apply(directory):
        tensors = load_file(directory / "model.safetensors")
        edit(tensors)
        save_file(tensors, directory / "model.safetensors")
    return apply


def edit_config(edit):
    def apply(directory):
        data = json.loads((directory / "config.json").read_text())
        edit(data)
        (directory / "config.json").write_text(json.dumps(data))
    return apply


def write_pickle(directory):
    torch.save({"fc.weight": torch.zeros(2, 2)}, directory / "model.safetensors")


def write_plain_pickle(directory):
    (directory / "model.safetensors").write_bytes(pickle.dumps({"fc.weight": [0.0]}, protocol=2))


def write_garbage(directory):
    (directory / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")


def set_d2t(values):
    def edit(tensors):
        tensors["d2t"] = torch.tensor(values, dtype=torch.long)
    return edit


def shift_d2t(tensors):
    tensors["d2t"][-1] = 1  # maps the last draft id to target id 96: outside the vocabulary


def duplicate_d2t(tensors):
    tensors["d2t"][1] = -1  # draft id 1 -> target id 0, same as draft id 0


LOAD_ERRORS = {
    "missing key": (edit_tensors(lambda t: t.pop("midlayer.mask_rep")), r"missing \['midlayer.mask_rep'\]"),
    "unexpected key": (edit_tensors(lambda t: t.update(extra=torch.zeros(1))), r"unexpected \['extra'\]"),
    "wrong shape": (edit_tensors(lambda t: t.update({"norm.weight": torch.ones(63)})),
                    r"norm.weight has shape \(63,\), expected \(64,\)"),
    "fc width": (edit_tensors(lambda t: t.update({"fc.weight": torch.zeros(64, 128)})),
                 r"fc.weight has shape \(64, 128\), expected \(64, 192\) \(fc reads 3 x target_hidden_size = 192"),
    "integer weight": (edit_tensors(lambda t: t.update({"norm.weight": torch.ones(64, dtype=torch.int32)})),
                       "norm.weight has dtype torch.int32, expected floating point"),
    "target hidden size": (edit_config(lambda c: c.update(target_hidden_size=32)),
                           "target_hidden_size is 32, but the target's hidden size is 64"),
    "vocab": (edit_config(lambda c: c.update(vocab_size=100)),
              "vocab_size is 100, but the target's vocabulary has 96 tokens"),
    "hidden size": (edit_config(lambda c: c.update(hidden_size=32, head_dim=8)),
                    "hidden_size is 32, but the target's token embeddings are 64 wide"),
    "d2t out of vocab": (edit_tensors(shift_d2t), r"outside the target vocabulary \[0, 96\)"),
    "d2t duplicate": (edit_tensors(duplicate_d2t), "two draft ids to the same target id"),
    "d2t float": (edit_tensors(lambda t: t.update(d2t=t["d2t"].float())), "d2t must hold integers"),
    "t2d shape": (edit_tensors(lambda t: t.update(t2d=torch.zeros(5, dtype=torch.bool))),
                  r"t2d has shape \(5,\), expected \(96,\)"),
    "embedding copy": (edit_tensors(lambda t: t.update({"embed_tokens.weight": torch.zeros(96, 32)})),
                       r"embed_tokens.weight has shape \(96, 32\), but the target's embedding is \(96, 64\)"),
    "torch.save pickle": (write_pickle, "pickle / torch.save archive, not safetensors"),
    "plain pickle": (write_plain_pickle, "pickle / torch.save archive, not safetensors"),
    "garbage": (write_garbage, "not a valid safetensors file"),
    "missing config field": (edit_config(lambda c: c.pop("draft_length")),
                             r"missing required field\(s\) \['draft_length'\]"),
    "config not json": (lambda d: (d / "config.json").write_text("{"), "not a readable JSON file"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors found"),
    "no config": (lambda d: (d / "config.json").unlink(), "no config.json found"),
}


@pytest.mark.parametrize("case", LOAD_ERRORS)
def test_loader_rejects_bad_checkpoints(case, tmp_path, monkeypatch):
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "cache"))
    corrupt, message = LOAD_ERRORS[case]
    save_draft_head(make_head("llama"), tmp_path)
    corrupt(tmp_path)

    def no_unpickling(*args, **kwargs):
        raise AssertionError("the loader must never unpickle")

    monkeypatch.setattr(torch, "load", no_unpickling)
    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    model = target("llama")
    with pytest.raises(DraftHeadLoadError, match=message):
        load_draft_head(tmp_path, model.config, model.get_input_embeddings(), "cpu", torch.float32)
