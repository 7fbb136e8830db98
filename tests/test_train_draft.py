"""Draft-head training: block mask, pairing with inference, loss, optimisation, checkpoint/resume.

Everything runs on tiny random fp32 targets (tests/tiny_models.py) and a byte-level fake
tokenizer, so the whole file takes seconds.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_train import trainer
from dart_train.corpus import Conversation, Turn
from dart_train.draft_training import (
    TeacherPass,
    block_attention_mask,
    dart_kl_loss,
    draft_training_logits,
    kl_per_row,
    loss_rows,
    most_frequent_ids,
    sample_anchors,
    top_k_teacher,
)
from dart_train.trainer import (
    TrainConfig,
    WorkerContext,
    checkpoint_dirs,
    collate,
    conversation_example,
    load_trainer_state,
    lr_lambda,
    parse_config,
    train_loop,
)
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.head.draft_checkpoint import load_draft_head
from dart_worker.head.draft_head import DartDraftHead
from dart_worker.sampling.params import SamplingParams
from dart_worker.target.adapter import TargetAdapter
from tests.hypothesis_budget import examples
from tests.tiny_models import TINY_VOCAB, tiny_model

M = 3  # draft_length of the test heads


# ------------------------------------------------------------------------------- helpers


class ByteTokenizer:
    """Ids = bytes folded into the tiny vocabulary (>= 3); BOS 1, EOS 2; no chat template."""

    eos_token_id = 2
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [3 + b % (TINY_VOCAB - 3) for b in text.encode()]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def chats(n: int, seed: int = 0) -> list[Conversation]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "the", "a", "of", "cat", "dog", "runs"]
    out = []
    for i in range(n):
        question = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
        answer = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
        out.append(Conversation(f"c{i}", (Turn("user", question), Turn("assistant", answer)), f"c{i}"))
    return out


def make_head(model, seed: int = 1, vocab: int = 64) -> DartDraftHead:
    kept = list(range(vocab))
    return DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=M,
                                     kept_target_ids=kept, seed=seed, dtype=torch.float32)


def brute_force_mask(num_real: int, anchors: list[int], m: int) -> torch.Tensor:
    """Row r may attend to column c, spelled out row by row from the DART definition."""
    rows = [("real", j, None) for j in range(num_real)]
    rows += [("mask", a, i) for a in anchors for i in range(1, m + 1)]
    size = len(rows)
    out = torch.zeros(size, size, dtype=torch.bool)
    for r, (kind_r, pos_r, i_r) in enumerate(rows):
        for c, (kind_c, pos_c, i_c) in enumerate(rows):
            if kind_r == "real":
                out[r, c] = kind_c == "real" and pos_c <= pos_r
            elif kind_c == "real":
                out[r, c] = pos_c <= pos_r  # a MASK row sees its anchor's prefix
            else:  # same block (same anchor and same block index), causal inside it
                out[r, c] = (r - num_real) // m == (c - num_real) // m and i_c <= i_r
    return out


# ------------------------------------------------------------------------------ the mask


@settings(max_examples=examples(40), deadline=None)
@given(num_real=st.integers(1, 12), m=st.integers(1, 4), data=st.data())
def test_block_mask_equals_brute_force(num_real, m, data):
    k = data.draw(st.integers(0, 4))
    anchors = [data.draw(st.integers(0, num_real - 1)) for _ in range(k)]
    got = block_attention_mask(num_real, torch.tensor([anchors], dtype=torch.long).view(1, k), m)
    assert got.shape == (1, 1, num_real + k * m, num_real + k * m)
    assert torch.equal(got[0, 0], brute_force_mask(num_real, anchors, m))


def test_sample_anchors_range_and_distinct():
    lengths = torch.tensor([20, 6, 2])
    starts = torch.tensor([5, 0, 0])
    gen = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(lengths, starts, 8, gen)
    a0 = anchors[0][valid[0]]
    assert len(a0) == 8 and len(set(a0.tolist())) == 8
    assert int(a0.min()) >= 5 and int(a0.max()) <= 17  # p <= L-3
    assert anchors[1][valid[1]].tolist() == [0, 1, 2, 3]  # fewer candidates than K: all of them
    assert not valid[2].any()  # L = 2: no MASK row has a teacher (p <= L-3)


# -------------------------------------------------------------- training == inference


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_training_forward_equals_draft_logits(family):
    model = tiny_model(family, num_layers=4)
    head = make_head(model).eval()
    torch.manual_seed(3)
    seq = 14
    ids = torch.randint(3, TINY_VOCAB, (1, seq))
    teacher = TeacherPass(model, torch.arange(64))
    out = teacher(ids)

    # The teacher's taps are the engine's taps (same layers, same order).
    adapter = TargetAdapter(model)
    engine_taps = adapter.prefill(adapter.new_state(1), [ids[0].tolist()]).taps
    torch.testing.assert_close(out.taps, engine_taps, rtol=1e-5, atol=1e-5)

    anchors = torch.tensor([[0, 4, 9, seq - 3]])
    with torch.no_grad():
        real, masked = draft_training_logits(head, out.taps, ids, anchors)
    for k, p in enumerate(anchors[0].tolist()):
        cache = head.new_cache(1)
        proposed = head.draft_logits(out.taps[:, : p + 1], ids[:, 1 : p + 2], torch.tensor([p + 1]), cache)
        torch.testing.assert_close(real[0, p], proposed[0, 0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(masked[0, k], proposed[0, 1:], rtol=1e-4, atol=1e-4)
    # Every real row is row 0 of its own anchor.
    for p in range(seq - 1):
        proposed = head.draft_logits(out.taps[:, : p + 1], ids[:, 1 : p + 2], torch.tensor([p + 1]), head.new_cache(1))
        torch.testing.assert_close(real[0, p], proposed[0, 0], rtol=1e-4, atol=1e-4)


def test_teacher_logits_are_target_logits_restricted():
    model = tiny_model("llama", num_layers=2)
    kept = torch.tensor([3, 7, 10, 50, 95])
    ids = torch.randint(3, TINY_VOCAB, (2, 9))
    out = TeacherPass(model, kept)(ids, full_vocab=True)
    with torch.no_grad():
        full = model(ids).logits.float()
    torch.testing.assert_close(out.logits, full[..., kept], rtol=1e-5, atol=1e-5)
    assert torch.equal(out.argmax, full.argmax(-1))
    mass = torch.softmax(full, -1)[..., kept].sum(-1)
    torch.testing.assert_close(out.in_vocab_mass, mass, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the loss


def test_kl_direction_is_teacher_weighted():
    p_logits = torch.tensor([[4.0, 0.0, -2.0]])
    q_logits = torch.tensor([[0.0, 1.0, 0.0]])
    p, q = torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)
    forward = (p * (p.log() - q.log())).sum()
    reverse = (q * (q.log() - p.log())).sum()
    assert not torch.isclose(forward, reverse)
    torch.testing.assert_close(kl_per_row(p_logits, q_logits)[0], forward)
    assert float(kl_per_row(p_logits, p_logits)[0]) == pytest.approx(0.0, abs=1e-6)


def test_loss_weights_and_pairing_by_hand():
    torch.manual_seed(0)
    vocab, seq, k = 5, 10, 2
    teacher = torch.randn(1, seq, vocab)
    real = torch.randn(1, seq - 1, vocab)
    masked = torch.randn(1, k, M, vocab)
    lengths, starts = torch.tensor([seq]), torch.tensor([2])
    anchors, valid = torch.tensor([[3, 6]]), torch.tensor([[True, True]])
    gamma = 0.6
    terms = dart_kl_loss(teacher, real, masked, lengths, starts, anchors, valid, gamma)

    def kl(p_logits, q_logits):
        return F.kl_div(F.log_softmax(q_logits, -1), F.log_softmax(p_logits, -1), log_target=True,
                        reduction="sum")

    row0 = [kl(teacher[0, p + 1], real[0, p]) for p in range(2, seq - 1)]  # anchors 2..L-2
    expected = [torch.stack(row0).mean()]
    for i in range(1, M + 1):
        terms_i = [kl(teacher[0, a + 1 + i], masked[0, j, i - 1]) for j, a in enumerate([3, 6])
                   if a + 1 + i <= seq - 1]
        expected.append(torch.stack(terms_i).mean())
    expected = torch.stack(expected)
    torch.testing.assert_close(terms.kl_per_position, expected, rtol=1e-5, atol=1e-6)
    weights = gamma ** torch.arange(M + 1, dtype=torch.float32)
    torch.testing.assert_close(terms.loss, (weights * expected).sum(), rtol=1e-5, atol=1e-6)
    # anchor 6: rows i with 6+1+i <= 9 -> i <= 2; anchor 3: all 3 rows
    assert terms.count_per_position.tolist() == [seq - 1 - 2, 2, 2, 1]


def test_invalid_anchors_do_not_count():
    torch.manual_seed(1)
    teacher, real = torch.randn(1, 8, 4), torch.randn(1, 7, 4)
    masked = torch.randn(1, 2, M, 4)
    a = dart_kl_loss(teacher, real, masked, torch.tensor([8]), torch.tensor([0]),
                     torch.tensor([[1, 0]]), torch.tensor([[True, False]]))
    masked2 = masked.clone()
    masked2[0, 1] = 100.0  # garbage in the invalid block
    b = dart_kl_loss(teacher, real, masked2, torch.tensor([8]), torch.tensor([0]),
                     torch.tensor([[1, 0]]), torch.tensor([[True, False]]))
    torch.testing.assert_close(a.loss, b.loss)


def test_one_step_reduces_loss_on_fixed_batch():
    model = tiny_model("gemma3", num_layers=4)
    model.requires_grad_(False)
    head = make_head(model).train()
    torch.manual_seed(5)
    ids = torch.randint(3, TINY_VOCAB, (2, 16))
    lengths, starts = torch.tensor([16, 12]), torch.tensor([2, 3])
    teacher = TeacherPass(model, torch.arange(64))
    out = teacher(ids)
    anchors, valid = sample_anchors(lengths, starts, 6, torch.Generator().manual_seed(0))
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3)

    def loss():
        real, masked = draft_training_logits(head, out.taps, ids, anchors)
        return dart_kl_loss(out.logits, real, masked, lengths, starts, anchors, valid).loss

    before = loss()
    before.backward()
    # Only the head's own parameters learn: the target and its embedding stay frozen.
    assert all(p.grad is None for p in model.parameters())
    assert head.midlayer.mask_rep.grad is not None and head.fc.weight.grad is not None
    optimizer.step()
    with torch.no_grad():
        after = loss()
    assert after.item() < before.item()


@settings(max_examples=examples(12), deadline=None)
@given(data=st.data(), top_k=st.sampled_from([None, 5]))
def test_loss_on_selected_rows_equals_the_dense_loss_and_its_gradients(data, top_k):
    """Projecting only the rows the loss reads (draft_training_logits with loss_rows) gives the
    dense path's loss, per-position KL, accuracy and counts, and the same gradients, for the live
    teacher and the cache's top-k one, whatever the lengths, prompt lengths and anchor count."""
    model = tiny_model("gemma3", num_layers=4)
    model.requires_grad_(False)
    head = make_head(model).train()
    batch, seq = data.draw(st.integers(1, 3)), data.draw(st.integers(6, 14))
    lengths = torch.tensor([data.draw(st.integers(4, seq)) for _ in range(batch)])
    lengths[0] = seq
    starts = torch.tensor([data.draw(st.integers(0, int(n) - 3)) for n in lengths])
    seed = data.draw(st.integers(0, 99))
    ids = torch.randint(3, TINY_VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    out = TeacherPass(model, torch.arange(64))(ids)
    teacher = out.logits if top_k is None else top_k_teacher(out.logits, top_k)
    anchors, valid = sample_anchors(lengths, starts, data.draw(st.integers(1, 6)), torch.Generator().manual_seed(1))
    rows = loss_rows(lengths, starts, anchors, valid, seq, M)
    results = []
    for selected in (False, True):
        head.zero_grad(set_to_none=True)
        real, masked = draft_training_logits(head, out.taps, ids, anchors, rows if selected else None)
        if selected:
            assert real.shape[0] == int(rows.real.sum()) and masked.shape[0] == int(rows.mask.sum())
        terms = dart_kl_loss(teacher, real, masked, lengths, starts, anchors, valid, draft_length=M)
        terms.loss.backward()
        results.append((terms, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}))
    (dense, dense_grads), (sel, sel_grads) = results
    torch.testing.assert_close(sel.loss, dense.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sel.kl_per_position, dense.kl_per_position, rtol=1e-5, atol=1e-6)
    assert torch.equal(sel.accuracy_per_position, dense.accuracy_per_position)
    assert torch.equal(sel.count_per_position, dense.count_per_position)
    assert sel_grads.keys() == dense_grads.keys() and sel_grads
    for name, grad in dense_grads.items():
        torch.testing.assert_close(sel_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_most_frequent_ids_ties_and_forced():
    counts = torch.tensor([5, 9, 9, 0, 1, 7])
    assert most_frequent_ids(counts, 3).tolist() == [1, 2, 5]  # sorted ascending
    assert most_frequent_ids(counts, 3, always=[3]).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="exceeds"):
        most_frequent_ids(counts, 7)


