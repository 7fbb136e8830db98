"""Input prompts as a Ray Data dataset: exactly one row per input line or Parquet row, never losing one.

Every row of the result has the columns of INPUT_SCHEMA:

    row_key      unique, stable across runs: "id:<id>" for a row with a usable id; for a row without
                 one, "row:<source>#<sha1 of the line>[~<n>]" (JSONL, n-th repeat of the same line
                 in the file) or "row:<source>#<row index>" (Parquet); a later occurrence of an id
                 gets "dup:<hash of its position>:id:<id>". The three prefixes keep the kinds apart,
                 so keys are unique whatever the ids look like.
    id           the id as a string (integer ids are written in decimal), or null
    prompt       the prompt text; for a messages column, the JSON list of {role, content} messages;
                 null on error rows
    prompt_kind  "text" or "messages"
    source       the canonical URL of the input file
    error        null, or why the row cannot be generated ("malformed JSON: ...", "missing prompt",
                 "empty prompt", "prompt is not a string (got int)", "prompt longer than N
                 characters (got M)", "missing id", "duplicate id (first seen in <source> line 3)",
                 "prompt holds a lone surrogate (U+DCFF at character 5), which is not valid Unicode
                 text", "prompt is not valid UTF-8 (byte 0xff at offset 2)", "setting 'seed' holds a
                 dict, which no setting accepts", ...)
    settings     null, or the row's own sampling settings (the setting columns present and not null,
                 input.settings_columns) as one JSON object; the worker checks them (pipeline/settings/row_settings.py)

No content ever makes a reader raise: every line or row becomes a row, ok or error. What does
raise (InputError, naming the file) is a file that cannot be read at all: an I/O failure, a
damaged compressed stream or Parquet file, a compression that cannot be streamed, a compressed
file whose name does not say so, a file name Ray Data cannot open. docs/output_schema.md
("Hostile inputs and failures") has the whole list and what the job does about each.

Why custom readers instead of Ray's read_json / read_text / read_parquet (they are still Ray Data
readers: FileBasedDatasource subclasses run as ordinary Ray Data read tasks):
- read_json parses a file with pyarrow and fails the whole file on one malformed line.
- read_text reads a whole file, decodes it at once (one invalid UTF-8 byte fails the file) and
  splits with str.splitlines, which also splits at U+2028, U+0085, ... that JSON allows raw inside
  strings, so one valid line would become two malformed rows.
- read_parquet unifies the schemas of all files before reading: one file whose id column is an
  integer while another's is a string fails the whole job at planning time.
The JSONL reader streams each file in chunks, splits only at b"\\n" and parses every line on its
own; the Parquet reader reads each file with its own schema. Both know each row's exact position
in its file, which gives stable keys and a deterministic "first occurrence" for duplicate ids.

Duplicate ids are found with a Ray Data sort of the row keys, counted block by block with pyarrow
(only keys seen more than once, and each block's first and last key, reach the driver), so the
input is read twice: once for this pass and once when the pipeline consumes the dataset. That
costs far less than generating, and no row is collected on the driver.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
import ray.data
from ray.data.aggregate import Count
from ray.data.block import BlockAccessor
from ray.data.context import ShuffleStrategy
from ray.data.datasource import FileBasedDatasource
from ray.data.expressions import col

from pipeline.data.storage import (
    StorageError,
    arrow_filesystem,
    describe_error,
    expand_inputs,
    filesystem_for,
    get_once,
    redact,
    url_of,
)
from pipeline.settings.row_settings import encode_settings

logger = logging.getLogger(__name__)

INPUT_SCHEMA = pa.schema(
    [
        pa.field("row_key", pa.string(), nullable=False),
        pa.field("id", pa.string()),
        pa.field("prompt", pa.string()),
        pa.field("prompt_kind", pa.string()),
        pa.field("source", pa.string()),
        pa.field("error", pa.string()),
        pa.field("settings", pa.string()),
    ]
)
# The readers add the row's position ("<source>\x1f<zero-padded index>\x1f<line|row>") for the duplicate pass.
ORDER_COLUMN = "_order"
PARSED_SCHEMA = INPUT_SCHEMA.append(pa.field(ORDER_COLUMN, pa.string(), nullable=False))

# Read-side block size (rows). Read at construction time so tests can make blocks small.
ROWS_PER_BLOCK = 4096
READ_CHUNK_BYTES = 4 << 20

# jsonl: one prompt object per line; parquet: one per row; openai_batch: OpenAI Batch API request
# lines (pipeline/data/openai_batch.py).
INPUT_FORMATS = ("jsonl", "parquet", "openai_batch")
InputFormat = Literal["jsonl", "parquet", "openai_batch"]

_MISSING = object()
_UTF8_BOM = b"\xef\xbb\xbf"


class InputError(ValueError):
    """An input file cannot be read at all (not a row-level problem: those become error rows)."""


@dataclass(frozen=True)
class PromptFields:
    """Which fields of an input record hold the id and the prompt, and the prompt length limit.

    `messages_column`, when given, is used instead of `prompt_column` (so the default
    prompt_column="prompt" need not be cleared when a messages column is configured).
    """

    id_column: str = "id"
    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    max_prompt_chars: int | None = None
    # (setting, column) pairs read into the row's `settings` column (pipeline/settings/row_settings.py)
    setting_columns: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.id_column:
            raise ValueError("id_column must be a non-empty column name")
        if not self.prompt_column and not self.messages_column:
            raise ValueError("one of prompt_column or messages_column must be given")
        if self.max_prompt_chars is not None and self.max_prompt_chars <= 0:
            raise ValueError(f"max_prompt_chars must be positive, got {self.max_prompt_chars}")

    @property
    def kind(self) -> str:
        return "messages" if self.messages_column else "text"

    @property
    def content_column(self) -> str:
        return self.messages_column or self.prompt_column  # type: ignore[return-value]

    def with_settings(self, prompt: str | None, error: str | None,
                      values: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
        """(prompt, error, settings JSON) of a record whose setting columns hold `values` (absent
        ones left out): a setting no JSON value can hold is the row's error (joined after others)."""
        settings, settings_error = encode_settings(values)
        if settings_error:
            return None, "; ".join(e for e in (error, settings_error) if e), None
        return prompt, error, settings


