"""Output rows: the schema, atomic part files with deterministic names, and resume.

One Parquet "part" file holds one batch of output rows. Its name is derived from the batch's
row keys (part-<sha256 of the sorted keys>[:20].parquet), so a batch that is retried or redone
after a crash rewrites the same file instead of adding a second copy of its rows.

A part is never visible half-written:
- local files are written to a hidden temporary name in the same directory, flushed to disk,
  then renamed with os.replace (atomic on POSIX within one filesystem);
- on object stores (S3, GCS, Azure) the file is uploaded with one call under its final name.
  An object store makes a new object visible only once its upload has completed (a single PUT,
  or CompleteMultipartUpload for large ones), and a failed upload leaves nothing behind. A
  temporary key plus copy+delete would add a window with two copies and no atomicity, so
  uploading in place is both simpler and safer.
Readers (and resume) only consider names matching PART_NAME_PATTERN; the temporary names start
with "." so Ray Data and Spark skip them as well.

Resume: `existing_row_keys` reads only the row_key column of every part; `resume_progress` turns
the keys of written samples (`sample_key`: n completions of one prompt are n rows) into the input
rows that are complete, which `filter_done` drops from the input, and the samples already written
of the others, which the workers skip. A part that cannot be read (damaged outside this code: parts are
written atomically) is moved to `<output>/_corrupt/` and logged, so its rows are generated again
and the evidence is kept; it is never silently counted as done.

The columns and the definition of tau are documented in docs/output_schema.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import posixpath
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
import ray.data

from dart_worker.artifacts import io_retry
from dart_worker.stats import STAT_COLUMNS
from pipeline.data.storage import StorageError, describe_error, filesystem_for, get_once, is_local, url_of
from pipeline.settings.sampling_settings import RECORDED_SETTINGS

logger = logging.getLogger(__name__)

# Arrow types of the per-request statistics columns, which come from dart_worker.stats.STAT_COLUMNS.
_STAT_TYPES = {"int": pa.int64(), "float": pa.float64(), "list[int]": pa.list_(pa.int64()),
               "list[float]": pa.list_(pa.float64())}
SCHEMA_VERSION = "8"
# One chat message of the `messages` column (output.messages): what SFT trainers read (a list of
# {role, content}: Hugging Face datasets, TRL's SFTTrainer).
MESSAGE_TYPE = pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])
# Columns added after version 1: parts written before them read back with nulls there, so a
# resumed run, the job summary and the nightly report keep working across the upgrade.
ADDED_COLUMNS = {"finished_at": "2", "accepted_head": "3", "accepted_context": "3", "mean_batch_live": "4",
                 "model_rounds": "4", "accepted_job_cache": "4", "min_p": "5", "repetition_penalty": "5",
                 "presence_penalty": "5", "frequency_penalty": "5", "logprobs": "5", "top_logprob_ids": "5",
                 "top_logprobs": "5", "sample_index": "6", "n": "6",
                 "messages": "7", "structured_complete": "8", "accepted_grammar": "8", "grammar_s": "8",
                 "structured_output": "8", "prompt_logprobs": "8", "prompt_top_logprob_ids": "8",
                 "prompt_top_logprobs": "8"}
OUTPUT_SCHEMA = pa.schema(
    [
        pa.field("row_key", pa.string(), nullable=False),
        pa.field("id", pa.string()),
        pa.field("sample_index", pa.int64()),
        pa.field("text", pa.string()),
        pa.field("token_ids", pa.list_(pa.int32())),
        pa.field("messages", pa.list_(MESSAGE_TYPE)),
        pa.field("logprobs", pa.list_(pa.float64())),
        pa.field("top_logprob_ids", pa.list_(pa.list_(pa.int32()))),
        pa.field("top_logprobs", pa.list_(pa.list_(pa.float64()))),
        pa.field("prompt_logprobs", pa.list_(pa.float64())),  # first entry null: nothing precedes it
        pa.field("prompt_top_logprob_ids", pa.list_(pa.list_(pa.int32()))),
        pa.field("prompt_top_logprobs", pa.list_(pa.list_(pa.float64()))),
        pa.field("finish_reason", pa.string()),
        pa.field("structured_complete", pa.bool_()),
        pa.field("error", pa.string()),
        *(pa.field(name, _STAT_TYPES[kind]) for name, kind in STAT_COLUMNS.items()),
        pa.field("finished_at", pa.timestamp("us", tz="UTC")),
        pa.field("mode", pa.string()),
        # the settings the row decoded with (structured_output: its constraint as JSON, or null)
        *(pa.field(name, arrow_type) for name, arrow_type in RECORDED_SETTINGS.items()),
        pa.field("target_fingerprint", pa.string()),
        pa.field("head_fingerprint", pa.string()),
        pa.field("trie_fingerprint", pa.string()),
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("worker", pa.string()),
        pa.field("source", pa.string()),
    ],
    metadata={"dart.output_schema_version": SCHEMA_VERSION},
)

PART_NAME_PATTERN = re.compile(r"part-[0-9a-f]{20}\.parquet")
TEMP_PREFIX = ".tmp-"
CORRUPT_DIR = "_corrupt"
# Object stores make an upload visible only when it completes; see the module docstring.
_OBJECT_STORE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"}
_LIST_THREADS = 8


# ---------------------------------------------------------------------------------------------
# Rows -> table


def _floats_in(value: Any) -> bool:
    if isinstance(value, (float, np.floating)):
        return True
    if isinstance(value, np.ndarray):
        return value.dtype.kind == "f"
    return isinstance(value, (list, tuple)) and any(isinstance(v, (float, np.floating)) for v in value)


def _convert_column(name: str, values: list, field: pa.Field, row_keys: list) -> pa.Array:
    value_type = field.type.value_type if pa.types.is_list(field.type) else field.type
    if pa.types.is_integer(value_type):  # pyarrow would silently truncate 1.5 to 1 here
        for i, value in enumerate(values):
            if _floats_in(value):
                raise ValueError(
                    f"output column {name!r} is {field.type}, but row {i} (row_key {row_keys[i]!r}) holds "
                    f"{value!r}: floats are not accepted for integers"
                )
    try:
        array = pa.array(values, type=field.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
        for i, value in enumerate(values):  # find the first offending row to name it
            try:
                pa.array([value], type=field.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
                raise ValueError(
                    f"output column {name!r} is {field.type}, but row {i} (row_key {row_keys[i]!r}) holds "
                    f"{value!r} of type {type(value).__name__}: {e}"
                ) from None
        raise
    if not field.nullable and array.null_count:
        i = values.index(None)
        raise ValueError(f"output column {name!r} must not be null (row {i}, row_key {row_keys[i]!r})")
    return array


def _check_unique_keys(keys: Sequence[str]) -> None:
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        repeated = sorted({k for k in keys if k in seen or seen.add(k)})  # type: ignore[func-returns-value]
        raise ValueError(f"row_key must be unique within a part; repeated: {repeated[:5]}")


def rows_to_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """The rows as a table with exactly OUTPUT_SCHEMA; a column absent from a row is null.

    Raises ValueError naming the column, row and value when a row has an unknown column, a value
    of the wrong type (e.g. 1.5 for an integer column), a null row_key or run_id, or when two
    rows share a row_key.
    """
    known = set(OUTPUT_SCHEMA.names)
    for i, row in enumerate(rows):
        unknown = set(row) - known
        if unknown:
            raise ValueError(f"row {i} has columns not in the output schema: {sorted(unknown)}")
    row_keys = [row.get("row_key") for row in rows]
    arrays = [
        _convert_column(field.name, [row.get(field.name) for row in rows], field, row_keys) for field in OUTPUT_SCHEMA
    ]
    _check_unique_keys(row_keys)
    return pa.Table.from_arrays(arrays, schema=OUTPUT_SCHEMA)


def storable_text(text: str) -> str:
    """`text` as UTF-8 can store it: each lone surrogate replaced by U+FFFD (a split pair joined).

    A tokenizer decodes invalid byte sequences to U+FFFD itself; a Python decoder may instead
    leave surrogates in its str (from surrogateescape or UTF-16 halves), which Arrow refuses.
    """
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


# Columns an error row keeps when a worker's result row cannot be stored (see result_rows_to_table).
_KEPT_ON_ERROR = ("row_key", "id", "sample_index", "n", "source", "finished_at", "mode", "temperature", "top_p",
                  "top_k", "seed", "max_new_tokens", "target_fingerprint", "head_fingerprint", "trie_fingerprint",
                  "run_id", "worker")


def result_rows_to_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """`rows_to_table` for a worker's result rows: one bad row must not fail its batch.

    Generated text goes through `storable_text` (documented in docs/output_schema.md). A row that
    still cannot be stored becomes an error row ("internal error: result cannot be stored: ...")
    with its key and run columns, so that its neighbours are written and it is counted; only a
    problem in those columns themselves (a bug upstream) still fails the batch.
    """
    rows = [{**row, "text": storable_text(row["text"])} if isinstance(row.get("text"), str) else row for row in rows]
    try:
        return rows_to_table(rows)
    except ValueError:
        pass
    stored = []
    for row in rows:
        try:
            rows_to_table([row])
            stored.append(row)
        except ValueError as e:
            message = f"internal error: result cannot be stored: {e}".encode("utf-8", "backslashreplace").decode()
            logger.error("row %r: %s", row.get("row_key"), message)
            stored.append({**{k: row.get(k) for k in _KEPT_ON_ERROR}, "finish_reason": "error", "error": message})
    return rows_to_table(stored)


def conform(table: pa.Table) -> pa.Table:
    """`table` with exactly OUTPUT_SCHEMA (including its nullability flags and metadata).

    The column names, order and types must match; nullability flags and metadata may have been
    lost on the way (Ray Data blocks, concatenation), so they are restored after checking that the
    non-nullable columns hold no nulls.
    """
    got_names, expected_names = table.schema.names, OUTPUT_SCHEMA.names
    differing = [
        f"{f.name}: {table.schema.field(f.name).type} instead of {f.type}"
        for f in OUTPUT_SCHEMA
        if f.name in got_names and table.schema.field(f.name).type != f.type
    ]
    if got_names != expected_names or differing:
        missing = [n for n in expected_names if n not in got_names]
        extra = [n for n in got_names if n not in expected_names]
        order = "" if missing or extra or differing else "; column order differs"
        raise ValueError(
            f"table does not match the output schema: missing {missing}, unexpected {extra}, "
            f"different types {differing}{order}"
        )
    for field in OUTPUT_SCHEMA:
        if not field.nullable and table.column(field.name).null_count:
            raise ValueError(f"output column {field.name!r} must not be null")
    return table.cast(OUTPUT_SCHEMA)


def part_name(row_keys: Iterable[str]) -> str:
    """part-<first 20 hex digits of sha256 over the sorted keys>.parquet (keys length-prefixed, so unambiguous)."""
    digest = hashlib.sha256()
    for key in sorted(row_keys):
        encoded = key.encode("utf-8")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return f"part-{digest.hexdigest()[:20]}.parquet"


# ---------------------------------------------------------------------------------------------
# Writing


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def _write_local_atomic(directory: str, name: str, data: bytes) -> None:
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, name)
    temp = os.path.join(directory, f"{TEMP_PREFIX}{name}.{uuid.uuid4().hex}")
    try:
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(temp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)
        raise


def _write_via_rename(fs: fsspec.AbstractFileSystem, directory: str, name: str, data: bytes) -> None:
    """Other filesystems (HDFS, SFTP, ...): temporary name, then rename, as locally."""
    temp = posixpath.join(directory, f"{TEMP_PREFIX}{name}.{uuid.uuid4().hex}")
    fs.makedirs(directory, exist_ok=True)
    try:
        fs.pipe_file(temp, data)
        fs.mv(temp, posixpath.join(directory, name))
    except BaseException:
        try:
            fs.rm_file(temp)
        except Exception:
            logger.warning("could not remove temporary file %s", url_of(fs, temp))
        raise


def _is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return bool(protocols & _OBJECT_STORE_PROTOCOLS)


def write_part(table: pa.Table, output_url: str, run_id: str, *, storage_options: dict[str, Any] | None = None) -> str:
    """Write one batch of output rows as a part file of `output_url`; returns the part's URL.

    The name depends only on the row keys, and the file appears atomically (see the module
    docstring), so writing the same batch again replaces the file with identical rows.
    Every row's run_id must equal `run_id`, which is also stored in the file's metadata.
    """
    table = conform(table)
    if table.num_rows == 0:
        raise ValueError("refusing to write an empty part: there are no rows to name it by")
    keys = table.column("row_key").to_pylist()
    _check_unique_keys(keys)
    other_runs = pc.unique(table.column("run_id")).to_pylist()
    if other_runs != [run_id]:
        raise ValueError(f"rows carry run_id {sorted(set(other_runs) - {run_id})}, expected only {run_id!r}")
    name = part_name(keys)
    metadata = {**OUTPUT_SCHEMA.metadata, b"dart.run_id": run_id.encode()}
    # Sorted rows: the same batch gives the same file whatever order its rows arrived in.
    data = _parquet_bytes(table.sort_by("row_key").replace_schema_metadata(metadata))
    return write_file_atomically(output_url, name, data, op="write part", storage_options=storage_options)


def write_file_atomically(output_url: str, name: str, data: bytes, *, op: str,
                          storage_options: dict[str, Any] | None = None) -> str:
    """`data` as `<output_url>/<name>`, never visible half-written (a part, the OpenAI batch output
    file): a local temporary name and rename; on an object store one upload under the final name,
    visible only when complete; elsewhere a temporary name and rename. Remote writes follow the
    job's retry policy as operation `op` (dart_worker/artifacts/io_retry.py). Returns the file's URL."""
    fs, directory = filesystem_for(output_url, storage_options)
    path = posixpath.join(directory, name)
    url = url_of(fs, path)
    try:
        if is_local(fs):  # a local disk has no outages to wait out: a full disk is permanent
            _write_local_atomic(directory, name, data)
        elif _is_object_store(fs):  # one upload under the final name: visible only when complete
            io_retry.active().call(op, url, lambda: fs.pipe_file(path, data))
        else:
            io_retry.active().call(op, url, lambda: _write_via_rename(fs, directory, name, data))
    except StorageError:
        raise
    except Exception as e:  # OSError, or botocore's own errors (endpoint unreachable, ...)
        raise StorageError(describe_error("write", url, e)) from e
    return url


# ---------------------------------------------------------------------------------------------
# Listing, resume, reading back


def list_parts(fs: fsspec.AbstractFileSystem, directory: str, output_url: str) -> list[str]:
    """Paths of the part files directly under `directory`, sorted; [] if the directory does not exist
    yet. Transient failures are retried under the process's policy (dart_worker/artifacts/io_retry.py)."""
    return io_retry.active().call("list output", output_url, lambda: _list_parts(fs, directory, output_url))


