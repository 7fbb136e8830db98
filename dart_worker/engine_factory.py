"""One way to make a decoding engine, for the pipeline, the benchmarks and training alike.

    parts = load_engine_parts("default", dtype="auto", device="auto", head=head_dir, trie=trie)
    engine = build_engine(parts, "dart_lookup", TreeParams(budget=32))

`EngineParts` is what is loaded once and shared by every engine over the same target (the
benchmarks build one engine per mode and budget over one model): the target adapter, its
tokenizer, its EOS ids, and the draft head and N-gram trie where a drafter needs them.
`build_engine` picks the drafter by name from the registry (`dart_worker.drafters`), checks that
what it needs is loaded, and wires it to the target. EOS ids are computed in one place
(`eos_ids_of`), so every entry point stops on the same tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dart_worker.calibration import deferral_pays, make_sizer
from dart_worker.defaults import DEFAULT_DTYPE
from dart_worker.drafters import DrafterResources, drafter_spec
from dart_worker.drafters.base import Drafter
from dart_worker.engine import DecodingEngine
from dart_worker.hardware.kernels import logits_for
from dart_worker.target.adapter import TargetAdapter
from dart_worker.target.shape_buckets import rows_buckets
from ngram_native.builders import TreeParams


def eos_ids_of(model, tokenizer=None) -> tuple[int, ...]:
    """Every EOS id the target declares (generation config, model config, tokenizer), sorted."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None)
    return tuple(sorted(ids))


@dataclass
class EngineParts:
    """A loaded target with what drafters may need; shared by every engine built over it."""

    target: TargetAdapter
    tokenizer: Any = None
    head: Any = None  # DartDraftHead, or None
    trie: Any = None  # an opened N-gram scorer (NgramTrie), or None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_model(cls, model, tokenizer=None, *, tap_layers=None, head=None, trie=None,
                   target: TargetAdapter | None = None) -> EngineParts:
        """Wrap an already loaded model. `head`: a checkpoint directory or a loaded head (checked
        against the target's taps); `trie`: a trie file path or an opened scorer."""
        target = target or TargetAdapter(model, tap_layers)
        return cls(target=target, tokenizer=tokenizer, head=_head(head, target), trie=_trie(trie, tokenizer),
                   eos_token_ids=eos_ids_of(model, tokenizer))


def load_engine_parts(target: str, *, dtype: str = DEFAULT_DTYPE, device: str = "auto", tap_layers=None,
                      head=None, trie=None) -> EngineParts:
    """Load the target (`dart_worker.artifacts.loading.load_target` spec) and wrap it with head and trie."""
    from dart_worker.artifacts.loading import load_target
    from dart_worker.hardware.device import resolve_device, resolve_dtype

    resolved = resolve_device(device)
    model, tokenizer = load_target(target, dtype=resolve_dtype(dtype, resolved), device=resolved)
    return EngineParts.from_model(model, tokenizer, tap_layers=tap_layers, head=head, trie=trie)


def build_engine(parts: EngineParts, mode: str, tree: TreeParams | None = None,
                 defer_logits: bool | None = None, sizing: str = "fixed", batches=(1,),
                 shapes: str | None = None, drafter: Drafter | None = None) -> DecodingEngine:
    """An engine decoding with the drafter registered as `mode`; ValueError if it needs a head and
    none is loaded. A trie is looked up by jobs (`needs_trie`), but an engine may be built without
    one: DART then scores its beam with the draft head alone (the tests use that). `defer_logits`:
    see `DecodingEngine` (None = where it pays, on a CPU). `sizing`: "auto" sizes every round's
    trees (up to `tree.budget` nodes) with a measured cost model (`dart_worker.sizing`; its
    verify costs are measured at build for each live batch size in `batches`, once per machine and
    model shape: `dart_worker.calibration`), "fixed" verifies the trees as the drafter builds them.
    `shapes`: the verify block's shapes, "bucketed" or "exact" (None: the device's strategy,
    `dart_worker.hardware.kernels.shapes_for`); bucketed, the sizer prices a tree at its bucket's rows and
    a round at its batch bucket's sequences.
    `drafter`: one the caller built with `build_drafter(parts, mode, tree)` and keeps a hand on (a
    benchmark reading the drafter's own records; nothing reaches it through the engine); None:
    built here."""
    tree = tree or TreeParams()  # checked when it was built
    drafter = drafter or build_drafter(parts, mode, tree)
    if defer_logits is None:  # the device's strategy, its CPU measurement read from the cache
        defer_logits = logits_for(parts.target.device, lambda: deferral_pays(parts.target)) == "deferred"
    engine = DecodingEngine(parts.target, drafter, tokenizer=parts.tokenizer, eos_token_ids=parts.eos_token_ids,
                            defer_logits=defer_logits, shapes=shapes)
    if drafter_spec(mode).uses_tree:
        engine.sizer = make_sizer(parts.target, sizing, tree.budget, engine.defer_logits, batches)
        if engine.sizer is not None and engine.bucketed:
            engine.sizer.rows_bucket = rows_buckets
            engine.sizer.batch_bucket = engine.forward_batch
        elif engine.sizer is not None:  # exact shapes: a block runs its real rows only
            engine.sizer.packed = engine.packs_rows
    return engine


def build_drafter(parts: EngineParts, mode: str, tree: TreeParams | None = None):
    """The drafter registered as `mode` over `parts` (what an engine drives; `dart_train.replay`
    drives one without an engine); ValueError if it needs a head and none is loaded."""
    spec = drafter_spec(mode)
    if spec.needs_head and parts.head is None:
        raise ValueError(f"mode {mode!r} needs a draft head")
    resources = DrafterResources(head=parts.head, trie=parts.trie, eos_token_ids=parts.eos_token_ids,
                                 vocab_size=parts.target.vocab_size, device=parts.target.device)
    return spec.build(resources, tree or TreeParams())


def _head(head, target: TargetAdapter):
    if head is None or not isinstance(head, (str, os.PathLike)):
        if head is not None:
            from dart_worker.head.draft_checkpoint import check_tap_layers

            check_tap_layers(head.config, target.tap_layers, target.num_layers, "draft head")
        return head
    from dart_worker.head.draft_checkpoint import load_draft_head

    model = target.model
    return load_draft_head(head, model.config, model.get_input_embeddings(), device=target.device,
                           dtype=target.dtype, tap_layers=target.tap_layers)


def _trie(trie, tokenizer):
    if trie is None or not isinstance(trie, (str, os.PathLike)):
        return trie
    from dart_worker.artifacts.fingerprint import tokenizer_fingerprint
    from ngram_native import NgramTrie

    expected = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    return NgramTrie.open(trie, verify=True, expected_tokenizer_fingerprint=expected)
