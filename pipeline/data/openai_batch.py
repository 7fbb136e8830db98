"""OpenAI Batch API files: request lines in (`input.format: openai_batch`), output lines out
(`output.openai_batch: true`).

Users arrive with request files in the Batch API's format (one JSON object per line: `custom_id`,
`method`, `url`, `body`), which OpenAI's Batch API and vLLM's `run-batch` accept. This module
maps each line onto the pipeline's row (id, prompt, per-row settings), and, when the job has
finished, writes the Batch API's output file from the Parquet parts: one line per request line,
in request order, with the `chat.completion` (or `text_completion`) object OpenAI would return.

Reading (`parse_request_line`, used by `OpenAIBatchDatasource`, the JSONL reader with another
parser): `custom_id` is the row's id, `body.messages` its chat prompt (`/v1/chat/completions`) or
`body.prompt` its text prompt (`/v1/completions`), and the sampling fields become the row's
settings (pipeline/settings/row_settings.py) under the names of `FIELD_SETTINGS`. A field this pipeline
cannot honour (tools, logit_bias, audio, an image part, a response_format type it does not know)
makes the line an error row naming the field: a request is never answered as if a field it
relied on had been given. A null value is taken as absent (OpenAI's meaning). A field the request
leaves out takes the job's `decoding.*` value, not OpenAI's default (OpenAI samples at
temperature 1 by default, `decoding.temperature` defaults to 0).

Writing (`write_batch_output`) re-reads the request files (the output lines follow their order,
and the request says which endpoint's shape and how many top logprobs each answer has) and
joins each line with its output rows by the row key the reader gave it (`JsonlRowKeys`, and the
pipeline's duplicate-id rule: the first occurrence is generated, later ones are error rows).
The file is built from every part under the output, so a resumed run writes it again with every
request exactly once, and it is written atomically under one name (`OUTPUT_NAME`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import posixpath
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from dart_worker.artifacts import io_retry
from pipeline.data.inputs import (
    JsonlPromptDatasource,
    JsonlRowKeys,
    duplicate_key,
    iter_lines,
    jsonl_codec,
    load_json_object,
    normalise_id,
    normalise_messages,
    normalise_text_prompt,
    order_key,
    register_datasource,
)
from pipeline.data.outputs import read_output, split_sample_key, write_file_atomically
from pipeline.data.storage import StorageError, describe_error, filesystem_for, is_local, url_of
from pipeline.settings.row_settings import encode_settings

logger = logging.getLogger(__name__)

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)
# The Batch API output file, next to the Parquet parts. Its name starts with "_", as the job
# summary's does: Ray Data, pyarrow.dataset and Spark skip such files, so the directory still reads
# as a Parquet dataset.
OUTPUT_NAME = "_openai_batch_output.jsonl"
# OpenAI's top_logprobs range (chat); the legacy completions `logprobs` is held to the same bound.
MAX_TOP_LOGPROBS = 20
# What OpenAI writes for a token whose probability is 0 (a filter removed it): JSON has no -inf.
ZERO_PROBABILITY_LOGPROB = -9999.0

# Body field -> per-row setting of the same meaning (vLLM's extensions top_k, min_p and
# repetition_penalty included: `run-batch` accepts them too). The setting checks the value.
FIELD_SETTINGS = {"temperature": "temperature", "top_p": "top_p", "n": "n", "seed": "seed",
                  "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                  "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
# Fields read by the mapping itself, per endpoint.
_CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "stop", "logprobs", "top_logprobs",
                "response_format", "structured_outputs", "user"}
_COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "stop", "logprobs", "response_format", "structured_outputs",
                      "user"}
# Fields accepted only with the value that changes nothing (their default); any other value is an error.
_ONLY_DEFAULT = {"stream": False, "echo": False, "best_of": 1, "logit_bias": {}, "tools": [], "suffix": ""}
_LINE_FIELDS = {"custom_id", "method", "url", "body"}
_MESSAGE_FIELDS = {"role", "content"}
# finish_reason of the output rows -> OpenAI's (a full context ends the completion by length, as OpenAI's does).
_FINISH_REASONS = {"stop": "stop", "length": "length", "context_limit": "length"}
# Columns of the output rows the response lines are built from.
_COLUMNS = ["row_key", "id", "sample_index", "n", "text", "token_ids", "logprobs", "top_logprob_ids", "top_logprobs",
            "finish_reason", "error", "num_prompt_tokens", "num_generated_tokens", "finished_at",
            "target_fingerprint", "run_id"]


# ---------------------------------------------------------------------------------------------
# Request lines -> rows


@dataclass(frozen=True)
class BatchRequest:
    """One request line as the pipeline takes it. `error` set: the line is an error row (the id is
    kept when it has one). `top_logprobs`: how many alternatives its answer lists per token, None
    when it did not ask for logprobs."""

    custom_id: str | None
    prompt: str | None = None
    kind: str = "messages"  # the row's prompt_kind: "messages" (chat) or "text" (completions)
    settings: str | None = None  # the row's settings column (pipeline/settings/row_settings.py encode_settings)
    error: str | None = None
    url: str | None = None
    top_logprobs: int | None = None


def parse_request_line(line: bytes, max_prompt_chars: int | None = None) -> BatchRequest:
    """The BatchRequest of one request line (bytes without the newline); never raises."""
    record, error = load_json_object(line)
    if error:
        return BatchRequest(None, error=error)
    problems: list[str] = []  # what is wrong with the line, in the order found
    custom_id = _custom_id(record, problems)
    present = {k: v for k, v in record.items() if v is not None}
    problems.extend(f"unsupported field {k}" for k in sorted(set(present) - _LINE_FIELDS))
    method, url, body = present.get("method"), present.get("url"), present.get("body")
    if method is None:
        problems.append("missing method")
    elif method != "POST":
        problems.append(f"method must be POST, got {method!r}")
    if url is None:
        problems.append("missing url")
        url = CHAT_URL
    elif url not in ENDPOINTS:  # its body is another endpoint's: not read
        problems.append(f"unsupported url {url!r}: this pipeline answers {CHAT_URL} and {COMPLETIONS_URL}")
        return BatchRequest(custom_id, error="; ".join(problems))
    kind = "messages" if url == CHAT_URL else "text"
    if not isinstance(body, dict):
        problems.append("missing body" if body is None else f"body is not an object (got {type(body).__name__})")
        return BatchRequest(custom_id, kind=kind, error="; ".join(problems), url=url)
    prompt, settings, top_logprobs = _map_body(body, url, max_prompt_chars, problems)
    encoded, settings_error = encode_settings(settings)
    if settings_error:
        problems.append(settings_error)
    if problems:
        return BatchRequest(custom_id, kind=kind, error="; ".join(problems), url=url)
    return BatchRequest(custom_id, prompt, kind, encoded, None, url, top_logprobs)


def _custom_id(record: dict, problems: list[str]) -> str | None:
    """The line's custom_id (a string; an integer is kept as its decimal text, but is an error)."""
    value = record.get("custom_id")
    custom_id, error = normalise_id(value if "custom_id" in record else None)
    if error:
        problems.append(error.replace("id", "custom_id", 1))
    elif not isinstance(value, str):
        problems.append(f"custom_id must be a string, got {type(value).__name__}")
    return custom_id