def _list_parts(fs: fsspec.AbstractFileSystem, directory: str, output_url: str) -> list[str]:
    try:
        fs.invalidate_cache(directory)  # other processes write here; a cached listing would be stale
        entries = fs.ls(directory, detail=False)
    except FileNotFoundError:
        if not is_local(fs):
            bucket = directory.split("/", 1)[0]
            try:
                bucket_exists = fs.exists(bucket)
            except Exception as e:
                raise StorageError(describe_error("reach", output_url, e)) from e
            if not bucket_exists:
                raise StorageError(f"cannot list {output_url}: bucket {bucket!r} does not exist") from None
        return []
    except Exception as e:
        raise StorageError(describe_error("list", output_url, e)) from e
    return sorted(p for p in entries if PART_NAME_PATTERN.fullmatch(posixpath.basename(p)))


def written_rows(output_url: str, *, storage_options: dict[str, Any] | None = None) -> int:
    """How many rows the part files under `output_url` hold, from their Parquet footers (a footer
    that cannot be read counts nothing: resume would generate those rows again). Read-only."""
    fs, directory = filesystem_for(output_url, storage_options)

    def footer_rows(path: str) -> int:
        try:
            with fs.open(path, "rb") as f:
                return pq.ParquetFile(f).metadata.num_rows
        except FileNotFoundError:  # removed since the listing
            return 0
        except pa.ArrowInvalid:  # not a readable Parquet file
            return 0

    def rows(path: str) -> int:
        return io_retry.active().call("read part", url_of(fs, path), lambda: footer_rows(path))

    with ThreadPoolExecutor(_LIST_THREADS) as pool:
        return sum(pool.map(rows, list_parts(fs, directory, output_url)))


