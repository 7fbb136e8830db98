"""Reading prompts into rows: one row per input line / Parquet row, stable unique keys, clear errors.

The pure parsing functions are tested directly (with hypothesis where inputs vary); the Ray Data
readers are tested on small files covering every kind of bad row, locally and from a real S3
server (moto_server on loopback).
"""

from __future__ import annotations

import io
import json
import random
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.data import inputs
from pipeline.data.inputs import (
    INPUT_SCHEMA,
    InputError,
    PromptFields,
    find_duplicate_ids,
    iter_lines,
    normalise_id,
    normalise_messages,
    normalise_text_prompt,
    parse_jsonl_line,
    read_prompts,
    scan_prompts,
)
from pipeline.data.storage import StorageError, expand_inputs
from tests.hostile_inputs import ShortReads, line_as_read
from tests.hypothesis_budget import examples
from tests.s3_server import running_s3_server

TEXT = PromptFields()

# ------------------------------------------------------------------------------------------
# Pure functions


def test_normalise_id():
    assert normalise_id("a") == ("a", None)
    assert normalise_id(7) == ("7", None)
    assert normalise_id(-12345678901234567890) == ("-12345678901234567890", None)
    assert normalise_id(None) == (None, "missing id")
    assert normalise_id(inputs._MISSING) == (None, "missing id")
    assert normalise_id("  ") == (None, "empty id")
    assert normalise_id(True) == (None, "id is not a string or integer (got bool)")
    assert normalise_id(1.0) == (None, "id is not a string or integer (got float)")
    assert normalise_id({"a": 1}) == (None, "id is not a string or integer (got object)")
    assert normalise_id(b"k") == ("k", None)  # Parquet binary
    assert normalise_id(b"\xffk") == (None, "id is not valid UTF-8 (byte 0xff at offset 0)")
    assert normalise_id("a\udcff") == (
        None, "id holds a lone surrogate (U+DCFF at character 1), which is not valid Unicode text")


def test_normalise_text_prompt():
    assert normalise_text_prompt("hi", None) == ("hi", None)
    assert normalise_text_prompt(inputs._MISSING, None) == (None, "missing prompt")
    assert normalise_text_prompt(None, None) == (None, "missing prompt")
    assert normalise_text_prompt("", None) == (None, "empty prompt")
    assert normalise_text_prompt(" \n\t", None) == (None, "empty prompt")
    assert normalise_text_prompt(5, None) == (None, "prompt is not a string (got int)")
    assert normalise_text_prompt(["a"], None) == (None, "prompt is not a string (got list)")
    assert normalise_text_prompt("abcd", 4) == ("abcd", None)
    assert normalise_text_prompt("abcde", 4) == (None, "prompt longer than 4 characters (got 5)")
    assert normalise_text_prompt("caf\xe9".encode(), None) == ("caf\xe9", None)
    assert normalise_text_prompt(b" \n", None) == (None, "empty prompt")
    assert normalise_text_prompt(b"ok\xc3", None) == (None, "prompt is not valid UTF-8 (byte 0xc3 at offset 2)")
    assert normalise_text_prompt("\ud83d\ude00", None) == (
        None, "prompt holds a lone surrogate (U+D83D at character 0), which is not valid Unicode text")
    assert normalise_text_prompt("\U0001f600", None) == ("\U0001f600", None)


def test_normalise_messages():
    ok = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi", "name": "x"}]
    prompt, error = normalise_messages(ok, None)
    assert error is None
    assert json.loads(prompt) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert normalise_messages(ok, 9) == (None, "prompt longer than 9 characters (got 10)")
    assert normalise_messages(None, None) == (None, "missing prompt")
    assert normalise_messages([], None) == (None, "empty prompt")
    assert normalise_messages([{"role": "user", "content": " "}], None) == (None, "empty prompt")
    assert normalise_messages("hi", None) == (None, "prompt is not a list of messages (got string)")
    assert normalise_messages([3], None) == (None, "message 0 is not an object (got int)")
    assert normalise_messages([{"content": "x"}], None) == (None, "message 0 has no string 'role'")
    assert normalise_messages([{"role": "user"}], None) == (None, "message 0 'content' is not a string (got null)")
    assert normalise_messages([{"role": b"user", "content": b"hi"}], None) == (
        '[{"role": "user", "content": "hi"}]', None)
    assert normalise_messages([{"role": "user", "content": "\udc80"}], None) == (
        None, "message 0 'content' holds a lone surrogate (U+DC80 at character 0), which is not valid Unicode text")
    assert normalise_messages([{"role": b"\x80", "content": "c"}], None) == (
        None, "message 0 'role' is not valid UTF-8 (byte 0x80 at offset 0)")
    # Non-ASCII text survives as is (ensure_ascii=False), so lengths and tokens are the user's.
    assert json.loads(normalise_messages([{"role": "user", "content": "é\u2028"}], None)[0])[0]["content"] == "é\u2028"