def _map_body(body: dict, url: str, max_chars: int | None,
              problems: list[str]) -> tuple[str | None, dict[str, Any], int | None]:
    """(prompt, {setting: raw value}, top_logprobs asked) of a request body; problems are appended."""
    chat = url == CHAT_URL
    present = {k: v for k, v in body.items() if v is not None}
    known = (_CHAT_FIELDS if chat else _COMPLETION_FIELDS) | set(FIELD_SETTINGS) | set(_ONLY_DEFAULT)
    for name in sorted(set(present) - known):
        problems.append(f"unsupported field body.{name}" + (f" (with url {url})" if name in _CHAT_FIELDS else ""))
    for name, default in _ONLY_DEFAULT.items():
        if name in present and present[name] != default:
            problems.append(f"unsupported field body.{name} (supported only as {json.dumps(default)}, its default)")
    model = present.get("model")
    if model is not None and not isinstance(model, str):
        problems.append(f"body.model must be a string, got {type(model).__name__}")
    content = "messages" if chat else "prompt"
    if content not in present:
        prompt, error = None, f"missing body.{content}"
    elif chat:
        prompt, error = normalise_messages(_chat_messages(present["messages"], problems), max_chars)
    elif isinstance(present["prompt"], list):
        prompt, error = None, ("body.prompt must be one string: a list (several prompts, or token ids) is not "
                               "supported; write one request line per prompt")
    else:
        prompt, error = normalise_text_prompt(present["prompt"], max_chars)
    if error:
        problems.append(error)
    settings = {FIELD_SETTINGS[name]: value for name, value in present.items() if name in FIELD_SETTINGS}
    max_tokens = _max_tokens(present, problems)
    if max_tokens is not None:
        settings["max_new_tokens"] = max_tokens
    if "stop" in present:
        stop = present["stop"]
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            problems.append(f"body.stop must be a non-empty string or a list of them, got "
                            f"{json.dumps(present['stop'])}")
        elif stop:
            settings["stop"] = stop
    top_logprobs = _logprobs(present, chat, problems)
    if top_logprobs is not None:
        settings["logprobs"] = max(1, top_logprobs)  # the chosen token's logprob needs k >= 1 (k 0 = off)
    constraint = _constraint(present, problems)
    if constraint is not None:
        settings["structured_output"] = constraint
    return prompt, settings, top_logprobs


