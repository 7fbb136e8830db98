"""Fuzzing the readers: one hostile row must never stop a job.

Every JSONL line and every Parquet row yields exactly one row, ok or error, with a stable key,
and the readers never raise on content; a file they cannot read at all (an unsupported codec, a
compressed file under an uncompressed name, a corrupt stream) is one clear error naming it.

Most examples run the readers' per-file code in this process (the same `_read_stream` a Ray Data
read task runs), which is fast enough for hypothesis; a few tests then read real files through
Ray Data (one local Ray for the module), with compression, duplicate ids and every category.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import random
from collections import Counter
from decimal import Decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pipeline.data.inputs import (
    PARSED_SCHEMA,
    InputError,
    PromptFields,
    prompt_datasource,
    refuse_if_not_text,
    scan_prompts,
)
from tests.hostile_inputs import (
    CATEGORIES,
    HOSTILE_JSONL,
    SPECIAL_TOKENS,
    UTF8_BOM,
    ShortReads,
    good_line,
    good_prompts,
    hostile_lines,
    line_as_read,
    nonblank_lines,
)
from tests.hypothesis_budget import examples

MAX_CHARS = 1000
FIELDS = PromptFields(max_prompt_chars=MAX_CHARS)


# ------------------------------------------------------------------------------------------
# In-process reading: the per-file code of the Ray Data readers (on the session's Ray cluster)


@pytest.fixture(scope="module")
def ray_session(join_shared_ray):
    """This process joined to the session's Ray cluster (tests/conftest.py) for the module."""
    with join_shared_ray(connect=True):
        yield


@pytest.fixture(scope="module")
def datasources(ray_session, tmp_path_factory):
    """JSONL and Parquet datasources, whose per-file readers are fed bytes directly (building one needs Ray)."""
    root = tmp_path_factory.mktemp("fuzz-ds")
    (root / "in.jsonl").write_bytes(b"{}\n")
    pq.write_table(pa.table({"id": ["a"]}), root / "in.parquet")
    return {
        "jsonl": prompt_datasource([str(root / "in.jsonl")], "jsonl", FIELDS),
        "messages": prompt_datasource([str(root / "in.jsonl")], "jsonl", PromptFields(messages_column="messages")),
        "parquet": prompt_datasource([str(root / "in.parquet")], "parquet", FIELDS),
        "parquet_messages": prompt_datasource([str(root / "in.parquet")], "parquet",
                                              PromptFields(messages_column="messages")),
        "root": root,
    }


def read_stream(datasource, stream, path: str = "/fuzz/in.jsonl") -> list[dict]:
    """Rows of one file as a Ray Data read task would produce them (blocks concatenated)."""
    tables = list(datasource._read_stream(stream, path))
    for table in tables:
        assert table.schema == PARSED_SCHEMA
    return pa.concat_tables(tables).to_pylist() if tables else []


def check_rows(rows: list[dict], lines: list[bytes]) -> None:
    assert len(rows) == len(lines)
    for row in rows:
        assert row["row_key"].startswith(("id:", "row:"))
        assert (row["prompt"] is None) != (row["error"] is None), row
        assert row["prompt_kind"] in ("text", "messages")
        if row["id"] is not None:
            assert row["row_key"] == "id:" + row["id"]
    keyless = [r["row_key"] for r in rows if r["row_key"].startswith("row:")]
    assert len(keyless) == len(set(keyless))


@settings(max_examples=examples(300), deadline=None)
@given(
    hostile=st.lists(hostile_lines, max_size=6),
    good=st.lists(good_prompts, max_size=4),
    seed=st.integers(0, 2**32 - 1),
    newline=st.sampled_from([b"\n", b"\r\n"]),
    final_newline=st.booleans(),
    file_bom=st.booleans(),
    chunk=st.sampled_from([None, 1, 2, 3, 5, 4096]),
    mode=st.sampled_from(["jsonl", "messages"]),
)
def test_jsonl_every_line_one_row(datasources, hostile, good, seed, newline, final_newline, file_bom, chunk, mode):
    for category, _ in hostile:
        event(f"jsonl: {category}")
    good_lines = [good_line(f"good-{i}", p) for i, p in enumerate(good)]
    lines = [line for _, line in hostile] + good_lines
    random.Random(seed).shuffle(lines)
    data = (UTF8_BOM if file_bom else b"") + newline.join(lines) + (newline if final_newline and lines else b"")
    small = chunk is not None and len(data) < 50_000
    try:
        rows = read_stream(datasources[mode], ShortReads(data, chunk) if small else pa.BufferReader(data))
    except InputError:  # allowed only for a file that starts as no UTF-8 text does (a random gzip header ...)
        event("refused: not UTF-8 text")
        with pytest.raises(InputError, match="it looks"):
            refuse_if_not_text(line_as_read(data.split(b"\n")[0]), "")
        return
    check_rows(rows, nonblank_lines(data))

    by_key = {r["row_key"]: r for r in rows}
    for i, prompt in enumerate(good):
        row = by_key[f"id:good-{i}"]
        if mode == "jsonl":
            assert (row["prompt"], row["error"]) == (prompt, None)
        else:
            assert row["error"] == "missing prompt"

    # Stable keys: the same lines in another order, read in one piece, get the same keys.
    again = read_stream(datasources[mode], pa.BufferReader(newline.join(reversed(lines))))
    assert sorted(r["row_key"] for r in again) == sorted(r["row_key"] for r in rows)