# ---------------------------------------------------------------------------------------------
# One record -> (id, prompt, error): shared by both formats, pure Python, unit-tested directly.


def _type_name(value: Any) -> str:
    names = {
        bool: "bool",
        int: "int",
        float: "float",
        str: "string",
        list: "list",
        dict: "object",
        bytes: "bytes",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


class _BadValue:
    """A Parquet value that cannot become a Python object: invalid UTF-8 in a string, a date out of range."""

    def __init__(self, error: Exception):
        if isinstance(error, UnicodeDecodeError):
            self.problem = f"is not valid UTF-8 (byte 0x{error.object[error.start]:02x} at offset {error.start})"
        else:
            self.problem = f"cannot be read ({type(error).__name__}: {error})"


def _as_text(value: Any) -> tuple[Any, str | None]:
    """(value, None) with bytes decoded as UTF-8, or (None, problem) for text that UTF-8 cannot hold.

    Parquet writers often store strings as `binary`; those bytes are text when they are valid
    UTF-8. A str may hold lone surrogates (JSON escapes such as "\\udcff" decode to them), which no
    UTF-8 file can store: Arrow would fail the whole block on them, so they are refused here, per row.
    """
    if isinstance(value, _BadValue):
        return None, value.problem
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8"), None
        except UnicodeDecodeError as e:
            return None, _BadValue(e).problem
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            where = f"U+{ord(value[e.start]):04X} at character {e.start}"
            return None, f"holds a lone surrogate ({where}), which is not valid Unicode text"
    return value, None


def normalise_id(value: Any) -> tuple[str | None, str | None]:
    """(id as a string, None) or (None, error). Integers become their decimal string; bools are rejected."""
    value, problem = _as_text(value)
    if problem:
        return None, f"id {problem}"
    if value is _MISSING or value is None:
        return None, "missing id"
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None, f"id is not a string or integer (got {_type_name(value)})"
    text = str(value)
    if not text.strip():
        return None, "empty id"
    return text, None


def _check_length(chars: int, limit: int | None) -> str | None:
    if limit is not None and chars > limit:
        return f"prompt longer than {limit} characters (got {chars})"
    return None


def normalise_text_prompt(value: Any, max_chars: int | None) -> tuple[str | None, str | None]:
    """(prompt, None) or (None, error). Whitespace-only prompts count as empty."""
    value, problem = _as_text(value)
    if problem:
        return None, f"prompt {problem}"
    if value is _MISSING or value is None:
        return None, "missing prompt"
    if not isinstance(value, str):
        return None, f"prompt is not a string (got {_type_name(value)})"
    if not value.strip():
        return None, "empty prompt"
    error = _check_length(len(value), max_chars)
    return (None, error) if error else (value, None)


def normalise_messages(value: Any, max_chars: int | None) -> tuple[str | None, str | None]:
    """(JSON list of {role, content}, None) or (None, error). The limit applies to the summed contents."""
    if isinstance(value, _BadValue):
        return None, f"prompt {value.problem}"
    if value is _MISSING or value is None:
        return None, "missing prompt"
    if not isinstance(value, list):
        return None, f"prompt is not a list of messages (got {_type_name(value)})"
    if not value:
        return None, "empty prompt"
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return None, f"message {i} is not an object (got {_type_name(message)})"
        role, role_problem = _as_text(message.get("role"))
        content, content_problem = _as_text(message.get("content"))
        if role_problem:
            return None, f"message {i} 'role' {role_problem}"
        if content_problem:
            return None, f"message {i} 'content' {content_problem}"
        if not isinstance(role, str) or not role.strip():
            return None, f"message {i} has no string 'role'"
        if not isinstance(content, str):
            return None, f"message {i} 'content' is not a string (got {_type_name(content)})"
        messages.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in messages):
        return None, "empty prompt"
    error = _check_length(sum(len(m["content"]) for m in messages), max_chars)
    return (None, error) if error else (json.dumps(messages, ensure_ascii=False), None)


def normalise_record(
    fields: PromptFields, id_value: Any, content_value: Any
) -> tuple[str | None, str | None, str | None]:
    """(id, prompt, error) of one record; absent fields are passed as the module's _MISSING sentinel.

    The id is kept even on an error row (it names the row in the output); the prompt is not.
    Several problems are joined with "; " (id first).
    """
    row_id, id_error = normalise_id(id_value)
    if fields.messages_column:
        prompt, prompt_error = normalise_messages(content_value, fields.max_prompt_chars)
    else:
        prompt, prompt_error = normalise_text_prompt(content_value, fields.max_prompt_chars)
    errors = [e for e in (id_error, prompt_error) if e]
    if errors:
        return row_id, None, "; ".join(errors)
    return row_id, prompt, None


