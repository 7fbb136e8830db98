"""Prepare what a bare GPU machine needs for the acceptance run: `python -m jobs.gpu_acceptance.bundle [dir]`.

A lent GPU machine has Python 3.12 with torch, transformers, numpy, pybind11, PyYAML and a
compiler, no network, and takes at most 64 MiB of extra files per run. The acceptance run needs
one small pure-Python package more (omegaconf, 0.25 MB as a wheel, with whatever it requires
that the GPU machine lacks: nothing from 2.4 on, antlr4-python3-runtime before) and the C++
extension `ngram_native._core` built for that Python. The wheels are the versions installed
where this runs - the environment the test suite ran in - so the GPU machine runs the omegaconf
the suite tested. This writes, under `dir` (default `.gpu`, which the repository ignores):

    dir/wheels/   omegaconf and its requirements (pip download; pip wheel for a source-only one)
    dir/ext/      ngram_native/_core.cpython-312-*.so, built here with python3.12 when it exists
                  (the GPU machine builds it itself otherwise: it has pybind11 and a compiler)

and prints the one command to run there (docs/gpu.md explains it). Needs a package registry.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
CARRIED = "omegaconf"  # what the acceptance run imports that a bare GPU machine lacks
ON_THE_GPU_MACHINE = {"pyyaml", "torch", "transformers", "numpy", "pybind11", "typing-extensions"}
PYTHON = "3.12"

DEVICE_COMMAND = (
    "python3 -m pip install -q --no-index --no-deps --target /tmp/site {dir}/wheels/*.whl && "
    "export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 && "
    "(cp {dir}/ext/*.so ngram_native/ 2>/dev/null; python3 -c 'import ngram_native' 2>/dev/null "
    "|| python3 setup.py -q build_ext --inplace) && "
    "python3 -m jobs.gpu_acceptance device=cuda output_dir=$OUT/acceptance"
)


def run(*command: str, cwd: Path | None = None) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=cwd)


def pins(package: str = CARRIED) -> list[str]:
    """`package==<installed version>` and, the same way, each of its runtime requirements that the
    GPU machine lacks (recursively): exactly what the suite ran with here."""
    found: dict[str, str] = {}
    todo = [package]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found or name in ON_THE_GPU_MACHINE:
            continue
        found[name] = metadata.version(name)
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": "", "python_version": PYTHON}):
                todo.append(requirement.name)
    return [f"{name}=={version}" for name, version in found.items()]


def download_wheels(wheels: Path) -> None:
    wheels.mkdir(parents=True, exist_ok=True)
    for pin in pins():
        try:
            run(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                PYTHON, "--implementation", "py", "-d", str(wheels), pin)
        except subprocess.CalledProcessError:  # published as a source archive only: build its (pure) wheel here
            run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), pin)


def find_python() -> str | None:
    """A working python3.12 (a pyenv shim of an inactive version answers 127: try pyenv's own too)."""
    candidates = [shutil.which(f"python{PYTHON}"), *sorted(map(str, Path.home().glob(
        f".pyenv/versions/{PYTHON}*/bin/python{PYTHON}")))]
    for python in filter(None, candidates):
        if subprocess.run([python, "-c", "pass"], capture_output=True).returncode == 0:
            return python
    return None


def build_extension(ext: Path) -> bool:
    """ngram_native._core for Python 3.12, in a scratch copy of the sources; False if there is no python3.12."""
    python = find_python()
    if python is None:
        print(f"no python{PYTHON} here: the GPU machine will build ngram_native itself", flush=True)
        return False
    ext.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ngram-cp312-") as tmp:
        scratch = Path(tmp)
        tools = scratch / "tools"
        run(python, "-m", "pip", "install", "-q", "--target", str(tools), "pybind11>=2.12", "setuptools>=68")
        shutil.copytree(REPO / "ngram_native", scratch / "ngram_native",
                        ignore=shutil.ignore_patterns("*.so", "__pycache__"))
        shutil.copy(REPO / "setup.py", scratch / "setup.py")
        subprocess.run([python, "setup.py", "-q", "build_ext", "--inplace"], check=True, cwd=scratch,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tools)})
        for built in (scratch / "ngram_native").glob("_core.cpython-312*.so"):
            shutil.copy(built, ext / built.name)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    directory = Path(argv[0] if argv else ".gpu")
    download_wheels(directory / "wheels")
    build_extension(directory / "ext")
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    print(f"\n{directory}: {size / 2**20:.1f} MiB. On the GPU machine, from the repository root, with {directory} "
          f"beside the sources:\n\n  {DEVICE_COMMAND.format(dir=directory)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