@pytest.mark.parametrize("category", CATEGORIES)
def test_jsonl_corpus_lines(datasources, category):
    """The fixed corpus, line by line: one row each, with the verdict each line deserves."""
    for line in HOSTILE_JSONL[category]:
        data = good_line("first", "p") + b"\n" + line
        rows = read_stream(datasources["jsonl"], pa.BufferReader(data))
        check_rows(rows, nonblank_lines(data))


def test_jsonl_surrogates_are_error_rows(datasources):
    """Issue 14: JSON escapes of lone surrogates decode to text UTF-8 cannot hold; the row says so."""
    lines = [
        b'{"id": "x", "prompt": "text \\udcff more"}',
        b'{"id": "y\\ud800", "prompt": "p"}',
        b'{"id": "m", "messages": [{"role": "user", "content": "a\\udfffb"}]}',
        b'{"id": "pair", "prompt": "\\ud83d\\ude00"}',
        b'{"id": "meta", "prompt": "p", "other": "\\udc80"}',
    ]
    rows = read_stream(datasources["jsonl"], pa.BufferReader(b"\n".join(lines)))
    assert [(r["id"], r["error"]) for r in rows] == [
        ("x", "prompt holds a lone surrogate (U+DCFF at character 5), which is not valid Unicode text"),
        (None, "id holds a lone surrogate (U+D800 at character 1), which is not valid Unicode text"),
        ("m", "missing prompt"),
        ("pair", None),
        ("meta", None),
    ]
    assert rows[3]["prompt"] == "\U0001f600"
    chat = read_stream(datasources["messages"], pa.BufferReader(lines[2]))
    assert chat[0]["error"] == (
        "message 0 'content' holds a lone surrogate (U+DFFF at character 1), which is not valid Unicode text")


def test_jsonl_boms_anywhere_at_a_line_start(datasources):
    """A BOM starts the file, or a later line where files with BOMs were concatenated; with short reads too."""
    data = UTF8_BOM + b'{"id": "a", "prompt": "p"}\n' + UTF8_BOM + b'{"id": "b", "prompt": "q"}\n' + UTF8_BOM + b"\n"
    for chunk in (1, 2, 3, 4096):
        rows = read_stream(datasources["jsonl"], ShortReads(data, chunk))
        assert [(r["id"], r["prompt"], r["error"]) for r in rows] == [("a", "p", None), ("b", "q", None)]


# ------------------------------------------------------------------------------------------
# Parquet: prompt and id columns of every type


TEXT_KINDS = ("string", "large_string", "string_view", "binary_utf8", "large_binary", "dictionary",
              "dictionary_binary")
OTHER_KINDS = ("binary_invalid", "string_invalid", "list", "struct", "all_null", "int64", "uint64", "float", "bool",
               "decimal", "timestamp", "timestamp_out_of_range", "messages", "messages_binary", "messages_invalid")
BAD_UTF8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"ok \xe2\x82"])
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
BINARY_MESSAGE = pa.struct([("role", pa.binary()), ("content", pa.binary())])


