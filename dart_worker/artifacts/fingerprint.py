"""Every content fingerprint of the project: tokenizers, files and model directories.

- `tokenizer_fingerprint`: which ids a tokenizer produces (tries and draft heads record it);
- `file_fingerprint`: the sha256 of one file, local or at any fsspec URL (the one file hash:
  trie sidecars, draft heads, the default target's GGUF);
- `model_files_fingerprint`: the files behind a model, a directory or a .gguf file, with
  per-file hashes cached next to them (`loading.model_fingerprint` resolves a target spec
  such as "default" or a hub id to those files first).

Tokenizers
----------
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

Models
------
A model's fingerprint covers the files that decide what it computes: config, generation
config, weights, tokenizer files and any remote code; not READMEs, licences, or our own stamps
and caches. It is a sha256 over (name, size, sha256) of each, so it changes exactly when the
model's behaviour can. Per-file hashes are cached (keyed by size, mtime and inode) next to the
files, or under the project cache when that directory is read-only, so repeated calls cost a
few stat()s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from dart_worker.artifacts.cache_dir import cache_root, write_text_atomically

log = logging.getLogger(__name__)

FINGERPRINT_VERSION = "dart-batch/tokenizer-fingerprint/v1"
FINGERPRINT_HEX_CHARS = 64  # sha256
_CHUNK = 1 << 22
# Written by default_target.py into a converted directory; describes the conversion, not the
# model, so it is left out of the fingerprint (two conversions of the same GGUF agree).
CONVERSION_STAMP_NAME = "dart_conversion.json"
FINGERPRINT_CACHE_NAME = ".dart_fingerprint.json"
_FINGERPRINT_CACHE_VERSION = 1
# Files that define what a model computes: weights, configs, tokenizer, remote code.
_FINGERPRINT_SUFFIXES = {".json", ".safetensors", ".bin", ".model", ".txt", ".jinja", ".tiktoken", ".py"}
_FINGERPRINT_SKIP_PREFIXES = ("license", "notice", "readme", "use_policy")
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


# Files a tokenizer directory may load from (what a cached fingerprint is keyed by).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja")


def cached_tokenizer_fingerprint(tokenizer: Any) -> str:
    """`tokenizer_fingerprint`, read from the project cache when this tokenizer was loaded before
    from the same unchanged files with the same libraries.

    Computing it reads the whole vocabulary and segmentation (Gemma-3's 262k tokens: seconds of a
    worker's start-up), and a drafting job did it twice at start-up (the driver's trie check, then every
    worker's) where an `ar` job does not at all. The cache key is what the result depends on as
    loaded: the library versions, the class, the directory's tokenizer files (name, size, mtime,
    inode, as for model files), the vocabulary size with added tokens and the special tokens; a
    tokenizer not loaded from a local directory is fingerprinted every time."""
    source = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    files = [source / name for name in _TOKENIZER_FILES] if source.is_dir() else []
    present = [f for f in files if f.is_file()]
    if not present:
        return tokenizer_fingerprint(tokenizer)
    import tokenizers
    import transformers

    stats = [(f.name, st.st_size, st.st_mtime_ns, st.st_ino) for f in present for st in [f.stat()]]
    key = _canonical({"version": FINGERPRINT_VERSION, "transformers": transformers.__version__,
                      "tokenizers": tokenizers.__version__, "class": type(tokenizer).__name__,
                      "dir": str(source.resolve()), "files": stats, "size": len(tokenizer),
                      "special": _special_of(tokenizer, _backend_of(tokenizer))})
    path = cache_root() / "tokenizer_fingerprints" / f"{hashlib.sha256(key).hexdigest()[:32]}.json"
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key.decode("utf-8") and len(stored.get("fingerprint", "")) == FINGERPRINT_HEX_CHARS:
            return stored["fingerprint"]
    except (OSError, ValueError, AttributeError):
        pass
    fingerprint = tokenizer_fingerprint(tokenizer)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps({"key": key.decode("utf-8"), "fingerprint": fingerprint}))
    except OSError as err:  # a read-only cache costs the computation next time, nothing else
        log.warning("could not cache the tokenizer fingerprint at %s: %s", path, err)
    return fingerprint


def file_fingerprint(path: str | os.PathLike) -> str:
    """sha256 hex digest of a file's bytes, streamed (any size; a local path or any fsspec URL)."""
    if isinstance(path, os.PathLike) or "://" not in str(path):
        opened = open(path, "rb")  # noqa: SIM115 (closed by the `with` below)
    else:
        import fsspec

        opened = fsspec.open(str(path), "rb")
    h = hashlib.sha256()
    with opened as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# --- model files ------------------------------------------------------------------------------


