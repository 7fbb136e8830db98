"""Content fingerprints: which tokenizer an artifact was built for, and file checksums.

A trie stores token ids. Queried with the ids of another tokenizer it does not fail: it returns
plausible-looking garbage. So every trie records the fingerprint of the tokenizer it was built with
and the loader compares it with the fingerprint of the tokenizer in use.

The fingerprint covers what decides which ids a text becomes, and nothing else:

- the vocabulary (every token string and its id, added tokens included);
- the special tokens (bos/eos/unk/pad/... and which ids are special);
- the segmentation rules of a Rust (``tokenizers``) backend: the model type and its parameters
  (BPE merges, Unigram scores, unk/byte-fallback settings), the normalizer, the pre-tokenizer
  and the added-token matching flags.

It deliberately leaves out file paths, timestamps, the library version, the Python class name
(transformers renames classes between versions, and a slow and a fast copy of one tokenizer
produce the same ids), truncation/padding settings, the post-processor (artifacts are built
without special tokens around texts) and the decoder (ids -> text does not change ids).

The digest is a sha256 over a canonical, labelled serialisation (JSON with sorted keys), so it is
stable across loads, processes and machines. A change of the ``tokenizers`` serialisation format
could change it for an unchanged tokenizer; that errs on the safe side (a refused trie, never a
silently wrong one).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

FINGERPRINT_VERSION = "dart-batch/tokenizer-fingerprint/v1"
FINGERPRINT_HEX_CHARS = 64  # sha256
_CHUNK = 1 << 20
_NAMED_SPECIAL = ("bos", "eos", "unk", "pad", "sep", "cls", "mask")
# Backend model fields that do not change which ids a text becomes.
_MODEL_FIELDS_IGNORED = ("vocab", "dropout")
_ADDED_TOKEN_FLAGS = ("content", "id", "special", "normalized", "lstrip", "rstrip", "single_word")


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _backend_of(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a transformers tokenizer, the object itself if it is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend
    if hasattr(tokenizer, "to_str") and hasattr(tokenizer, "get_vocab"):
        return tokenizer
    return None


def _vocab_of(tokenizer: Any, backend: Any) -> dict[str, int]:
    if backend is not None and backend is tokenizer:
        return backend.get_vocab(with_added_tokens=True)
    return dict(tokenizer.get_vocab())


def _special_of(tokenizer: Any, backend: Any) -> dict[str, Any]:
    named = {}
    for name in _NAMED_SPECIAL:
        token = getattr(tokenizer, f"{name}_token", None)
        if token is not None:
            named[name] = [str(token), getattr(tokenizer, f"{name}_token_id", None)]
    ids = getattr(tokenizer, "all_special_ids", None)
    if ids is None and backend is not None:  # a bare tokenizers.Tokenizer
        ids = [i for i, t in backend.get_added_tokens_decoder().items() if t.special]
    return {"named": named, "special_ids": sorted(int(i) for i in ids or [])}


def _merges_as_pairs(merges: list[Any]) -> list[list[str]]:
    """BPE merges are serialised as "a b" strings by older tokenizers and as [a, b] by newer ones."""
    if all(not isinstance(m, str) for m in merges[:1]):
        return merges  # already pairs (checked on the first: one serialiser writes one style)
    return [m.split(" ", 1) if isinstance(m, str) else list(m) for m in merges]


def _segmentation_of(backend: Any) -> dict[str, Any]:
    spec = json.loads(backend.to_str())
    model = dict(spec.get("model") or {})
    if model.get("type") == "Unigram":
        model["scores"] = [float(score) for _, score in model.get("vocab") or []]
    if "merges" in model:
        model["merges"] = _merges_as_pairs(model["merges"])
    for key in _MODEL_FIELDS_IGNORED:
        model.pop(key, None)
    added = sorted(
        ({k: t.get(k) for k in _ADDED_TOKEN_FLAGS} for t in spec.get("added_tokens") or []),
        key=lambda t: t["id"],
    )
    return {
        "model": model,
        "normalizer": spec.get("normalizer"),
        "pre_tokenizer": spec.get("pre_tokenizer"),
        "added_tokens": added,
    }


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """64 hex chars identifying what ids ``tokenizer`` produces; see the module doc for what counts.

    Accepts a transformers tokenizer (fast or slow) or a bare ``tokenizers.Tokenizer``. A slow
    tokenizer has no inspectable segmentation rules, so its class name stands in for them.
    """
    backend = _backend_of(tokenizer)
    vocab = _vocab_of(tokenizer, backend)
    if not vocab:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has an empty vocabulary")
    h = hashlib.sha256()

    def section(label: str, payload: bytes) -> None:
        # Length-prefixed sections: no two different inputs serialise to the same byte stream.
        h.update(label.encode() + b"\0" + len(payload).to_bytes(8, "little") + payload)

    section("version", FINGERPRINT_VERSION.encode())
    section("vocab", _canonical(sorted((int(i), str(t)) for t, i in vocab.items())))
    section("special", _canonical(_special_of(tokenizer, backend)))
    if backend is not None:
        section("segmentation", _canonical(_segmentation_of(backend)))
    else:
        section("slow_tokenizer_class", type(tokenizer).__name__.encode())
    return h.hexdigest()


def file_fingerprint(path: str | Path) -> str:
    """sha256 hex digest of a file's bytes, read in 1 MiB chunks (any size, any fsspec URL)."""
    h = hashlib.sha256()
    if isinstance(path, Path) or "://" not in str(path):
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        return h.hexdigest()
    import fsspec

    with fsspec.open(str(path), "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_tokenizer_fingerprint(expected: str, tokenizer: Any, what: str = "artifact") -> None:
    """Raise ValueError naming both fingerprints when ``tokenizer`` is not the one ``what`` was built for."""
    actual = tokenizer_fingerprint(tokenizer)
    if actual != expected:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"{what} was built for tokenizer fingerprint {expected}, but tokenizer {name!r} has "
            f"fingerprint {actual}: rebuild the {what} with this tokenizer or use the matching one"
        )