@st.composite
def parquet_column(draw, n: int) -> tuple[str, pa.Array, list]:
    """(kind, array of n values, the text each value must read as or None): a column as some writer stores it."""
    kind = draw(st.sampled_from(TEXT_KINDS + OTHER_KINDS))
    strings = draw(st.lists(st.none() | st.text(st.characters(codec="utf-8"), max_size=30), min_size=n, max_size=n))
    encoded = [s.encode() if s is not None else None for s in strings]
    nothing = [None] * n
    if kind in ("string", "large_string", "string_view"):
        return kind, pa.array(strings, getattr(pa, kind)()), strings
    if kind in ("binary_utf8", "large_binary"):
        return kind, pa.array(encoded, pa.binary() if kind == "binary_utf8" else pa.large_binary()), strings
    if kind == "dictionary":
        return kind, pa.array(strings, pa.string()).dictionary_encode(), strings
    if kind == "dictionary_binary":
        return kind, pa.array(encoded, pa.binary()).dictionary_encode(), strings
    if kind in ("binary_invalid", "string_invalid"):
        array = pa.array([b + draw(BAD_UTF8) if b is not None else None for b in encoded], pa.binary())
        return kind, array.view(pa.string()) if kind == "string_invalid" else array, nothing
    if kind == "list":
        return kind, pa.array([[s] if s is not None else None for s in strings], pa.list_(pa.string())), nothing
    if kind == "struct":
        return kind, pa.array([{"text": s} for s in strings], pa.struct([("text", pa.string())])), nothing
    if kind == "all_null":
        return kind, pa.nulls(n), nothing
    if kind == "int64":
        return kind, pa.array(draw(st.lists(st.none() | st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n)),
                              pa.int64()), nothing
    if kind == "uint64":
        return kind, pa.array(draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n)), pa.uint64()), nothing
    if kind == "float":
        return kind, pa.array(draw(st.lists(st.floats(), min_size=n, max_size=n)), pa.float64()), nothing
    if kind == "bool":
        return kind, pa.array(draw(st.lists(st.booleans(), min_size=n, max_size=n))), nothing
    if kind == "decimal":
        return kind, pa.array([Decimal(i).scaleb(-5) for i in range(n)], pa.decimal128(20, 5)), nothing
    if kind == "timestamp":
        return kind, pa.array(list(range(n)), pa.timestamp("s")), nothing
    if kind == "timestamp_out_of_range":  # no datetime can hold year 33658
        return kind, pa.array([10**12] * n, pa.timestamp("s")), nothing
    if kind == "messages":
        return kind, pa.array([[{"role": "user", "content": s}] if s is not None else None for s in strings],
                              pa.list_(MESSAGE)), nothing
    if kind == "messages_binary":
        return kind, pa.array([[{"role": b"user", "content": b}] if b is not None else None for b in encoded],
                              pa.list_(BINARY_MESSAGE)), nothing
    raw = [[{"role": b"user", "content": b + draw(BAD_UTF8)}] if b is not None else None for b in encoded]
    return kind, pa.array(raw, pa.list_(BINARY_MESSAGE)).view(pa.list_(MESSAGE)), nothing


def _expected_ids(kind: str, column: pa.Array, texts: list) -> list:
    if kind in TEXT_KINDS:
        return [t if t is not None and t.strip() else None for t in texts]
    if kind in ("int64", "uint64"):
        return [None if v is None else str(v) for v in column.to_pylist()]
    return [None] * len(column)


@settings(max_examples=examples(200), deadline=None)
@given(data=st.data(), n=st.integers(0, 12), id_present=st.booleans(), row_group=st.integers(1, 5),
       messages=st.booleans())
def test_parquet_every_row_one_row(datasources, data, n, id_present, row_group, messages):
    prompt_kind, prompt, prompt_texts = data.draw(parquet_column(n))
    event(f"parquet prompt column: {prompt_kind}")
    columns = {("messages" if messages else "prompt"): prompt}
    expected_ids = [None] * n
    if id_present:
        id_kind, ids, id_texts = data.draw(parquet_column(n))
        event(f"parquet id column: {id_kind}")
        columns["id"] = ids
        expected_ids = _expected_ids(id_kind, ids, id_texts)
    buffer = io.BytesIO()
    pq.write_table(pa.table(columns), buffer, row_group_size=row_group)
    rows = read_stream(datasources["parquet_messages" if messages else "parquet"], pa.BufferReader(buffer.getvalue()),
                       "/fuzz/in.parquet")
    assert len(rows) == n
    for i, (row, expected_id, text) in enumerate(zip(rows, expected_ids, prompt_texts)):
        assert (row["prompt"] is None) != (row["error"] is None), row
        assert row["id"] == expected_id, (row, expected_id)
        assert row["row_key"] == ("id:" + expected_id if expected_id is not None else f"row:file:///fuzz/in.parquet#{i}")
        if not messages:
            ok = expected_id is not None and text is not None and text.strip()
            assert row["prompt"] == (text if ok else None), (prompt_kind, text, row)
        if prompt_kind in ("binary_invalid", "string_invalid") and prompt[i].is_valid and not messages:
            assert "prompt is not valid UTF-8 (byte 0x" in row["error"]
        if prompt_kind == "messages_invalid" and prompt[i].is_valid and messages:
            assert "prompt is not valid UTF-8 (byte 0x" in row["error"]