def counts_for_fingerprint(name: str) -> bool:
    """Whether a model file called `name` decides what the model computes (see the module doc).

    Public so that a model being downloaded (dart_worker/artifacts/target_store.py) is fingerprinted by the
    same rule as one on disk, from hashes taken while its bytes arrive."""
    if name.startswith(".") or name == CONVERSION_STAMP_NAME:
        return False
    if name.lower().startswith(_FINGERPRINT_SKIP_PREFIXES):
        return False
    return Path(name).suffix.lower() in _FINGERPRINT_SUFFIXES


def _counts_for_fingerprint(path: Path) -> bool:
    return counts_for_fingerprint(path.name) and path.is_file()


def _hash_cache_paths(path: Path, beside: Path) -> list[Path]:
    """`beside` (next to the files) when writable; else a file named after `path` under the project cache."""
    fallback = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24] + ".json"
    return [beside, cache_root() / "fingerprints" / fallback]


def _read_hash_cache(paths: list[Path]) -> dict:
    for path in paths:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if data.get("version") == _FINGERPRINT_CACHE_VERSION and isinstance(data.get("files"), dict):
            return data["files"]
    return {}


def _write_hash_cache(paths: list[Path], files: dict) -> None:
    text = json.dumps({"version": _FINGERPRINT_CACHE_VERSION, "files": files}, indent=1, sort_keys=True)
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(path, text)
            return
        except OSError:
            continue
    log.debug("could not cache file hashes for %s anywhere", paths[0].parent)


def _files_fingerprint(files: list[Path], cache_paths: list[Path]) -> str:
    """sha256 over (name, size, sha256) of each file; per-file hashes are reused while the
    file's size, mtime and inode are unchanged, so repeated calls cost a few stat()s."""
    cached = _read_hash_cache(cache_paths)
    fresh: dict[str, dict] = {}
    for path in sorted(files, key=lambda p: p.name):
        stat = path.stat()
        key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
        entry = cached.get(path.name)
        if not (entry and all(entry.get(k) == v for k, v in key.items()) and "sha256" in entry):
            entry = {**key, "sha256": file_fingerprint(path)}
        fresh[path.name] = entry
    if fresh != cached:
        _write_hash_cache(cache_paths, fresh)
    return combine_file_hashes({name: (e["size"], e["sha256"]) for name, e in fresh.items()})


def combine_file_hashes(files: dict[str, tuple[int, str]]) -> str:
    """The model fingerprint from {file name: (size, sha256)} of the files that count: the one
    combining rule, for files on disk and for files whose hashes were taken while downloading."""
    combined = hashlib.sha256()
    for name in sorted(files):
        size, sha256 = files[name]
        combined.update(f"{name}\t{size}\t{sha256}\n".encode())
    return combined.hexdigest()


def record_file_hashes(directory: str | os.PathLike, hashes: dict[str, str]) -> None:
    """Seed the per-file hash cache of a model directory with sha256s already known (computed
    while the files were downloaded), so that its first `model_files_fingerprint` costs a few
    stat()s instead of reading every weight again. Only files present now are recorded; each is
    keyed by its current size, mtime and inode like any cached hash."""
    directory = Path(directory)
    files = {}
    for name, sha256 in hashes.items():
        path = directory / name
        if counts_for_fingerprint(name) and path.is_file():
            stat = path.stat()
            files[name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino,
                           "sha256": sha256}
    _write_hash_cache(_hash_cache_paths(directory, directory / FINGERPRINT_CACHE_NAME), files)


def model_files_fingerprint(path: str | os.PathLike) -> str:
    """A sha256 hex digest identifying the model at `path`: a local model directory or .gguf file.

    For a directory it covers config, generation config, weights, tokenizer files and any
    remote code (not READMEs, licences or our own stamps), so it changes exactly when the
    model's behaviour can. Cheap to call repeatedly: file hashes are cached next to the files.
    For a target spec ("default", a hub id), use `dart_worker.artifacts.loading.model_fingerprint`.
    """
    path = Path(path)
    if path.is_file():
        beside = path.parent / f".{path.name}{FINGERPRINT_CACHE_NAME}"
        return _files_fingerprint([path], _hash_cache_paths(path, beside))
    if not (path / "config.json").is_file():
        raise ValueError(f"cannot fingerprint {str(path)!r}: it is neither a model file nor a directory with "
                         "a config.json")
    files = [p for p in path.iterdir() if _counts_for_fingerprint(p)]
    return _files_fingerprint(files, _hash_cache_paths(path, path / FINGERPRINT_CACHE_NAME))


def check_tokenizer_fingerprint(expected: str, tokenizer: Any, what: str = "artifact") -> None:
    """Raise ValueError naming both fingerprints when ``tokenizer`` is not the one ``what`` was built for."""
    actual = tokenizer_fingerprint(tokenizer)
    if actual != expected:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"{what} was built for tokenizer fingerprint {expected}, but tokenizer {name!r} has "
            f"fingerprint {actual}: rebuild the {what} with this tokenizer or use the matching one"
        )
