"""OpenAI Batch API files in and out (pipeline/data/openai_batch.py).

- Request lines map onto rows: custom_id -> id, body.messages / body.prompt -> the prompt, the
  sampling fields -> per-row settings that pipeline/settings/row_settings.py accepts, response_format ->
  structured_output; every field the pipeline cannot honour is an error row naming it.
- The output file has one line per request line, in request order, in the Batch API's shape
  (`chat.completion` / `text_completion` bodies with n choices, usage, OpenAI-shaped logprobs), an
  error line for every error row; a resumed run writes it again with every request exactly once.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.dataset
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.data.openai_batch import (
    CHAT_URL,
    COMPLETIONS_URL,
    FIELD_SETTINGS,
    OUTPUT_NAME,
    ZERO_PROBABILITY_LOGPROB,
    BatchRequest,
    RequestLine,
    TokenStrings,
    byte_level_decoder,
    parse_request_line,
    piece_bytes,
    response_line,
    write_batch_output,
)
from pipeline.data.outputs import read_output, rows_to_table, sample_key, write_part
from pipeline.settings.config import ConfigError, load_config
from pipeline.settings.row_settings import SETTING_KINDS, checked_setting, decode_settings
from tests.hypothesis_budget import examples

REPO = Path(__file__).resolve().parents[1]


def request(custom_id, body: dict, url: str = CHAT_URL, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra}


def chat(custom_id, content="w5 w6", **body) -> dict:
    return request(custom_id, {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], **body})


def parse(line: dict | str) -> BatchRequest:
    return parse_request_line((line if isinstance(line, str) else json.dumps(line)).encode())


# ------------------------------------------------------------------------------ request lines


def test_a_chat_request_maps_onto_the_rows_prompt_and_settings():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    got = parse(request("r1", {
        "model": "gpt-4o-mini",
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"},
                                                       {"type": "text", "text": "and exact"}]},
                     {"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"},
                     {"role": "user", "content": "w8", "name": None}],
        "max_completion_tokens": 9, "temperature": 0.7, "top_p": 0.9, "n": 2, "seed": 11, "stop": "w9",
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "logprobs": True, "top_logprobs": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
        "user": "someone", "stream": False, "tools": None}))
    assert got.error is None and got.custom_id == "r1" and got.kind == "messages" and got.url == CHAT_URL
    assert json.loads(got.prompt) == [{"role": "system", "content": "be brief\nand exact"},
                                      {"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"},
                                      {"role": "user", "content": "w8"}]
    settings = decode_settings(got.settings)
    assert settings == {"max_new_tokens": 9, "temperature": 0.7, "top_p": 0.9, "n": 2, "seed": 11, "stop": ["w9"],
                        "presence_penalty": 0.5, "frequency_penalty": -0.5, "logprobs": 3,
                        "structured_output": {"json": schema}}
    assert got.top_logprobs == 3
    for name, value in settings.items():  # every setting is one pipeline/settings/row_settings.py accepts
        checked_setting(name, value)
    assert checked_setting("structured_output", settings["structured_output"]).kind == "json"


@pytest.mark.parametrize("body, settings, top", [
    ({"max_tokens": 4}, {"max_new_tokens": 4}, None),
    ({"max_tokens": 4, "max_completion_tokens": 4}, {"max_new_tokens": 4}, None),
    ({"logprobs": True}, {"logprobs": 1}, 0),  # the chosen token's logprob needs our k >= 1; 0 alternatives shown
    ({"logprobs": False}, {}, None),
    ({"stop": ["w9", "w10"]}, {"stop": ["w9", "w10"]}, None),
    ({"response_format": {"type": "json_object"}}, {"structured_output": {"json_object": True}}, None),
    ({"response_format": {"type": "text"}}, {}, None),
    ({"structured_outputs": {"choice": ["w5", "w7"]}}, {"structured_output": {"choice": ["w5", "w7"]}}, None),
    ({"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1}, {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1},
     None),
])
def test_each_chat_field_becomes_its_setting(body, settings, top):
    got = parse(chat("x", **body))
    assert got.error is None, got.error
    assert decode_settings(got.settings) == settings and got.top_logprobs == top


def test_a_completions_request_is_a_text_prompt_with_legacy_logprobs():
    got = parse(request("c", {"model": "m", "prompt": "w5 w6", "max_tokens": 3, "logprobs": 2, "echo": False,
                              "best_of": 1}, url=COMPLETIONS_URL))
    assert got.error is None and got.kind == "text" and got.prompt == "w5 w6" and got.url == COMPLETIONS_URL
    assert decode_settings(got.settings) == {"max_new_tokens": 3, "logprobs": 2} and got.top_logprobs == 2


@pytest.mark.parametrize("line, words", [
    (chat("a", tools=[{"type": "function", "function": {"name": "f"}}]), "unsupported field body.tools"),
    (chat("a", tool_choice="auto"), "unsupported field body.tool_choice"),
    (chat("a", logit_bias={"5": 10}), "unsupported field body.logit_bias"),
    (chat("a", stream=True), "unsupported field body.stream"),
    (chat("a", audio={"voice": "x"}), "unsupported field body.audio"),
    (chat("a", response_format={"type": "grammar"}), "unsupported body.response_format type 'grammar'"),
    (chat("a", response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "body.response_format.json_schema.schema is missing"),
    (chat("a", response_format={"type": "json_object"}, structured_outputs={"regex": "w5"}), "give one"),
    (chat("a", top_logprobs=2), "body.top_logprobs needs body.logprobs: true"),
    (chat("a", logprobs=True, top_logprobs=21), "body.top_logprobs must be an integer in [0, 20]"),
    (chat("a", max_tokens=0), "body.max_tokens must be a positive integer"),
    (chat("a", max_tokens=3, max_completion_tokens=4), "differ; give one"),
    (chat("a", stop=["w5", 3]), "body.stop must be a non-empty string or a list of them"),
    (chat("a", temperature={"t": 1}), "setting 'temperature' holds a dict"),
    (request("a", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}),
     "unsupported content part body.messages[0].content[0] (type 'image_url')"),
    (request("a", {"messages": [{"role": "user", "content": "w5", "name": "bob"}]}),
     "unsupported field body.messages[0].name"),
    (request("a", {"messages": []}), "empty prompt"),
    (request("a", {"model": "m"}), "missing body.messages"),
    (request("a", {"prompt": ["w5", "w6"]}, url=COMPLETIONS_URL), "body.prompt must be one string"),
    (request("a", {"prompt": "w5", "suffix": "w6"}, url=COMPLETIONS_URL), "unsupported field body.suffix"),
    (request("a", {"input": "w5"}, url="/v1/embeddings"), "unsupported url '/v1/embeddings'"),
    ({**chat("a"), "method": "GET"}, "method must be POST, got 'GET'"),
    ({**chat("a"), "priority": 1}, "unsupported field priority"),
    ({"custom_id": "a", "method": "POST", "url": CHAT_URL}, "missing body"),
    ({"method": "POST", "url": CHAT_URL, "body": chat("a")["body"]}, "missing custom_id"),
    (chat(7), "custom_id must be a string, got int"),
    ('{"custom_id": "a", "body": ', "malformed JSON"),
    ("[1, 2]", "line is not a JSON object (got list)"),
])
def test_what_cannot_be_honoured_is_an_error_row_naming_it(line, words):
    got = parse(line)
    assert got.error is not None and words in got.error, got.error
    assert got.prompt is None and got.settings is None


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-3, 30) | st.floats(-3, 3) | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                        max_size=3), max_leaves=6)
BODY_FIELDS = sorted({*FIELD_SETTINGS, "model", "max_tokens", "max_completion_tokens", "stop", "logprobs",
                      "top_logprobs", "response_format", "structured_outputs", "user", "stream", "echo", "tools",
                      "logit_bias", "tool_choice", "functions", "audio", "modalities", "prediction"})


@settings(max_examples=examples(300), deadline=None)
@given(fields=st.dictionaries(st.sampled_from(BODY_FIELDS), JSON_VALUES, max_size=5),
       chat_url=st.booleans())
def test_a_field_is_honoured_or_named_never_dropped(fields, chat_url):
    """Any body: parsing never raises; a line without an error carries every field it was given
    that changes the answer (as a setting the row's checks accept), and a field the pipeline does
    not know is named in the error whatever else is wrong."""
    body = {**fields, **({"messages": [{"role": "user", "content": "w5"}]} if chat_url else {"prompt": "w5"})}
    got = parse(request("p", body, url=CHAT_URL if chat_url else COMPLETIONS_URL))
    known = {*FIELD_SETTINGS, "model", "max_tokens", "stop", "logprobs", "response_format", "structured_outputs",
             "user", "stream", "echo", "tools", "logit_bias"} | ({"max_completion_tokens", "top_logprobs"}
                                                               if chat_url else set())
    for name in set(fields) - known:
        if fields[name] is not None:
            assert got.error is not None and f"body.{name}" in got.error, (name, got.error)
    if got.error is None:
        settings = decode_settings(got.settings)
        for name in FIELD_SETTINGS:
            if fields.get(name) is not None:
                assert settings[name] == fields[name]
        if fields.get("max_tokens") is not None or fields.get("max_completion_tokens") is not None:
            assert "max_new_tokens" in settings
        if isinstance(fields.get("response_format"), dict) and fields["response_format"].get("type") != "text":
            assert "structured_output" in settings
        assert set(settings) <= set(SETTING_KINDS)  # names the worker knows (it checks the values)


def test_an_error_row_keeps_its_custom_id():
    assert parse(chat("keep", tools=[{}])).custom_id == "keep"
    assert parse(chat(7)).custom_id == "7"


# ------------------------------------------------------------------------------ token spellings


def test_token_bytes_follow_the_vocabularys_spelling():
    byte_decoder = byte_level_decoder()
    assert len(byte_decoder) == 256 and sorted(byte_decoder.values()) == list(range(256))
    assert piece_bytes("<0xE2>", None) == b"\xe2"  # SentencePiece byte fallback
    assert piece_bytes("\u2581hello", None) == b" hello"  # SentencePiece word
    assert piece_bytes("\u0120hi", byte_decoder) == b" hi"  # byte-level BPE ("Ġ" is a space)
    assert piece_bytes("\u00e2\u0122", byte_decoder) == b"\xe2\x80"  # part of a character
    assert piece_bytes("w5", None) is None  # decoded by the tokenizer instead


def test_token_strings_of_the_tiny_tokenizer():
    from tests.tiny_models import tiny_tokenizer

    strings = TokenStrings(tiny_tokenizer())
    assert strings(5) == ("w5", list(b"w5")) and strings(2) == ("<eos>", list(b"<eos>"))


# ------------------------------------------------------------------------------ response lines


def output_row(key: str, sample: int = 0, n: int = 1, text: str | None = "w5 w6", error: str | None = None,
               **extra) -> dict:
    ok = error is None
    return {"row_key": sample_key(key, sample), "id": key.removeprefix("id:"), "sample_index": sample, "n": n,
            "text": text if ok else None, "token_ids": [5, 6] if ok else None,
            "finish_reason": "stop" if ok else "error",
            "error": error, "num_prompt_tokens": 4, "num_generated_tokens": 2 if ok else 0,
            "finished_at": datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc), "target_fingerprint": "fp",
            "run_id": "run", "logprobs": None, "top_logprob_ids": None, "top_logprobs": None, **extra}


class FakeStrings:
    def __call__(self, token_id: int):
        return f"w{token_id}", list(f"w{token_id}".encode())


def test_a_chat_response_has_n_choices_usage_and_openai_logprobs():
    line = RequestLine("id:a", "f", 1, BatchRequest("a", url=CHAT_URL, top_logprobs=1))
    logprobs = dict(logprobs=[-0.5, -float("inf")], top_logprob_ids=[[5, 9], [7, 6]],
                    top_logprobs=[[-0.5, -1.0], [-0.1, -float("inf")]])
    samples = [output_row("id:a", 0, 2, **logprobs),
               output_row("id:a", 1, 2, text="w7", finish_reason="length", **logprobs)]
    out = response_line(line, samples, "tiny", FakeStrings)
    assert out["custom_id"] == "a" and out["error"] is None and out["id"].startswith("batch_req_")
    response = out["response"]
    assert response["status_code"] == 200 and response["request_id"]
    body = response["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny" and body["system_fingerprint"] == "fp"
    assert body["created"] == int(samples[0]["finished_at"].timestamp())
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"] for c in body["choices"]] == [{"role": "assistant", "content": "w5 w6"},
                                                       {"role": "assistant", "content": "w7"}]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    content = body["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "w5", "logprob": -0.5, "bytes": list(b"w5"),
                          "top_logprobs": [{"token": "w5", "logprob": -0.5, "bytes": list(b"w5")}]}  # k = 1 of 2
    assert content[1]["logprob"] == ZERO_PROBABILITY_LOGPROB and len(content[1]["top_logprobs"]) == 1
    json.dumps(out, allow_nan=False)  # no -inf or NaN reaches the file
    # the same line without logprobs asked
    plain = response_line(RequestLine("id:a", "f", 1, BatchRequest("a", url=CHAT_URL)), samples, "tiny", FakeStrings)
    assert all(c["logprobs"] is None for c in plain["response"]["body"]["choices"])


def test_a_completions_response_is_a_text_completion():
    line = RequestLine("id:c", "f", 1, BatchRequest("c", kind="text", url=COMPLETIONS_URL, top_logprobs=2))
    samples = [output_row("id:c", logprobs=[-0.5, -0.25], top_logprob_ids=[[5, 9, 4], [6, 4, 7]],
                          top_logprobs=[[-0.5, -1.0, -2.0], [-0.25, -3.0, -4.0]], finish_reason="context_limit")]
    body = response_line(line, samples, "tiny", FakeStrings)["response"]["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["text"] == "w5 w6" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"tokens": ["w5", "w6"], "token_logprobs": [-0.5, -0.25],
                                  "top_logprobs": [{"w5": -0.5, "w9": -1.0}, {"w6": -0.25, "w4": -3.0}],
                                  "text_offset": [0, 2]}


@pytest.mark.parametrize("samples, code, words", [
    ([output_row("id:e", error="setting 'structured_output': structured_output.json: bad")], "invalid_request",
     "structured_output.json"),
    ([output_row("id:e", error="duplicate id (first seen in f line 1)")], "duplicate_custom_id", "duplicate id"),
    ([output_row("id:e", error="internal error: RuntimeError('x')")], "server_error", "internal error"),
    ([output_row("id:e", 0, 3), output_row("id:e", 2, 3)], "server_error", "2 of its 3 completions"),
    (None, "missing_output", "no output row for this request"),
])
def test_an_error_row_is_an_error_line(samples, code, words):
    out = response_line(RequestLine("id:e", "f", 3, BatchRequest("e", url=CHAT_URL)), samples, "tiny", FakeStrings)
    assert out["response"] is None and out["custom_id"] == "e"
    assert out["error"]["code"] == code and words in out["error"]["message"]


def test_an_error_line_without_a_custom_id_names_its_line():
    out = response_line(RequestLine("row:f#abc", "file:///in.jsonl", 7, BatchRequest(None, error="malformed JSON")),
                        [output_row("row:f#abc", error="malformed JSON: x")], "tiny", FakeStrings)
    assert out["custom_id"] is None and out["error"]["message"] == "file:///in.jsonl line 7: malformed JSON: x"


# ------------------------------------------------------------------------------ the output file


def write_requests(path: Path, lines: list) -> list:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return lines


def batch_lines(output: str | Path, fs_read=None) -> list[dict]:
    text = fs_read() if fs_read else (Path(output) / OUTPUT_NAME).read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_the_file_answers_every_request_line_once_in_order_from_the_parts(tmp_path):
    """Parts written as a job would (duplicates keyed as the reader keys them, an id-less malformed
    line by its hash); the file follows the requests, and a request without rows is an error line."""
    from pipeline.data.inputs import JsonlRowKeys, duplicate_key, order_key

    requests = tmp_path / "requests.jsonl"
    write_requests(requests, [chat("a"), "{broken", chat("b"), chat("a", content="w9"), chat("gone")])
    source = requests.as_uri()
    malformed_key = JsonlRowKeys(source).key(None, b"{broken")
    rows = [output_row("id:a"), output_row(malformed_key, error="malformed JSON: x", id=None),
            output_row("id:b", 0, 2), output_row("id:b", 1, 2, text="w8"),
            output_row(duplicate_key("id:a", order_key(source, 4, "line")), error="duplicate id (first seen ...)"),
            output_row("id:stale")]  # answers no request line
    write_part(rows_to_table(rows), str(tmp_path / "out"), "run")
    report = write_batch_output(str(tmp_path / "out"), [source], model="tiny", tokenizer=lambda: None)
    lines = batch_lines(tmp_path / "out")
    assert [line["custom_id"] for line in lines] == ["a", None, "b", "a", "gone"]
    assert [line["error"]["code"] if line["error"] else None for line in lines] == [
        None, "invalid_request", None, "duplicate_custom_id", "missing_output"]
    assert len(lines[2]["response"]["body"]["choices"]) == 2
    assert (report.lines, report.errors, report.missing, report.unmatched) == (5, 3, 1, 1)
    assert not list((tmp_path / "out").glob(".tmp-*"))  # written atomically, nothing left beside it
    assert len(read_output(str(tmp_path / "out"))) == len(rows)  # the parts' readers skip the file
    assert pyarrow.dataset.dataset(str(tmp_path / "out"), format="parquet").count_rows() == len(rows)  # so do others


def test_a_compressed_request_file_is_read_again_as_the_reader_reads_it(tmp_path):
    import gzip

    path = tmp_path / "requests.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(json.dumps(chat(k)).encode() + b"\n" for k in ("x", "y"))))
    write_part(rows_to_table([output_row("id:x"), output_row("id:y", text="w9")]), str(tmp_path / "out"), "run")
    write_batch_output(str(tmp_path / "out"), [path.as_uri()], model="tiny", tokenizer=lambda: None)
    assert [line["response"]["body"]["choices"][0]["message"]["content"] for line in batch_lines(tmp_path / "out")] \
        == ["w5 w6", "w9"]


def test_the_file_is_written_on_s3(tmp_path, s3_server, s3_bucket):
    """The request file and the output on the local S3 server: the same lines as on a local disk."""
    lines = [chat("a"), chat("b", tools=[{}])]
    fs = s3_server.filesystem()
    fs.pipe_file(f"{s3_bucket}/in/requests.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode())
    output = f"s3://{s3_bucket}/out"
    write_part(rows_to_table([output_row("id:a"), output_row("id:b", error="unsupported field body.tools")]),
               output, "run")
    report = write_batch_output(output, [f"s3://{s3_bucket}/in/requests.jsonl"], model="tiny", tokenizer=lambda: None)
    assert report.url == f"s3://{s3_bucket}/out/{OUTPUT_NAME}"
    got = [json.loads(line) for line in fs.cat_file(f"{s3_bucket}/out/{OUTPUT_NAME}").decode().splitlines()]
    assert [line["custom_id"] for line in got] == ["a", "b"]
    assert got[0]["response"]["body"]["choices"][0]["message"]["content"] == "w5 w6"
    assert got[1]["error"] == {"code": "invalid_request", "message": "unsupported field body.tools"}


# ------------------------------------------------------------------------------ config


def test_the_config_takes_the_format_and_the_output_switch():
    cfg = load_config("configs/local.yaml", ["input.format=openai_batch", "output.openai_batch=true"])
    assert cfg.input.format == "openai_batch" and cfg.output.openai_batch
    with pytest.raises(ConfigError, match=r"output\.openai_batch: needs input\.format: openai_batch"):
        load_config("configs/local.yaml", ["output.openai_batch=true"])
    with pytest.raises(ConfigError, match=r"output\.openai_batch: needs output\.include_token_ids"):
        load_config("configs/local.yaml", ["input.format=openai_batch", "output.openai_batch=true",
                                           "output.include_token_ids=false"])


# ------------------------------------------------------------------------------ the whole job

REQUESTS = [
    chat("plain", "w5 w6 w7", max_tokens=6),
    chat("sampled", "w8 w9", max_tokens=5, temperature=0.8, n=2, seed=3),
    chat("logprobs", "w10 w11", max_completion_tokens=4, logprobs=True, top_logprobs=2),
    request("completion", {"model": "m", "prompt": "w12 w13", "max_tokens": 4, "logprobs": 1}, url=COMPLETIONS_URL),
    chat("choice", "w14", structured_outputs={"choice": ["w5 w6", "w7"]}),
    '{"custom_id": "broken", "body": ',
    chat("tools", tools=[{"type": "function", "function": {"name": "f"}}]),
    chat("badschema", response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                              "schema": {"type": "objectx"}}}),
    chat("plain", "w20"),  # a repeated custom_id
    chat("json", "w15", response_format={"type": "json_object"}, max_tokens=3),
]


def job_config(tmp_path: Path, artifacts: dict, output: Path, **overrides) -> Path:
    cfg = {"input": {"urls": [str(tmp_path / "requests.jsonl")], "format": "openai_batch"},
           "model": {"target": artifacts["target"], "draft_head": artifacts["head"], "trie": artifacts["trie"],
                     "dtype": "fp32", "device": "cpu"},
           "decoding": {"mode": "dart_lookup", "max_new_tokens": 8, "tree": {"budget": 8}},
           "resources": {"num_workers": 1, "num_cpus_per_worker": 0.5, "batch_size": 3},
           "output": {"url": str(output), "rows_per_file": 2, "openai_batch": True},
           "run": {"run_id": "batch", "progress_interval_s": 5}}
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(cfg))
    return path


def test_a_request_file_goes_in_and_the_batch_output_comes_out_once_per_request(tmp_path, tiny_artifacts,
                                                                                shared_ray):
    from pipeline.run import run_pipeline
    from tests.tiny_models import tiny_tokenizer

    write_requests(tmp_path / "requests.jsonl", REQUESTS)
    out = tmp_path / "out"
    config = job_config(tmp_path, tiny_artifacts, out)
    run_pipeline(load_config(config))
    lines = batch_lines(out)
    assert [line["custom_id"] for line in lines] == ["plain", "sampled", "logprobs", "completion", "choice", None,
                                                     "tools", "badschema", "plain", "json"]
    by_id = {}
    for line in lines:
        by_id.setdefault(line["custom_id"], line)
    errors = {line["custom_id"]: line["error"] for line in lines if line["error"]}
    assert set(errors) - {"json"} == {None, "tools", "badschema", "plain"} and lines[0]["error"] is None
    assert "malformed JSON" in errors[None]["message"] and "line 6" in errors[None]["message"]
    assert "unsupported field body.tools" in errors["tools"]["message"]
    assert errors["badschema"]["code"] == "invalid_request"
    assert "structured_output.json" in errors["badschema"]["message"]
    assert errors["plain"]["code"] == "duplicate_custom_id" and lines[8]["error"] == errors["plain"]
    rows = {r["row_key"]: r for r in read_output(str(out)).to_pylist()}
    # json_object over a vocabulary of words, where no token can begin an object: whatever the engine
    # makes of it (today an error row), the line carries it
    assert json.loads(rows["id:json"]["structured_output"]) == {"json_object": True}
    if rows["id:json"]["error"]:
        assert by_id["json"]["error"]["message"] == rows["id:json"]["error"]
    else:
        assert by_id["json"]["response"]["body"]["choices"][0]["message"]["content"] == rows["id:json"]["text"]
    plain = by_id["plain"]["response"]["body"]
    assert plain["object"] == "chat.completion" and plain["model"] == tiny_artifacts["target"]
    assert plain["choices"][0]["message"]["content"] == rows["id:plain"]["text"]
    assert plain["usage"]["completion_tokens"] == rows["id:plain"]["num_generated_tokens"] <= 6
    assert plain["usage"]["prompt_tokens"] == rows["id:plain"]["num_prompt_tokens"]
    sampled = by_id["sampled"]["response"]["body"]["choices"]
    assert [c["message"]["content"] for c in sampled] == [rows["id:sampled"]["text"],
                                                          rows["sample:1:id:sampled"]["text"]]
    assert rows["id:sampled"]["temperature"] == 0.8 and rows["id:sampled"]["max_new_tokens"] == 5
    content = by_id["logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    row = rows["id:logprobs"]
    assert [c["token"] for c in content] == tiny_tokenizer().convert_ids_to_tokens(row["token_ids"])
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert [c["logprob"] for c in content] == pytest.approx(
        [lp if math.isfinite(lp) else ZERO_PROBABILITY_LOGPROB for lp in row["logprobs"]])
    completion = by_id["completion"]["response"]["body"]
    assert completion["object"] == "text_completion"
    assert completion["choices"][0]["text"] == rows["id:completion"]["text"]
    assert len(completion["choices"][0]["logprobs"]["tokens"]) == rows["id:completion"]["num_generated_tokens"]
    assert by_id["choice"]["response"]["body"]["choices"][0]["message"]["content"] in ("w5 w6", "w7")

    # a resumed run (rows lost from one part) writes the file again: every request exactly once
    first = (out / OUTPUT_NAME).read_text()
    (out / OUTPUT_NAME).unlink()
    next(iter(sorted(out.glob("part-*.parquet")))).unlink()
    run_pipeline(load_config(config, ["run.resume=true"]))
    again = batch_lines(out)
    assert [line["custom_id"] for line in again] == [line["custom_id"] for line in lines]

    def without_times(text_lines):
        for line in text_lines:
            if line["response"]:
                line["response"]["body"].pop("created")
        return text_lines

    # The same lines; log-probabilities to float rounding only: the resumed rows are verified in
    # other forwards (other rows beside them, other trees), whose sums run in another order.
    assert_same_lines(without_times(again), without_times([json.loads(t) for t in first.splitlines()]))


def assert_same_lines(got, expected, where="lines"):
    """`got` equals `expected` (parsed JSON): every key, string, integer and list length exactly,
    floats (log-probabilities) to 1e-5."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), where
        for key in expected:
            assert_same_lines(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), where
        for k, (a, b) in enumerate(zip(got, expected)):
            assert_same_lines(a, b, f"{where}[{k}]")
    elif isinstance(expected, float):
        assert isinstance(got, (int, float)) and got == pytest.approx(expected, rel=1e-5, abs=1e-5), where
    else:
        assert type(got) is type(expected) and got == expected, where