def test_parquet_odd_columns_give_clear_rows(datasources):
    """One file per column type that an issue-14 user met, each row checked."""
    cases = {
        "binary": (pa.array([b"caf\xc3\xa9", b"\xff", None], pa.binary()),
                   ["café", "prompt is not valid UTF-8 (byte 0xff at offset 0)", "missing prompt"]),
        "large_string": (pa.array(["a", "", None], pa.large_string()), ["a", "empty prompt", "missing prompt"]),
        "dictionary": (pa.array(["a", "a", None]).dictionary_encode(), ["a", "a", "missing prompt"]),
        "list": (pa.array([["a"], [], None], pa.list_(pa.string())),
                 ["prompt is not a string (got list)"] * 2 + ["missing prompt"]),
        "struct": (pa.array([{"t": "a"}, None, {"t": None}], pa.struct([("t", pa.string())])),
                   ["prompt is not a string (got object)", "missing prompt", "prompt is not a string (got object)"]),
        "all_null": (pa.nulls(3), ["missing prompt"] * 3),
        "invalid_string": (pa.array([b"ok", b"x\xed\xa0\x80", b"\xc3"], pa.binary()).view(pa.string()),
                           ["ok", "prompt is not valid UTF-8 (byte 0xed at offset 1)",
                            "prompt is not valid UTF-8 (byte 0xc3 at offset 0)"]),
    }
    for name, (column, expected) in cases.items():
        buffer = io.BytesIO()
        pq.write_table(pa.table({"id": ["1", "2", "3"], "prompt": column}), buffer)
        rows = read_stream(datasources["parquet"], pa.BufferReader(buffer.getvalue()), "/fuzz/in.parquet")
        assert [r["prompt"] or r["error"] for r in rows] == expected, name
    empty = io.BytesIO()
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.binary())}), empty)
    assert read_stream(datasources["parquet"], pa.BufferReader(empty.getvalue()), "/fuzz/in.parquet") == []
    binary_ids = io.BytesIO()
    pq.write_table(pa.table({"id": pa.array([b"k1", b"\xff"]), "prompt": ["a", "b"]}), binary_ids)
    rows = read_stream(datasources["parquet"], pa.BufferReader(binary_ids.getvalue()), "/fuzz/in.parquet")
    assert [(r["id"], r["error"]) for r in rows] == [
        ("k1", None), (None, "id is not valid UTF-8 (byte 0xff at offset 0)")]


# ------------------------------------------------------------------------------------------
# Compressed inputs, unsupported codecs, files that cannot be read at all


def compress(data: bytes, codec: str) -> bytes:
    if codec == "gzip":
        return gzip.compress(data)
    if codec == "bz2":
        return bz2.compress(data)
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, codec) as out:
        out.write(data)
    return sink.getvalue().to_pybytes()


SUFFIXES = [("gzip", ".gz"), ("gzip", ".GZ"), ("gzip", ".gzip"), ("bz2", ".bz2"), ("zstd", ".zst"),
            ("zstd", ".zstd"), ("lz4", ".lz4")]


@settings(max_examples=examples(40), deadline=None)
@given(hostile=st.lists(hostile_lines, max_size=5), codec_suffix=st.sampled_from(SUFFIXES))
def test_compressed_jsonl_reads_transparently(datasources, hostile, codec_suffix):
    codec, suffix = codec_suffix
    event(f"compressed: {codec}")
    data = b"\n".join([good_line("g", "fine")] + [line for _, line in hostile]) + b"\n"
    path = datasources["root"] / f"c.jsonl{suffix}"
    path.write_bytes(compress(data, codec))
    jsonl = datasources["jsonl"]
    with jsonl._open_input_source(jsonl._filesystem, str(path)) as stream:
        rows = read_stream(jsonl, stream, str(path))
    check_rows(rows, nonblank_lines(data))
    assert any(r["row_key"] == "id:g" and r["prompt"] == "fine" for r in rows)