def parse_jsonl_line(line: bytes, fields: PromptFields) -> tuple[str | None, str | None, str | None]:
    """(id, prompt, error) of one JSONL line (bytes without the newline)."""
    row_id, prompt, error, _ = parse_jsonl_record(line, fields)
    return row_id, prompt, error


def parse_jsonl_record(line: bytes, fields: PromptFields) -> tuple[str | None, str | None, str | None, str | None]:
    """(id, prompt, error, settings JSON) of one JSONL line (bytes without the newline)."""
    record, error = load_json_object(line)
    if error:
        return None, None, error, None
    row_id, prompt, error = normalise_record(fields, record.get(fields.id_column, _MISSING),
                                             record.get(fields.content_column, _MISSING))
    values = {name: record[column] for name, column in fields.setting_columns if column in record}
    return (row_id, *fields.with_settings(prompt, error, values))


def load_json_object(line: bytes) -> tuple[dict | None, str | None]:
    """(the JSON object on one line, None) or (None, why the line is not one): "malformed JSON: ..."
    for bytes that are not UTF-8 JSON, "line is not a JSON object (got list)" for other values."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"malformed JSON: invalid UTF-8 at byte {e.start}"
    try:
        record = json.loads(text)
    except RecursionError:
        return None, "malformed JSON: nested too deeply"
    except ValueError as e:  # json.JSONDecodeError, and int strings beyond Python's digit limit
        return None, f"malformed JSON: {e}"
    if not isinstance(record, dict):
        return None, f"line is not a JSON object (got {_type_name(record)})"
    return record, None


def iter_lines(f: Any, chunk_bytes: int = READ_CHUNK_BYTES) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) for every line of a binary stream, split at b"\\n" only.

    A trailing b"\\r" (CRLF files) and leading UTF-8 byte-order marks are removed from every line:
    a BOM starts the file, or a later line where files saved with BOMs were concatenated; removing
    them per line (not from the first read) also holds when a stream returns fewer than 3 bytes per
    read. The last line needs no newline. Reads in chunks, so memory stays bounded by the longest line.
    """
    parts: list[bytes] = []
    line_no = 0
    while True:
        chunk = f.read(chunk_bytes)
        if not chunk:
            break
        parts.append(chunk)
        if b"\n" not in chunk:
            continue
        *lines, rest = b"".join(parts).split(b"\n")
        parts = [rest] if rest else []
        for line in lines:
            line_no += 1
            yield line_no, _without_boms(line.removesuffix(b"\r"))
    if parts:
        yield line_no + 1, _without_boms(b"".join(parts).removesuffix(b"\r"))


def _without_boms(line: bytes) -> bytes:
    while line.startswith(_UTF8_BOM):  # the file's own, then one per concatenated file
        line = line[len(_UTF8_BOM) :]
    return line


def order_key(source: str, position: int, unit: str) -> str:
    """Sorts by file, then position: the smallest is the "first occurrence" of a duplicated id."""
    return f"{source}\x1f{position:015d}\x1f{unit}"


def describe_position(order: str) -> str:
    source, position, unit = order.rsplit("\x1f", 2)  # a file name may hold \x1f too
    return f"{source} {unit} {int(position)}"


class _RowBuilder:
    """Collects parsed rows of one file and emits PARSED_SCHEMA tables of a fixed number of rows."""

    def __init__(self, source: str, kind: str, rows_per_block: int):
        self.source, self.kind, self.rows_per_block = source, kind, rows_per_block
        self._columns: dict[str, list] = {name: [] for name in PARSED_SCHEMA.names}

    def add(self, row_key: str, row_id: str | None, prompt: str | None, error: str | None, order: str,
            settings: str | None = None, kind: str | None = None) -> None:
        """One parsed row; `kind` overrides the file's prompt kind (an OpenAI batch file mixes chat
        and completion requests)."""
        c = self._columns
        c["settings"].append(settings)
        c["row_key"].append(row_key)
        c["id"].append(row_id)
        c["prompt"].append(prompt)
        c["prompt_kind"].append(kind or self.kind)
        c["source"].append(self.source)
        c["error"].append(error)
        c[ORDER_COLUMN].append(order)

    def __len__(self) -> int:
        return len(self._columns["row_key"])

    def full(self) -> bool:
        return len(self) >= self.rows_per_block

    def take(self) -> pa.Table:
        table = pa.table(self._columns, schema=PARSED_SCHEMA)
        self._columns = {name: [] for name in PARSED_SCHEMA.names}
        return table


