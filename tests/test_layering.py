"""The package layering of docs/DESIGN.md, checked on the source: no upward import, no cycle.

Reads every module of the project's packages with `ast` (nothing is imported) and collects
every import statement, lazy ones inside functions included: a lazy import still makes the
importer depend on the imported module, it only defers the failure.
"""

from __future__ import annotations

import ast
import importlib.machinery
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Lowest first: a package may import its own modules and those of the packages before it.
LAYERS = ("ngram_native", "dart_worker", "dart_train", "pipeline", "dart_bench", "jobs")
# The layer of entry points only: nothing but tests imports its modules (each is a thin `main`
# over library code in the layers below it).
ENTRY_POINTS = "jobs"
# Third-party packages a layer must never import (docs/DESIGN.md).
FORBIDDEN = {
    "ngram_native": {"torch", "transformers", "ray", "pyarrow", "fsspec"},
    "dart_worker": {"ray"},
}
# The package whose functions Ray Data runs in task workers (reads, the dedupe's counts, the resume
# filter, part writes, the OpenAI batch reader, and what they use): a task worker imports them and
# nothing else of the job, so torch and transformers there would cost every task worker seconds and
# hundreds of MB.
TASK_PACKAGE = "pipeline.data"
HEAVY_PACKAGES = ("torch", "transformers")
# Modules a Ray Data generation worker runs; none of them may pull in training code or jobs.
WORKER_MODULES = ("pipeline.worker",)
# An engine's parts: only the engine and the factory that wires them touch them; everything else
# uses the engine's public methods (warm, job_state, sizing_calibration, cost_model).
ENGINE_PARTS = ("drafter", "sizer")
ENGINE_MODULES = ("dart_worker.engine", "dart_worker.engine_factory")


def _module_files() -> dict[str, Path]:
    """Dotted name -> file, for every module of LAYERS (source files and compiled extensions)."""
    modules: dict[str, Path] = {}
    for package in LAYERS:
        for path in sorted((REPO_ROOT / package).rglob("*")):
            if "csrc" in path.parts or not path.is_file():
                continue
            name = path.name
            if name.endswith(".py"):
                stem = name[: -len(".py")]
            else:
                suffix = next((s for s in importlib.machinery.EXTENSION_SUFFIXES if name.endswith(s)), None)
                if suffix is None:
                    continue
                stem = name[: -len(suffix)]
            parts = list(path.relative_to(REPO_ROOT).parent.parts)
            if stem != "__init__":
                parts.append(stem)
            modules[".".join(parts)] = path
    return modules


MODULES = _module_files()
TASK_MODULES = tuple(name for name in MODULES if name.startswith(TASK_PACKAGE + "."))