class _CorruptPart(Exception):
    pass


def _read_part(fs: fsspec.AbstractFileSystem, path: str, columns: list[str] | None) -> pa.Table:
    """The part's columns; _CorruptPart if the file's content is not a readable part.

    A read error while opening may be the network or the file: on any failure the whole file is
    fetched again (errors there are storage errors and propagate) and parsed from memory, where a
    failure can only be the content.
    """
    try:
        with fs.open(path, "rb") as f:
            return _read_parquet(f, columns)
    except Exception:
        pass
    try:
        data = io_retry.active().call("read part", url_of(fs, path), lambda: fs.cat_file(path))
    except StorageError:
        raise
    except Exception as e:
        raise StorageError(describe_error("read", url_of(fs, path), e)) from e
    try:
        return _read_parquet(pa.BufferReader(data), columns)
    except Exception as e:
        raise _CorruptPart(f"{type(e).__name__}: {e}") from e


def _read_parquet(source: Any, columns: list[str] | None) -> pa.Table:
    """`columns` of the file; one added since the part was written is skipped, any other missing
    column is an error (the part is not ours)."""
    parquet = pq.ParquetFile(source)
    if columns is not None:
        present = set(parquet.schema_arrow.names)
        missing = [c for c in columns if c not in present and c not in ADDED_COLUMNS]
        if missing:
            raise ValueError(f"no column(s) {missing}")
        columns = [c for c in columns if c in present]
    return parquet.read(columns=columns)