def _naming_the_file(source: str, blocks: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """`blocks`, with a failure to read the file's bytes raised as one InputError naming the file.

    Content problems are rows; what is left are I/O errors (network, permissions), damaged
    compressed streams and damaged Parquet files. The original message is kept, so Ray Data's
    retry of transient storage errors (DataContext.retried_io_errors) still recognises it.
    """
    try:
        yield from blocks
    except InputError:
        raise
    except (OSError, pa.ArrowException) as e:
        raise InputError(describe_error("read", source, e)) from e


class _PromptDatasource(FileBasedDatasource):
    """What both readers share: the prompt fields, the URL prefix of the paths, and errors that name the file."""

    def __init__(self, paths: list[str], *, fields: PromptFields, url_prefix: str, **kwargs: Any):
        super().__init__(paths, **kwargs)
        self._fields = fields
        self._url_prefix = url_prefix
        self._rows_per_block = ROWS_PER_BLOCK

    def _open_input_source(self, filesystem: Any, path: str, **open_args: Any) -> pa.NativeFile:
        try:
            return self._open(filesystem, path, **open_args)
        except (OSError, pa.ArrowException) as e:  # as _naming_the_file, for the open
            raise InputError(describe_error("read", self._url_prefix + path, e)) from e

    def _open(self, filesystem: Any, path: str, **open_args: Any) -> pa.NativeFile:
        return super()._open_input_source(filesystem, path, **open_args)


class JsonlPromptDatasource(_PromptDatasource):
    """Ray Data reader for JSONL prompts: one row per non-blank line, malformed lines become error rows.

    Blocks hold a fixed number of rows in file order, so a retried read yields the same blocks
    (Ray Data's read retry skips the blocks an earlier attempt already produced). Compressed files
    are decompressed while streaming, by their suffix (see `jsonl_codec`).
    """

    def resolve_compression(self, path: str, open_args: dict[str, Any]) -> str | None:
        return jsonl_codec(self._url_prefix + path)

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[pa.Table]:
        source = self._url_prefix + path
        yield from _naming_the_file(source, self._read_rows(f, source))

    def _read_rows(self, f: pa.NativeFile, source: str) -> Iterator[pa.Table]:
        rows = _RowBuilder(source, self._fields.kind, self._rows_per_block)
        keys = JsonlRowKeys(source)
        for line_no, line in iter_lines(f):
            if line_no == 1:
                refuse_if_not_text(line, source)
            if not line.strip():
                continue
            row_id, prompt, error, settings, kind = self._parse_line(line)
            rows.add(keys.key(row_id, line), row_id, prompt, error, order_key(source, line_no, "line"), settings,
                     kind)
            if rows.full():
                yield rows.take()
        if len(rows):
            yield rows.take()

    def _parse_line(self, line: bytes) -> tuple[str | None, str | None, str | None, str | None, str | None]:
        """(id, prompt, error, settings JSON, prompt kind or None for the file's) of one non-blank line."""
        return (*parse_jsonl_record(line, self._fields), None)


class JsonlRowKeys:
    """The row keys of one JSONL file's lines, in file order: "id:<id>" for a line with a usable
    id, else "row:<source>#<sha1 of the line>[~<n>]" (the n-th repeat of the same line). Shared by
    the reader and pipeline.data.openai_batch, which re-reads request files to join them with the output."""

    def __init__(self, source: str):
        self.source = source
        self._repeats: Counter[str] = Counter()  # only lines without a usable id are counted

    def key(self, row_id: str | None, line: bytes) -> str:
        if row_id is not None:
            return "id:" + row_id
        digest = hashlib.sha1(line).hexdigest()[:16]
        repeat = self._repeats[digest]
        self._repeats[digest] += 1
        return f"row:{self.source}#{digest}" + (f"~{repeat}" if repeat else "")


def _python_values(column: pa.Array) -> list:
    """The column's values as Python objects, one per row; a value that cannot be one becomes a _BadValue.

    Parquet readers do not validate UTF-8, so one bad string in a `string` column makes
    `to_pylist` fail for the whole batch (as does a timestamp beyond year 9999); only then are
    the values converted one by one, so that the bad ones become their rows' errors.
    """
    try:
        return column.to_pylist()
    except (ValueError, OverflowError):  # UnicodeDecodeError is a ValueError
        pass
    values = []
    for i in range(len(column)):
        try:
            values.append(column[i].as_py())
        except (ValueError, OverflowError) as e:
            values.append(_BadValue(e))
    return values


class ParquetPromptDatasource(_PromptDatasource):
    """Ray Data reader for Parquet prompts: each file with its own schema, one row per Parquet row.

    Any column type is read; values that cannot be prompts or ids become error rows, the same as
    in JSONL, except that `binary` values (as some writers store strings) count as text when they
    are valid UTF-8.
    """

    def _open(self, filesystem: Any, path: str, **open_args: Any) -> pa.NativeFile:
        return filesystem.open_input_file(path)  # Parquet needs random access to read the footer

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[pa.Table]:
        source = self._url_prefix + path
        try:
            parquet = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"cannot read Parquet file {source}: {redact(str(e))}") from e
        yield from _naming_the_file(source, self._read_rows(parquet, source))

    def _read_rows(self, parquet: pq.ParquetFile, source: str) -> Iterator[pa.Table]:
        names = set(parquet.schema_arrow.names)
        id_column, content_column = self._fields.id_column, self._fields.content_column
        setting_columns = [(name, column) for name, column in self._fields.setting_columns if column in names]
        for name in {id_column, content_column, *(column for _, column in setting_columns)}:
            if len(parquet.schema_arrow.get_all_field_indices(name)) > 1:
                raise InputError(f"cannot read {source}: it has {parquet.schema_arrow.names.count(name)} columns "
                                 f"named {name!r}, so which one to read is ambiguous")
        columns = [c for c in dict.fromkeys((id_column, content_column, *(c for _, c in setting_columns)))
                   if c in names]
        rows = _RowBuilder(source, self._fields.kind, self._rows_per_block)
        position = 0
        for batch in parquet.iter_batches(batch_size=self._rows_per_block, columns=columns):
            n = batch.num_rows
            ids = _python_values(batch.column(id_column)) if id_column in names else [_MISSING] * n
            contents = _python_values(batch.column(content_column)) if content_column in names else [_MISSING] * n
            settings_values = [(name, _python_values(batch.column(column))) for name, column in setting_columns]
            for k, (id_value, content) in enumerate(zip(ids, contents)):
                row_id, prompt, error = normalise_record(self._fields, id_value, content)
                prompt, error, settings = self._fields.with_settings(
                    prompt, error, {name: values[k] for name, values in settings_values})
                row_key = "id:" + row_id if row_id is not None else f"row:{source}#{position}"
                rows.add(row_key, row_id, prompt, error, order_key(source, position, "row"), settings)
                position += 1
                if rows.full():
                    yield rows.take()
        if len(rows):
            yield rows.take()