def test_lr_schedule_warmup_then_cosine():
    from dart_train.trainer import OptimConfig

    f = lr_lambda(OptimConfig(warmup_steps=4, min_lr_ratio=0.1), max_steps=20)
    assert f(0) == pytest.approx(0.25) and f(3) == pytest.approx(1.0)
    assert f(4) == pytest.approx(1.0) and f(20) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(4, 20))


# ------------------------------------------------------------------------ data framing


def test_example_framing_matches_inference_prompt():
    tok = ByteTokenizer()
    cfg = TrainConfig()
    conv = chats(1)[0]
    example = conversation_example(conv, tok, cfg.data)
    prompt = tok(f"User: {conv.turns[0].text}\nAssistant:")["input_ids"]
    assert example.ids[: len(prompt)] == prompt and example.prompt_len == len(prompt)
    assert example.ids[len(prompt):] == tok(" " + conv.turns[1].text, add_special_tokens=False)["input_ids"] + [2]
    batch = collate([example], loss_on_prompt=False)
    assert int(batch.loss_starts[0]) == len(prompt) - 1


def test_parse_config_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  max_steps: 7\nloss:\n  gamma: 0.5\n")
    cfg = parse_config([str(path), "trainer.batch_size=3"])
    assert (cfg.trainer.max_steps, cfg.trainer.batch_size, cfg.loss.gamma) == (7, 3, 0.5)
    with pytest.raises(Exception, match="nope"):
        parse_config(["nope=1"])
    cfg = parse_config(["data.source=[a.jsonl,default]", "data.source_weights=[3,1]"])
    assert (cfg.data.source, cfg.data.source_weights) == (["a.jsonl", "default"], [3.0, 1.0])
    for bad, message in ((["data.source=[]"], "non-empty"), (["data.source=[a.jsonl,'']"], "non-empty"),
                         (["data.source=[a.jsonl,b.jsonl]", "data.source_weights=[1]"], "one positive number"),
                         (["data.source_weights=[0]"], "one positive number")):
        with pytest.raises(ValueError, match=message):  # at parse time, before any data is read
            parse_config(bad)