def test_parse_jsonl_line():
    assert parse_jsonl_line(b'{"id": 3, "prompt": "x"}', TEXT) == ("3", "x", None)
    row_id, prompt, error = parse_jsonl_line(b'{"id": 3, "prompt": ', TEXT)
    assert (row_id, prompt) == (None, None) and error.startswith("malformed JSON: Expecting value")
    assert parse_jsonl_line(b"\xff{}", TEXT) == (None, None, "malformed JSON: invalid UTF-8 at byte 0")
    assert parse_jsonl_line(b'"just a string"', TEXT) == (None, None, "line is not a JSON object (got string)")
    assert parse_jsonl_line(b"[" * 100_000, TEXT)[2].startswith("malformed JSON")
    # Both problems are reported; the id is kept so that the row can be named in the output.
    assert parse_jsonl_line(b'{"id": 1.5, "prompt": ""}', TEXT) == (
        None,
        None,
        "id is not a string or integer (got float); empty prompt",
    )
    assert parse_jsonl_line(b'{"id": "k", "prompt": 1}', TEXT) == ("k", None, "prompt is not a string (got int)")
    fields = PromptFields(id_column="uid", prompt_column="text", messages_column="chat")
    assert parse_jsonl_line(b'{"uid": "u", "chat": [{"role": "user", "content": "c"}]}', fields)[1] == (
        '[{"role": "user", "content": "c"}]'
    )


def test_prompt_fields_validation():
    with pytest.raises(ValueError, match="one of prompt_column or messages_column"):
        PromptFields(prompt_column=None)
    with pytest.raises(ValueError, match="max_prompt_chars"):
        PromptFields(max_prompt_chars=0)


BOM = b"\xef\xbb\xbf"


@settings(max_examples=examples(200), deadline=None)
@given(
    lines=st.lists((st.binary(max_size=12) | st.just(BOM * 2 + b"x")).map(lambda b: b.replace(b"\n", b"")),
                   max_size=12),
    trailing_newline=st.booleans(),
    chunk=st.integers(1, 9),
)
def test_iter_lines_matches_split(lines, trailing_newline, chunk):
    data = b"\n".join(lines) + (b"\n" if trailing_newline and lines else b"")
    expected = data.split(b"\n")
    if expected and expected[-1] == b"" and data.endswith(b"\n"):
        expected.pop()
    if data == b"":
        expected = []
    got = list(iter_lines(ShortReads(data, chunk), chunk_bytes=chunk))
    assert [n for n, _ in got] == list(range(1, len(expected) + 1))
    # every line loses a trailing CR and its leading BOMs, whatever the read sizes
    assert [line for _, line in got] == [line_as_read(e) for e in expected]


def test_iter_lines_bom_crlf_and_unicode_separators():
    data = b'\xef\xbb\xbf{"a": 1}\r\n{"b": "x\xe2\x80\xa8y\xc2\x85z"}\n\n\xef\xbb\xbf{"c": 3}'
    assert list(iter_lines(io.BytesIO(data), chunk_bytes=4)) == [
        (1, b'{"a": 1}'),
        (2, b'{"b": "x\xe2\x80\xa8y\xc2\x85z"}'),
        (3, b""),
        (4, b'{"c": 3}'),  # files saved with a BOM, then concatenated
    ]


# ------------------------------------------------------------------------------------------
# Ray Data readers (one local Ray and one S3 server for the module)


@pytest.fixture(scope="module")
def s3():
    with running_s3_server(buckets=["inputs"]) as server:
        yield server


@pytest.fixture(scope="module")
def ray_session(s3, join_shared_ray):
    """This process joined to the session's Ray cluster for the module; its workers get the
    module's S3 server variables (set here by `s3`, forwarded by the join)."""
    with join_shared_ray(connect=True):
        yield


def rows_of(ds) -> list[dict]:
    rows = ds.take_all()
    assert all(set(row) == set(INPUT_SCHEMA.names) for row in rows)
    return sorted(rows, key=lambda r: r["row_key"])