# ---------------------------------------------------------------------------------------------
# Compressed JSONL: by suffix, streamed by pyarrow; anything else is a clear error before generation.

# Suffix (lower case) -> pyarrow codec. Ray Data's own inference (pyarrow.Codec.detect) knows only
# .gz, .bz2, .zst and .lz4, and reads any other file as plain text.
_JSONL_CODECS = {".gz": "gzip", ".gzip": "gzip", ".bz2": "bz2", ".zst": "zstd", ".zstd": "zstd", ".lz4": "lz4"}
_UNSTREAMABLE = {".xz", ".lzma", ".zip", ".7z", ".rar", ".br", ".z", ".lz", ".tar", ".tgz", ".tbz2", ".snappy"}
# How files that are not UTF-8 text start (a JSONL file never does): junk error rows for every line
# would be written as done, so such a file is refused at start-up instead.
_COMPRESS_ADVICE = "rename it with the suffix of its compression (e.g. .gz, .zst) or decompress it"
_NOT_TEXT = [
    (re.compile(rb"\x1f\x8b\x08"), "gzip-compressed", _COMPRESS_ADVICE),
    (re.compile(rb"BZh[1-9](1AY&SY|\x17rE8P\x90)"), "bzip2-compressed", _COMPRESS_ADVICE),
    (re.compile(rb"\x28\xb5\x2f\xfd"), "zstd-compressed", _COMPRESS_ADVICE),
    (re.compile(rb"\x04\x22\x4d\x18"), "lz4-compressed", _COMPRESS_ADVICE),
    (re.compile(rb"\xfd7zXZ\x00"), "xz-compressed", _COMPRESS_ADVICE),
    (re.compile(rb"PK\x03\x04"), "zip-compressed", _COMPRESS_ADVICE),
    (re.compile(rb"7z\xbc\xaf\x27\x1c"), "7z-compressed", _COMPRESS_ADVICE),
    (re.compile(rb'\xff\xfe\{\x00|\xfe\xff\x00\{|\{\x00"\x00|\x00\{\x00"'), "UTF-16 text", "save it as UTF-8"),
]


def jsonl_codec(url: str) -> str | None:
    """The codec that decompresses the JSONL file `url` while reading (None: plain text), by its suffix.

    Raises InputError for an archive or a codec that cannot be streamed (.xz, .zip, .tar.gz, ...).
    """
    name = url.rsplit("/", 1)[-1].lower()
    suffix = "." + name.rsplit(".", 1)[-1] if "." in name else ""
    archive = suffix in (".tar", ".tgz", ".tbz2") or name.removesuffix(suffix).endswith(".tar")
    if archive or suffix in _UNSTREAMABLE:
        raise InputError(
            f"cannot read {url}: {'tar archives are' if archive else suffix + ' compression is'} not supported; "
            f"use one JSONL file per input, plain or compressed as {', '.join(sorted(_JSONL_CODECS))}"
        )
    codec = _JSONL_CODECS.get(suffix)
    if codec and not pa.Codec.is_available(codec):
        raise InputError(f"cannot read {url}: {codec} compression is not supported by this pyarrow build")
    return codec


def refuse_if_not_text(first_line: bytes, source: str) -> None:
    """InputError if the file's first line shows it is not UTF-8 text (compressed, or UTF-16)."""
    for start, what, advice in _NOT_TEXT:
        if start.match(first_line):
            raise InputError(f"cannot read {source}: it looks {what}, but JSONL must be UTF-8 text; {advice}")


# ---------------------------------------------------------------------------------------------
# Reading, duplicates, the public entry point.


def prompt_datasource(
    urls: Sequence[str],
    format: InputFormat,
    fields: PromptFields,
    storage_options: dict[str, Any] | None = None,
) -> FileBasedDatasource:
    """The Ray Data reader for the input files named by `urls` (listed once, here)."""
    if format not in INPUT_FORMATS:
        raise ValueError(f"input format must be 'jsonl', 'parquet' or 'openai_batch', got {format!r}")
    files = expand_inputs(urls, storage_options)
    for url in files:  # file names become the rows' source column (UTF-8 text), and a codec must be known
        if _as_text(url)[1]:  # undecodable bytes in a local file name come back as lone surrogates
            raise InputError(f"cannot read {url!r}: its name is not valid UTF-8; rename the file")
        if any(c in url for c in "\n\r\t"):  # Ray Data parses paths as URLs, and urllib drops these
            raise InputError(f"cannot read {url!r}: Ray Data cannot open a file whose name holds a line break or "
                             f"tab; rename the file")
        if format != "parquet":  # jsonl, openai_batch: JSON lines
            jsonl_codec(url)
    schemes = sorted({u.split("://", 1)[0] for u in files})
    if len(schemes) > 1:
        raise StorageError(f"all inputs must be on one filesystem, got schemes {schemes}")
    fs, first_path = filesystem_for(files[0], storage_options)
    paths = [filesystem_for(u, storage_options)[1] for u in files]
    url_prefix = url_of(fs, first_path)[: -len(first_path)]
    for path, url in zip(paths, files):
        if url_prefix + path != url:  # the readers rebuild source URLs from the paths Ray hands them
            raise StorageError(f"cannot map input {url} to a path on its filesystem (got {path})")
    datasource_class = _DATASOURCES.get(format)
    if datasource_class is None:  # a reader defined elsewhere that nothing imported
        raise ValueError(f"no reader registered for input format {format!r}: import its module "
                         f"(pipeline.{format}) first")
    return datasource_class(paths, fields=fields, url_prefix=url_prefix, filesystem=arrow_filesystem(fs))


