"""The Python versions the project states are the ones its code runs on.

pyproject.toml's requires-python, its classifiers, ruff's target-version and the docs' "Python
3.N+" agree on one floor, and vermin (a test extra) finds no module, member, keyword or syntax
newer than that floor in the packages or the tests: on the floor (3.10) the worker imports, where
the `UTC` alias of the datetime module (3.11) once stopped it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pyproject import pyproject

REPO = Path(__file__).resolve().parents[1]
# Every package pyproject.toml ships (dart_bench included), and the tests.
CHECKED = (*(p.rstrip("*") for p in pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]), "tests")
# Names vermin misreads: torch's Tensor.long() is not Python 2's `long`.
NOT_PYTHON = ("long",)


def floor() -> tuple[int, int]:
    found = re.fullmatch(r">=\s*3\.(\d+)", pyproject()["project"]["requires-python"].strip())
    assert found, "requires-python should be '>=3.N'"
    return 3, int(found.group(1))


def test_requires_python_classifiers_ruff_and_docs_name_one_floor():
    major, minor = floor()
    project = pyproject()["project"]
    listed = sorted(int(c.rsplit(".", 1)[1]) for c in project["classifiers"]
                    if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert listed and listed[0] == minor, f"classifiers list 3.{listed}, requires-python says >=3.{minor}"
    assert listed == list(range(listed[0], listed[-1] + 1)), f"classifiers skip a version: {listed}"
    assert sys.version_info[:2] >= (major, minor), "this interpreter is older than the declared floor"
    assert pyproject()["tool"]["ruff"]["target-version"] == f"py{major}{minor}"
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for stated in re.findall(r"Python (3\.\d+)\+", doc.read_text(encoding="utf-8")):
            assert stated == f"{major}.{minor}", f"{doc.relative_to(REPO)} says Python {stated}+"


@pytest.mark.slow
def test_no_code_needs_a_python_newer_than_the_floor():
    major, minor = floor()
    excludes = [arg for name in NOT_PYTHON for arg in ("--exclude", name)]
    done = subprocess.run(
        [sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())", f"--target={major}.{minor}-",
         "--violations", "--no-tips", "--eval-annotations", "--processes=1", *excludes, *CHECKED],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert "No module named" not in done.stderr, "vermin is missing: pip install -e '.[test]'"
    assert done.returncode == 0, f"code that needs a Python newer than {major}.{minor}:\n{done.stdout}{done.stderr}"