@pytest.mark.parametrize("suffix", [".xz", ".zip", ".7z", ".lzma", ".br", ".snappy", ".Z", ".tar.gz", ".tgz"])
def test_unsupported_codecs_fail_at_startup(tmp_path, suffix):
    path = tmp_path / f"prompts.jsonl{suffix}"
    path.write_bytes(b"whatever")
    with pytest.raises(InputError, match=rf"cannot read {path.as_uri()}: .*not supported"):
        prompt_datasource([str(path)], "jsonl", FIELDS)


@pytest.mark.parametrize("codec", ["gzip", "bz2", "zstd", "lz4", "xz", "zip", "utf-16", "utf-16-le", "utf-16-be"])
def test_files_that_are_not_utf8_text_are_a_clear_error(datasources, codec):
    """A compressed or UTF-16 file named .jsonl would otherwise give a junk error row per line, written as done."""
    data = b'{"id": "a", "prompt": "p"}\n' * 50
    if codec.startswith("utf-16"):
        blob = data.decode().encode(codec)
    elif codec == "xz":
        import lzma

        blob = lzma.compress(data)
    elif codec == "zip":
        import zipfile

        sink = io.BytesIO()
        with zipfile.ZipFile(sink, "w") as z:
            z.writestr("prompts.jsonl", data)
        blob = sink.getvalue()
    else:
        blob = compress(data, codec)
    with pytest.raises(InputError, match=r"cannot read file:///fuzz/in.jsonl: it looks (.*-compressed|UTF-16 text), "
                                         r"but JSONL must be UTF-8 text"):
        read_stream(datasources["jsonl"], pa.BufferReader(blob))


def test_damaged_files_are_one_error_naming_the_file(datasources):
    good = b'{"id": "a", "prompt": "p"}\n' * 1000
    path = datasources["root"] / "bad.jsonl.gz"
    jsonl = datasources["jsonl"]
    compressed = gzip.compress(good)
    for blob in (compressed[: len(compressed) // 2], b"\x1f\x8b\x08" + b"\xff" * 64):  # truncated, garbage
        path.write_bytes(blob)
        with pytest.raises(InputError, match=rf"cannot read {path.as_uri()}: OSError: .+"), \
                jsonl._open_input_source(jsonl._filesystem, str(path)) as stream:
            read_stream(jsonl, stream, str(path))
    with pytest.raises(InputError, match=r"cannot read Parquet file file:///fuzz/in.parquet"):
        read_stream(datasources["parquet"], pa.BufferReader(b"PAR1" + b"\x00" * 20 + b"PAR1"), "/fuzz/in.parquet")
    twice = io.BytesIO()  # Parquet allows two columns of one name; which would be the prompt?
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["p"]), pa.array(["q"])],
                                        names=["id", "prompt", "prompt"]), twice)
    with pytest.raises(InputError, match=r"file:///fuzz/in.parquet: it has 2 columns named 'prompt'"):
        read_stream(datasources["parquet"], pa.BufferReader(twice.getvalue()), "/fuzz/in.parquet")


# ------------------------------------------------------------------------------------------
# Through Ray Data: real files, several blocks, duplicate ids, compression, odd file names


def test_ray_reads_every_hostile_line(ray_session, tmp_path, monkeypatch):
    from pipeline.data import inputs

    monkeypatch.setattr(inputs, "ROWS_PER_BLOCK", 5)
    corpus = [line for lines in HOSTILE_JSONL.values() for line in lines]
    good = [good_line(f"good-{i}", f"prompt {i} " + SPECIAL_TOKENS[i % len(SPECIAL_TOKENS)]) for i in range(10)]
    data = b"\n".join(corpus[:20] + good + corpus[20:]) + b"\n"
    (tmp_path / "a.jsonl").write_bytes(data)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(data))  # the same rows: every id is a duplicate
    (tmp_path / "c.jsonl.zst").write_bytes(compress(b"\r\n".join(good[:3]), "zstd"))
    scan = scan_prompts([str(tmp_path)], "jsonl", PromptFields(max_prompt_chars=MAX_CHARS))
    ds, duplicates = scan.dataset, scan.duplicates
    rows = ds.take_all()
    expected = 2 * len(nonblank_lines(data)) + 3
    assert len(rows) == expected == len({r["row_key"] for r in rows})
    a_rows = [r for r in rows if r["source"].endswith("/a.jsonl")]
    assert all(r["error"] is None for r in a_rows if (r["id"] or "").startswith("good-"))
    assert all(r["error"].startswith("duplicate id") for r in rows if r["source"].endswith("/c.jsonl.zst"))
    assert duplicates["good-0"] == 3
    kinds = Counter(r["error"].split(" (")[0].split(":")[0] for r in a_rows if r["error"])
    assert kinds["prompt holds a lone surrogate"] == 3 and kinds["id holds a lone surrogate"] == 1
    assert kinds["malformed JSON"] > 5