# Input format -> its reader. Readers that build on this module register themselves here
# (`register_datasource`: pipeline/data/openai_batch.py), so this module never imports them back.
_DATASOURCES: dict[str, type[FileBasedDatasource]] = {}


def register_datasource(format: str, datasource_class: type[FileBasedDatasource]) -> None:
    """Make `prompt_datasource` read input format `format` (one of INPUT_FORMATS) with `datasource_class`."""
    if format not in INPUT_FORMATS:
        raise ValueError(f"unknown input format {format!r}; known: {list(INPUT_FORMATS)}")
    _DATASOURCES[format] = datasource_class


def _num_partitions() -> int:
    cpus = int(ray.cluster_resources().get("CPU", 1)) if ray.is_initialized() else 1
    return max(1, min(64, cpus))


@dataclass(frozen=True)
class KeyScan:
    """What the duplicate pass learns about the input's row keys without collecting them."""

    repeated: dict[str, tuple[str, int]]  # row_key -> (position of its first occurrence, number of rows)
    rows: int  # parsed rows (one per non-blank JSONL line or Parquet row)
    pending: int | None  # rows whose final key (after duplicates) is not in `done`; None without `done`


def duplicate_key(key: str, order: str) -> str:
    """The key a later occurrence of `key`, at position `order`, gets (resolve_repeated_keys)."""
    return f"dup:{hashlib.sha1(order.encode()).hexdigest()[:16]}:{key}"


# Inputs whose files add up to at most this many bytes are scanned by the driver itself
# (`scan_keys`): a Ray Data sort of a few thousand keys costs its tasks' worker processes and the
# executor's start-up (seconds on a fresh Ray job), parsing them in the driver milliseconds.
SCAN_IN_DRIVER_BYTES = 8 << 20


def scan_keys(datasource: FileBasedDatasource, done: frozenset[str] | None = None,
              in_driver_bytes: int | None = None) -> KeyScan:
    """The duplicate pass: which keys repeat, how many rows there are and, given the keys already
    written (`done`, for a resumed run), how many rows are left to generate.

    Inputs of at most `in_driver_bytes` (default SCAN_IN_DRIVER_BYTES) of files are read and
    counted by the driver (`scan_keys_in_driver`), with the same reader and the same counting;
    larger ones on the cluster: Ray Data sorts the (row_key, position) pairs, so that the rows of
    a key are contiguous; each sorted block is then counted with pyarrow's vectorized group_by
    (`repeats_and_edges`), and only the keys it sees more than once, plus its first and last key
    (whose rows may continue in the neighbouring blocks), reach the driver, where they are merged
    (`merge_repeats`). Only "id:" keys can repeat (the others are unique by construction), but
    every key is checked so that any collision would still be caught. The sort gets a dataset (and
    DataContext) of its own, with the task-based sort shuffle: the hash shuffle starts aggregator
    actors, whose start-up alone outweighs a few thousand keys on a small node. Ray Data's own
    groupby().aggregate() does the same job slower, since it aggregates group by group
    (docs/benchmarks.md has the figures).
    """
    limit = SCAN_IN_DRIVER_BYTES if in_driver_bytes is None else in_driver_bytes
    size = datasource.estimate_inmemory_data_size()
    if size is not None and size <= limit:
        return scan_keys_in_driver(datasource, done)
    parsed = ray.data.read_datasource(datasource)
    parsed.context.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    ordered = parsed.select_columns(["row_key", ORDER_COLUMN]).sort("row_key")
    ref = ray.put(done) if done is not None else None

    def count(block: pa.Table) -> pa.Table:
        return repeats_and_edges(block, get_once(ref) if ref is not None else None)

    counted = ordered.map_batches(count, batch_format="pyarrow", batch_size=None)
    batches = counted.iter_batches(batch_format="pyarrow", batch_size=None)
    return merge_repeats(batches, count_pending=done is not None)


def scan_keys_in_driver(datasource: FileBasedDatasource, done: frozenset[str] | None = None) -> KeyScan:
    """`scan_keys` without a cluster: the datasource's read tasks run here, one after another, and
    their (row_key, position) rows are counted as one run (`repeats_and_edges`, which groups by key,
    and `merge_repeats`: what the cluster does per sorted block; one run needs no sort). For small
    inputs, where the sort's tasks would cost more than the work."""
    runs = [BlockAccessor.for_block(block).to_arrow().select(["row_key", ORDER_COLUMN])
            for task in datasource.get_read_tasks(1) for block in task()]
    counted = [repeats_and_edges(pa.concat_tables(runs), done)] if runs else []
    return merge_repeats(counted, count_pending=done is not None)


