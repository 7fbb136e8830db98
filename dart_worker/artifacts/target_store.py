"""Model directories at any fsspec URL (s3://, gs://, ...), downloaded once per node into the cache.

A job's workers each call `load_target(url)`; on a node with eight workers that must not mean
eight copies of a 16 GB model, a reader seeing half of one, or a restart beginning again at byte
zero. So `fetch_model_dir(url)`:

- lists the store (a cheap call) and looks the listing up in a per-node index: a copy fetched
  from this exact listing (names, sizes, ETags) is returned at once, with no lock and no download;
- otherwise takes a per-listing file lock (`cache_dir.file_lock`; the kernel releases it when a
  holder dies), so that concurrent workers share one download: the first downloads, the others
  wait and then find the copy ready;
- downloads into a private `.partial-<key>` directory, file by file. A finished file is renamed
  from `<name>.part` to `<name>` and recorded (with its sha256) in the partial manifest; a
  `.part` left by an interrupted run is continued from its last byte (the bytes already there are
  hashed again, never trusted). So an interrupted download resumes where it stopped;
- checks every file against the store: its size against the listing, and its MD5 against the
  store's checksum where the store gives one (S3 single-part ETags, GCS md5Hash). A difference
  stops the fetch with an error naming the file and both values; nothing incomplete or corrupt is
  ever returned;
- is content-addressed: the finished directory is named by the model fingerprint
  (`fingerprint.combine_file_hashes`, the same value `model_files_fingerprint` gives for that
  directory, computed from hashes taken while the bytes arrived), gets a completion marker, and
  appears by one atomic rename. The same model fetched from two URLs is stored once, and a target
  in S3 has the fingerprint of the same files on a local disk.

Which files are fetched: the top-level files of the directory (transformers reads nothing
below it), without hidden files, weights of other frameworks (`.h5`, `.msgpack`, `.onnx`, ...,
`.pth` consolidated checkpoints) and pickled `.bin` weights when safetensors are there. A URL
ending `.gguf` fetches that one file.

Credentials and endpoints come from the environment or the standard chain, as for every other
URL in the project (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ...). This module imports neither
torch nor transformers.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import posixpath
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dart_worker.artifacts import io_retry
from dart_worker.artifacts.cache_dir import announce, cache_dir, file_lock, write_text_atomically
from dart_worker.artifacts.fingerprint import combine_file_hashes, counts_for_fingerprint, record_file_hashes
from dart_worker.artifacts.url_filesystem import StorageError, url_filesystem

log = logging.getLogger(__name__)

COMPLETE_MARKER = ".dart_complete.json"
PARTIAL_MANIFEST = ".dart_partial.json"
PART_SUFFIX = ".part"
_CHUNK = 1 << 22
_LOCAL_PROTOCOLS = ("file", "local")
# Weights transformers' PyTorch loader never reads: other frameworks' formats, and original
# (non-HF) consolidated checkpoints some repositories ship next to the HF weights.
_SKIPPED_SUFFIXES = (".h5", ".msgpack", ".ot", ".onnx", ".tflite", ".pth", ".pt", ".ckpt", ".npz")


class TargetFetchError(OSError):
    """A model at a URL that cannot be listed, is not a model, or did not arrive intact."""


@dataclass(frozen=True)
class RemoteFile:
    """One file of a model as the store lists it."""

    name: str  # relative to the model directory
    path: str  # the store's path (what `fs.open` takes)
    size: int
    version: str | None  # ETag / generation / mtime: changes when the object is rewritten
    md5: str | None  # hex MD5 of the bytes when the store gives it, to check the download against


def is_remote_url(spec: str | os.PathLike) -> bool:
    """True for a URL with a non-local fsspec protocol (s3://, gs://, hf://, memory://, ...)."""
    text = os.fspath(spec)
    if "://" not in text:
        return False
    return text.split("://", 1)[0].lower() not in _LOCAL_PROTOCOLS


def local_path_of(spec: str | os.PathLike) -> str:
    """A local path for `file://` (and `local://`) URLs, the spec itself otherwise."""
    text = os.fspath(spec)
    for protocol in _LOCAL_PROTOCOLS:
        if text.lower().startswith(protocol + "://"):
            return text[len(protocol) + 3:]
    return text


def _md5_of(info: dict) -> str | None:
    """The store's MD5 of an object's bytes, where it states one: S3's ETag of a single-part
    upload is the hex MD5 (a multipart ETag, "<hex>-<parts>", is not); GCS gives md5Hash in
    base64. None where the store gives nothing usable (then only the size is checked)."""
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"').lower()
    if len(etag) == 32 and all(c in "0123456789abcdef" for c in etag):
        return etag
    md5_b64 = info.get("md5Hash")
    if md5_b64:
        with contextlib.suppress(ValueError, TypeError):
            raw = base64.b64decode(md5_b64)
            if len(raw) == 16:
                return raw.hex()
    return None


def _version_of(info: dict) -> str | None:
    for key in ("ETag", "etag", "md5Hash", "generation", "VersionId", "LastModified", "mtime", "last_modified",
                "updated", "created"):
        value = info.get(key)
        if value is not None:
            return f"{key}={value}"
    return None


def _wanted(names: list[str]) -> list[str]:
    has_safetensors = any(n.endswith(".safetensors") for n in names)
    keep = []
    for name in names:
        lower = name.lower()
        if name.startswith(".") or lower.endswith(_SKIPPED_SUFFIXES):
            continue
        if has_safetensors and lower.endswith(".bin") and "pytorch_model" in lower:
            continue
        keep.append(name)
    return keep


def list_model(url: str, what: str = "target"):
    """(filesystem, listed files) of the model at `url`: a directory with a config.json, or one
    .gguf file. Raises TargetFetchError naming the URL when it is neither."""

    def listing() -> list[dict]:
        fs.invalidate_cache(root)  # a listing cached by this process must not hide a re-upload
        if root.lower().endswith(".gguf"):
            return [fs.info(root)]
        return [i for i in fs.ls(root, detail=True) if i.get("type") == "file"]

    try:
        fs, root = url_filesystem(url)
        root = root.rstrip("/")
        # A transient failure (HTTP 5xx, throttling, a reset) is waited out under the process's policy.
        infos = io_retry.active().call("list artifact", url, listing)
    except FileNotFoundError:  # also when the retry policy gave up on one (`StorageNotFoundError`)
        raise TargetFetchError(f"{what} {url}: nothing there (no such directory or file in the store)") from None
    except Exception as exc:  # the store's own error types (auth, endpoint, bucket) vary by backend
        raise TargetFetchError(f"{what} {url}: cannot list it: {type(exc).__name__}: {exc}") from None
    if root.lower().endswith(".gguf") and infos[0].get("type") != "file":
        raise TargetFetchError(f"{what} {url}: not a file")
    by_name = {posixpath.basename(i["name"].rstrip("/")): i for i in infos}
    names = sorted(by_name) if root.lower().endswith(".gguf") else _wanted(sorted(by_name))
    if not root.lower().endswith(".gguf") and "config.json" not in names:
        raise TargetFetchError(f"{what} {url}: not a model directory: no config.json among "
                               f"{sorted(by_name)[:12] or 'no files'}")
    files = [RemoteFile(name=n, path=by_name[n]["name"], size=int(by_name[n].get("size") or 0),
                        version=_version_of(by_name[n]), md5=_md5_of(by_name[n])) for n in names]
    return fs, files


def _listing_key(url: str, files: list[RemoteFile]) -> str:
    payload = json.dumps([url.rstrip("/"), [(f.name, f.size, f.version) for f in files]], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _complete(directory: Path) -> dict | None:
    """The completion marker of a finished copy, or None (missing, or a file it lists is gone or
    has another size: a copy someone pruned by hand is fetched again, not used)."""
    marker = _read_json(directory / COMPLETE_MARKER)
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return None
    for name, entry in files.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != entry.get("size"):
            return None
    return marker


def _result_path(directory: Path, marker: dict) -> Path:
    single = marker.get("single_file")
    return directory / single if single else directory


def fetch_model_dir(url: str, what: str = "target", store: str = "targets") -> Path:
    """A verified local copy of the model at `url` (see the module doc), downloading it if this
    node has no copy of the current listing. Returns the directory (or, for a .gguf URL, the
    file). `what` names the artifact in messages; `store` is the cache subdirectory."""
    started = time.monotonic()
    fs, files = list_model(url, what)
    key = _listing_key(url, files)
    root = cache_dir(store)
    index_path = cache_dir(store, "sources") / f"{hashlib.sha256(url.rstrip('/').encode()).hexdigest()[:32]}.json"

    def cached() -> Path | None:
        entry = _read_json(index_path)
        if entry.get("key") != key or not entry.get("fingerprint"):
            return None
        directory = root / entry["fingerprint"]
        marker = _complete(directory)
        return _result_path(directory, marker) if marker else None

    hit = cached()
    if hit is not None:
        return hit
    with file_lock(root / f".{key}.lock"):
        hit = cached()
        if hit is not None:  # another process on this node finished it while we waited
            return hit
        total = sum(f.size for f in files)
        partial = root / f".partial-{key}"
        partial.mkdir(exist_ok=True)
        manifest = _read_json(partial / PARTIAL_MANIFEST)
        if manifest.get("url") != url.rstrip("/"):
            manifest = {"url": url.rstrip("/"), "files": {}}
        resumed = sum(e["size"] for e in manifest["files"].values())
        announce(f"downloading {what} {url}: {len(files)} files, {_size(total)}"
                 + (f" ({_size(resumed)} already here from an interrupted download)" if resumed else "")
                 + f", into {root} (once per node)")
        received = 0
        for f in files:
            received += _fetch_file(fs, f, partial, manifest, url)
        _drop_other_partials(root, url, key)
        hashes = {n: e["sha256"] for n, e in manifest["files"].items()}
        single = files[0].name if len(files) == 1 and files[0].name.lower().endswith(".gguf") else None
        counted = {f.name: (f.size, hashes[f.name]) for f in files if single or counts_for_fingerprint(f.name)}
        fingerprint = combine_file_hashes(counted)
        marker = {"url": url.rstrip("/"), "fingerprint": fingerprint, "key": key, "single_file": single,
                  "files": {f.name: {"size": f.size, "sha256": hashes[f.name], "version": f.version} for f in files},
                  "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (partial / PARTIAL_MANIFEST).unlink(missing_ok=True)
        write_text_atomically(partial / COMPLETE_MARKER, json.dumps(marker, indent=1, sort_keys=True))
        final = root / fingerprint
        if _complete(final):  # the same content, fetched earlier from another URL
            shutil.rmtree(partial, ignore_errors=True)
        else:
            if final.exists():
                shutil.rmtree(final)  # an incomplete leftover under the final name (not ours)
            os.rename(partial, final)  # the copy appears whole or not at all
            record_file_hashes(final, hashes)
        write_text_atomically(index_path, json.dumps({"url": url.rstrip("/"), "key": key,
                                                      "fingerprint": fingerprint}, sort_keys=True))
        announce(f"{what} {url}: {_size(received)} downloaded in {time.monotonic() - started:.1f} s; "
                 f"cached at {final}")
        return _result_path(final, marker)


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _fetch_file(fs, f: RemoteFile, partial: Path, manifest: dict, url: str) -> int:
    """Bring one file into `partial` (resuming a `.part`), check it, record it. Returns the bytes
    read from the store."""
    dest = partial / f.name
    done = manifest["files"].get(f.name)
    if done and done.get("size") == f.size and done.get("version") == f.version and dest.is_file() \
            and dest.stat().st_size == f.size:
        return 0
    part = partial / (f.name + PART_SUFFIX)
    sha256, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    offset = part.stat().st_size if part.is_file() else 0
    if offset > f.size:
        part.unlink()
        offset = 0
    if offset:  # resume: re-hash what an earlier attempt wrote
        with open(part, "rb") as existing:
            while chunk := existing.read(_CHUNK):
                sha256.update(chunk)
                md5.update(chunk)
    read = 0

    def copy_the_rest() -> None:
        """Append the bytes the `.part` lacks: a try after a transient failure continues where the
        last one stopped (every chunk hashed was written, and closing flushes it)."""
        nonlocal read
        with fs.open(f.path, "rb") as source, open(part, "ab") as out:
            if offset + read:
                source.seek(offset + read)
            while offset + read < f.size and (chunk := source.read(min(_CHUNK, f.size - offset - read))):
                sha256.update(chunk)
                md5.update(chunk)
                out.write(chunk)
                read += len(chunk)
            out.flush()
            os.fsync(out.fileno())

    try:
        io_retry.active().call("read artifact", f"{url.rstrip('/')}/{f.name}", copy_the_rest)
    except FileNotFoundError:
        raise TargetFetchError(f"{url}: {f.name} disappeared from the store while downloading; "
                               "fetch again once the upload is finished") from None
    except StorageError as exc:
        raise TargetFetchError(f"{url}: {f.name}: {exc}; the {offset + read} bytes received are kept in "
                               f"{part} and the next fetch continues from there") from exc
    got = part.stat().st_size
    if got != f.size:
        raise TargetFetchError(
            f"{url}: {f.name}: the store lists {f.size} bytes but the download ended after {got}; "
            f"the {got} bytes are kept in {part} and the next fetch continues from there")
    if f.md5 is not None and md5.hexdigest() != f.md5:
        part.unlink()
        raise TargetFetchError(
            f"{url}: {f.name}: the downloaded bytes have MD5 {md5.hexdigest()}, the store's checksum is "
            f"{f.md5}: the download is corrupt (removed; the next fetch downloads the file again)")
    os.replace(part, dest)
    manifest["files"][f.name] = {"size": f.size, "version": f.version, "sha256": sha256.hexdigest()}
    write_text_atomically(partial / PARTIAL_MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    return read


def _drop_other_partials(root: Path, url: str, key: str) -> None:
    """Partial downloads of an earlier listing of the same URL (the model was re-uploaded since)
    can never be finished: remove them, unless another process holds their lock."""
    for other in root.glob(".partial-*"):
        other_key = other.name.removeprefix(".partial-")
        if other_key == key or _read_json(other / PARTIAL_MANIFEST).get("url") != url.rstrip("/"):
            continue
        with contextlib.suppress(TimeoutError), file_lock(root / f".{other_key}.lock", timeout=0):
            log.info("removing %s: an interrupted download of an older version of %s", other, url)
            shutil.rmtree(other, ignore_errors=True)