def _imports(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported dotted name, line) for every import in a source module; names as written,
    with `from a import b` giving a.b when that is a module, else a."""
    if path.suffix != ".py":
        return
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full if full in MODULES else base), node.lineno


def _project_module(imported: str) -> str | None:
    """The project module an import resolves to (its longest known prefix), or None for others."""
    parts = imported.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def _layer(module: str) -> str:
    return module.split(".")[0]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for imported, _ in _imports(name, path):
            target = _project_module(imported)
            if target is not None and target != name:
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_scan_sees_the_packages():
    assert {"ngram_native.trie", "dart_worker.artifacts.loading", "dart_train.corpus", "pipeline.run",
            "dart_bench.common", "jobs.build_ngram"} <= set(MODULES)
    graph = _graph()
    assert "dart_worker.artifacts.default_target" in graph["dart_worker.artifacts.loading"]  # a lazy import counts
    assert {"ngram_native.trie", "ngram_native"} & graph["pipeline.cluster.ngram_store"]


def installed_packages() -> list[str]:
    """The packages pyproject.toml installs (its packages.find include list, without the globs)."""
    text = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r"^include = \[(.*)\]$", text, re.MULTILINE)
    assert match, "pyproject.toml: no [tool.setuptools.packages.find] include list"
    return [name.strip().strip('"').rstrip("*") for name in match.group(1).split(",")]


def test_every_installed_package_has_a_layer():
    assert set(installed_packages()) == set(LAYERS), "place every package in LAYERS (and in docs/DESIGN.md)"


def test_no_upward_imports():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = []
    for name, path in MODULES.items():
        for imported, line in _imports(name, path):
            target = _project_module(imported)
            if target is not None and rank[_layer(target)] > rank[_layer(name)]:
                upward.append(f"{path.relative_to(REPO_ROOT)}:{line}: {_layer(name)} imports {target}")
    assert not upward, "imports against the layering " + " < ".join(LAYERS) + ":\n" + "\n".join(upward)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_forbidden_third_party_imports(layer):
    bad = []
    for name, path in MODULES.items():
        if _layer(name) != layer:
            continue
        for imported, line in _imports(name, path):
            if imported.split(".")[0] in FORBIDDEN[layer]:
                bad.append(f"{path.relative_to(REPO_ROOT)}:{line}: {imported}")
    assert not bad, f"{layer} must not import {sorted(FORBIDDEN[layer])}:\n" + "\n".join(bad)


def test_entry_points_are_imported_by_tests_only():
    """A module of jobs/ is a `main`: the code it runs lives in a library package, where other
    code can import it (jobs/ importing jobs/ is caught here, anything below by the layering)."""
    importers = []
    for name, path in MODULES.items():
        for imported, line in _imports(name, path):
            target = _project_module(imported)
            if target is not None and target != name and _layer(target) == ENTRY_POINTS:
                importers.append(f"{path.relative_to(REPO_ROOT)}:{line}: imports {target}")
    assert not importers, f"only tests may import modules of {ENTRY_POINTS}/ (move what is shared into a " \
        "library package):\n" + "\n".join(dict.fromkeys(importers))


def test_no_import_cycles_between_modules():
    cycles = _cycles(_graph())
    assert not cycles, "modules that import each other (directly or around a loop):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_workers_import_no_training_code_and_no_jobs():
    graph = _graph()
    for start in WORKER_MODULES:
        seen, todo = {start}, [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert not {m for m in seen if _layer(m) in ("dart_train", "jobs")}, sorted(seen)
        assert "pipeline.run" not in seen  # the driver is not part of a worker


def test_ray_data_task_modules_import_neither_torch_nor_transformers():
    """Imported for real in a fresh interpreter (lazy and TYPE_CHECKING imports are what the AST
    scan cannot tell apart): the write task lived in pipeline/run.py and row settings imported
    dart_worker.sampling.params, so every read and write task worker imported the whole engine."""
    assert {f"{TASK_PACKAGE}.{m}" for m in ("inputs", "outputs", "write_task", "openai_batch")} <= set(TASK_MODULES)
    code = (f"import sys\nfor m in {TASK_MODULES!r}: __import__(m)\n"
            f"print(sorted({{k.split('.')[0] for k in sys.modules}} & set({HEAVY_PACKAGES!r})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", f"a Ray Data task module imports {done.stdout.strip()}"


def test_cycle_finder_finds_a_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


def _part_accesses(source: str) -> Iterator[tuple[int, str]]:
    """(line, code) for every use of an attribute named in ENGINE_PARTS on anything but `self`
    (`engine.drafter`, `self.engine.sizer`, `engines[m].drafter`, `getattr(e, "sizer")`): outside
    the engine modules no object of the project has such an attribute but an engine. A class's
    own `self.drafter` is its own."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_PARTS:
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and node.args[1].value in ENGINE_PARTS:
            yield node.lineno, ast.unparse(node)


def test_no_code_reaches_into_an_engines_parts():
    """Outside dart_worker.engine and its factory, nothing reaches a drafter or a sizer through an
    engine: the engine says what callers may ask of it (a worker warms it and reads its job state
    through public methods), so its parts can change without touching the pipeline or benchmarks."""
    found = []
    for name, path in MODULES.items():
        if path.suffix != ".py" or name in ENGINE_MODULES:
            continue
        for line, code in sorted(_part_accesses(path.read_text(encoding="utf-8"))):
            found.append(f"{path.relative_to(REPO_ROOT)}:{line}: {code}")
    assert not found, "reaches into an engine's parts (give DecodingEngine a public method):\n" + "\n".join(found)


