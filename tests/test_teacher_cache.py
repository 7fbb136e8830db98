"""The teacher cache (dart_train/teacher_cache.py, dart_train/teacher_cache_build.py) and training from it.

Tiny random fp32 targets saved as real model directories (config + weights + a word-level
tokenizer), so the fingerprints, the loader and both command-line entry points run for real.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from dart_train.draft_training import (
    TeacherPass,
    TopKTeacher,
    dart_kl_loss,
    draft_training_logits,
    kl_per_row,
    sample_anchors,
    top_k_teacher,
)
from dart_train.teacher_cache import (
    CachedExample,
    CachedExampleStream,
    TeacherCache,
    TeacherCacheMismatch,
    check_fingerprint,
    collate_teacher,
    decode_shard,
    encode_shard,
    read_manifest,
    shard_name,
)
from dart_train.teacher_cache_build import build_teacher_cache
from dart_train.trainer import ExampleStream, checkpoint_dirs, collate, load_trainer_state, parse_config
from dart_worker.artifacts.loading import load_target
from dart_worker.head.draft_checkpoint import load_draft_head
from dart_worker.head.draft_head import DartDraftHead
from jobs import train_draft
from tests.tiny_models import TINY_VOCAB, tiny_model, tiny_tokenizer

VD = 64  # draft vocabulary of the test heads
M = 3


def write_target(directory, seed: int = 0, tokenizer=None):
    model = tiny_model("gemma3", seed=seed, num_layers=4)
    model.save_pretrained(directory)
    (tokenizer or tiny_tokenizer()).save_pretrained(directory)
    return directory


def write_chats(path, n: int = 24, seed: int = 0):
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(4, TINY_VOCAB)]
    rows = []
    for i in range(n):
        question = " ".join(rng.choice(words[:30]) for _ in range(rng.randint(2, 6)))
        answer = " ".join(rng.choice(words) for _ in range(rng.randint(6, 20)))
        rows.append({"id": f"c{i}", "conversations": [{"from": "human", "value": question},
                                                      {"from": "gpt", "value": answer}]})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tc")
    return {"root": root, "target": write_target(root / "target"), "data": write_chats(root / "chats.jsonl")}


def args(setup, cache, *extra) -> list[str]:
    return [f"target={setup['target']}", f"data.source={setup['data']}", "data.dev_fraction=0.0",
            "data.shuffle_buffer=4", f"data.teacher_cache={cache}", "trainer.target_dtype=fp32", "trainer.device=cpu",
            f"head.draft_vocab_size={VD}", f"head.draft_length={M}", "head.vocab_conversations=24",
            "head.scale_fc_sequences=2", "cache.shard_tokens=96", "cache.batch_size=3", "cache.tap_dtype=model",
            "loss.anchors_per_sequence=4", "eval.dev_sequences=0", "eval.tau_prompts=0", "trainer.amp=false",
            "trainer.batch_size=2", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=10", "trainer.log_every=1",
            "optim.warmup_steps=2", "optim.lr=3e-3", *extra]


def build(setup, cache, *extra, **kwargs) -> dict:
    cfg = parse_config(args(setup, cache, *extra))
    return build_teacher_cache(cfg, progress=False, **kwargs)


def cache_files(url) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(url.iterdir())}


# -------------------------------------------------------------------------- format


def test_shard_round_trip_is_exact():
    torch.manual_seed(0)
    examples = []
    for n, p in ((5, 2), (9, 4), (1, 0)):
        examples.append(CachedExample(list(range(n)), p, (torch.randn(n, 12) * 300).to(torch.bfloat16),
                                      torch.randint(0, 20000, (n, 7)), torch.randn(n, 7), torch.rand(n)))
    back = decode_shard(encode_shard(examples, draft_vocab_size=20000))
    assert len(back) == len(examples)
    for a, b in zip(examples, back, strict=True):
        assert a.ids == b.ids and a.prompt_len == b.prompt_len
        assert b.taps.dtype == torch.bfloat16 and torch.equal(a.taps, b.taps)
        assert b.top_ids.dtype == torch.int16 and torch.equal(a.top_ids, b.top_ids.long())
        assert torch.equal(a.top_logprobs, b.top_logprobs) and torch.equal(a.rest_mass, b.rest_mass)


def test_built_cache_holds_the_training_examples_and_their_teacher(setup, tmp_path):
    cache_url = tmp_path / "cache"
    manifest = build(setup, cache_url, "cache.top_k=8")
    assert manifest["complete"] and len(manifest["shards"]) >= 3
    cache = TeacherCache(str(cache_url))
    cfg = parse_config(args(setup, cache_url))
    model, tokenizer = load_target(str(setup["target"]), dtype="fp32", device="cpu")
    live = ExampleStream(cfg.data, tokenizer, cfg.trainer.seed)
    cached = CachedExampleStream(cache, cfg.trainer.seed)
    teacher = TeacherPass(model, cache.kept_target_ids)
    for _ in range(manifest["examples"]):  # epoch 0 of the cache = epoch 0 of the training stream
        want, got = live.next_example(), cached.next_example()
        assert (got.ids, got.prompt_len) == (want.ids, want.prompt_len)
        out = teacher(torch.tensor([want.ids]))
        top = top_k_teacher(out.logits[0], 8)
        torch.testing.assert_close(got.taps, out.taps[0], rtol=1e-5, atol=1e-5)  # batched with padding at build
        assert torch.equal(got.top_ids.long(), top.ids)
        torch.testing.assert_close(got.top_logprobs, top.logprobs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.rest_mass, top.rest, rtol=1e-4, atol=1e-6)
    assert live.epoch == 0 and cached.epoch == 0
    cached.next_example()
    assert (cached.epoch, cached.position) == (1, 1)
    assert 0 < manifest["mean_rest_mass"] < 1


def test_cached_stream_resumes_and_shards_across_ranks(setup, tmp_path):
    cache_url = tmp_path / "cache"
    build(setup, cache_url)
    cache = TeacherCache(str(cache_url))
    total = cache.manifest["examples"]
    full = CachedExampleStream(cache, seed=3)
    seq = [tuple(full.next_example().ids) for _ in range(2 * total + 5)]
    assert sorted(seq[:total]) == sorted(seq[total : 2 * total]) and seq[:total] != seq[total : 2 * total]
    for cut in (1, total - 1, total + 3):
        first = CachedExampleStream(cache, seed=3)
        for _ in range(cut):
            first.next_example()
        resumed = CachedExampleStream(cache, seed=3, epoch=first.epoch, position=first.position)
        assert [tuple(resumed.next_example().ids) for _ in range(5)] == seq[cut : cut + 5]
    # Two ranks read disjoint shards that together are the whole cache.
    ranks = [CachedExampleStream(cache, seed=3, rank=r, world_size=2) for r in range(2)]
    counts = [sum(s["examples"] for s in cache.shards[r::2]) for r in range(2)]
    got = [[tuple(ranks[r].next_example().ids) for _ in range(counts[r])] for r in range(2)]
    assert sorted(got[0] + got[1]) == sorted(seq[:total])
    with pytest.raises(ValueError, match="shards"):
        CachedExampleStream(cache, seed=0, world_size=len(cache.shards) + 1)


# ---------------------------------------------------------------- resume and fingerprint


def test_resume_after_kill_equals_uninterrupted_build(setup, tmp_path):
    whole = tmp_path / "whole"
    build(setup, whole)
    killed = tmp_path / "killed"
    partial = build(setup, killed, stop_after_shards=2)
    assert not partial["complete"] and len(partial["shards"]) == 2
    # Killed while writing shard 2: a temporary file, and a shard file the manifest never listed.
    (killed / f".tmp-{shard_name(2)}").write_bytes(b"partial")
    (killed / shard_name(2)).write_bytes(b"written but not listed")
    with pytest.raises(OSError, match="incomplete"):
        TeacherCache(str(killed))
    build(setup, killed)
    assert cache_files(killed) == cache_files(whole)
    assert read_manifest(str(killed))["complete"]
    # A complete cache is left alone; a build with other settings is refused, naming them.
    build(setup, killed)
    with pytest.raises(TeacherCacheMismatch, match="build"):
        build(setup, killed, "cache.top_k=5")


def test_cache_of_another_target_tokenizer_taps_or_vocab_is_refused(setup, tmp_path):
    cache_url = tmp_path / "cache"
    build(setup, cache_url)
    other_target = write_target(tmp_path / "other_target", seed=7)
    with pytest.raises(TeacherCacheMismatch, match=r"different target \(target: cache has"):
        train_draft.main(args(setup, cache_url, f"target={other_target}", f"output_dir={tmp_path / 'r1'}"))

    renamed = tiny_tokenizer(vocab_size=TINY_VOCAB - 6)  # another vocabulary: another tokenizer
    other_tok = tmp_path / "other_tok"
    shutil.copytree(setup["target"], other_tok)
    renamed.save_pretrained(other_tok)
    with pytest.raises(TeacherCacheMismatch, match="tokenizer"):
        train_draft.main(args(setup, cache_url, f"target={other_tok}", f"output_dir={tmp_path / 'r2'}"))
    with pytest.raises(ValueError, match="draft_vocab"):
        train_draft.main(args(setup, cache_url, "head.draft_vocab_size=32", f"output_dir={tmp_path / 'r3'}"))
    fingerprint = TeacherCache(str(cache_url)).fingerprint
    with pytest.raises(TeacherCacheMismatch, match=r"different tap_layers \(tap_layers: cache has \[0, 2, 1\]"):
        check_fingerprint("u", {**fingerprint, "tap_layers": [0, 2, 1]}, fingerprint)


# ------------------------------------------------------------------------------ the loss


@pytest.mark.slow
def test_loss_from_cache_equals_live_loss(setup, tmp_path):
    """k = Vd: the cached loss is the live loss. k < Vd: it is the KL of the distributions coarsened
    to (top-k ids, everything else), computed here independently from the live logits, and a lower
    bound of the live KL row by row (docs/training.md, "Teacher cache")."""
    model, _ = load_target(str(setup["target"]), dtype="fp32", device="cpu")
    for k in (VD, 6):
        url = tmp_path / f"k{k}"
        build(setup, url, f"cache.top_k={k}")
        cache = TeacherCache(str(url))
        assert len(cache.kept_target_ids) == VD
        teacher = TeacherPass(model, cache.kept_target_ids)
        head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=M,
                                         kept_target_ids=cache.kept_target_ids.tolist(), seed=1, dtype=torch.float32)
        stream = CachedExampleStream(cache, seed=0)
        examples = [stream.next_example() for _ in range(3)]
        batch = collate(examples)
        taps, cached_teacher = collate_teacher(examples, batch.input_ids.shape[1])
        live = teacher(batch.input_ids)
        anchors, valid = sample_anchors(batch.lengths, batch.loss_starts, 4, torch.Generator().manual_seed(0))
        real, mask = draft_training_logits(head, live.taps, batch.input_ids, anchors)
        real_c, mask_c = draft_training_logits(head, taps, batch.input_ids, anchors)
        # Padding positions differ (the live taps are the target's states over pad tokens, the
        # cache pads with zeros); causal attention keeps them out of every real position's row.
        row_ok = torch.arange(batch.input_ids.shape[1] - 1)[None] < batch.lengths[:, None] - 1
        torch.testing.assert_close(real_c[row_ok], real[row_ok], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mask_c[valid], mask[valid], rtol=1e-5, atol=1e-5)
        args_ = (batch.lengths, batch.loss_starts, anchors, valid, 0.6)
        live_terms = dart_kl_loss(live.logits, real, mask, *args_)
        cached_terms = dart_kl_loss(cached_teacher, real_c, mask_c, *args_)
        assert torch.equal(cached_terms.count_per_position, live_terms.count_per_position)
        assert torch.equal(cached_terms.accuracy_per_position, live_terms.accuracy_per_position)
        if k == VD:
            torch.testing.assert_close(cached_terms.loss, live_terms.loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(cached_terms.kl_per_position, live_terms.kl_per_position, rtol=1e-5, atol=1e-6)
            continue
        # Independently: coarsen both distributions to k + 1 outcomes and take the dense KL.
        p = live.logits[:, 1:].float().softmax(-1)
        q = real.float().softmax(-1)
        top = p.topk(k, -1).indices
        p_c = torch.cat((p.gather(-1, top), 1 - p.gather(-1, top).sum(-1, keepdim=True)), -1)
        q_c = torch.cat((q.gather(-1, top), 1 - q.gather(-1, top).sum(-1, keepdim=True)), -1)
        coarse = (p_c * (p_c.log() - q_c.log())).sum(-1)
        mine = kl_per_row(cached_teacher[:, 1:], real_c)
        torch.testing.assert_close(mine[row_ok], coarse[row_ok], rtol=1e-4, atol=1e-5)
        full = kl_per_row(live.logits[:, 1:], real)
        assert bool((mine[row_ok] <= full[row_ok] + 1e-5).all())
        assert cached_terms.loss.item() <= live_terms.loss.item() + 1e-5


def test_top_k_kl_gradients_are_finite_when_every_id_is_kept():
    torch.manual_seed(0)
    teacher_logits, draft = torch.randn(4, 10) * 3, (torch.randn(4, 10) * 3).requires_grad_()
    dense = kl_per_row(teacher_logits, draft)
    sparse = kl_per_row(top_k_teacher(teacher_logits, 10), draft)
    torch.testing.assert_close(sparse, dense)
    sparse.sum().backward()
    assert torch.isfinite(draft.grad).all()
    assert isinstance(top_k_teacher(teacher_logits, 3)[1:], TopKTeacher)


# -------------------------------------------------------------------------- training


@pytest.mark.slow
def test_training_from_the_cache_checkpoints_and_resumes_identically(setup, tmp_path, monkeypatch):
    cache_url = tmp_path / "cache"
    build(setup, cache_url, "cache.top_k=16")
    calls = []
    real_call = TeacherPass.__call__
    monkeypatch.setattr(TeacherPass, "__call__", lambda self, *a, **k: calls.append(1) or real_call(self, *a, **k))
    # 14 steps x 2 sequences > the 24 examples of the cache: the stream wraps into later epochs.
    summary = train_draft.main(args(setup, cache_url, "trainer.max_steps=14", f"output_dir={tmp_path / 'a'}"))
    assert calls == []  # the target never ran
    manifest = read_manifest(str(cache_url))
    assert summary["steps"] == 14 and summary["teacher_cache"] == {
        "url": str(cache_url), "examples": 24, "tokens": manifest["tokens"], "sources": manifest["sources"]}
    assert list(manifest["sources"]) == [str(setup["data"])]
    assert summary["steady_tokens_per_s"] > 0
    dirs = checkpoint_dirs(tmp_path / "a")
    assert dirs[-1].name == "step-0000014" and load_trainer_state(dirs[-1])["data_positions"] == [[1, 4]]

    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(dirs[2], tmp_path / "b" / "checkpoints" / dirs[2].name)  # step 6
    train_draft.main(args(setup, cache_url, "trainer.max_steps=14", f"output_dir={tmp_path / 'b'}"))
    model, _ = load_target(str(setup["target"]), dtype="fp32", device="cpu")
    embed = model.get_input_embeddings()
    head_a = load_draft_head(dirs[-1], model.config, embed)
    head_b = load_draft_head(checkpoint_dirs(tmp_path / "b")[-1], model.config, embed)
    for (name, a), (_, b) in zip(head_a.state_dict().items(), head_b.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_cache_on_an_object_store_url_equals_the_local_one(setup, tmp_path):
    """A non-local fsspec URL (memory://, as s3:// through s3fs): single-put writes, same bytes."""
    import fsspec

    local = tmp_path / "local"
    build(setup, local)
    url = "memory://teacher-cache-test/tc"
    try:
        build(setup, url, stop_after_shards=1)
        build(setup, url)
        fs = fsspec.filesystem("memory")
        remote = {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.ls("/teacher-cache-test/tc", detail=False)}
        assert remote == cache_files(local)
        stream = CachedExampleStream(TeacherCache(url), seed=0)
        assert stream.next_example().ids == CachedExampleStream(TeacherCache(str(local)), seed=0).next_example().ids
    finally:
        fsspec.filesystem("memory").rm("/teacher-cache-test", recursive=True)


def test_a_mixture_of_sources_is_interleaved_and_counted_per_source(setup, tmp_path):
    """data.source as a list: the cache holds the interleaved stream's examples, and the manifest
    says how many examples, tokens and reply tokens each source gave (counted here independently
    from the live training stream)."""
    other = write_chats(tmp_path / "other.jsonl", n=5, seed=7)
    sources = f"data.source=[{setup['data']},{other}]"
    manifest = build(setup, tmp_path / "cache", sources, "cache.top_k=8")
    cfg = parse_config([*args(setup, tmp_path / "cache"), sources])
    _, tokenizer = load_target(str(setup["target"]), dtype="fp32", device="cpu")
    live = ExampleStream(cfg.data, tokenizer, cfg.trainer.seed)
    want: dict[str, dict[str, int]] = {}
    for _ in range(manifest["examples"]):
        e = live.next_example()
        entry = want.setdefault(e.origin, {"examples": 0, "tokens": 0, "reply_tokens": 0})
        entry["examples"] += 1
        entry["tokens"] += len(e.ids)
        entry["reply_tokens"] += len(e.ids) - e.prompt_len
    assert live.epoch == 0
    assert manifest["sources"] == want
    assert set(want) == {str(setup["data"]), str(other)} and want[str(other)]["examples"] == 5
    assert sum(v["tokens"] for v in want.values()) == manifest["tokens"]
    assert manifest["build"]["data"]["source"] == [str(setup["data"]), str(other)]
    assert all("sources" in shard for shard in manifest["shards"])


def test_bench_teacher_cache_reports_both_runs_and_the_projection_a_b(setup, tmp_path):
    """The benchmark's JSON line: live and cached throughput, and the dense vs row-selected step
    (both timed, losses equal)."""
    from jobs.bench import main as bench_main

    report = bench_main(["teacher_cache", *args(setup, tmp_path / "unused"), "bench.steps=3",
                         "bench.projection_steps=2", f"bench.work_dir={tmp_path / 'w'}"])
    assert report["live_tokens_per_s"] > 0 and report["cached_tokens_per_s"] > 0 and report["cache_examples"] == 6
    projection = report["projection"]
    assert projection["dense_step_s"] > 0 and projection["selected_step_s"] > 0
    assert projection["max_loss_difference"] < 1e-4