def _chat_messages(messages: Any, problems: list[str]) -> Any:
    """`body.messages` as the pipeline's [{role, content}] list: text content parts joined with
    newlines (as vLLM joins them for a text-only model), role developer taken as system. What
    normalise_messages checks (roles, empty content, lengths) is left to it."""
    if not isinstance(messages, list):
        return messages  # normalise_messages names the problem
    converted = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            converted.append(message)
            continue
        present = {k: v for k, v in message.items() if v is not None}
        problems.extend(f"unsupported field body.messages[{i}].{k}" for k in sorted(set(present) - _MESSAGE_FIELDS))
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}:
                    texts.append(part["text"])
                else:
                    what = f"type {kind!r}" if kind else "no text"
                    problems.append(f"unsupported content part body.messages[{i}].content[{j}] ({what}): only "
                                    "text parts are supported")
            content = "\n".join(texts)
        role = message.get("role")
        converted.append({"role": "system" if role == "developer" else role, "content": content})
    return converted


def _max_tokens(present: dict, problems: list[str]) -> int | None:
    values = {name: present[name] for name in ("max_tokens", "max_completion_tokens") if name in present}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"body.{name} must be a positive integer, got {json.dumps(value)}")
            return None
    if len(set(values.values())) > 1:
        problems.append(f"body.max_tokens ({values['max_tokens']}) and body.max_completion_tokens "
                        f"({values['max_completion_tokens']}) differ; give one")
        return None
    return next(iter(values.values()), None)


def _logprobs(present: dict, chat: bool, problems: list[str]) -> int | None:
    """How many alternatives per token the answer lists (None: no logprobs asked). Chat: `logprobs:
    true` with `top_logprobs: k` (0 when absent); completions: `logprobs: k`."""
    def count(name: str, value: Any) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
            problems.append(f"body.{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {json.dumps(value)}")
            return None
        return value

    asked = present.get("logprobs")
    if not chat:
        return None if asked is None else count("logprobs", asked)
    if asked is not None and not isinstance(asked, bool):
        problems.append(f"body.logprobs must be true or false, got {json.dumps(asked)}")
        return None
    if "top_logprobs" in present and not asked:
        problems.append("body.top_logprobs needs body.logprobs: true")
        return None
    if not asked:
        return None
    return count("top_logprobs", present.get("top_logprobs", 0))


def _constraint(present: dict, problems: list[str]) -> dict | None:
    """The row's structured_output from `response_format` (OpenAI) or `structured_outputs` (vLLM's
    mapping, taken as it is: the worker checks it); the schema itself is checked by the worker."""
    constraint = None
    response_format = present.get("response_format")
    if response_format is not None:
        constraint = _response_format(response_format, problems)
    vllm = present.get("structured_outputs")
    if vllm is not None:
        if not isinstance(vllm, dict):
            problems.append(f"body.structured_outputs must be an object, got {type(vllm).__name__}")
        elif constraint is not None:
            problems.append("body.response_format and body.structured_outputs both constrain the output; give one")
        else:
            constraint = vllm
    return constraint