def test_part_access_finder_finds_the_ways_in():
    source = """
engine.drafter.warm(docs)
self.engine.sizer.describe()
engines["on"].drafter.context.job_cache
getattr(engines.get(mode), "sizer", None)
self.drafter.propose(tokens)
drafter.job_ngram
"""
    assert sorted(line for line, _ in _part_accesses(source)) == [2, 3, 4, 5]


# The cost model (dart_worker/sizing/) is numpy over trees: it never imports torch, the engine or
# the drafters, only these (dart_worker.decode_round for the round record's type).
SIZING_PACKAGE = "dart_worker.sizing"
SIZING_MAY_IMPORT = ("dart_worker.sizing", "dart_worker.sampling.params", "dart_worker.decode_round", "ngram_native")


def test_the_sizing_package_sits_below_the_engine():
    assert {f"{SIZING_PACKAGE}.{m}" for m in ("latency", "verify_costs", "acceptance", "bias", "drain", "pacing",
                                               "sizer", "policy")} <= set(MODULES)
    bad = []
    for name, path in MODULES.items():
        if not name.startswith(SIZING_PACKAGE):
            continue
        for imported, line in _imports(name, path):
            target = _project_module(imported)
            allowed = any(target == m or (target or "").startswith(m + ".") for m in SIZING_MAY_IMPORT)
            if (target is not None and not allowed) or imported.split(".")[0] in HEAVY_PACKAGES:
                bad.append(f"{path.relative_to(REPO_ROOT)}:{line}: {imported}")
    assert not bad, f"{SIZING_PACKAGE} may import only {SIZING_MAY_IMPORT} and numpy:\n" + "\n".join(bad)


def _attributes_used_on(source: str, owner: str) -> dict[str, set[str]]:
    """Per method of the module's classes, the attributes read on `self.<owner>` in it."""
    used: dict[str, set[str]] = {}
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                        isinstance(node.value.value, ast.Name) and node.value.value.id == "self" and \
                        node.value.attr == owner:
                    used.setdefault(fn.name, set()).add(node.attr)
    return used


def test_the_engine_asks_its_sizing_policy_two_things():
    """A round plans its trees and hands the policy its record (docs/DESIGN.md); the sizer itself
    is reached only by the engine's reports (the calibration line and the cost model's state)."""
    source = MODULES["dart_worker.engine"].read_text(encoding="utf-8")
    policy_calls = set().union(*_attributes_used_on(source, "_policy").values())
    assert policy_calls == {"plan", "learn"}
    assert set(_attributes_used_on(source, "sizer")) <= {"sizing_calibration", "cost_model"}


def test_the_attribute_finder_sees_calls_on_a_part():
    source = """
class E:
    def round(self):
        self._policy.plan(record, draft)
        self._policy.learn(record)
    def report(self):
        return self.sizer.describe()
"""
    assert _attributes_used_on(source, "_policy") == {"round": {"plan", "learn"}}
    assert _attributes_used_on(source, "sizer") == {"report": {"describe"}}


# Within dart_worker and pipeline, groups of modules, lowest first: a subpackage, or one top-level
# module named here; a package's other top-level modules are its core (the engine; the job and its
# entry points), above every group. A group imports its own modules and those of the groups before
# it, so no two groups import each other, directly or around a loop (docs/DESIGN.md, "File map").
CORE = "(core)"
GROUPS = {
    "dart_worker": ("defaults", "hardware", "artifacts", "target", "sampling", "head", "sizing", "drafters", CORE),
    "pipeline": ("settings", "data", "cluster", "startup", CORE),
}
# Imports against that order allowed because they name a type only (under `if TYPE_CHECKING:`, so
# nothing runs): the sizing policy's protocol names the round record the engine hands it.
TYPE_ONLY_UPWARD = {("dart_worker.sizing", "dart_worker.decode_round")}