def summary(row: dict) -> tuple:
    """(file name, id, prompt, error) with the variable detail of JSON decoder messages cut off."""
    error = row["error"]
    if error and error.startswith("malformed JSON") and "UTF-8" not in error:
        error = "malformed JSON"
    return (row["source"].rsplit("/", 1)[-1], row["id"], row["prompt"], error)


LONG = "x" * 101
# (line, expected id, expected prompt, expected error); None as the line means a blank line.
A_LINES = [
    ('{"id": "a1", "prompt": "hello"}', "a1", "hello", None),
    ('{"id": 7, "prompt": "int id"}', "7", "int id", None),
    ("", None, None, None),
    ("   \t", None, None, None),
    ('{"id": "a3", "prompt": "x"', None, None, "malformed JSON"),
    ('{"prompt": "no id"}', None, None, "missing id"),
    ('{"id": "a4"}', "a4", None, "missing prompt"),
    ('{"id": "a5", "prompt": ""}', "a5", None, "empty prompt"),
    ('{"id": "a6", "prompt": 42}', "a6", None, "prompt is not a string (got int)"),
    (json.dumps({"id": "a7", "prompt": LONG}), "a7", None, "prompt longer than 100 characters (got 101)"),
    ('{"id": "a8", "prompt": "line\u2028sep\u0085"}', "a8", "line\u2028sep\u0085", None),
    ("[1, 2]", None, None, "line is not a JSON object (got list)"),
    ('{"id": null, "prompt": "null id"}', None, None, "missing id"),
    ('{"id": true, "prompt": "bool id"}', None, None, "id is not a string or integer (got bool)"),
    ('{"id": "dup", "prompt": "first"}', "dup", "first", None),
    ('{"id": "dup", "prompt": "second"}', "dup", None, "duplicate id (first seen in {a} line 15)"),
    ('{"prompt": "no id"}', None, None, "missing id"),
    ("\udcff", None, None, "malformed JSON: invalid UTF-8 at byte 0"),
    ('{"id": "crlf", "prompt": "windows"}\r', "crlf", "windows", None),
    ('{"id": "a9", "prompt": null}', "a9", None, "missing prompt"),
    ('{"id": "last", "prompt": "no newline at the end"}', "last", "no newline at the end", None),
]
B_LINES = [
    ('{"id": "dup", "prompt": "third, other file"}', "dup", None, "duplicate id (first seen in {a} line 15)"),
    ('{"id": 7, "prompt": "int id again"}', "7", None, "duplicate id (first seen in {a} line 2)"),
    ('{"id": "b1", "prompt": "fine"}', "b1", "fine", None),
]


def write_jsonl(path: Path, lines: list[tuple]) -> None:
    # "\udcff" stands for the invalid byte 0xff; the last line gets no newline.
    data = b"\n".join(line.encode("utf-8", "surrogateescape") for line, *_ in lines)
    path.write_bytes(data)


@pytest.fixture
def jsonl_dir(tmp_path) -> Path:
    write_jsonl(tmp_path / "a.jsonl", A_LINES)
    write_jsonl(tmp_path / "b.jsonl", B_LINES)
    (tmp_path / "_SUCCESS").write_text("")  # metadata files of a directory are not inputs
    (tmp_path / ".hidden.jsonl").write_text("{}\n")
    return tmp_path


def expected_rows(directory: Path) -> list[tuple]:
    a_url = (directory / "a.jsonl").resolve().as_uri()
    rows = []
    for name, lines in (("a.jsonl", A_LINES), ("b.jsonl", B_LINES)):
        for line, row_id, prompt, error in lines:
            if line.strip():
                rows.append((name, row_id, prompt, error.format(a=a_url) if error else None))
    return sorted(rows, key=repr)


def test_jsonl_every_line_one_row(ray_session, jsonl_dir, monkeypatch):
    monkeypatch.setattr(inputs, "ROWS_PER_BLOCK", 4)  # several blocks per file
    scan = scan_prompts([str(jsonl_dir)], "jsonl", PromptFields(max_prompt_chars=100))
    ds, duplicates = scan.dataset, scan.duplicates
    rows = rows_of(ds)
    assert sorted(map(summary, rows), key=repr) == expected_rows(jsonl_dir)
    assert duplicates == {"dup": 3, "7": 2}

    keys = [r["row_key"] for r in rows]
    assert len(set(keys)) == len(keys)
    by_key = {r["row_key"]: r for r in rows}
    assert by_key["id:dup"]["prompt"] == "first" and by_key["id:7"]["prompt"] == "int id"
    assert by_key["id:a1"]["source"] == (jsonl_dir / "a.jsonl").resolve().as_uri()
    assert {r["prompt_kind"] for r in rows} == {"text"}
    # Two identical lines without an id get different keys; keys name the row kind.
    assert sum(k.startswith("row:") and k.endswith("~1") for k in keys) == 1
    assert all(k.startswith(("id:", "row:", "dup:")) for k in keys)

    # A second read (other block size, files named differently) gives the same keys for the same rows.
    monkeypatch.setattr(inputs, "ROWS_PER_BLOCK", 1000)
    again = rows_of(
        read_prompts([str(jsonl_dir / "b.jsonl"), f"file://{jsonl_dir}/*.jsonl"], "jsonl", max_prompt_chars=100)
    )
    assert again == rows