def find_repeated_keys(datasource: FileBasedDatasource) -> dict[str, tuple[str, int]]:
    """{row_key: (position of its first occurrence, number of rows)} for each key on more than one parsed row."""
    return scan_keys(datasource).repeated


_COUNTED = pa.schema([("row_key", pa.string()), ("n", pa.int64()), ("first", pa.string()),
                      ("key_done", pa.bool_()), ("first_dup_done", pa.bool_()), ("dups_pending", pa.int64()),
                      ("pending", pa.int64())])


def repeats_and_edges(block: pa.Table, done: frozenset[str] | None = None) -> pa.Table:
    """_COUNTED rows for one contiguous run of sorted (row_key, position) rows: (row_key, n, first)
    for each key on more than one of its rows and for its first and last key, which may have more
    rows in other runs. Given `done`: per such key, whether the key is done, whether the duplicate
    key of its first row here is done, and how many rows here have a duplicate key not done.
    And one row with a null key for the run's other rows (keys on one row only, not at an edge:
    each is its key's first occurrence): how many (`n`) and, given `done`, how many of them are
    not done (`pending`)."""
    if block.num_rows == 0:
        return _COUNTED.empty_table()
    keys = block.column("row_key")
    edges = pa.array([keys[0].as_py(), keys[-1].as_py()], pa.string())
    if done is not None:
        key_list, orders = keys.to_pylist(), block.column(ORDER_COLUMN).to_pylist()
        flags = [k in done for k in key_list]
        dup_done = [duplicate_key(k, o) in done for k, o in zip(key_list, orders)]
        # the flag rides on the position, so that the smallest position carries its own flag
        block = pa.table({"row_key": keys, "order_flag": [o + ("\x1f1" if d else "\x1f0") for o, d in
                                                           zip(orders, dup_done)],
                          "key_done": flags, "dup_pending": [0 if d else 1 for d in dup_done]})
        groups = block.group_by("row_key").aggregate(
            [("row_key", "count"), ("order_flag", "min"), ("key_done", "max"), ("dup_pending", "sum")])
        firsts = groups.column("order_flag_min").to_pylist()
        first = pa.array([f[:-2] for f in firsts], pa.string())
        first_dup_done = pa.array([f.endswith("1") for f in firsts], pa.bool_())
        key_done, dups_pending = groups.column("key_done_max"), groups.column("dup_pending_sum").cast(pa.int64())
    else:
        groups = block.group_by("row_key").aggregate([("row_key", "count"), (ORDER_COLUMN, "min")])
        first = groups.column(f"{ORDER_COLUMN}_min")
        first_dup_done = key_done = pa.nulls(len(groups), pa.bool_())
        dups_pending = pa.nulls(len(groups), pa.int64())
    n = groups.column("row_key_count").cast(pa.int64())
    keep = pc.or_(pc.greater(n, 1), pc.is_in(groups.column("row_key"), edges))
    counted = pa.table([groups.column("row_key"), n, first, key_done, first_dup_done, dups_pending,
                        pa.nulls(len(groups), pa.int64())], schema=_COUNTED)
    rest = counted.filter(pc.invert(keep))
    settled = None if done is None else int(pc.sum(pc.invert(rest.column("key_done"))).as_py() or 0)
    total = pa.table([pa.array([None], pa.string()), pa.array([rest.num_rows], pa.int64()),
                      pa.array([None], pa.string()), pa.nulls(1, pa.bool_()), pa.nulls(1, pa.bool_()),
                      pa.nulls(1, pa.int64()), pa.array([settled], pa.int64())], schema=_COUNTED)
    return pa.concat_tables([counted.filter(keep), total])


def merge_repeats(counted: Iterable[pa.Table], count_pending: bool = False) -> KeyScan:
    """The KeyScan from `repeats_and_edges` of every contiguous run of the sorted rows: a key's
    entries from several runs add up and keep the smallest position (with that row's flag); a
    key's rows left to generate are its first row if the key is not done, and each later row
    whose duplicate key is not done."""
    merged: dict[str, list] = {}
    rows, pending = 0, 0
    for batch in counted:
        columns = [batch.column(c).to_pylist() for c in _COUNTED.names]
        for key, n, first, key_done, first_dup_done, dups_pending, settled in zip(*columns):
            rows += n
            if key is None:
                pending += settled or 0
                continue
            seen = merged.get(key)
            if seen is None:
                merged[key] = [first, n, key_done, first_dup_done, dups_pending]
                continue
            if first < seen[0]:
                seen[0], seen[3] = first, first_dup_done
            seen[1] += n
            seen[2] = seen[2] or key_done
            if dups_pending is not None:
                seen[4] += dups_pending
    if count_pending:  # a key's first row keeps the key; each later one gets its duplicate key
        pending += sum((not key_done) + dups_pending - (not first_dup_done)
                       for _, _, key_done, first_dup_done, dups_pending in merged.values())
    repeated = {key: (entry[0], entry[1]) for key, entry in merged.items() if entry[1] > 1}
    return KeyScan(repeated, rows, pending if count_pending else None)


