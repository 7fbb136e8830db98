"""Comments say why the code is as it is, not how fast it ran once (#49).

A timing quoted in a comment ("at batch 16 on a 2-core EPYC 234 ms against a 380 ms step",
"1.5-4x faster") was measured on one machine with one version of the code and goes stale
silently; the figures live in docs/benchmarks.md, where each names its machine and date. This
test reads every comment and docstring of `dart_worker/`, `ngram_native/` (Python and the C++
sources) and `pipeline/` and fails on a quoted timing, listing each offending line.

The rules are deliberately narrow, so that what they flag is a benchmark figure:
- a speed ratio: a number with "x" before faster/slower/dearer/cheaper ("5-7x slower"), or a
  speed-up against `ar` ("0.89x `ar`");
- a sub-second duration (ns, us, ms): code's own timeouts are configured in seconds, so a
  millisecond figure in prose is a measurement; likewise a throughput (tok/s, rows/s, MB/s);
- a duration in seconds or minutes, a ratio ("2.2x") or a percentage in a block of text that
  also names a machine (EPYC, Xeon, AMX, "2-core", "on a CPU", ...): a configured timeout, a
  bucket's growth factor or a share of a budget names no machine.
"""

from __future__ import annotations

import ast
import bisect
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON_PACKAGES = ("dart_worker", "ngram_native", "pipeline")
CPP_SOURCES = ("ngram_native/csrc",)

_NUMBER = r"(?<![\w.])~?\d+(?:\.\d+)?(?:\s*(?:-|to)\s*\d+(?:\.\d+)?)?"
SPEED_RATIO = re.compile(_NUMBER + r"\s*x\s+(?:faster|slower|dearer|cheaper)\b", re.I)
SPEEDUP = re.compile(_NUMBER + r"\s*x\s+`?ar\b`?")
RATIO = re.compile(_NUMBER + r"(?:x(?!\w)|\s*%)")  # "2.2x", "16%"; not "64 x 60" (a product)
SUBSECOND = re.compile(_NUMBER + r"\s*(?:ns|us|µs|ms|milliseconds?|microseconds?)\b")
THROUGHPUT = re.compile(_NUMBER + r"\s*(?:tok/s|tokens/s|rows/s|[KMG]i?B/s)(?!\w)", re.I)
SECONDS = re.compile(_NUMBER + r"\s*(?:s|sec|secs|seconds?|min|mins|minutes?)\b")
MACHINE = re.compile(r"\b(?:EPYC|Xeon|Ryzen|Graviton|Threadripper|AMX|AVX2|AVX-?512\w*|[HAV]100|H200|L4|"
                     r"\d+-(?:core|CPU|vCPU)s?|on (?:a|this|the) (?:CPU|machine|node|laptop))\b", re.I)


@dataclass(frozen=True)
class Block:
    """One comment block (consecutive comment lines) or one docstring paragraph."""

    path: Path
    lines: tuple[tuple[int, str], ...]  # (line number, text without the comment marker)


@dataclass(frozen=True)
class Finding:
    path: Path
    line: int
    rule: str
    text: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}: " \
               f"[{self.rule}] {self.text.strip()}"


