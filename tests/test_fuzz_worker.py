"""Fuzzing the engine and writer side: every row handed to a worker comes back as exactly one written row.

The worker (pipeline.worker.GenerationWorker, built here in-process on the tiny artifacts, as
`jobs.bench pipeline` builds one) gets batches of hostile rows: prompts of special tokens only,
prompts at and around the target's context limit, chat prompts with odd roles, rows that are
already errors; with stop strings that are odd or hold surrogates, stop token ids, one-token
limits, greedy and sampled decoding in every mode, and a tokenizer whose decoding yields text
that UTF-8 cannot encode. Its output must be one row per input row, in order, that
`write_part` writes and `read_output` reads back: never a crashed worker.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from dart_worker.drafters import drafter_names
from ngram_native import TreeParams
from pipeline.data.inputs import INPUT_SCHEMA
from pipeline.data.outputs import OUTPUT_SCHEMA, read_output, result_rows_to_table, storable_text, write_part
from pipeline.settings.config import PipelineConfig, to_dict
from pipeline.worker import GenerationWorker
from tests.hostile_inputs import SPECIAL_TOKENS
from tests.hypothesis_budget import examples
from tests.tiny_models import TINY_VOCAB, save_tiny_artifacts

MAX_POSITIONS = 256  # the tiny target's context
MODES = drafter_names()  # every registered drafter, lookup and the hybrids included


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """One in-process worker per mode on the tiny artifacts (no Ray: the trie is mapped directly)."""
    artifacts = save_tiny_artifacts(tmp_path_factory.mktemp("fuzz-worker"))
    built = {}
    for mode in MODES:
        cfg = PipelineConfig()
        cfg.input.urls = ["unused.jsonl"]
        cfg.output.url = "unused"
        cfg.model.target, cfg.model.draft_head = artifacts["target"], artifacts["head"]
        cfg.model.trie = artifacts["trie"]
        cfg.model.dtype, cfg.model.device = "fp32", "cpu"
        cfg.decoding.mode, cfg.decoding.tree = mode, TreeParams(budget=8)
        cfg.resources.torch_threads = 1
        cfg.output.include_token_ids = True
        resolved = {"run_id": "fuzz", "head_dir": artifacts["head"], "trie_url": artifacts["trie"]}
        built[mode] = GenerationWorker(to_dict(cfg), resolved)
    return built


words = st.integers(4, TINY_VOCAB - 1).map(lambda t: f"w{t}")


@st.composite
def hostile_prompt(draw) -> tuple[str, str, str]:
    """(category, prompt kind, prompt) as the reader hands them on."""
    category = draw(st.sampled_from(["special tokens only", "near the context limit", "words", "odd text",
                                     "messages", "odd messages"]))
    if category == "special tokens only":
        return category, "text", "".join(draw(st.lists(st.sampled_from([*SPECIAL_TOKENS, " "]), min_size=1,
                                                        max_size=6)))
    if category == "near the context limit":  # the plain template adds "User:" and "Assistant:" (2 tokens)
        n = draw(st.integers(MAX_POSITIONS - 5, MAX_POSITIONS + 1))
        return category, "text", " ".join(draw(st.lists(words, min_size=n, max_size=n)))
    if category == "words":
        return category, "text", " ".join(draw(st.lists(words, min_size=1, max_size=8)))
    if category == "odd text":
        return category, "text", draw(st.sampled_from(["\x00", "\u2028", "\ufeff", "\u200b", "é" * 50, "\U0001f600",
                                                       "w5\r\nw6", "\t\x0b", "<eos>" * 300]))
    if category == "messages":
        turns = draw(st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]), st.lists(words, max_size=5)),
                              min_size=1, max_size=4))
        return category, "messages", json.dumps([{"role": r, "content": " ".join(c)} for r, c in turns])
    odd = draw(st.sampled_from([[{"role": "tool", "content": "w5"}], [{"role": "user", "content": "<eos><bos>"}],
                                [{"role": "user", "content": ""}], [{"role": "User", "content": "w5"}]]))
    return category, "messages", json.dumps(odd)


@st.composite
def hostile_batch(draw) -> tuple[list[dict], list[str]]:
    rows, categories = [], []
    for k in range(draw(st.integers(1, 4))):
        if draw(st.integers(0, 5)) == 0:
            rows.append({"row_key": f"row:e{k}", "id": None, "prompt": None, "prompt_kind": "text",
                         "source": "file:///fuzz.jsonl", "error": "malformed JSON: Expecting value"})
            categories.append("error row")
            continue
        category, kind, prompt = draw(hostile_prompt())
        rows.append({"row_key": f"id:{k}", "id": str(k), "prompt": prompt, "prompt_kind": kind,
                     "source": "file:///fuzz.jsonl", "error": None})
        categories.append(category)
    return rows, categories


STOPS = [[], ["w5"], ["\u2028"], ["<eos>"], ["\x00"], ["w" * 200], ["w9", "w7 w8"], ["\udcff"], ["a\ud800b"], [""],
         ["é"]]


@settings(max_examples=examples(200), deadline=None)
@given(
    batch=hostile_batch(),
    mode=st.sampled_from(MODES),
    temperature=st.sampled_from([0.0, 1.0]),
    max_new_tokens=st.sampled_from([1, 2, 6]),
    stop=st.sampled_from(STOPS),
    stop_token_ids=st.sampled_from([[], [5], [0, 1, 2, 3]]),
    template=st.booleans(),
    surrogate_decoding=st.booleans(),
    max_live=st.sampled_from([None, 1, 2]),
)
def test_worker_writes_one_row_per_row(workers, tmp_path_factory, batch, mode, temperature, max_new_tokens, stop,
                                       stop_token_ids, template, surrogate_decoding, max_live):
    rows, categories = batch
    for category in categories:
        event(f"prompt: {category}")
    event(f"stop: {stop!r}")
    worker = workers[mode]
    worker.cfg.resources.max_live = max_live  # continuous batching when below the batch's rows
    d = worker.cfg.decoding
    d.temperature, d.max_new_tokens, d.stop, d.stop_token_ids = temperature, max_new_tokens, stop, stop_token_ids
    worker.cfg.input.apply_chat_template = template
    tokenizer = worker.tokenizer
    original_decode = type(tokenizer).decode
    if surrogate_decoding:  # a tokenizer whose text holds lone surrogates (a Python decoder may produce them)
        event("decoding: lone surrogates in the text")
        tokenizer.decode = lambda ids, **kw: original_decode(tokenizer, ids, **kw).replace("w", "w\udcff")
    try:
        out = worker(pa.Table.from_pylist(rows, schema=INPUT_SCHEMA))
    finally:
        vars(tokenizer).pop("decode", None)

    assert out.schema.names == OUTPUT_SCHEMA.names
    assert out.column("row_key").to_pylist() == [r["row_key"] for r in rows]
    for row, result in zip(rows, out.to_pylist()):
        if row["error"]:
            assert result["error"] == row["error"] and result["finish_reason"] == "error"
            continue
        if result["error"] is not None:
            assert result["finish_reason"] == "error" and result["text"] is None
            event(f"error: {result['error'].split(' (')[0][:50]}")
            continue
        assert result["finish_reason"] in ("stop", "length", "context_limit")
        assert 1 <= result["num_generated_tokens"] <= max_new_tokens
        assert result["num_prompt_tokens"] + result["num_generated_tokens"] <= MAX_POSITIONS
        result["text"].encode("utf-8")  # storable
        if surrogate_decoding and not stop and "w" in result["text"]:  # (a stop string may cut before one)
            assert "w\ufffd" in result["text"]
    directory = tmp_path_factory.mktemp("parts")
    write_part(out, str(directory), "fuzz")
    assert read_output(str(directory))["row_key"].to_pylist() == sorted(r["row_key"] for r in rows)


def test_surrogates_in_generated_text_are_replaced(workers, tmp_path):
    """Generated text that UTF-8 cannot encode is stored with U+FFFD in place of each lone surrogate."""
    worker = workers["ar"]
    worker.cfg.decoding.stop, worker.cfg.decoding.max_new_tokens, worker.cfg.decoding.temperature = [], 3, 0.0
    tokenizer = worker.tokenizer
    original_decode = type(tokenizer).decode
    tokenizer.decode = lambda ids, **kw: "x\udcffy" if ids else ""
    try:
        out = worker(pa.Table.from_pylist([{"row_key": "id:a", "id": "a", "prompt": "w5 w6", "prompt_kind": "text",
                                            "source": None, "error": None}], schema=INPUT_SCHEMA))
    finally:
        vars(tokenizer).pop("decode", None)
    assert type(tokenizer).decode is original_decode
    row = out.to_pylist()[0]
    assert (row["text"], row["error"], row["num_generated_tokens"]) == ("x\ufffdy", None, 3)
    write_part(out, str(tmp_path), "fuzz")
    assert read_output(str(tmp_path))["text"].to_pylist() == ["x\ufffdy"]
    assert storable_text("\ud83d\ude00 \ude00\ud83d é") == "\U0001f600 \ufffd\ufffd é"  # a split pair is joined


def test_a_row_that_cannot_be_stored_becomes_an_error_row():
    good = {"row_key": "id:a", "run_id": "r", "text": "fine", "finish_reason": "length"}
    bad = {"row_key": "id:b", "run_id": "r", "text": "t", "finish_reason": "length", "num_generated_tokens": 1.5,
           "id": "b", "mode": "ar"}
    rows = result_rows_to_table([good, bad]).to_pylist()
    assert rows[0]["text"] == "fine" and rows[0]["error"] is None
    assert (rows[1]["row_key"], rows[1]["id"], rows[1]["mode"], rows[1]["text"], rows[1]["finish_reason"]) == (
        "id:b", "b", "ar", None, "error")
    assert rows[1]["error"].startswith("internal error: result cannot be stored: output column 'num_generated_tokens'")


def test_continuous_batching_in_the_worker_writes_the_static_batch_rows(workers):
    """`resources.max_live` below the batch: rows join as others finish, and every row's text,
    tokens and finish reason are those of the static batch (greedy), in input order."""
    worker = workers["dart_lookup"]
    d = worker.cfg.decoding
    d.temperature, d.max_new_tokens, d.stop, d.stop_token_ids = 0.0, 12, [], []
    worker.cfg.input.apply_chat_template = False
    prompts = ["w5 w6 w7 w5 w6 w7 w5", "w9", "w11 w12 w13 w14 w15 w16 w17 w18", "w4 w4 w4", "w20 w21"]
    rows = [{"row_key": f"id:{k}", "id": str(k), "prompt": p, "prompt_kind": "text", "source": "file:///b.jsonl",
             "error": None} for k, p in enumerate(prompts)]
    rows.insert(2, {"row_key": "row:e", "id": None, "prompt": None, "prompt_kind": "text",
                    "source": "file:///b.jsonl", "error": "malformed JSON"})
    table = pa.Table.from_pylist(rows, schema=INPUT_SCHEMA)
    columns = ["row_key", "text", "token_ids", "finish_reason", "error"]
    worker.cfg.resources.max_live = None
    static = worker(table).select(columns).to_pylist()
    for max_live in (1, 2):
        worker.cfg.resources.max_live = max_live
        assert worker(table).select(columns).to_pylist() == static
    assert sum(r["error"] is None for r in static) == len(prompts)


def test_rows_carry_their_own_start_and_finish(workers):
    """With max_live 1 the rows decode one after another: each row's `finished_at - wall_s` (its
    start) is at or after the previous row's finish, all inside the worker call; an error row
    gets the batch's end."""
    from datetime import datetime, timedelta, timezone

    worker = workers["lookup"]
    d = worker.cfg.decoding
    d.temperature, d.max_new_tokens, d.stop, d.stop_token_ids = 0.0, 6, [], []
    worker.cfg.input.apply_chat_template = False
    rows = [{"row_key": f"id:{k}", "id": str(k), "prompt": f"w{5 + k} w{9 + k}", "prompt_kind": "text",
             "source": "file:///t.jsonl", "error": None} for k in range(3)]
    rows.append({"row_key": "row:e", "id": None, "prompt": None, "prompt_kind": "text",
                 "source": "file:///t.jsonl", "error": "malformed JSON"})
    worker.cfg.resources.max_live = 1
    called = datetime.now(timezone.utc)
    out = worker(pa.Table.from_pylist(rows, schema=INPUT_SCHEMA)).to_pylist()
    returned = datetime.now(timezone.utc)
    worker.cfg.resources.max_live = None
    done = [r for r in out if r["error"] is None]
    assert len(done) == 3
    slack = timedelta(milliseconds=2)  # timestamps are stored at microseconds
    previous = called - slack
    for r in done:
        began = r["finished_at"] - timedelta(seconds=r["wall_s"])
        assert previous - slack <= began <= r["finished_at"] <= returned
        previous = r["finished_at"]
    assert done[-1]["finished_at"] <= out[-1]["finished_at"] <= returned