def resolve_repeated_keys(parsed: ray.data.Dataset, repeated: dict[str, tuple[str, int]]) -> ray.data.Dataset:
    """INPUT_SCHEMA rows: every occurrence of a repeated key but the first becomes an error row.

    The first occurrence (smallest (source URL, position)) keeps its key and status. Each later one
    gets the key "dup:<sha1 of its position>[:16]:<key>", a null prompt and the error
    "duplicate id (first seen in <source> line N)" (followed by its own error, if it had one).
    """
    if not repeated:
        return parsed.drop_columns([ORDER_COLUMN])
    ref = ray.put(repeated)

    def mark(batch: pa.Table) -> pa.Table:
        firsts = get_once(ref)
        keys = batch.column("row_key").to_pylist()
        prompts = batch.column("prompt").to_pylist()
        errors = batch.column("error").to_pylist()
        orders = batch.column(ORDER_COLUMN).to_pylist()
        for i, (key, order) in enumerate(zip(keys, orders)):
            entry = firsts.get(key)
            if entry is None or entry[0] == order:
                continue
            what = "id" if key.startswith("id:") else "row key"
            message = f"duplicate {what} (first seen in {describe_position(entry[0])})"
            keys[i] = duplicate_key(key, order)
            prompts[i] = None
            errors[i] = message if errors[i] is None else f"{message}; {errors[i]}"
        columns = {name: batch.column(name) for name in INPUT_SCHEMA.names}
        columns["row_key"] = pa.array(keys, pa.string())
        columns["prompt"] = pa.array(prompts, pa.string())
        columns["error"] = pa.array(errors, pa.string())
        return pa.table(columns, schema=INPUT_SCHEMA)

    return parsed.map_batches(mark, batch_format="pyarrow", zero_copy_batch=True)


def describe_duplicates(repeated: dict[str, tuple[str, int]], max_examples: int = 5) -> str:
    """One line for the log: how many ids repeat, how many rows became errors, a few examples."""
    ids = {k: v for k, v in repeated.items() if k.startswith("id:")}
    examples = "; ".join(
        f"{key[3:]!r} x{n} (kept {describe_position(first)})" for key, (first, n) in sorted(ids.items())[:max_examples]
    )
    extra_rows = sum(n - 1 for _, n in ids.values())
    return f"{len(ids)} ids appear on more than one row; {extra_rows} later rows are error rows, e.g. {examples}"


@dataclass(frozen=True)
class PromptScan:
    """The lazy dataset of INPUT_SCHEMA rows (duplicates resolved) and what the duplicate pass counted."""

    dataset: ray.data.Dataset
    duplicates: dict[str, int]  # id -> number of rows with that id, for the ids on more than one row
    rows: int  # input rows
    pending: int | None  # rows whose key is not among `done_keys` (None when none were given)


def scan_prompts(urls: Sequence[str], format: InputFormat, fields: PromptFields, *,
                 done_keys: frozenset[str] | None = None,
                 storage_options: dict[str, Any] | None = None) -> PromptScan:
    """Run the duplicate pass over the inputs now (it reads every input file: one that cannot be
    read is an InputError here, before any generation) and return the lazy dataset. Given the keys
    already written (`done_keys`, a resumed run), it also counts the rows still to generate, so a
    run that finds everything done need not start a worker."""
    datasource = prompt_datasource(urls, format, fields, storage_options)
    try:
        scan = scan_keys(datasource, done_keys)
    except InputError as e:  # raised in a Ray task: keep our one-line message, not Ray's notes and traceback
        cause = getattr(e, "cause", e)
        raise InputError(str(cause).split("\n", 1)[0]) from None
    if scan.repeated:
        logger.warning("duplicate ids in the input: %s", describe_duplicates(scan.repeated))
    duplicates = {key[3:]: n for key, (_, n) in scan.repeated.items() if key.startswith("id:")}
    dataset = resolve_repeated_keys(ray.data.read_datasource(datasource), scan.repeated)
    return PromptScan(dataset, duplicates, scan.rows, scan.pending)


def read_prompts(
    urls: Sequence[str],
    format: InputFormat,
    id_column: str = "id",
    prompt_column: str | None = "prompt",
    messages_column: str | None = None,
    max_prompt_chars: int | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
) -> ray.data.Dataset:
    """A Ray Data dataset of INPUT_SCHEMA rows: one per non-blank JSONL line or Parquet row of `urls`.

    `urls` are files, directories or globs on one filesystem (see pipeline.data.storage.expand_inputs).
    Rows that cannot be generated carry an error instead of a prompt. Duplicate ids are already
    resolved (first occurrence kept, the others error rows with their own keys) and logged, so
    row_key is unique. Runs the duplicate pass now (a Ray Data sort of the keys); the returned
    dataset is lazy and reads the input again when consumed.
    """
    fields = PromptFields(id_column, prompt_column, messages_column, max_prompt_chars)
    return scan_prompts(urls, format, fields, storage_options=storage_options).dataset


def find_duplicate_ids(ds: ray.data.Dataset) -> dict[str, int]:
    """{id: number of rows} for every id on more than one row of an INPUT_SCHEMA dataset (a Ray Data groupby).

    On the result of read_prompts these are the ids it resolved: all rows of such an id keep the
    id, one with key "id:<id>" and the others as "duplicate id" error rows. Reads the input again;
    `scan_prompts` gives the same dict (`PromptScan.duplicates`) without that extra pass.
    """
    groups = (
        ds.select_columns(["id"])
        .filter(expr=col("id").is_not_null())
        .groupby("id", num_partitions=_num_partitions())
        .aggregate(Count(alias_name="n"))
        .filter(expr=col("n") > 1)
    )
    return {row["id"]: int(row["n"]) for row in groups.iter_rows()}


register_datasource("jsonl", JsonlPromptDatasource)
register_datasource("parquet", ParquetPromptDatasource)