def _response_format(value: Any, problems: list[str]) -> dict | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        problems.append(f"body.response_format must be an object with a type, got {json.dumps(value)}")
        return None
    kind = value["type"]
    extra = sorted(set(k for k, v in value.items() if v is not None) - {"type", "json_schema"})
    if kind == "text" or kind == "json_object":
        extra += ["json_schema"] if value.get("json_schema") is not None else []
        if extra:
            problems.append(f"unsupported field body.response_format.{extra[0]} (with type {kind!r})")
            return None
        return None if kind == "text" else {"json_object": True}
    if kind != "json_schema":
        problems.append(f"unsupported body.response_format type {kind!r} (supported: text, json_object, json_schema)")
        return None
    spec = value.get("json_schema")
    if extra or not isinstance(spec, dict):
        problems.append(f"unsupported field body.response_format.{extra[0]}" if extra else
                        "body.response_format.json_schema must be an object with a schema")
        return None
    unknown = sorted(set(k for k, v in spec.items() if v is not None) - {"name", "schema", "strict", "description"})
    if unknown:
        problems.append(f"unsupported field body.response_format.json_schema.{unknown[0]}")
        return None
    if spec.get("schema") is None:
        problems.append("body.response_format.json_schema.schema is missing")
        return None
    return {"json": spec["schema"]}  # strict or not, the schema is enforced (the grammar masks every token)


class OpenAIBatchDatasource(JsonlPromptDatasource):
    """Ray Data reader for Batch API request files: the JSONL reader (streaming, compressed files,
    row keys, error rows) with each line mapped by `parse_request_line`."""

    def _parse_line(self, line: bytes) -> tuple[str | None, str | None, str | None, str | None, str | None]:
        request = parse_request_line(line, self._fields.max_prompt_chars)
        return request.custom_id, request.prompt, request.error, request.settings, request.kind


# ---------------------------------------------------------------------------------------------
# Output rows -> response lines


@dataclass(frozen=True)
class RequestLine:
    """A request line located: its source and line number, and the key of its output rows."""

    row_key: str
    source: str
    line_no: int
    request: BatchRequest


def iter_request_lines(input_files: Sequence[str], max_prompt_chars: int | None = None, *,
                       storage_options: dict[str, Any] | None = None) -> Iterator[RequestLine]:
    """Every non-blank line of the request files, in the order that decides which occurrence of an
    id is first (by source URL, then line: pipeline.data.inputs.order_key), with the key the reader
    gave its row: "id:<custom_id>" for the first occurrence, the duplicate key for later ones."""
    seen: set[str] = set()
    for source in sorted(input_files, key=lambda url: url + "\x1f"):  # as order_key sorts
        fs, path = filesystem_for(source, storage_options)
        codec = jsonl_codec(source)
        try:
            with _open_request_file(fs, path, source) as raw:
                f = pa.CompressedInputStream(raw, codec) if codec else raw
                keys = JsonlRowKeys(source)
                for line_no, line in iter_lines(f):
                    if not line.strip():
                        continue
                    request = parse_request_line(line, max_prompt_chars)
                    key = keys.key(request.custom_id, line)
                    if key in seen:
                        key = duplicate_key(key, order_key(source, line_no, "line"))
                    seen.add(key)
                    yield RequestLine(key, source, line_no, request)
        except (OSError, pa.ArrowException) as e:
            raise StorageError(describe_error("read", source, e)) from e


def _open_request_file(fs, path: str, source: str) -> pa.NativeFile:
    """A request file as an Arrow stream: a local one read as it streams; a remote one fetched whole
    under the job's retry policy (dart_worker/artifacts/io_retry.py: a transient failure is waited out), which
    a stream cannot resume mid-file (a Batch API file is at most 200 MB)."""
    if is_local(fs):
        return pa.PythonFile(fs.open(path, "rb"), mode="r")
    return pa.BufferReader(io_retry.active().call("read input", source, lambda: fs.cat_file(path)))


def piece_bytes(piece: str, byte_decoder: Mapping[str, int] | None) -> bytes | None:
    """The bytes of a vocabulary entry, where its spelling says them: a byte-fallback token
    ("<0xE2>"), a byte-level BPE piece (GPT-2's byte-to-character table, `byte_decoder`), a
    SentencePiece piece ("▁" is a space). None: decode the token instead."""
    found = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
    if found:
        return bytes([int(found.group(1), 16)])
    if byte_decoder is not None and piece and all(c in byte_decoder for c in piece):
        return bytes(byte_decoder[c] for c in piece)
    if "\u2581" in piece:
        return piece.replace("\u2581", " ").encode("utf-8")
    return None


