"""The one registry of drafters by name (`decoding.mode`): what each needs, how to build it.

Import-light on purpose (no torch): the config schema validates `decoding.mode` against it on
the driver before anything heavy loads. Built-in drafters register below with builders that
import their module only when an engine is made.

    from dart_worker.drafters import DrafterSpec, register_drafter
    register_drafter(DrafterSpec("mine", build=lambda res, tree: MyDrafter(res.eos_token_ids)))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# How the engine sizes the trees of a drafter that builds them (`decoding.sizing`): "auto" by a
# measured cost model (dart_worker.sizing), "fixed" as the drafter builds them. Here, not in
# the cost model, so that the config schema checks it without importing torch.
SIZING_MODES = ("auto", "fixed")


@dataclass(frozen=True)
class DrafterResources:
    """What the engine factory hands a drafter's builder (None where it was not loaded)."""

    head: Any = None  # DartDraftHead
    trie: Any = None  # ngram_native.NgramScorer (an opened NgramTrie)
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 0  # the target's vocabulary: every proposed token id is below it
    device: Any = None  # torch.device of the target


@dataclass(frozen=True)
class DrafterSpec:
    """A named drafter: `build(resources, tree_params) -> Drafter`, plus what it needs loaded."""

    name: str
    build: Callable[[DrafterResources, Any], Any]
    needs_head: bool = False  # a draft head must be loaded (model.draft_head)
    needs_trie: bool = False  # jobs load an N-gram trie for it (model.trie); None = head scores only
    uses_tree: bool = True  # tree parameters (budget, ...) change its proposals: benchmarks sweep them
    summary: str = field(default="", compare=False)


_REGISTRY: dict[str, DrafterSpec] = {}


def register_drafter(spec: DrafterSpec, *, replace: bool = False) -> DrafterSpec:
    """Add `spec` under `spec.name`; a second registration of a name needs replace=True."""
    if not spec.name or not spec.name.replace("_", "").isalnum():
        raise ValueError(f"drafter name {spec.name!r}: use letters, digits and '_'")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"drafter {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_drafter(name: str) -> None:
    """Remove a drafter (tests that register their own clean up with this)."""
    _REGISTRY.pop(name, None)


def drafter_names() -> tuple[str, ...]:
    """Every registered mode, built-ins first, in registration order."""
    return tuple(_REGISTRY)


def drafter_spec(name: str) -> DrafterSpec:
    """The spec registered as `name`; ValueError listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown decoding mode {name!r}; expected one of {list(_REGISTRY)}") from None


# ------------------------------------------------------------------------------ built-ins


def _build_ar(resources: DrafterResources, tree: Any):
    from dart_worker.drafters.autoregressive import AutoregressiveDrafter

    return AutoregressiveDrafter()


def _build_chain(resources: DrafterResources, tree: Any):
    from dart_worker.drafters.head import ChainDrafter

    return ChainDrafter(resources.head, tree, resources.eos_token_ids)


def _build_ddtree(resources: DrafterResources, tree: Any):
    from dart_worker.drafters.head import DDTreeDrafter

    return DDTreeDrafter(resources.head, tree, resources.eos_token_ids)


def _build_dart(resources: DrafterResources, tree: Any):
    from dart_worker.drafters.head import DartDrafter

    return DartDrafter(resources.head, tree, resources.eos_token_ids, resources.trie)


def _build_lookup(resources: DrafterResources, tree: Any):
    from dart_worker.drafters.lookup import LookupDrafter

    return LookupDrafter(tree, resources.eos_token_ids)


def _build_hybrid(inner_build):
    def build(resources: DrafterResources, tree: Any):
        from dart_worker.drafters.hybrid import HybridDrafter

        return HybridDrafter(inner_build(resources, tree), tree, resources.eos_token_ids)

    return build


register_drafter(DrafterSpec("ar", _build_ar, uses_tree=False,
                             summary="no draft: plain autoregressive decoding (the baseline)"))
register_drafter(DrafterSpec("chain", _build_chain, needs_head=True,
                             summary="draft head, top-1 token per position"))
register_drafter(DrafterSpec("ddtree", _build_ddtree, needs_head=True,
                             summary="draft head, DDTree best-first tree under the node budget"))
register_drafter(DrafterSpec("dart", _build_dart, needs_head=True, needs_trie=True,
                             summary="draft head + N-gram-guided beam search (DART)"))
register_drafter(DrafterSpec("lookup", _build_lookup,
                             summary="no model: continuations of the request's own text (prompt lookup)"))
register_drafter(DrafterSpec("dart_lookup", _build_hybrid(_build_dart), needs_head=True, needs_trie=True,
                             summary="dart's tree with the lookup tree grafted in, same budget"))
register_drafter(DrafterSpec("ddtree_lookup", _build_hybrid(_build_ddtree), needs_head=True,
                             summary="ddtree's tree with the lookup tree grafted in, same budget"))