ODD_NAMES = ["with space.jsonl", "hash#frag.jsonl", "pct%20.jsonl", "é-ü.jsonl", "sep\x1fx.jsonl", "brackets[1].jsonl",
             "star*.jsonl", "q?.jsonl"]


def test_ray_odd_file_names(ray_session, tmp_path):
    """Names with spaces, URL and glob characters, non-ASCII and \\x1f are read; duplicates name them."""
    for k, name in enumerate(ODD_NAMES):
        lines = [{"id": k, "prompt": "a"}, {"id": k, "prompt": "b"}, {"prompt": "c"}]
        (tmp_path / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
    scan = scan_prompts([str(tmp_path / name) for name in ODD_NAMES], "jsonl", PromptFields())
    ds, duplicates = scan.dataset, scan.duplicates
    rows = ds.take_all()
    assert len(rows) == 3 * len(ODD_NAMES) == len({r["row_key"] for r in rows})
    assert duplicates == {str(k): 2 for k in range(len(ODD_NAMES))}
    for name in ODD_NAMES:
        source = f"file://{tmp_path / name}"  # fsspec URLs: not percent-encoded
        mine = sorted((r["row_key"].split(":")[0], r["prompt"], r["error"]) for r in rows if r["source"] == source)
        assert mine == [("dup", None, f"duplicate id (first seen in {source} line 1)"), ("id", "a", None),
                        ("row", None, "missing id")], name


def test_ray_file_names_that_cannot_be_read_are_startup_errors(ray_session, tmp_path):
    with open(bytes(tmp_path) + b"/bad-\xff.jsonl", "wb") as f:  # the byte 0xff in the file name
        f.write(b'{"id": 1, "prompt": "a"}\n')
    with pytest.raises(InputError, match=r"bad-.*not valid UTF-8"):
        scan_prompts([str(tmp_path)], "jsonl", PromptFields())
    for name in ("new\nline.jsonl", "tab\t.jsonl", "cr\r.jsonl"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        (tmp_path / "sub" / name).write_text('{"id": 1, "prompt": "a"}\n')
        with pytest.raises(InputError, match=r"line break or tab"):
            scan_prompts([str(tmp_path / "sub")], "jsonl", PromptFields())
        (tmp_path / "sub" / name).unlink()


def test_ray_parquet_binary_and_invalid_strings(ray_session, tmp_path):
    pq.write_table(pa.table({"id": [1, 2, 3], "prompt": pa.array([b"ok", b"\xff", None], pa.binary())}),
                   tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [4], "prompt": pa.array([b"\xc3"], pa.binary()).view(pa.string())}),
                   tmp_path / "b.parquet")
    pq.write_table(pa.table({"id": pa.array([], pa.int64()), "prompt": pa.array([], pa.string())}),
                   tmp_path / "c.parquet")
    ds = scan_prompts([str(tmp_path)], "parquet", PromptFields()).dataset
    rows = sorted(ds.take_all(), key=lambda r: r["row_key"])
    assert [(r["id"], r["prompt"], r["error"]) for r in rows] == [
        ("1", "ok", None),
        ("2", None, "prompt is not valid UTF-8 (byte 0xff at offset 0)"),
        ("3", None, "missing prompt"),
        ("4", None, "prompt is not valid UTF-8 (byte 0xc3 at offset 0)"),
    ]


def test_ray_unreadable_file_is_one_clear_error(ray_session, tmp_path):
    (tmp_path / "ok.jsonl").write_bytes(b'{"id": 1, "prompt": "a"}\n')
    compressed = gzip.compress(b'{"id": 2, "prompt": "b"}\n' * 2000)
    (tmp_path / "cut.jsonl.gz").write_bytes(compressed[: len(compressed) // 2])
    with pytest.raises(InputError) as excinfo:
        scan_prompts([str(tmp_path)], "jsonl", PromptFields())
    message = str(excinfo.value)
    assert message.startswith(f"cannot read {(tmp_path / 'cut.jsonl.gz').as_uri()}: OSError: ") and "\n" not in message
