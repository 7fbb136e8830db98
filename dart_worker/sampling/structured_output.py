"""What a request asks its output to look like: vLLM's structured-output options, parsed and checked.

A request may constrain its completion with exactly one of (vLLM's `StructuredOutputsParams` names
and meanings):

    json: <schema>        a JSON schema (a mapping, or its JSON text): the output is one JSON value
                          that validates against it
    json_object: true     any JSON object
    regex: <pattern>      the whole output matches the regular expression
    choice: [s1, s2, ..]  the output is exactly one of the strings
    grammar: <ebnf>       the output is a sentence of the EBNF grammar (GBNF / xgrammar EBNF, with a
                          `root` rule)

`StructuredOutput` holds one of them in a canonical text form (a schema is re-serialised, its
key order kept, since properties are written in schema order), so equal constraints compare and
hash equal: a worker compiles each distinct constraint once
(dart_worker/sampling/grammar.py). This module is import-light (no torch): the config schema and the row
settings check a constraint on the driver before anything heavy loads; `check_syntax` imports the
grammar engine only when called.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputError(ValueError):
    """A structured-output setting that cannot be used; the message names the problem."""


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint: `kind` (one of KINDS) and `spec`, its canonical text (the schema's JSON; the
    regex or grammar as given; the choices as a JSON list; "" for json_object)."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"structured_output kind must be one of {list(KINDS)}, got {self.kind!r}")

    @property
    def choices(self) -> list[str]:
        return json.loads(self.spec) if self.kind == "choice" else []

    @property
    def schema(self) -> Any:
        return json.loads(self.spec) if self.kind == "json" else None

    def to_dict(self) -> dict[str, Any]:
        """The mapping a user writes for it (what `parse_structured_output` reads back)."""
        if self.kind == "json_object":
            return {"json_object": True}
        if self.kind in ("json", "choice"):
            return {self.kind: json.loads(self.spec)}
        return {self.kind: self.spec}

    def describe(self, limit: int = 80) -> str:
        """A short one-line label for logs and errors."""
        text = f"{self.kind}: {self.spec}" if self.spec else self.kind
        return text if len(text) <= limit else text[: limit - 3] + "..."

    def ebnf(self) -> str | None:
        """The grammar of a `choice` constraint (an alternation of escaped string literals), as vLLM
        builds it for its xgrammar backend; None for the other kinds."""
        if self.kind != "choice":
            return None
        return "root ::= " + " | ".join(_ebnf_literal(c) for c in self.choices)


def _ebnf_literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    escaped = escaped.replace("\t", "\\t")
    return f'"{escaped}"'


def parse_structured_output(value: Any) -> StructuredOutput | None:
    """A `StructuredOutput` from a user's setting: None (off), a mapping with exactly one of KINDS,
    or that mapping's JSON text. Raises StructuredOutputError naming the problem (syntax of the
    schema, regex or grammar is checked by `check_syntax`)."""
    if value is None or isinstance(value, StructuredOutput):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise StructuredOutputError(f"structured_output is not valid JSON: {exc}") from None
        if value is None:
            return None
    if not isinstance(value, Mapping):
        raise StructuredOutputError(
            f"structured_output must be a mapping with one of {list(KINDS)}, got {type(value).__name__}")
    given = [k for k, v in value.items() if v is not None and not (k == "json_object" and v is False)]
    unknown = [k for k in value if k not in KINDS]
    if unknown:
        raise StructuredOutputError(
            f"structured_output: unknown key {unknown[0]!r}; expected exactly one of {list(KINDS)}")
    if len(given) != 1:
        raise StructuredOutputError(
            f"structured_output needs exactly one of {list(KINDS)}, got {sorted(given) or 'none'}")
    kind = given[0]
    raw = value[kind]
    if kind == "json_object":
        if raw is not True:
            raise StructuredOutputError(f"structured_output.json_object must be true, got {raw!r}")
        return StructuredOutput("json_object", "")
    if kind == "json":
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise StructuredOutputError(f"structured_output.json: the schema is not valid JSON: {exc}") from None
        if isinstance(raw, bool) or not isinstance(raw, Mapping):
            raise StructuredOutputError(
                f"structured_output.json must be a JSON schema object, got {type(raw).__name__}")
        # Key order is kept: a schema's property order is the order the record is written in.
        return StructuredOutput("json", json.dumps(raw, ensure_ascii=False))
    if kind == "choice":
        if isinstance(raw, str) or not isinstance(raw, (list, tuple)) or not raw:
            raise StructuredOutputError("structured_output.choice must be a non-empty list of strings")
        if not all(isinstance(c, str) and c for c in raw):
            bad = next(c for c in raw if not (isinstance(c, str) and c))
            raise StructuredOutputError(f"structured_output.choice entries must be non-empty strings, got {bad!r}")
        return StructuredOutput("choice", json.dumps(list(raw), ensure_ascii=False))
    if not isinstance(raw, str) or not raw.strip():
        raise StructuredOutputError(f"structured_output.{kind} must be a non-empty string, got {raw!r}")
    return StructuredOutput(kind, raw)


# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:line: "; users need the rest.
_ENGINE_PREFIX = re.compile(r"^\s*(\[[0-9:]+\]\s*)?\S+\.(cc|h|cpp):\d+:\s*")


def engine_message(exc: BaseException) -> str:
    """The grammar engine's error as one line, without its source-location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _ENGINE_PREFIX.sub("", text)


def grammar_of(constraint: StructuredOutput):
    """The grammar engine's (xgrammar's) tokenizer-independent `Grammar` of a constraint; raises
    StructuredOutputError with the engine's message when the schema, regex or grammar is invalid."""
    import xgrammar

    try:
        if constraint.kind == "json":
            return xgrammar.Grammar.from_json_schema(constraint.spec, **JSON_LAYOUT)
        if constraint.kind == "json_object":
            return xgrammar.Grammar.from_json_schema(ANY_OBJECT_SCHEMA, **JSON_LAYOUT)
        if constraint.kind == "regex":
            return xgrammar.Grammar.from_regex(constraint.spec)
        if constraint.kind == "choice":
            return xgrammar.Grammar.from_ebnf(constraint.ebnf())
        return xgrammar.Grammar.from_ebnf(constraint.spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise StructuredOutputError(f"structured_output.{constraint.kind}: {engine_message(exc)}") from None


def check_syntax(constraint: StructuredOutput | None) -> None:
    """Raise StructuredOutputError if the constraint's schema, regex or grammar is invalid (no
    tokenizer needed: what the config check and the row settings run before decoding)."""
    if constraint is not None:
        grammar_of(constraint)


# How JSON is laid out under a `json` or `json_object` constraint: `json.dumps`'s separators and no
# other whitespace. A grammar that allows any whitespace lets a small base model pad a record
# with blanks until max_new_tokens (a known failure of free-whitespace JSON grammars); one layout
# also makes the punctuation between values forced text, which the grammar drafts for free.
JSON_LAYOUT = {"any_whitespace": False, "separators": (", ", ": ")}
# `json_object`: any object (strict mode would otherwise forbid properties the schema does not name).
ANY_OBJECT_SCHEMA = '{"type": "object", "additionalProperties": true}'