def test_jsonl_messages_column(ray_session, tmp_path):
    chat = [{"role": "user", "content": "hi"}]
    lines = [
        {"id": "m1", "messages": chat, "prompt": "ignored"},
        {"id": "m2", "messages": "not a list"},
        {"id": "m3", "messages": []},
        {"id": "m4", "messages": [{"role": "user"}]},
        {"id": "m5"},
    ]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    rows = rows_of(read_prompts([str(tmp_path / "chat.jsonl")], "jsonl", messages_column="messages"))
    assert [(r["id"], r["error"]) for r in rows] == [
        ("m1", None),
        ("m2", "prompt is not a list of messages (got string)"),
        ("m3", "empty prompt"),
        ("m4", "message 0 'content' is not a string (got null)"),
        ("m5", "missing prompt"),
    ]
    assert json.loads(rows[0]["prompt"]) == chat
    assert {r["prompt_kind"] for r in rows} == {"messages"}


def test_parquet_rows_with_differing_schemas(ray_session, tmp_path, monkeypatch):
    """Files whose columns have different types are each read with their own schema."""
    pq.write_table(
        pa.table({"id": pa.array([1, 2, 3, None, 5], pa.int64()), "prompt": ["ok", None, "", "no id", "x" * 11]}),
        tmp_path / "p1.parquet",
        row_group_size=2,
    )
    pq.write_table(pa.table({"id": ["1", "s2"], "prompt": pa.array([1, 2], pa.int64())}), tmp_path / "p2.parquet")
    pq.write_table(pa.table({"id": ["m1"]}), tmp_path / "p3.parquet")
    pq.write_table(pa.table({"prompt": ["same", "same"]}), tmp_path / "p4.parquet")
    pq.write_table(pa.table({"id": [1.0], "prompt": ["float id"]}), tmp_path / "p5.parquet")
    monkeypatch.setattr(inputs, "ROWS_PER_BLOCK", 2)
    scan = scan_prompts([str(tmp_path / "*.parquet")], "parquet", PromptFields(max_prompt_chars=10))
    ds, duplicates = scan.dataset, scan.duplicates
    rows = rows_of(ds)
    p1 = (tmp_path / "p1.parquet").resolve().as_uri()
    assert sorted(map(summary, rows), key=repr) == sorted(
        [
            ("p1.parquet", "1", "ok", None),
            ("p1.parquet", "2", None, "missing prompt"),
            ("p1.parquet", "3", None, "empty prompt"),
            ("p1.parquet", None, None, "missing id"),
            ("p1.parquet", "5", None, "prompt longer than 10 characters (got 11)"),
            ("p2.parquet", "1", None, f"duplicate id (first seen in {p1} row 0); prompt is not a string (got int)"),
            ("p2.parquet", "s2", None, "prompt is not a string (got int)"),
            ("p3.parquet", "m1", None, "missing prompt"),
            ("p4.parquet", None, None, "missing id"),
            ("p4.parquet", None, None, "missing id"),
            ("p5.parquet", None, None, "id is not a string or integer (got float)"),
        ],
        key=repr,
    )
    assert duplicates == {"1": 2}
    keys = [r["row_key"] for r in rows]
    assert len(set(keys)) == len(keys) == 11
    assert f"row:{p1}#3" in keys  # id-less Parquet rows are keyed by their row index
    assert rows_of(read_prompts([str(tmp_path)], "parquet", max_prompt_chars=10)) == rows