def _runs(numbered: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Split (line, text) pairs into runs of consecutive lines; a blank text ends a run too."""
    runs: list[list[tuple[int, str]]] = []
    for line, text in numbered:
        if not text.strip():
            runs.append([])
            continue
        if not runs or not runs[-1] or runs[-1][-1][0] != line - 1:
            runs.append([])
        runs[-1].append((line, text))
    return [run for run in runs if run]


def python_blocks(path: Path, source: str | None = None) -> list[Block]:
    """Comment blocks and string-statement paragraphs (docstrings, attribute docs) of a Python file.

    A file that does not parse fails the test (raises) rather than being skipped."""
    source = path.read_text(encoding="utf-8") if source is None else source
    comments = [(tok.start[0], tok.string.lstrip("#"))
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT]
    blocks = [Block(path, tuple(run)) for run in _runs(comments)]
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            first = node.value.lineno
            # the literal's own source lines (a docstring is written as it reads)
            text_lines = source.splitlines()[first - 1:node.value.end_lineno]
            blocks += [Block(path, tuple(run)) for run in _runs(list(enumerate(text_lines, first)))]
    return blocks


def cpp_blocks(path: Path, source: str | None = None) -> list[Block]:
    """`//` and `/* */` comments of a C++ file (string and character literals skipped)."""
    source = path.read_text(encoding="utf-8") if source is None else source
    numbered: list[tuple[int, str]] = []
    i, line, n = 0, 1, len(source)
    while i < n:
        c = source[i]
        if c == "\n":
            line += 1
            i += 1
        elif source.startswith("//", i):
            end = source.find("\n", i)
            end = n if end < 0 else end
            numbered.append((line, source[i + 2:end]))
            i = end
        elif source.startswith("/*", i):
            end = source.find("*/", i + 2)
            if end < 0:
                raise ValueError(f"{path}:{line}: unterminated /* comment")
            for k, text in enumerate(source[i + 2:end].split("\n")):
                numbered.append((line + k, text.lstrip(" *")))
            line += source.count("\n", i, end)
            i = end + 2
        elif c in "\"'":
            if c == '"' and source[max(0, i - 1)] == "R":
                raise ValueError(f"{path}:{line}: raw string literals are not read by this scanner")
            j = i + 1
            while j < n and source[j] != c:
                j += 2 if source[j] == "\\" else 1
            line += source.count("\n", i, j)
            i = j + 1
        else:
            i += 1
    # a line holding both a // comment and the end of a /* */ one is rare; runs keep line order
    numbered.sort(key=lambda pair: pair[0])
    return [Block(path, tuple(run)) for run in _runs(numbered)]


def findings(block: Block) -> list[Finding]:
    """The quoted timings of one block, each reported at the line where it starts."""
    starts, parts, offset = [], [], 0
    for _, text in block.lines:
        starts.append(offset)
        parts.append(text)
        offset += len(text) + 1
    joined = " ".join(parts)  # a figure may straddle two lines ("1.5-4x\nslower")

    def at(pos: int, rule: str) -> Finding:
        k = bisect.bisect_right(starts, pos) - 1
        return Finding(block.path, block.lines[k][0], rule, block.lines[k][1])

    found = [at(m.start(), "speed ratio") for m in SPEED_RATIO.finditer(joined)]
    found += [at(m.start(), "speed-up against ar") for m in SPEEDUP.finditer(joined)]
    found += [at(m.start(), "sub-second timing") for m in SUBSECOND.finditer(joined)]
    found += [at(m.start(), "throughput") for m in THROUGHPUT.finditer(joined)]
    if MACHINE.search(joined):
        found += [at(m.start(), "timing on a named machine") for m in SECONDS.finditer(joined)]
        found += [at(m.start(), "ratio on a named machine") for m in RATIO.finditer(joined)]
    # one finding per line, naming every rule it broke
    rules: dict[int, list[str]] = {}
    for f in found:
        rules.setdefault(f.line, []).append(f.rule)
    text = dict(block.lines)
    return [Finding(block.path, line, ", ".join(dict.fromkeys(names)), text[line])
            for line, names in sorted(rules.items())]


def source_files() -> list[Path]:
    files = [p for package in PYTHON_PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    files += [p for folder in CPP_SOURCES for p in sorted((ROOT / folder).glob("*"))
              if p.suffix in (".cpp", ".cc", ".h", ".hpp")]
    return files


def blocks_of(path: Path) -> list[Block]:
    return python_blocks(path) if path.suffix == ".py" else cpp_blocks(path)


def test_every_package_is_read():
    files = source_files()
    for folder in PYTHON_PACKAGES + CPP_SOURCES:
        assert any(p.is_relative_to(ROOT / folder) for p in files), f"no sources found under {folder}"
    assert any(p.suffix == ".cpp" for p in files) and any(p.suffix == ".h" for p in files)


def test_no_comment_quotes_a_timing():
    offending = [str(f) for path in source_files() for block in blocks_of(path) for f in findings(block)]
    assert not offending, (
        "comments quoting benchmark figures (move the figure to docs/benchmarks.md, naming the machine "
        "and where it was measured, and say in the comment why the code is as it is):\n" + "\n".join(offending))


# Figures as code comments quoted them before #49 moved them out: each must be caught.
PLANTED = [
    "# with the pause before it (batch 16, T=1, 2-core EPYC: 328 ms after 32 rounds, a 380 ms step)",
    "# runs it 1.5-4x faster there, see projection.py",
    "# read-out rows. MKL runs such a product 1.5-4x\n# slower than the same product",
    "# groupby().aggregate() did the same job 5-7x slower (22 s against 3.5 s for 100k rows here)",
    "# Computing it reads the whole vocabulary (Gemma-3's 262k tokens: ~4 s on a\n# 2-core CPU)",
    "# spinning threads made decoding steps >10x slower.",
    "# a numpy scan of the children per step cost 25 us",
    "# Block sums (a float64 reduction over [16, 262k] cost 20 ms on a CPU, the float32 one 0.5 ms)",
    "# of after it (1.8 s of a drafting worker's start-up on a 2-core CPU)",
    "# the read side ran at 6,623 rows/s and `ar` at 5.72 tok/s",
]


@pytest.mark.parametrize("comment", PLANTED)
def test_planted_figures_are_caught(comment, tmp_path):
    source = f"x = 1\n{comment}\ny = 2\n"
    path = tmp_path / "planted.py"
    caught = [f for block in python_blocks(path, source) for f in findings(block)]
    assert caught and caught[0].line == 2, comment
    docstring = f'def f():\n    """Why.\n\n{comment.replace("# ", "    ")}\n    """\n'
    assert [f for block in python_blocks(path, docstring) for f in findings(block)], comment
    cpp = "int x = 1;\n" + comment.replace("# ", "// ") + '\nconst char* s = "// 5 ms in a string";\n'
    caught = [f for block in cpp_blocks(tmp_path / "planted.cpp", cpp) for f in findings(block)]
    assert caught and all(f.line in (2, 3) for f in caught), comment


@pytest.mark.parametrize("comment", [
    "# waits (at most `timeout_s`, default 900 s) for its path",  # a configured timeout
    "# Ray's GCS client blocks in C++ (about 40 s against a silent port)",  # a library's own timeout
    "# 1.5x steps from 8 on, so padding never exceeds half the real rows",  # a size ratio
    "# per round, 4x for Llama-3-8B (grouped-query heads)",
    "# seconds per round by stage",
])
def test_reasons_are_not_flagged(comment, tmp_path):
    source = f"{comment}\nx = 1\n"
    assert not [f for block in python_blocks(tmp_path / "ok.py", source) for f in findings(block)]


def test_timings_in_code_and_strings_are_not_comments(tmp_path):
    source = 'TIMEOUT_MS = 500  # the poll interval\nmessage = "took 5 ms on a 2-core EPYC"\n'
    assert not [f for block in python_blocks(tmp_path / "ok.py", source) for f in findings(block)]
    cpp = 'const char* s = "5 ms \\" // 3 ms";  // why: the poll interval\n'
    assert not [f for block in cpp_blocks(tmp_path / "ok.cpp", cpp) for f in findings(block)]
