"""Hostile input rows for the fuzz tests: hypothesis strategies, and a fixed corpus built from them.

Each JSONL category is what real prompt files scraped from the web or written by other tools
contain: random bytes, invalid UTF-8, JSON escapes of lone surrogates, NUL and control
characters, byte-order marks, odd line endings, deep nesting, huge numbers and odd ids, very
long lines, and the target's special-token strings. A "hostile" line may still be a valid row
(a prompt holding NUL or "<eos>" is fine): the readers must only turn every line into exactly one
row, ok or error, and never raise.

`HOSTILE_JSONL` is a fixed list of such lines (several per category), used where a test needs the
same corpus every time (the end-to-end run); the strategies draw new ones for the fuzz tests.
"""

from __future__ import annotations

import io
import json
import re

from hypothesis import strategies as st

# Strings that tokenizers treat as special tokens (the tiny test tokenizer's and common targets').
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>",
                  "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "[INST]"]
INVALID_UTF8 = [b"\xff", b"\xfe", b"\x80", b"\xbf", b"\xc0\xaf", b"\xc3", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80",
                b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xef\xbb"]
LINE_BREAKS = ["\r", "\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"]
UTF8_BOM = b"\xef\xbb\xbf"
BOMS = [b"\xef\xbb\xbf", b"\xef\xbb\xbf\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff"]
ODD_IDS = ["1e400", "-1e400", "NaN", "Infinity", "-Infinity", "123456789012345678901234567890",
           "-123456789012345678901234567890", "1" * 4301, "true", "false", "null", "{}", "[]", '{"a": 1}',
           "[1, 2]", "1.0", "-0", "0", "1e3", '""', '" "', '"\\t"', '"id:x"', '"row:y#z"', '"dup:0:id:x"',
           json.dumps("é\u2028\x00"), json.dumps("k" * 10_000)]

CATEGORIES = ("random_bytes", "invalid_utf8", "surrogates", "control_chars", "boms", "line_breaks", "deep_nesting",
              "numbers_and_ids", "long_lines", "special_tokens", "json_shapes")

words = st.text(st.characters(codec="utf-8", exclude_characters="\n"), max_size=20)


def _record(prompt: str, row_id: object = "h") -> bytes:
    return json.dumps({"id": row_id, "prompt": prompt}).encode()


def _surrogate_text() -> st.SearchStrategy[str]:
    lone = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
    pair = st.just("\ud83d\ude00")  # a valid pair: json decodes it to one emoji
    reversed_pair = st.just("\ude00\ud83d")
    piece = st.one_of(lone, pair, reversed_pair, words)
    return st.lists(piece, min_size=1, max_size=5).map("".join)


@st.composite
def _surrogates(draw) -> bytes:
    text = draw(_surrogate_text())
    where = draw(st.sampled_from(["prompt", "id", "other key", "key name", "raw", "message content", "message role"]))
    if where == "prompt":
        return _record("p " + text)
    if where == "id":
        return _record("p", text)
    if where == "other key":
        return json.dumps({"id": "h", "prompt": "p", "meta": text}).encode()
    if where == "key name":
        return json.dumps({"id": "h", text: "x", "prompt": "p"}).encode()
    if where == "message content":
        return json.dumps({"id": "h", "messages": [{"role": "user", "content": text}]}).encode()
    if where == "message role":
        return json.dumps({"id": "h", "messages": [{"role": text, "content": "c"}]}).encode()
    # surrogates written as raw bytes (CESU-8 style): invalid UTF-8
    return json.dumps({"id": "h", "prompt": text}, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _escaped(text: str) -> bytes:
    """`text` as the inside of a JSON string (ASCII: every non-ASCII character escaped)."""
    return json.dumps(text)[1:-1].encode()


@st.composite
def _invalid_utf8(draw) -> bytes:
    before, after = _escaped(draw(words)), _escaped(draw(words))
    bad = draw(st.sampled_from(INVALID_UTF8))
    where = draw(st.sampled_from(["prompt", "id", "outside"]))
    if where == "prompt":
        return b'{"id": "h", "prompt": "' + before + bad + after + b'"}'
    if where == "id":
        return b'{"id": "' + before + bad + after + b'", "prompt": "p"}'
    return bad + _record(draw(words) + "x")


@st.composite
def _control_chars(draw) -> bytes:
    char = draw(st.characters(max_codepoint=0x1F, exclude_characters="\n") | st.just("\x7f"))
    how = draw(st.sampled_from(["escaped", "raw in string", "raw outside"]))
    before, after = draw(words), draw(words)
    if how == "escaped":
        return _record(before + char + after)
    if how == "raw in string":
        return b'{"id": "h", "prompt": "' + _escaped(before) + char.encode() + _escaped(after) + b'"}'
    return char.encode() + _record("p") + char.encode()


@st.composite
def _boms(draw) -> bytes:
    bom = draw(st.sampled_from(BOMS))
    where = draw(st.sampled_from(["line start", "inside prompt", "alone", "after line"]))
    if where == "line start":
        return bom + _record(draw(words) + "x")
    if where == "inside prompt":
        return json.dumps({"id": "h", "prompt": "a\ufeffb"}, ensure_ascii=False).encode()
    if where == "alone":
        return bom
    return _record("p") + bom


@st.composite
def _line_breaks(draw) -> bytes:
    brk = draw(st.sampled_from(LINE_BREAKS))
    how = draw(st.sampled_from(["inside prompt", "between records", "trailing", "between tokens"]))
    if how == "inside prompt":
        return json.dumps({"id": "h", "prompt": f"a{brk}b"}, ensure_ascii=False).encode()
    if how == "between records":
        return (_record("a").decode() + brk + _record("b", "h2").decode()).encode()
    if how == "trailing":
        return _record("p") + brk.encode() * draw(st.integers(1, 3))
    return ('{"id": "h",' + brk + '"prompt": "p"}').encode()


@st.composite
def _deep_nesting(draw) -> bytes:
    depth = draw(st.sampled_from([10, 999, 1000, 5000, 100_000]))
    shape = draw(st.sampled_from(["array", "object", "in prompt", "in id", "unclosed"]))
    nested = "[" * depth + "]" * depth
    if shape == "array":
        return nested.encode()
    if shape == "object":
        return ('{"a":' * depth + "1" + "}" * depth).encode()
    if shape == "in prompt":
        return ('{"id": "h", "prompt": ' + nested + "}").encode()
    if shape == "in id":
        return ('{"id": ' + nested + ', "prompt": "p"}').encode()
    return ("[" * depth).encode()


@st.composite
def _numbers_and_ids(draw) -> bytes:
    value = draw(st.sampled_from(ODD_IDS))
    field = draw(st.sampled_from(["id", "prompt"]))
    if field == "id":
        return ('{"id": ' + value + ', "prompt": "p"}').encode()
    return ('{"id": "h", "prompt": ' + value + "}").encode()


@st.composite
def _long_lines(draw) -> bytes:
    size = draw(st.sampled_from([999, 1000, 1001, 100_000, 1_000_000]))
    kind = draw(st.sampled_from(["prompt", "whitespace", "keys", "id"]))
    if kind == "prompt":
        return _record("x" * size)
    if kind == "whitespace":
        return b" " * size + _record("p") + b"\t" * size
    if kind == "keys":
        return json.dumps({"id": "h", "prompt": "p", **{f"k{i}": i for i in range(size // 10)}}).encode()
    return _record("p", "i" * size)


@st.composite
def _special_tokens(draw) -> bytes:
    parts = draw(st.lists(st.sampled_from(SPECIAL_TOKENS) | st.sampled_from(["w5", " ", "\n", ""]),
                          min_size=1, max_size=8))
    return _record("".join(parts))


def _json_shapes() -> st.SearchStrategy[bytes]:
    return st.sampled_from([
        b'{"id": "h", "id": "h2", "prompt": "duplicate keys"}', b'{"id": "h", "prompt": "a", "prompt": ""}',
        b"[]", b"{}", b'"just a string"', b"42", b"null", b"true", b'{"id": "h", "prompt": "p"}{}',
        b'{"id": "h", "prompt": "p"', b"{'id': 'h', 'prompt': 'single quotes'}", b'{"id": "h", "prompt": "p"} // c',
        b'{"id": True, "prompt": None}', b'{"id": "h", "prompt": "p",}', b"{,}", b'{"prompt": "no id"}',
        b'{"id": "h"}', b'{"id": "h", "prompt": "   "}', b'{"id": "h", "prompt": ["a", "b"]}',
        b'{"id": "h", "prompt": {"text": "p"}}', b"\x00", b"\t \x0b\x0c",
    ])


HOSTILE_LINE = {
    "random_bytes": st.binary(max_size=200).map(lambda b: b.replace(b"\n", b"")),
    "invalid_utf8": _invalid_utf8(),
    "surrogates": _surrogates(),
    "control_chars": _control_chars(),
    "boms": _boms(),
    "line_breaks": _line_breaks(),
    "deep_nesting": _deep_nesting(),
    "numbers_and_ids": _numbers_and_ids(),
    "long_lines": _long_lines(),
    "special_tokens": _special_tokens(),
    "json_shapes": _json_shapes(),
}

# (category, line) pairs, one category chosen per draw.
hostile_lines = st.sampled_from(CATEGORIES).flatmap(lambda c: st.tuples(st.just(c), HOSTILE_LINE[c]))
# Prompts a good row may hold: any valid Unicode but line breaks of the file, with a non-blank character.
good_prompts = st.text(st.characters(codec="utf-8"), min_size=1, max_size=60).filter(lambda s: s.strip())


class ShortReads(io.BytesIO):
    """A stream that returns at most `limit` bytes per read, as network and decompressing streams may."""

    def __init__(self, data: bytes, limit: int):
        super().__init__(data)
        self.limit = limit

    def read(self, n: int | None = -1) -> bytes:
        return super().read(self.limit if n is None or n < 0 else min(n, self.limit))


def line_as_read(line: bytes) -> bytes:
    """A line (split at b"\\n") as the JSONL reader sees it: without a trailing b"\\r" and leading BOMs."""
    return re.sub(b"^(" + UTF8_BOM + b")+", b"", line.removesuffix(b"\r"))


def nonblank_lines(data: bytes) -> list[bytes]:
    """The lines that must yield a row: split at b"\\n" only, as read, not blank."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [line for line in map(line_as_read, lines) if line.strip()]


def good_line(row_id: str, prompt: str) -> bytes:
    return json.dumps({"id": row_id, "prompt": prompt}).encode()


# A fixed corpus: explicit lines per category (the end-to-end test feeds these through the whole job).
HOSTILE_JSONL: dict[str, list[bytes]] = {
    "random_bytes": [b"\x00\x01\x02\xfa\xfb", bytes(range(11, 256)), b"\x1f\x8b\x08\x00\x00\x00"],
    "invalid_utf8": [b'{"id": "u1", "prompt": "caf\xe9"}', b'{"id": "u2\xff", "prompt": "p"}',
                     b'{"id": "u3", "prompt": "\xed\xa0\x80"}', b'\xc3{"id": "u4", "prompt": "p"}'],
    "surrogates": [b'{"id": "x", "prompt": "text \\udcff more"}', b'{"id": "s2", "prompt": "\\ud800"}',
                   b'{"id": "s3", "prompt": "\\ude00\\ud83d reversed"}', b'{"id": "\\udfff", "prompt": "p"}',
                   b'{"id": "s5", "prompt": "\\ud83d\\ude00 a valid pair"}',
                   b'{"id": "s6", "prompt": "p", "meta": "\\udc80"}'],
    "control_chars": [b'{"id": "c1", "prompt": "nul \\u0000 inside"}', b'{"id": "c2", "prompt": "raw \x00 nul"}',
                      b'{"id": "c3", "prompt": "\\u0007\\u001b[31m"}', b'\x00{"id": "c4", "prompt": "p"}'],
    "boms": [b'\xef\xbb\xbf{"id": "b1", "prompt": "bom at a line start"}',
             b'\xef\xbb\xbf\xef\xbb\xbf{"id": "b2", "prompt": "two boms"}',
             b'\xff\xfe{"id": "b3", "prompt": "utf-16 bom"}', '{"id": "b4", "prompt": "a\ufeffb"}'.encode()],
    "line_breaks": [b'{"id": "l1", "prompt": "crlf"}\r', b'{"id": "l2", "prompt": "a"}\r{"id": "l3", "prompt": "b"}',
                    '{"id": "l4", "prompt": "sep\u2028par\u2029nel\x85"}'.encode(),
                    '{"id": "l5",\u2028"prompt": "p"}'.encode()],
    "deep_nesting": [b"[" * 100_000, b'{"id": "d1", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                     b'{"a":' * 3000 + b"1" + b"}" * 3000],
    "numbers_and_ids": [b'{"id": 1e400, "prompt": "p"}', b'{"id": 123456789012345678901234567890, "prompt": "big"}',
                        b'{"id": true, "prompt": "p"}', b'{"id": {"a": 1}, "prompt": "p"}',
                        b'{"id": NaN, "prompt": "p"}', b'{"id": ' + b"9" * 5000 + b', "prompt": "p"}',
                        b'{"id": "n1", "prompt": 1e400}'],
    "long_lines": [b'{"id": "g1", "prompt": "' + b"x" * 1_000_001 + b'"}', b" " * 200_000,
                   b'{"id": "' + b"i" * 100_000 + b'", "prompt": "long id"}'],
    "special_tokens": [b'{"id": "t1", "prompt": "<eos>"}', b'{"id": "t2", "prompt": "<bos><pad><eos>"}',
                       b'{"id": "t3", "prompt": "w5 <eos> w6 <|endoftext|> <start_of_turn>"}',
                       b'{"id": "t4", "prompt": "<unk> <unk>"}'],
    "json_shapes": [b"[]", b'"just a string"', b'{"id": "j1", "prompt": "p"}{}', b"{'id': 'j2'}",
                    b'{"id": "j3", "id": "j4", "prompt": "duplicate keys"}', b"{}"],
}