def test_parquet_messages_column(ray_session, tmp_path):
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    chats = pa.array([[{"role": "user", "content": "hello"}], [], None], pa.list_(message))
    pq.write_table(pa.table({"id": ["c1", "c2", "c3"], "conversation": chats}), tmp_path / "chat.parquet")
    rows = rows_of(read_prompts([str(tmp_path)], "parquet", prompt_column=None, messages_column="conversation"))
    assert [(r["id"], r["error"]) for r in rows] == [("c1", None), ("c2", "empty prompt"), ("c3", "missing prompt")]
    assert json.loads(rows[0]["prompt"]) == [{"role": "user", "content": "hello"}]


# Where the duplicate pass runs (`inputs.scan_keys`): small inputs in the driver, the rest as a
# Ray Data sort on the cluster. The tests' inputs are small, so a test about the pass runs both.
SCAN_IN = {"driver": inputs.SCAN_IN_DRIVER_BYTES, "cluster": -1}


@pytest.fixture(params=sorted(SCAN_IN))
def scan_in(request, monkeypatch):
    """Run the duplicate pass in the driver or on the cluster, whatever the input's size."""
    monkeypatch.setattr(inputs, "SCAN_IN_DRIVER_BYTES", SCAN_IN[request.param])
    return request.param


def test_random_inputs_against_reference(ray_session, tmp_path, monkeypatch, scan_in):
    """Many rows over several files and blocks: dedupe and keys agree with a brute-force reference,
    with the duplicate pass in the driver and on the cluster."""
    rng = random.Random(5)
    files = {}
    for f in range(3):
        lines = []
        for _ in range(rng.randint(30, 80)):
            r = rng.random()
            if r < 0.1:
                lines.append("")
            elif r < 0.2:
                lines.append('{"id": "broken"')
            elif r < 0.3:
                lines.append(json.dumps({"prompt": f"anon {rng.randint(0, 3)}"}))
            else:
                row_id = rng.choice([rng.randint(0, 60), f"s{rng.randint(0, 60)}"])
                lines.append(json.dumps({"id": row_id, "prompt": f"p{rng.randint(0, 9)}"}))
        files[f"f{f}.jsonl"] = lines
        (tmp_path / f"f{f}.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(inputs, "ROWS_PER_BLOCK", 7)
    rows = rows_of(read_prompts([str(tmp_path)], "jsonl"))

    expected, seen = [], set()
    for name in sorted(files):  # first occurrence = smallest (file URL, line number)
        for line in files[name]:
            if not line:
                continue
            record = json.loads(line) if not line.endswith('"broken"') else None
            row_id = str(record["id"]) if record and "id" in record else None
            duplicate = row_id is not None and row_id in seen
            seen.add(row_id)
            ok = row_id is not None and not duplicate
            expected.append((name, row_id, record["prompt"] if ok else None, duplicate))
    got = [(*summary(r)[:3], bool(r["error"] and r["error"].startswith("duplicate id"))) for r in rows]
    assert sorted(got, key=repr) == sorted(expected, key=repr)
    assert len({r["row_key"] for r in rows}) == len(rows)
    assert find_duplicate_ids(read_prompts([str(tmp_path)], "jsonl")) == {
        i: n for i, n in _counts(e[1] for e in expected).items() if n > 1
    }


def _counts(values) -> dict:
    counts: dict = {}
    for v in values:
        if v is not None:
            counts[v] = counts.get(v, 0) + 1
    return counts


def test_the_duplicate_pass_counts_the_same_in_the_driver_and_on_the_cluster(ray_session, tmp_path, monkeypatch):
    """`scan_keys` in the driver (small inputs) and as the cluster's sort (several blocks a file):
    the same repeated keys with their first positions, rows and, given written keys, rows left."""
    rng = random.Random(11)
    for f in range(3):
        lines = [json.dumps({"id": rng.randint(0, 40), "prompt": "p"}) if rng.random() < 0.8 else
                 json.dumps({"prompt": f"anon {rng.randint(0, 3)}"}) for _ in range(rng.randint(20, 60))]
        (tmp_path / f"f{f}.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(inputs, "ROWS_PER_BLOCK", 6)
    source = inputs.prompt_datasource([str(tmp_path)], "jsonl", TEXT, None)
    driver = inputs.scan_keys(source)
    assert driver.repeated and driver == inputs.scan_keys(source, in_driver_bytes=-1)
    done = frozenset({"id:1", "id:2", "id:3", "id:not-in-the-input", *list(driver.repeated)[:2]})
    resumed = inputs.scan_keys(source, done)
    assert resumed.pending < resumed.rows and resumed == inputs.scan_keys(source, done, in_driver_bytes=-1)


def test_input_errors(ray_session, tmp_path, scan_in):
    with pytest.raises(StorageError, match=r"input not found: .*nothing\.jsonl"):
        read_prompts([str(tmp_path / "nothing.jsonl")], "jsonl")
    with pytest.raises(StorageError, match="no files match"):
        read_prompts([str(tmp_path / "*.jsonl")], "jsonl")
    (tmp_path / "x.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="'jsonl', 'parquet' or 'openai_batch'"):
        read_prompts([str(tmp_path)], "csv")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InputError) as excinfo:  # at start-up, as a plain one-line error
        read_prompts([str(tmp_path / "bad.parquet")], "parquet")
    assert str(excinfo.value).startswith(f"cannot read Parquet file {(tmp_path / 'bad.parquet').as_uri()}: ")
    assert "\n" not in str(excinfo.value) and type(excinfo.value) is InputError


def test_expand_inputs_is_sorted_and_skips_metadata(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "sub/c.jsonl", "_SUCCESS", ".x.crc", "_tmp/d.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    uri = tmp_path.resolve().as_uri()
    expected = [f"{uri}/a.jsonl", f"{uri}/b.jsonl", f"{uri}/sub/c.jsonl"]
    assert expand_inputs([str(tmp_path)]) == expected
    assert expand_inputs([f"{tmp_path}/sub/*.jsonl", str(tmp_path / "b.jsonl"), f"file://{tmp_path}/a.jsonl"]) == [
        f"{uri}/a.jsonl",
        f"{uri}/b.jsonl",
        f"{uri}/sub/c.jsonl",
    ]
    # A file named explicitly is read even if its name looks like metadata.
    assert expand_inputs([str(tmp_path / "_SUCCESS")]) == [f"{uri}/_SUCCESS"]


# ------------------------------------------------------------------------------------------
# From a real S3 server


def test_s3_jsonl_and_parquet(ray_session, s3, jsonl_dir):
    fs = s3.filesystem()
    fs.put_file(str(jsonl_dir / "a.jsonl"), "inputs/prompts/a.jsonl")
    fs.put_file(str(jsonl_dir / "b.jsonl"), "inputs/prompts/b.jsonl")
    scan = scan_prompts(["s3://inputs/prompts/"], "jsonl", PromptFields(max_prompt_chars=100))
    ds, duplicates = scan.dataset, scan.duplicates
    rows = rows_of(ds)
    assert len(rows) == sum(1 for lines in (A_LINES, B_LINES) for line, *_ in lines if line.strip())
    assert duplicates == {"dup": 3, "7": 2}
    assert rows_of(read_prompts(["s3://inputs/prompts/*.jsonl"], "jsonl", max_prompt_chars=100)) == rows
    by_key = {r["row_key"]: r for r in rows}
    assert by_key["id:a1"]["source"] == "s3://inputs/prompts/a.jsonl"
    assert by_key[next(k for k in by_key if k.startswith("dup:") and k.endswith(":id:7"))]["error"] == (
        "duplicate id (first seen in s3://inputs/prompts/a.jsonl line 2)"
    )

    buffer = io.BytesIO()
    pq.write_table(pa.table({"id": [10, 11], "prompt": ["from s3", None]}), buffer)
    fs.pipe_file("inputs/pq/part-0.parquet", buffer.getvalue())
    rows = rows_of(read_prompts(["s3://inputs/pq"], "parquet"))
    assert [(r["id"], r["prompt"], r["error"], r["source"]) for r in rows] == [
        ("10", "from s3", None, "s3://inputs/pq/part-0.parquet"),
        ("11", None, "missing prompt", "s3://inputs/pq/part-0.parquet"),
    ]


def test_s3_missing_bucket_and_wrong_endpoint(ray_session, s3, monkeypatch):
    with pytest.raises(StorageError, match=r"s3://no-such-bucket/x\.jsonl .*bucket does not exist"):
        read_prompts(["s3://no-such-bucket/x.jsonl"], "jsonl")
    with pytest.raises(StorageError, match=r"input not found: s3://inputs/none\.jsonl"):
        read_prompts(["s3://inputs/none.jsonl"], "jsonl")

    closed = s3.endpoint.rsplit(":", 1)[0] + ":1"  # nothing listens on port 1
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    start = time.monotonic()
    with pytest.raises(StorageError) as excinfo:
        read_prompts(["s3://inputs/prompts/"], "jsonl")
    message = str(excinfo.value)
    assert "cannot list s3://inputs/prompts/" in message and "Could not connect" in message
    assert s3.env["AWS_SECRET_ACCESS_KEY"] not in message
    assert time.monotonic() - start < 15