def byte_level_decoder() -> dict[str, int]:
    """Character -> byte of byte-level BPE vocabularies (GPT-2's `bytes_to_unicode`, which the
    `tokenizers` ByteLevel decoder inverts; transformers moves its copy between versions): printable
    bytes stand for themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


class TokenStrings:
    """Token id -> (token text, its UTF-8 bytes), as OpenAI's logprobs entries show them: the text of
    the token alone; a token holding part of a character shows its bytes escaped (`\\xe2`), and
    `bytes` holds them, so that joining the bytes of a completion's tokens gives its text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_decoder = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and "ByteLevel" in repr(backend.decoder):
            self._byte_decoder = byte_level_decoder()

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
            data = piece_bytes(piece, self._byte_decoder) if isinstance(piece, str) else None
            if data is None:
                data = self.tokenizer.decode([int(token_id)]).encode("utf-8")
            found = self._cache[token_id] = (data.decode("utf-8", "backslashreplace"), list(data))
        return found


def _logprob(value: float | None) -> float:
    return ZERO_PROBABILITY_LOGPROB if value is None or math.isinf(value) or math.isnan(value) else float(value)


def _chat_logprobs(row: dict, k: int, strings: TokenStrings) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text, data = strings(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": data}

    content = []
    for token_id, logprob, ids, lps in zip(row["token_ids"], row["logprobs"], row["top_logprob_ids"] or [],
                                           row["top_logprobs"] or []):
        content.append({**entry(token_id, logprob), "top_logprobs": [entry(i, lp) for i, lp in zip(ids[:k], lps[:k])]})
    return {"content": content, "refusal": None}


def _completion_logprobs(row: dict, k: int, strings: TokenStrings) -> dict:
    tokens, offsets, top, offset = [], [], [], 0
    for token_id, ids, lps in zip(row["token_ids"], row["top_logprob_ids"] or [], row["top_logprobs"] or []):
        text = strings(token_id)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        alternatives: dict[str, float] = {}
        for i, lp in zip(ids[:k], lps[:k]):
            alternatives.setdefault(strings(i)[0], _logprob(lp))  # two ids of one spelling: the likelier
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": [_logprob(lp) for lp in row["logprobs"]][:len(tokens)],
            "top_logprobs": top, "text_offset": offsets}


def error_code(message: str) -> str:
    """The error's `code` in the output line: `duplicate_custom_id`, `server_error` (the engine
    failed on the row), `missing_output` (no output row: the request file changed since the run)
    or `invalid_request` (everything about the request itself: its JSON, fields, prompt, settings)."""
    if message.startswith("duplicate id"):
        return "duplicate_custom_id"
    if message.startswith("internal error"):
        return "server_error"
    if message.startswith("no output row"):
        return "missing_output"
    return "invalid_request"


def _line_id(run_id: str, row_key: str) -> str:
    """Deterministic ids: writing the file again (a resumed run) gives the same lines."""
    return hashlib.sha256(f"{run_id}\x1f{row_key}".encode()).hexdigest()[:24]


def response_line(line: RequestLine, samples: list[dict] | None, model: str,
                  strings: Callable[[], TokenStrings]) -> dict:
    """The output line of one request: its response, or its error. `samples`: its output rows by
    sample index (None: none written); `strings` gives the token spellings (loaded on first use)."""
    request = line.request
    run_id = samples[0]["run_id"] if samples else ""
    h = _line_id(run_id, line.row_key)
    message = None
    if not samples:
        message = (f"no output row for this request under the output (row key {line.row_key!r}): the request "
                   "file changed since the job ran, or the job did not finish; rerun with run.resume=true")
    else:
        failed = [s["error"] for s in samples if s["error"]]
        n = samples[0]["n"] or 1
        if failed:
            message = failed[0]
        elif [s["sample_index"] or 0 for s in samples] != list(range(n)):
            message = (f"internal error: {len(samples)} of its {n} completions are written; rerun with "
                       "run.resume=true to generate the others")
    if message is not None:
        if request.custom_id is None:
            message = f"{line.source} line {line.line_no}: {message}"
        return {"id": f"batch_req_{h}", "custom_id": request.custom_id, "response": None,
                "error": {"code": error_code(message), "message": message}}
    chat = request.url != COMPLETIONS_URL
    k = request.top_logprobs
    choices = []
    for s in samples:
        logprobs = None
        if k is not None and s["logprobs"] is not None and s["token_ids"] is not None:
            logprobs = (_chat_logprobs if chat else _completion_logprobs)(s, k, strings())
        reason = _FINISH_REASONS.get(s["finish_reason"], s["finish_reason"])
        if chat:
            choices.append({"index": s["sample_index"] or 0, "message": {"role": "assistant", "content": s["text"]},
                            "logprobs": logprobs, "finish_reason": reason})
        else:
            choices.append({"index": s["sample_index"] or 0, "text": s["text"], "logprobs": logprobs,
                            "finish_reason": reason})
    prompt_tokens = int(samples[0]["num_prompt_tokens"] or 0)
    completion_tokens = sum(int(s["num_generated_tokens"] or 0) for s in samples)
    finished = [s["finished_at"] for s in samples if s["finished_at"] is not None]
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{h}", "object": "chat.completion" if chat else "text_completion",
            "created": int(max(finished).timestamp()) if finished else 0, "model": model,
            "system_fingerprint": samples[0]["target_fingerprint"], "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    return {"id": f"batch_req_{h}", "custom_id": request.custom_id,
            "response": {"status_code": 200, "request_id": h, "body": body}, "error": None}


