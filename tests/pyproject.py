"""pyproject.toml as a dict, for the tests that hold the project to what it declares."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib  # novm (3.11+, guarded)
else:  # Python 3.10: the same parser as the tomli package (the test extra installs it there)
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def pyproject() -> dict[str, Any]:
    return tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))
