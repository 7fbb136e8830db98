"""jobs.prepare_model end to end on a tiny Qwen3 target with small settings: every step runs, the
benchmark's modes all reproduce `ar` token for token, the printed block is a valid pipeline config,
a rerun skips what is done, `redo`/`skip` do what they say, and an imported head for another target
stops the job with the reason."""

from __future__ import annotations

import json
import random

import pytest

from pipeline import prepare_model
from tests.tiny_models import save_tiny_target

SMALL = ["dtype=fp32", "device=cpu", "threads=1", "trie.order=3", "head.max_steps=3", "head.draft_length=3",
         "head.draft_vocab_size=64", "head.batch_size=1",
         "head.overrides=[loss.anchors_per_sequence=4,eval.dev_sequences=0,eval.tau_prompts=0,"
         "trainer.checkpoint_every=0,trainer.amp=false,save_dtype=fp32,data.max_seq_len=64]",
         "bench.num_prompts=2", "bench.max_new_tokens=12", "bench.modes=[ar,lookup,dart,dart_lookup]",
         "bench.budget=8"]


@pytest.fixture()
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "cache"))
    target = save_tiny_target(tmp_path / "qwen-tiny", "qwen3", num_layers=8, seed=2)
    rng = random.Random(0)
    phrases = [" ".join(f"w{rng.randrange(4, 96)}" for _ in range(6)) for _ in range(12)]
    rows = []
    for i in range(60):
        ask = " ".join(rng.choice(phrases) for _ in range(2))
        reply = " ".join(rng.choice(phrases) for _ in range(5))
        turns = [{"from": "human", "value": ask}, {"from": "gpt", "value": reply}]
        rows.append({"id": f"c{i}", "conversations": turns})
    corpus = tmp_path / "chats.jsonl"
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return target, corpus, tmp_path / "prep"


def run(target, corpus, out, *extra):
    return prepare_model.main([str(target), f"corpus={corpus}", f"output_dir={out}", *SMALL, *extra])


def test_prepare_model_end_to_end_then_resumes(setup, capsys):
    from pipeline.settings.config import load_config

    target, corpus, out = setup
    assert run(target, corpus, out) == 0
    printed = capsys.readouterr().out
    state = json.loads((out / "prepare_state.json").read_text())
    assert sorted(state) == sorted(prepare_model.STEPS)
    assert state["check"]["result"]["family"] == "qwen3" and state["check"]["result"]["layers"] == 8
    assert 50 <= state["trie"]["result"]["documents"] < 60  # the training split: dev conversations stay out
    assert state["head"]["result"]["steps"] == 3
    bench = state["bench"]["result"]
    assert set(bench["modes"]) == {"ar", "lookup", "dart", "dart_lookup"}
    assert all(m["equals_ar"] for m in bench["modes"].values()), bench["modes"]
    block = (out / "pipeline_model.yaml").read_text()
    assert block in printed and f"mode: {bench['best_mode']}" in block
    (out / "job.yaml").write_text(block + "input:\n  urls: [prompts.jsonl]\noutput:\n  url: out\n")
    cfg = load_config(out / "job.yaml")  # the block is a valid pipeline config as printed
    assert cfg.model.draft_head == str((out / "head").resolve()) and cfg.model.trie.endswith("trie.ngram")

    assert run(target, corpus, out) == 0  # everything done: nothing runs again
    again = capsys.readouterr().out
    assert again.count("done earlier") == 5 and "[prepare]" not in again

    assert run(target, corpus, out, "redo=[bench]", "skip=[config]") == 0
    lines = capsys.readouterr().out
    assert "[prepare] bench" in lines and "[prepare] trie" not in lines and "skipped (skip=)" in lines

    assert run(target, corpus, out, "bench.max_new_tokens=10") == 0  # a changed input reruns that step only
    lines = capsys.readouterr().out
    assert "[prepare] bench" in lines and "[prepare] head" not in lines and "[prepare] config" in lines


def test_imported_head_for_another_target_stops_with_the_reason(setup, tmp_path, capsys):
    import torch

    from dart_worker.head.draft_checkpoint import save_draft_head
    from dart_worker.head.draft_head import DartDraftHead
    from tests.tiny_models import tiny_model

    target, corpus, out = setup
    other = tiny_model("qwen3", num_layers=8, vocab_size=80)
    torch.manual_seed(0)
    save_draft_head(DartDraftHead.random_init(other.config, other.get_input_embeddings(), draft_length=3),
                    tmp_path / "other_head")
    assert run(target, corpus, out, f"head.source={tmp_path / 'other_head'}", "skip=[trie,bench]") == 2
    assert "prepare_model: head: draft head" in capsys.readouterr().err


def test_unknown_step_is_a_clear_error(setup, capsys):
    target, corpus, out = setup
    assert run(target, corpus, out, "skip=[heads]") == 2
    assert "skip: unknown step(s) ['heads']" in capsys.readouterr().err