# ------------------------------------------------------------- checkpoint, resume, engine


def tiny_config(out_dir, max_steps: int) -> TrainConfig:
    cfg = TrainConfig()
    cfg.output_dir = str(out_dir)
    cfg.head.draft_length = M
    cfg.head.draft_vocab_size = 64
    cfg.data.shuffle_buffer = 1
    cfg.loss.anchors_per_sequence = 4
    cfg.optim.warmup_steps = 2
    cfg.optim.lr = 3e-3
    cfg.eval.dev_sequences = 0
    cfg.eval.tau_prompts = 0
    cfg.trainer.amp = False
    cfg.trainer.batch_size = 2
    cfg.trainer.max_steps = max_steps
    cfg.trainer.checkpoint_every = 2
    cfg.trainer.keep_checkpoints = 10
    cfg.trainer.log_every = 1
    return cfg


def run(cfg, model, data):
    def conversations(epoch):
        order = list(data)
        random.Random(epoch).shuffle(order)
        return iter(order)

    return train_loop(cfg, WorkerContext(), model=model, tokenizer=ByteTokenizer(), conversations=conversations)


def test_checkpoint_resume_reload_identical(tmp_path):
    data = chats(5)  # 2 sequences per step: step 3 starts a new epoch
    model = tiny_model("gemma3", num_layers=4)
    run(tiny_config(tmp_path / "a", 4), model, data)
    dirs_a = checkpoint_dirs(tmp_path / "a")
    assert [d.name for d in dirs_a] == ["step-0000002", "step-0000004"]

    # Resume a copy of the step-2 checkpoint and train to step 4 again.
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(dirs_a[0], tmp_path / "b" / "checkpoints" / dirs_a[0].name)
    run(tiny_config(tmp_path / "b", 4), model, data)
    dir_b = checkpoint_dirs(tmp_path / "b")[-1]
    assert dir_b.name == "step-0000004"

    embed = model.get_input_embeddings()
    head_a = load_draft_head(dirs_a[-1], model.config, embed)
    head_b = load_draft_head(dir_b, model.config, embed)
    for (name, a), (_, b) in zip(head_a.state_dict().items(), head_b.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    state_a, state_b = load_trainer_state(dirs_a[-1]), load_trainer_state(dir_b)
    assert state_a["data_positions"] == state_b["data_positions"]
    assert state_a["tokens_seen"] == state_b["tokens_seen"]
    for (ka, a), (kb, b) in zip(state_a["optimizer"]["state"].items(), state_b["optimizer"]["state"].items(),
                                strict=True):
        assert ka == kb and all(torch.equal(a[k], b[k]) for k in a)
    # A head that trained differs from its initialisation (the loop really stepped).
    head_2 = load_draft_head(dirs_a[0], model.config, embed)
    assert not torch.equal(head_2.fc.weight, head_a.fc.weight)


@pytest.mark.slow
def test_trained_head_loads_strictly_and_decodes_losslessly(tmp_path):
    model = tiny_model("gemma3", num_layers=4)
    cfg = tiny_config(tmp_path / "run", 2)
    cfg.export_dir = str(tmp_path / "export")
    cfg.save_dtype = "fp32"
    summary = run(cfg, model, chats(6))
    assert summary["steps"] == 2 and (tmp_path / "export" / "training_config.yaml").is_file()
    head = load_draft_head(tmp_path / "export", model.config, model.get_input_embeddings())
    assert head.config.draft_vocab_size == 64 and head.config.draft_length == M
    parts = EngineParts(target=TargetAdapter(model), head=head)
    prompt = ByteTokenizer()("User: the cat\nAssistant:")["input_ids"]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    ar = build_engine(parts, "ar").generate([prompt], params)[0]
    chain = build_engine(parts, "chain").generate([prompt], params)[0]
    assert chain.error is None and chain.token_ids == ar.token_ids


def test_training_tau_is_the_engines_greedy_tau(tmp_path):
    """eval's tau (a replay of the dev prompts) equals what the engine measures with the checkpoint."""
    from dart_train.corpus import sharegpt_dev_prompts
    from dart_worker.prompt_format import format_user_prompt

    model = tiny_model("gemma3", num_layers=4)
    cfg = tiny_config(tmp_path / "run", 2)
    cfg.export_dir = str(tmp_path / "export")
    cfg.save_dtype = "fp32"
    run(cfg, model, chats(6))
    cfg.eval.tau_prompts, cfg.eval.tau_max_new_tokens, cfg.eval.tau_modes = 3, 10, ["chain", "ddtree"]
    cache: dict = {}
    got = trainer.evaluate_tau(tmp_path / "export", model, ByteTokenizer(), cfg, cache)
    tokenizer = ByteTokenizer()
    prompts = [tokenizer(format_user_prompt(tokenizer, p.text))["input_ids"] for p in
               sharegpt_dev_prompts(12, dev_fraction=cfg.data.dev_fraction, max_chars=4 * cfg.data.max_prompt_tokens)]
    prompts = [ids for ids in prompts if len(ids) <= cfg.data.max_prompt_tokens][:3]
    assert [r.prompt for r in cache["refs"]] == prompts
    head = load_draft_head(tmp_path / "export", model.config, model.get_input_embeddings())
    parts = EngineParts(target=TargetAdapter(model), head=head)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    for mode in ("chain", "ddtree"):
        results = [build_engine(parts, mode).generate([ids], params)[0] for ids in prompts]
        assert got[f"tau_{mode}"] == pytest.approx(sum(r.stats.tau for r in results) / len(results))


def test_fine_tuning_keeps_the_initial_heads_draft_vocabulary(tmp_path, monkeypatch):
    """init_from on other data (e.g. self-distilled replies): the teacher must keep the head's
    own draft ids, not a vocabulary counted on the new data."""
    model = tiny_model("gemma3", num_layers=4)
    first = tiny_config(tmp_path / "first", 2)
    first.export_dir, first.save_dtype = str(tmp_path / "export"), "fp32"
    run(first, model, chats(6))
    initial = load_draft_head(tmp_path / "export", model.config, model.get_input_embeddings())

    seen_kept = []
    real_teacher = trainer.TeacherPass

    def recording_teacher(target, kept):
        seen_kept.append(kept.tolist())
        return real_teacher(target, kept)

    monkeypatch.setattr(trainer, "TeacherPass", recording_teacher)
    other = [Conversation(f"o{i}", (Turn("user", "zzz yyy"), Turn("assistant", "QQQ WWW XXX " * 5)), f"o{i}")
             for i in range(6)]
    tuned = tiny_config(tmp_path / "tuned", 2)
    tuned.head.init_from = str(tmp_path / "export")
    tuned.head.draft_vocab_size = 32  # ignored: the vocabulary is the initial head's
    tuned.export_dir, tuned.save_dtype = str(tmp_path / "export2"), "fp32"
    run(tuned, model, other)
    expected = initial.to_target_ids(torch.arange(64)).tolist()
    assert seen_kept == [expected]
    head = load_draft_head(tmp_path / "export2", model.config, model.get_input_embeddings())
    assert head.to_target_ids(torch.arange(64)).tolist() == expected
    assert not torch.equal(head.fc.weight, initial.fc.weight)


# ------------------------------------------------------------------------ Ray Train backend


@pytest.mark.slow
def test_ray_backend_two_workers(tmp_path, shared_ray):
    """Two data-parallel Ray Train workers train a head on a tiny Gemma3 target end to end, a job
    on the session's Ray cluster (2 CPUs: one per worker), as on a cluster it joins.

    The target directory pairs a tiny random model with the default (Gemma-3) tokenizer, as
    a user's own target would come: a local Hugging Face directory loaded by each worker.
    """
    import json

    ray = pytest.importorskip("ray")
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from dart_worker.artifacts.default_target import default_tokenizer
    from jobs.train_draft import main

    tok = default_tokenizer()
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=16,
                              max_position_embeddings=256, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    target_dir = tmp_path / "target"
    Gemma3ForCausalLM(config).save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": c.turns[0].text},
                                              {"from": "gpt", "value": c.turns[1].text}]}
            for i, c in enumerate(chats(12))]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ray.init()  # RAY_ADDRESS: the session's cluster
    try:
        main([f"target={target_dir}", f"data.source={data}", "data.dev_fraction=0.0",
              f"output_dir={tmp_path / 'run'}", f"export_dir={tmp_path / 'export'}", "save_dtype=fp32",
              "head.draft_vocab_size=256", "head.draft_length=3", "loss.anchors_per_sequence=4",
              "eval.dev_sequences=0", "eval.tau_prompts=0", "trainer.backend=ray", "trainer.num_workers=2",
              "trainer.max_steps=2", "trainer.checkpoint_every=0", "trainer.batch_size=1", "trainer.amp=false",
              "trainer.target_dtype=fp32", "trainer.threads=1"])
    finally:
        ray.shutdown()
    model = Gemma3ForCausalLM.from_pretrained(target_dir)
    head = load_draft_head(tmp_path / "export", model.config, model.get_input_embeddings())
    assert head.config.draft_vocab_size == 256
    summary = json.loads((tmp_path / "run" / "training_summary.json").read_text())
    assert summary["steps"] == 2


def test_fc_scaled_to_tap_rms():
    from dart_train.draft_training import scale_fc_to_taps, tap_rms

    model = tiny_model("llama", num_layers=4)
    head = make_head(model)
    torch.manual_seed(0)
    h = model.config.hidden_size
    taps = torch.randn(2, 6, 3 * h) * torch.tensor([1.0] * h + [10.0] * h + [100.0] * h)
    taps[:, 0] = 1e4  # BOS attention sink: left out
    lengths = torch.tensor([6, 4])
    rms = tap_rms(taps, lengths)
    real = torch.cat([taps[0, 1:6], taps[1, 1:4]]).view(-1, 3, h)
    torch.testing.assert_close(rms, real.pow(2).mean((0, 2)).sqrt())
    before = head.fc(taps / rms.repeat_interleave(h))
    scale_fc_to_taps(head, rms)
    torch.testing.assert_close(head.fc(taps), before, rtol=1e-4, atol=1e-4)
