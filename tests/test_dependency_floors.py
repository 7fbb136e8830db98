"""The lowest torch, transformers and ray that pyproject.toml allows are the ones tested here.

CI installs the newest releases the ranges allow; this test builds a virtual environment on top of
that one (`--system-site-packages`) with exactly the declared floors of the three libraries whose
behaviour the engine and the job rely on (transformers' cache and attention internals, torch's
kernels, Ray Data's actor pools), and runs the tests that exercise them there: the kernel
strategies, the target adapter, the GPU acceptance run on a CPU, the device checks and one whole
pipeline job. A floor that does not work fails here, instead of on a user's older install.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from dart_worker.cache_dir import cache_dir, file_lock
from tests.pyproject import pyproject

REPO = Path(__file__).resolve().parents[1]
FLOORED = ("torch", "transformers", "ray")
# What depends on the floored versions' APIs: the adapter's logits, masks and cache argument
# (transformers), the tree attention registered with its attention interfaces (transformers),
# Ray's remote errors read by the device check, and one whole job (Ray Data, Ray actors).
FLOOR_TESTS = (
    "tests/test_target.py",
    "tests/test_tree_attention.py",
    "tests/test_device_check.py::test_worker_failure_reads_the_line_from_remote_errors",
    "tests/test_pipeline_run.py::test_every_row_once_with_errors_and_lossless_results",
)

pytestmark = pytest.mark.slow


def declared_floors() -> dict[str, tuple[str, str]]:
    """name -> (requirement with extras, floor version) for FLOORED, from pyproject.toml."""
    dependencies = pyproject()["project"]["dependencies"]
    floors = {}
    for requirement in dependencies:
        found = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?>=([0-9][0-9.]*)", requirement.replace(" ", ""))
        if found and found.group(1) in FLOORED:
            floors[found.group(1)] = (found.group(1) + (found.group(2) or ""), found.group(3))
    missing = set(FLOORED) - set(floors)
    assert not missing, f"pyproject.toml declares no '>=' floor for {sorted(missing)}"
    return floors


def floor_environment(floors: dict[str, tuple[str, str]]) -> Path:
    """A venv over this interpreter's packages with the floors installed on top (cached by floors)."""
    key = hashlib.sha256(repr(sorted(floors.items())).encode() + sys.version.encode()).hexdigest()[:12]
    venv = cache_dir("floor-venvs") / key
    python = venv / "bin" / "python"
    with file_lock(venv.with_suffix(".lock")):
        if not (venv / "ready").exists():
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--clear", str(venv)], check=True)
            pins = [f"{requirement}=={version}" for requirement, version in floors.values()]
            subprocess.run([str(python), "-m", "pip", "install", "-q", *pins], check=True)
            (venv / "ready").write_text("\n".join(pins) + "\n")
    return python


def test_the_declared_floors_pass_the_tests_that_rely_on_them():
    floors = declared_floors()
    python = floor_environment(floors)
    versions = subprocess.run(
        [str(python), "-c", "import torch, transformers, ray; print(torch.__version__, transformers.__version__, "
                            "ray.__version__)"], check=True, capture_output=True, text=True).stdout.split()
    for name, found in zip(FLOORED, versions):  # 2.13.0+cpu is the floor 2.13
        assert Version(Version(found).base_version) == Version(floors[name][1]), f"{name}: the floor env has {found}"
    done = subprocess.run([str(python), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *FLOOR_TESTS],
                          cwd=REPO, capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, f"at the floors {versions}:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
