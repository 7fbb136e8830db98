"""One source for every default: the mode, the tree budget and the dtype are written once
(dart_worker/defaults.py), nothing writes their values again as a default, and the config
reference (docs/config.md) states every key of the pipeline config with the schema's default,
the modes as the registry has them, and which knobs are expert-only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from dart_worker.defaults import DEFAULT_BUDGET, DEFAULT_DTYPE, DEFAULT_MODE
from dart_worker.drafters import drafter_names, drafter_spec
from ngram_native import TreeParams
from ngram_native import _core as native
from pipeline.settings.config import DecodingConfig, ModelConfig, PipelineConfig
from tests.pyproject import pyproject

REPO = Path(__file__).resolve().parents[1]
# Every package pyproject.toml ships (dart_bench included), so a new one is checked too.
PACKAGES = tuple(p.rstrip("*") for p in pyproject()["tool"]["setuptools"]["packages"]["find"]["include"])
REFERENCE = REPO / "docs" / "config.md"
# TreeParams fields that only tests and studies change (the reference's choices); docs/config.md
# marks them expert, and no shipped config sets them.
EXPERT = {"decoding.tree.keep_pruned", "decoding.tree.prune", "decoding.tree.ngram_first_level"}
BUILT_IN_MODES = ("ar", "chain", "ddtree", "dart", "lookup", "dart_lookup", "ddtree_lookup")


def test_the_schema_and_the_builders_take_the_one_set_of_defaults():
    assert DEFAULT_MODE in drafter_names()
    assert DecodingConfig().mode == DEFAULT_MODE and ModelConfig().dtype == DEFAULT_DTYPE
    assert TreeParams().budget == DEFAULT_BUDGET == native.DartParams().budget


def _kind(name: str) -> str | None:
    """Which default a parameter or field of this name takes, if any."""
    for kind in ("mode", "dtype", "budget"):
        if name == kind or name.endswith("_" + kind):
            return kind
    return None


def _written_defaults(tree: ast.AST):
    """(name, default node) for every dataclass-style field and function parameter with a default."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                    yield item.target.id, item.value
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True):
                yield arg.arg, default
            for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
                if default is not None:
                    yield arg.arg, default


def test_no_default_writes_the_value_of_a_shared_one_again():
    """A default mode, dtype or budget equal to the shared one names it (DEFAULT_MODE, ...): a job that
    measures something else on purpose writes its own, different, value."""
    values = {"mode": DEFAULT_MODE, "dtype": DEFAULT_DTYPE, "budget": DEFAULT_BUDGET}
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path == REPO / "dart_worker" / "defaults.py":
                continue
            for name, default in _written_defaults(ast.parse(path.read_text(encoding="utf-8"))):
                kind = _kind(name)
                if kind and isinstance(default, ast.Constant) and default.value == values[kind] \
                        and type(default.value) is type(values[kind]):
                    found.append(f"{path.relative_to(REPO)}:{default.lineno}: {name} = {default.value!r} "
                                 f"(use DEFAULT_{kind.upper()} from dart_worker.defaults)")
    assert not found, "\n".join(found)


def _reference_rows() -> dict[str, str]:
    """key -> default cell, for every `| `key` | default | ... |` row of docs/config.md."""
    rows = {}
    for line in REFERENCE.read_text(encoding="utf-8").splitlines():
        found = re.match(r"\| `([a-z_]+(?:\.[a-z_]+)+)` \| ([^|]*) \|", line)
        if found:
            assert found.group(1) not in rows, f"docs/config.md lists {found.group(1)} twice"
            rows[found.group(1)] = found.group(2).strip()
    return rows


def _schema_defaults() -> dict[str, object]:
    out = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and key != "settings_columns":
                walk(value, f"{prefix}{key}.")
            else:
                out[prefix + key] = value

    walk(OmegaConf.to_container(OmegaConf.structured(PipelineConfig)), "")
    return out


def test_the_config_reference_states_every_key_with_its_default():
    rows, schema = _reference_rows(), _schema_defaults()
    assert sorted(set(schema) - set(rows)) == [], "keys of pipeline/settings/config.py missing from docs/config.md"
    assert sorted(set(rows) - set(schema)) == [], "docs/config.md lists keys the schema does not have"
    for key, cell in rows.items():
        if cell == "required":
            assert schema[key] == "???", f"{key}: docs/config.md says required, the schema has a default"
        elif cell.startswith("`") and cell.endswith("`"):
            assert yaml.safe_load(cell[1:-1]) == schema[key], f"{key}: docs/config.md says {cell}, " \
                                                              f"the schema {schema[key]!r}"


def _needs(name: str) -> str:
    spec = drafter_spec(name)
    return ", ".join([*(["draft head"] if spec.needs_head else []), *(["trie"] if spec.needs_trie else [])]) or "-"


def test_the_reference_lists_the_modes_as_the_registry_has_them():
    assert drafter_names()[:len(BUILT_IN_MODES)] == BUILT_IN_MODES
    table = "\n".join(["| mode | drafts with | needs |", "|---|---|---|",
                       *(f"| `{name}` | {drafter_spec(name).summary} | {_needs(name)} |" for name in BUILT_IN_MODES)])
    assert table in REFERENCE.read_text(encoding="utf-8"), f"docs/config.md's mode table should read:\n{table}"


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_expert_knobs_are_marked_and_no_shipped_config_sets_one(config):
    rows = _reference_rows()
    assert {key for key in rows if "*expert*" in _row_text(key)} == EXPERT
    data = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    pipeline = data.get("pipeline", data)  # configs/nightly.yaml nests the pipeline config
    tree = ((pipeline.get("decoding") or {}).get("tree") or {}) if isinstance(pipeline, dict) else {}
    assert not {f"decoding.tree.{name}" for name in tree} & EXPERT, f"{config.name} sets an expert knob"


def _row_text(key: str) -> str:
    return next(line for line in REFERENCE.read_text(encoding="utf-8").splitlines() if line.startswith(f"| `{key}` |"))
