"""The lowest torch, transformers and ray that pyproject.toml allows, tested: CI's step after the
README's test command (`python -m tests.dependency_floors`, in .ci/run).

CI installs the newest releases the ranges allow; this builds a virtual environment over the
running interpreter's environment with exactly the declared floors of the three libraries whose
behaviour the engine and the job rely on (transformers' cache and attention internals, torch's
kernels, Ray Data's actor pools) installed on top, checks that the floors are what it imports,
and runs there the tests that exercise them: the target adapter, the tree attention, the device
check's reading of remote errors and one whole pipeline job. A floor that does not work fails
here, instead of on a user's older install. Exit status 0 when they pass, 1 otherwise.

The venv sees the running environment's packages through a `.pth` file that adds this
interpreter's site-packages (`site.addsitedir`, so their own .pth files, editable installs
included, apply), after the venv's own: the floors installed in the venv win. It is not
`venv --system-site-packages`: from an interpreter that is itself a venv, that exposes the *base*
interpreter's packages, not the venv's (CI in a venv then lacked omegaconf). The venv is cached
under $DART_CACHE_DIR/floor-venvs, keyed by the floors, the Python version and the environment
it overlays, so a second CI run on the same machine installs nothing.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.pyproject import pyproject

REPO = Path(__file__).resolve().parents[1]
FLOORED = ("torch", "transformers", "ray")
# What depends on the floored versions' APIs: the adapter's logits, masks and cache argument
# (transformers), the tree attention registered with its attention interfaces (transformers),
# Ray's remote errors read by the device check, one whole job (Ray Data, Ray actors), and the GPU
# acceptance run with the GPU's kernel plan (the GPU machine has transformers 5.17, docs/gpu.md).
FLOOR_TESTS = (
    "tests/test_target.py",
    "tests/test_tree_attention.py",
    "tests/test_gpu_acceptance.py::test_the_gpu_plan_runs_every_section_on_a_cpu_without_what_a_bare_gpu_machine_lacks",
    "tests/test_device_check.py::test_worker_failure_reads_the_line_from_remote_errors",
    "tests/test_pipeline_run.py::test_every_row_once_with_errors_and_lossless_results",
)
OVERLAY_PTH = "_dart_overlay_parent_env.pth"


def declared_floors() -> dict[str, tuple[str, str]]:
    """name -> (requirement with extras, floor version) for FLOORED, from pyproject.toml."""
    dependencies = pyproject()["project"]["dependencies"]
    floors = {}
    for requirement in dependencies:
        found = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?>=([0-9][0-9.]*)", requirement.replace(" ", ""))
        if found and found.group(1) in FLOORED:
            floors[found.group(1)] = (found.group(1) + (found.group(2) or ""), found.group(3))
    missing = set(FLOORED) - set(floors)
    if missing:
        raise ValueError(f"pyproject.toml declares no '>=' floor for {sorted(missing)}")
    return floors


def site_dirs() -> list[str]:
    """The running interpreter's site-packages directories (a venv's own when it is a venv)."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def overlay_venv(venv: Path, python: str = sys.executable, parent_site_dirs: list[str] | None = None) -> Path:
    """A venv at `venv` (made by `python`, without pip) whose interpreter also sees the packages
    of `parent_site_dirs` (default: this interpreter's), after its own; returns its python."""
    subprocess.run([python, "-m", "venv", "--clear", "--without-pip", str(venv)], check=True)
    venv_python = venv / "bin" / "python"
    own_site = subprocess.run([str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
    dirs = site_dirs() if parent_site_dirs is None else parent_site_dirs
    (Path(own_site) / OVERLAY_PTH).write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
    return venv_python


def floor_environment(floors: dict[str, tuple[str, str]]) -> Path:
    """The cached venv with the floors installed over this environment; returns its python."""
    from dart_worker.artifacts.cache_dir import cache_dir, file_lock

    key_text = repr((sorted(floors.items()), sys.version, sys.prefix, site_dirs()))
    venv = cache_dir("floor-venvs") / hashlib.sha256(key_text.encode()).hexdigest()[:12]
    python = venv / "bin" / "python"
    pins = [f"{requirement}=={version}" for requirement, version in floors.values()]
    with file_lock(venv.with_suffix(".lock")):
        ready = venv / "ready"
        if not (ready.exists() and ready.read_text().split() == pins and python.exists()):
            overlay_venv(venv)
            # This interpreter's pip installs into the venv; what the overlaid environment
            # already has at the pinned version is not installed again.
            subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", *pins],
                           check=True)
            ready.write_text("\n".join(pins) + "\n")
    return python


def imported_versions(python: Path) -> dict[str, str]:
    out = subprocess.run([str(python), "-c", "import torch, transformers, ray; print(torch.__version__, "
                          "transformers.__version__, ray.__version__)"], check=True, capture_output=True,
                         text=True).stdout.split()
    return dict(zip(FLOORED, out))


def check_floors() -> int:
    from packaging.version import Version

    floors = declared_floors()
    python = floor_environment(floors)
    versions = imported_versions(python)
    for name, found in versions.items():  # 2.13.0+cpu is the floor 2.13
        if Version(Version(found).base_version) != Version(floors[name][1]):
            print(f"dependency floors: the floor env imports {name} {found}, not the floor {floors[name][1]}")
            return 1
    print(f"dependency floors: {versions} in {python.parent.parent}; running {len(FLOOR_TESTS)} test targets",
          flush=True)
    done = subprocess.run([str(python), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *FLOOR_TESTS],
                          cwd=REPO, timeout=3000)
    if done.returncode != 0:
        print(f"dependency floors: the tests failed at the floors {versions}")
    return 0 if done.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(check_floors())