@dataclass
class BatchOutputReport:
    """What `write_batch_output` wrote."""

    url: str
    lines: int = 0
    errors: int = 0
    missing: int = 0  # request lines without output rows
    unmatched: int = 0  # output rows of no request line (the request files changed since they were written)
    codes: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        extra = f", {self.unmatched} output rows answer no request line" if self.unmatched else ""
        return f"{self.url}: {self.lines} lines, {self.errors} errors{extra}"


def model_name(target: str) -> str:
    """The `model` the responses name: the job's target as configured (the embedded default by its name)."""
    if target == "default":
        from dart_worker.artifacts.default_target import CONVERTED_DIR_NAME

        return CONVERTED_DIR_NAME.removesuffix("-bf16")
    return target


def write_batch_output(output_url: str, input_files: Sequence[str], *, model: str,
                       tokenizer: Callable[[], Any], max_prompt_chars: int | None = None,
                       storage_options: dict[str, Any] | None = None) -> BatchOutputReport:
    """Write `<output_url>/_openai_batch_output.jsonl`: one Batch API output line per request line of
    `input_files`, in their order, from every part under `output_url` (so a resumed run's file holds
    each request once). `tokenizer()` loads the target's tokenizer, called only when a response
    lists logprobs. The rows are read into this process: the Batch API's own files hold at most
    50,000 requests."""
    table = read_output(output_url, _COLUMNS, storage_options=storage_options)
    by_key: dict[str, list[dict]] = {}
    for row in table.to_pylist():
        by_key.setdefault(split_sample_key(row["row_key"])[0], []).append(row)
    loaded: list[TokenStrings] = []

    def strings() -> TokenStrings:
        if not loaded:
            loaded.append(TokenStrings(tokenizer()))
        return loaded[0]

    fs, directory = filesystem_for(output_url, storage_options)
    report = BatchOutputReport(url_of(fs, posixpath.join(directory, OUTPUT_NAME)))
    buffer = io.StringIO()
    for line in iter_request_lines(input_files, max_prompt_chars, storage_options=storage_options):
        samples = by_key.pop(line.row_key, None)
        if samples is not None:
            samples.sort(key=lambda s: s["sample_index"] or 0)
        out = response_line(line, samples, model, strings)
        buffer.write(json.dumps(out, ensure_ascii=False, allow_nan=False) + "\n")
        report.lines += 1
        if out["error"] is not None:
            report.errors += 1
            code = out["error"]["code"]
            report.codes[code] = report.codes.get(code, 0) + 1
            report.missing += code == "missing_output"
    report.unmatched = sum(len(rows) for rows in by_key.values())
    if report.missing or report.unmatched:
        logger.warning("openai batch output %s: %d request lines have no output rows, %d output rows answer no "
                       "request line (did the request files change since the job ran?)", report.url,
                       report.missing, report.unmatched)
    write_file_atomically(output_url, OUTPUT_NAME, buffer.getvalue().encode("utf-8"), op="write batch output",
                          storage_options=storage_options)
    return report


def write_job_batch_output(cfg, resolved: Mapping[str, Any], output_url: str) -> BatchOutputReport:
    """The job's hook (pipeline/run.py, once every row is written and committed): the output file
    under `output_url`, the job's final output, for its input files; the responses name the job's
    target, and the target's tokenizer (as the driver resolved it) spells logprobs' tokens."""
    from dart_worker.artifacts.loading import load_tokenizer

    target = cfg.model.target

    def tokenizer():
        return load_tokenizer("default" if target == "default" else resolved.get("target_location", target))

    return write_batch_output(output_url, resolved["input_files"], model=model_name(target), tokenizer=tokenizer,
                              max_prompt_chars=cfg.input.max_prompt_chars)


register_datasource("openai_batch", OpenAIBatchDatasource)  # `input.format: openai_batch`