def _group(module: str) -> str | None:
    """The group of a module of GROUPS' packages (None for the packages themselves and the rest)."""
    parts = module.split(".")
    if parts[0] not in GROUPS or len(parts) == 1:
        return None
    return parts[1] if parts[1] in GROUPS[parts[0]] else CORE


def _type_only_lines(source: str) -> set[int]:
    """Lines of the imports under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            lines |= {sub.lineno for stmt in node.body for sub in ast.walk(stmt)
                      if isinstance(sub, (ast.Import, ast.ImportFrom))}
    return lines


def _group_imports() -> Iterator[tuple[str, str, str, str]]:
    """(where, importing group, imported group, imported module) for every import from one group of
    a package into another, but the type-only ones TYPE_ONLY_UPWARD allows; groups as `package.group`."""
    for name, path in MODULES.items():
        group = _group(name)
        if group is None:
            continue
        package = _layer(name)
        type_only = _type_only_lines(path.read_text(encoding="utf-8")) if path.suffix == ".py" else set()
        for imported, line in _imports(name, path):
            target = _project_module(imported)
            if target is None or _layer(target) != package or _group(target) in (None, group):
                continue
            if line in type_only and (f"{package}.{group}", target) in TYPE_ONLY_UPWARD:
                continue
            yield f"{path.relative_to(REPO_ROOT)}:{line}", f"{package}.{group}", f"{package}.{_group(target)}", target


def test_every_subpackage_has_a_group():
    for package, groups in GROUPS.items():
        subpackages = {p.name for p in (REPO_ROOT / package).iterdir() if (p / "__init__.py").is_file()}
        named = set(groups) - {CORE}
        assert subpackages <= named, f"place every subpackage of {package} in GROUPS and docs/DESIGN.md's file map"
        assert {f"{package}.{g}" for g in named} <= set(MODULES), "a group that names no module"


def test_groups_import_only_the_groups_below_them():
    rank = {f"{package}.{g}": i for package, groups in GROUPS.items() for i, g in enumerate(groups)}
    upward = [f"{where}: {src} imports {target}"
              for where, src, dst, target in _group_imports() if rank[dst] > rank[src]]
    order = "; ".join(" < ".join(groups) for groups in GROUPS.values())
    assert not upward, f"imports against the groups' order ({order}):\n" + "\n".join(upward)


def test_no_import_cycles_between_groups():
    graph: dict[str, set[str]] = {f"{p}.{g}": set() for p, groups in GROUPS.items() for g in groups}
    for _, src, dst, _ in _group_imports():
        graph[src].add(dst)
    cycles = _cycles(graph)
    assert not cycles, "groups that import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_group_finder_and_type_only_imports():
    assert _group("dart_worker.target.adapter") == "target"
    assert _group("dart_worker.defaults") == "defaults"
    assert _group("dart_worker.engine") == CORE and _group("pipeline.run") == CORE
    assert _group("dart_worker") is None and _group("dart_bench.common") is None
    source = """
from typing import TYPE_CHECKING
import numpy
if TYPE_CHECKING:
    from dart_worker.decode_round import RoundRecord
else:
    import dart_worker.engine
"""
    assert _type_only_lines(source) == {5}
    # the sizing policy's type-only import of the round record is in the graph, and allowed
    assert "dart_worker.decode_round" in _graph()["dart_worker.sizing.policy"]
    assert not any(src == "dart_worker.sizing" and target == "dart_worker.decode_round"
                   for _, src, _, target in _group_imports())


def test_the_file_map_names_every_module():
    """docs/DESIGN.md's file map (and its "Tree sizing" table for sizing/) has a line for every
    module of the grouped packages, by its path within the package, so a new or moved module
    gets one."""
    design = (REPO_ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    missing = []
    for name, path in MODULES.items():
        if _group(name) is None or path.name == "__init__.py" or path.suffix != ".py":
            continue
        relative = path.relative_to(REPO_ROOT / _layer(name)).as_posix()
        if f"`{relative}`" not in design:
            missing.append(relative)
    assert not missing, "docs/DESIGN.md's file map lacks: " + ", ".join(missing)