def _with_added_columns(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Null columns for the schema's columns added after the part was written."""
    for name in ADDED_COLUMNS:
        if name in schema.names and name not in table.schema.names:
            table = table.append_column(schema.field(name), pa.nulls(len(table), schema.field(name).type))
    return table


def _quarantine(fs: fsspec.AbstractFileSystem, directory: str, path: str, reason: str) -> None:
    target_dir = posixpath.join(directory, CORRUPT_DIR)
    target = posixpath.join(target_dir, posixpath.basename(path))
    try:
        fs.makedirs(target_dir, exist_ok=True)
        fs.mv(path, target)
        where = f"moved to {url_of(fs, target)}"
    except Exception as e:
        fs.rm_file(path)
        where = f"deleted (could not move it: {type(e).__name__})"
    logger.warning("corrupt output part %s (%s): %s; its rows will be generated again", url_of(fs, path), reason, where)


def existing_row_keys(output_url: str, *, storage_options: dict[str, Any] | None = None) -> set[str]:
    """Row keys already written under `output_url` (empty if it does not exist yet).

    Reads only the row_key column of each part file, in parallel threads. Temporary files are
    ignored; a corrupt part is moved to <output_url>/_corrupt/ and logged, so its rows count as
    not done.
    """
    done: set[str] = set()
    for keys, in _key_columns(output_url, ["row_key"], storage_options):
        done.update(keys)
    return done


def _key_columns(output_url: str, columns: list[str], storage_options: dict[str, Any] | None):
    """Per readable part, the Python lists of `columns` (a column added after the part was written
    reads as nulls); parts are read in parallel threads and corrupt ones quarantined."""
    for table in _key_tables(output_url, columns, storage_options):
        yield [table.column(c).to_pylist() for c in columns]


def _key_tables(output_url: str, columns: list[str], storage_options: dict[str, Any] | None):
    """Per readable part, an Arrow table of `columns` (a column added after the part was written
    reads as nulls); parts are read in parallel threads and corrupt ones quarantined."""
    fs, directory = filesystem_for(output_url, storage_options)
    parts = list_parts(fs, directory, output_url)

    def read(path: str) -> pa.Table | _CorruptPart:
        try:
            table = _read_part(fs, path, columns)
        except _CorruptPart as e:
            return e
        for c in columns:
            if c not in table.column_names:
                table = table.append_column(c, pa.nulls(len(table), OUTPUT_SCHEMA.field(c).type))
        return table.select(columns)

    with ThreadPoolExecutor(_LIST_THREADS) as pool:
        for path, table in zip(parts, pool.map(read, parts)):
            if isinstance(table, _CorruptPart):
                _quarantine(fs, directory, path, str(table))
            else:
                yield table


# Output row keys of a prompt's completions: sample 0 keeps the input row's key (so n = 1 writes the
# keys it always wrote, and earlier outputs resume unchanged), sample j > 0 is "sample:<j>:<key>".
# Input keys start with "id:", "row:" or "dup:" (pipeline.data.inputs), so the two kinds never collide.
SAMPLE_KEY_PREFIX = "sample:"


def sample_key(row_key: str, sample: int) -> str:
    """The output row key of completion `sample` of the input row `row_key`."""
    return row_key if sample == 0 else f"{SAMPLE_KEY_PREFIX}{sample}:{row_key}"


def split_sample_key(key: str) -> tuple[str, int]:
    """(input row key, sample index) of an output row key (the inverse of `sample_key`)."""
    if key.startswith(SAMPLE_KEY_PREFIX):
        index, _, row_key = key[len(SAMPLE_KEY_PREFIX):].partition(":")
        if index.isdigit() and row_key:
            return row_key, int(index)
    return key, 0


@dataclass(frozen=True)
class ResumeProgress:
    """What a resumed run finds written: the input rows whose every sample is written (`done`:
    dropped from the input) and, for the input rows with only some written, which sample indices
    are, with the n they were started with (`partial`: {row key: (n, written indices)}; the worker
    generates only the others, up to that n). `rows_written`: output rows found."""

    done: frozenset[str]
    partial: dict[str, tuple[int, tuple[int, ...]]]
    rows_written: int


def resume_progress(output_url: str, *, storage_options: dict[str, Any] | None = None) -> ResumeProgress:
    """Which input rows and samples are written under `output_url` (read from row_key and n).

    An input row is done when samples 0..n-1 are all written, n being what its written rows record
    (the samples its prompt asked for; 1 for a prompt that failed as a whole, and for parts written
    before schema version 6, which had no n column). A crash can leave a prompt's samples in
    different parts, some written: exactly those are not generated again, so every sample is
    written once. Corrupt parts are quarantined as in `existing_row_keys`.
    """
    # Most rows are an input row's only sample (key not "sample:...", n 1, or null before schema 6):
    # such a row is done by itself, which Arrow finds without a Python object per row. Only the
    # other rows (n > 1) go through the per-sample bookkeeping; a per-row loop over every key made
    # the scan grow faster than its rows (a set and two dict entries per row).
    alone_keys: set[str] = set()
    written: dict[str, set[int]] = {}
    wanted: dict[str, int] = {}
    rows = 0
    for table in _key_tables(output_url, ["row_key", "n"], storage_options):
        rows += len(table)
        keys = table.column("row_key")
        alone = pc.and_(pc.invert(pc.starts_with(keys, SAMPLE_KEY_PREFIX)),
                        pc.fill_null(pc.less_equal(table.column("n"), 1), True))
        alone_keys.update(keys.filter(alone).to_pylist())
        rest = table.filter(pc.invert(alone))
        for key, n in zip(rest.column("row_key").to_pylist(), rest.column("n").to_pylist()):
            row_key, sample = split_sample_key(key)
            written.setdefault(row_key, set()).add(sample)
            wanted[row_key] = max(wanted.get(row_key, 1), int(n or 1))
    for key in alone_keys.intersection(written):  # a key with other samples too: sample 0 is one of them
        written[key].add(0)
    done = frozenset(alone_keys.difference(written)).union(
        k for k, samples in written.items() if samples.issuperset(range(wanted[k])))
    partial = {k: (wanted[k], tuple(sorted(samples))) for k, samples in written.items() if k not in done}
    return ResumeProgress(done=done, partial=partial, rows_written=rows)


def remove_temp_files(output_url: str, *, storage_options: dict[str, Any] | None = None) -> int:
    """Delete leftover temporary files of crashed writers; returns how many. Call only while no worker writes."""
    fs, directory = filesystem_for(output_url, storage_options)
    try:
        fs.invalidate_cache(directory)
        entries = fs.ls(directory, detail=False)
    except FileNotFoundError:
        return 0
    temps = [p for p in entries if posixpath.basename(p).startswith(TEMP_PREFIX)]
    for path in temps:
        fs.rm_file(path)
    return len(temps)


def filter_done(ds: ray.data.Dataset, done_keys: Iterable[str]) -> ray.data.Dataset:
    """`ds` without the rows whose row_key is in `done_keys` (a lazy map_batches filter).

    The keys travel once through the object store (ray.put) and each worker process builds its
    lookup set once, so the cost per batch is one set lookup per row.
    """
    done = frozenset(done_keys)
    if not done:
        return ds
    ref = ray.put(done)

    def drop_done(batch: pa.Table) -> pa.Table:
        keys = get_once(ref)
        mask = [key not in keys for key in batch.column("row_key").to_pylist()]
        return batch.filter(pa.array(mask, pa.bool_()))

    return ds.map_batches(drop_done, batch_format="pyarrow", zero_copy_batch=True)


def read_output(
    output_url: str, columns: list[str] | None = None, *, storage_options: dict[str, Any] | None = None,
    max_rows: int | None = None,
) -> pa.Table:
    """All rows under `output_url` as one table (OUTPUT_SCHEMA, or `columns` of it), sorted by row_key.
    `max_rows`: read parts in name order only until they hold that many rows (then the first
    `max_rows` of them by row_key).

    For tests and the job summary: it reads everything into the driver, so name the columns you
    need. Without `max_rows` the parts are read in parallel threads, as `existing_row_keys` reads
    them: on an object store each read is a round trip of tens of milliseconds. A corrupt part is a
    StorageError here (this function never modifies the output). Should a row_key appear in two
    parts (only possible if batches were formed differently on a retry), the row from the first
    part by name is kept and a warning logged.
    """
    fs, directory = filesystem_for(output_url, storage_options)
    read_columns = None if columns is None else list(dict.fromkeys(["row_key", *columns]))
    schema = OUTPUT_SCHEMA if read_columns is None else pa.schema([OUTPUT_SCHEMA.field(c) for c in read_columns])

    def load(path: str) -> pa.Table:
        try:
            table = _with_added_columns(_read_part(fs, path, read_columns), schema)
        except _CorruptPart as e:
            raise StorageError(f"corrupt output part {url_of(fs, path)}: {e}") from None
        try:
            names = schema.names if read_columns is not None else OUTPUT_SCHEMA.names
            return table.select(names).replace_schema_metadata(None).cast(schema.remove_metadata())
        except (pa.ArrowInvalid, KeyError, ValueError) as e:
            raise StorageError(f"output part {url_of(fs, path)} does not match the output schema: {e}") from e

    paths = list_parts(fs, directory, output_url)
    if max_rows is None:
        with ThreadPoolExecutor(_LIST_THREADS) as pool:
            tables = list(pool.map(load, paths))  # in name order, as the first-copy rule needs
    else:
        tables, rows = [], 0
        for path in paths:
            if rows >= max_rows:
                break
            tables.append(load(path))
            rows += len(tables[-1])
    if not tables:
        return schema.empty_table()
    table = pa.concat_tables(tables)
    keys = table.column("row_key")
    if pc.count_distinct(keys).as_py() != len(table):
        first = pc.equal(pa.array(range(len(table))), pa.array(_first_index(keys.to_pylist())))
        logger.warning(
            "output under %s holds %d repeated row keys; keeping the first copy",
            output_url,
            len(table) - pc.sum(first).as_py(),
        )
        table = table.filter(first)
    table = table.sort_by("row_key").replace_schema_metadata(schema.metadata)
    if max_rows is not None:
        table = table.slice(0, max_rows)
    if columns is not None:
        table = table.select(columns)
    return table


def _first_index(keys: list[str]) -> list[int]:
    """For each position, the position of the first occurrence of its key."""
    first: dict[str, int] = {}
    return [first.setdefault(key, i) for i, key in enumerate(keys)]
