"""The dependency-floors check (tests/dependency_floors.py), which CI runs as its own step after
the README's test command, and what makes it work inside a virtualenv.

The check itself (a venv with the floors of torch, transformers and ray installed over the CI
environment, running the tests that rely on them) moved out of the suite into `.ci/run`: it
installs packages, which a test run should not do, and it proves the same there. What stays
here proves that the check can run where CI runs it: pyproject.toml declares a floor for each
library it pins, every test it names exists, CI runs it, and the venv it builds sees the
running environment's packages even when that environment is itself a venv (with
`venv --system-site-packages`, the earlier way, a venv made from a venv saw the base
interpreter's packages instead, and omegaconf was missing there).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.dependency_floors import FLOOR_TESTS, FLOORED, REPO, declared_floors, overlay_venv, site_dirs


def test_pyproject_declares_a_floor_for_each_floored_library():
    floors = declared_floors()
    assert set(floors) == set(FLOORED)
    assert floors["ray"][0].startswith("ray[")  # the extras the job needs are installed at the floor too
    assert all(version[0].isdigit() for _, version in floors.values())


def test_every_floor_test_exists_and_ci_runs_the_check():
    for target in FLOOR_TESTS:
        path, _, name = target.partition("::")
        assert (REPO / path).is_file(), target
        assert not name or f"def {name}(" in (REPO / path).read_text(), target
    ci = (REPO / ".ci" / "run").read_text()
    readme_command = ci.index("python -m pytest")
    assert "python -m tests.dependency_floors" in ci[readme_command:], "CI must run the floors after the suite"


def run(python: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_floor_venv_sees_the_packages_of_the_venv_it_is_made_from(tmp_path):
    """A venv (`outer`) holding a module of its own builds the floors' venv (`inner`) the way CI
    would from inside a venv: `inner` imports outer's module and this environment's packages
    (omegaconf), and its own site-packages come first (so the floors installed there win)."""
    outer = overlay_venv(tmp_path / "outer")
    outer_site = run(outer, "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    (Path(outer_site) / "only_in_outer_venv.py").write_text("WHERE = 'outer'\n")
    made = run(outer, f"import sys, pathlib; sys.path.insert(0, {str(REPO)!r}); "
                      f"from tests.dependency_floors import overlay_venv; "
                      f"print(overlay_venv(pathlib.Path({str(tmp_path / 'inner')!r})))")
    assert made.returncode == 0, made.stderr
    inner = Path(made.stdout.strip())
    seen = run(inner, f"import only_in_outer_venv, omegaconf, sys, sysconfig; "
                      f"own = sysconfig.get_paths()['purelib']; "
                      f"print(only_in_outer_venv.WHERE, sys.path.index(own) < sys.path.index({site_dirs()[0]!r}))")
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.split() == ["outer", "True"]
