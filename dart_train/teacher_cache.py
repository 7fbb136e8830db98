"""The teacher cache: the frozen target's taps and top-k teacher over the training examples, on disk.

Built once by `python -m jobs.build_teacher_cache` (dart_train/teacher_cache_build.py), streamed by
the training loop (`python -m jobs.train_draft`, dart_train/trainer.py) with `data.teacher_cache=<url>`
for as many epochs as wanted without running the target. The format is documented in
docs/training.md ("Teacher cache"); in short:

    <url>/manifest.json          format, fingerprint, build settings, the complete shards in order
    <url>/shard-000000.safetensors ...

A shard is one safetensors file (no pickle; bf16 supported) holding a run of whole examples:

    input_ids     int32  [T]          the examples' token ids, concatenated
    offsets       int64  [N+1]        example i is tokens offsets[i]:offsets[i+1]
    prompt_lens   int32  [N]          tokens before the first generated one (as Example.prompt_len)
    taps          tap_dtype [T, 3*H]  the target's hidden states at the inputs of the tap layers
    top_ids       int16|int32 [T, k]  the teacher's k most probable draft ids, most probable first
    top_logprobs  float32 [T, k]      their log-probabilities over the draft vocabulary
    rest_mass     float32 [T]         the teacher's probability of the other Vd - k draft ids

Writes are atomic (`write_atomically`: a temporary name + rename locally, one single upload on
object stores, where an object appears whole or not at all). The manifest lists only shards
that were complete before it was written, so a build that was killed resumes after its last
listed shard; files not listed are ignored and overwritten.

This module is the format only: it does not import the training loop (which imports it).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import posixpath
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from dart_train.draft_training import TopKTeacher
from dart_worker.artifacts.url_filesystem import StorageError, describe_error, filesystem_for, is_local

FORMAT = "dart-batch/teacher-cache/v1"
MANIFEST_NAME = "manifest.json"
TAP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# What must agree between a cache and a training run (or a resumed build), in this order.
FINGERPRINT_FIELDS = ("target", "tokenizer", "tap_layers", "draft_vocab")


@dataclass
class CacheConfig:
    """How `jobs.build_teacher_cache` writes the cache at `data.teacher_cache`."""

    top_k: int = 64  # teacher ids kept per token (+ the remaining mass); >= draft_vocab_size = exact
    # Taps are stored in bf16 by default: with a bf16 target (the default on bf16 CPUs/GPUs) that
    # is lossless, the head's fc runs under bf16 autocast anyway, and bf16 keeps fp32's range
    # (fp16 overflows on attention-sink states: Gemma-3's BOS taps reach ~1e4-1e5). "model" keeps
    # the target's dtype (exact for fp32 targets, twice the size).
    tap_dtype: str = "bf16"  # bf16 | fp16 | fp32 | model
    shard_tokens: int = 16384  # a shard is closed once it holds this many tokens (bounds memory)
    max_examples: int | None = None  # null: one whole pass over the training split
    batch_size: int = 8  # sequences per target forward while building


# ----------------------------------------------------------------------------- fingerprint


def vocab_digest(kept_target_ids: torch.Tensor) -> str:
    ids = torch.as_tensor(kept_target_ids, dtype=torch.int64).contiguous()
    return f"{ids.numel()}:" + hashlib.sha256(ids.numpy().tobytes()).hexdigest()


def cache_fingerprint(target_fingerprint: str, tokenizer_fingerprint: str, tap_layers, kept) -> dict:
    """The identity of what a cache holds: target files, tokenizer, tap layers, draft vocabulary."""
    return {"target": target_fingerprint, "tokenizer": tokenizer_fingerprint,
            "tap_layers": [int(t) for t in tap_layers], "draft_vocab": vocab_digest(kept)}


class TeacherCacheMismatch(ValueError):
    """A cache was built for another target, tokenizer, tap layers, draft vocabulary or settings."""


def check_fingerprint(url: str, cached: dict, expected: dict, fields=FINGERPRINT_FIELDS,
                      what: str = "this run") -> None:
    """Raise TeacherCacheMismatch naming every field where `cached` and `expected` differ."""
    differing = [f for f in fields if cached.get(f) != expected.get(f)]
    if differing:
        details = "; ".join(f"{f}: cache has {_short(cached.get(f))}, {what} has {_short(expected.get(f))}"
                            for f in differing)
        raise TeacherCacheMismatch(
            f"teacher cache {url} was built for a different {', '.join(differing)} ({details}); rebuild it with "
            "`python -m jobs.build_teacher_cache <config> data.teacher_cache=<new url>` or use the matching "
            "target/tokenizer/head")


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


# ----------------------------------------------------------------------------- storage


def join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def write_atomically(url: str, data: bytes) -> None:
    """Write `data` at `url` so that readers see the old object or the whole new one, never a part.

    Locally: a hidden temporary file in the same directory, then rename. Object stores (s3://,
    gs://, ...): one single put, which creates the object atomically.
    """
    fs, path = filesystem_for(url)
    try:
        if is_local(fs):
            parent, name = posixpath.split(path)
            fs.makedirs(parent, exist_ok=True)
            tmp = posixpath.join(parent, f".tmp-{name}")
            with fs.open(tmp, "wb") as f:
                f.write(data)
            fs.mv(tmp, path)
        else:
            fs.pipe_file(path, data)
    except Exception as e:
        raise StorageError(describe_error("write", url, e)) from e


def read_bytes(url: str) -> bytes | None:
    """The bytes at `url`, None when it does not exist."""
    fs, path = filesystem_for(url)
    try:
        fs.invalidate_cache()
        if not fs.exists(path):
            return None
        return fs.cat_file(path)
    except Exception as e:
        raise StorageError(describe_error("read", url, e)) from e


def remove_unlisted(url: str, listed: set[str]) -> list[str]:
    """Delete shard files and temporary files under `url` that the manifest does not list."""
    fs, path = filesystem_for(url)
    removed = []
    try:
        fs.invalidate_cache()
        if not fs.exists(path):
            return []
        for entry in fs.ls(path, detail=False):
            name = posixpath.basename(entry.rstrip("/"))
            stale_shard = name.startswith("shard-") and name not in listed
            if stale_shard or name.startswith(".tmp-"):
                fs.rm(entry)
                removed.append(name)
    except Exception as e:
        raise StorageError(describe_error("clean", url, e)) from e
    return removed


def read_manifest(url: str) -> dict | None:
    data = read_bytes(join(url, MANIFEST_NAME))
    if data is None:
        return None
    manifest = json.loads(data)
    if manifest.get("format") != FORMAT:
        raise TeacherCacheMismatch(f"teacher cache {url}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def write_manifest(url: str, manifest: dict) -> None:
    write_atomically(join(url, MANIFEST_NAME), json.dumps(manifest, indent=1, sort_keys=True).encode())


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.safetensors"


# ------------------------------------------------------------------------------- shards


@dataclass
class CachedExample:
    """One training example with its teacher: what `jobs.train_draft` needs, without the target."""

    ids: list[int]
    prompt_len: int
    taps: torch.Tensor  # [L, 3H] tap dtype
    top_ids: torch.Tensor  # [L, k]
    top_logprobs: torch.Tensor  # [L, k] float32
    rest_mass: torch.Tensor  # [L] float32


def encode_shard(examples: list[CachedExample], draft_vocab_size: int) -> bytes:
    lengths = [len(e.ids) for e in examples]
    offsets = torch.zeros(len(examples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    id_dtype = torch.int16 if draft_vocab_size <= 32767 else torch.int32
    tensors = {
        "input_ids": torch.tensor([t for e in examples for t in e.ids], dtype=torch.int32),
        "offsets": offsets,
        "prompt_lens": torch.tensor([e.prompt_len for e in examples], dtype=torch.int32),
        "taps": torch.cat([e.taps for e in examples]).contiguous(),
        "top_ids": torch.cat([e.top_ids for e in examples]).to(id_dtype).contiguous(),
        "top_logprobs": torch.cat([e.top_logprobs for e in examples]).float().contiguous(),
        "rest_mass": torch.cat([e.rest_mass for e in examples]).float().contiguous(),
    }
    # One metadata key only: safetensors does not keep the order of several, and a resumed build
    # must write the same bytes as an uninterrupted one.
    return save_safetensors(tensors, metadata={"format": FORMAT})


def decode_shard(data: bytes) -> list[CachedExample]:
    t = load_safetensors(data)
    offsets = t["offsets"].tolist()
    ids = t["input_ids"].tolist()
    out = []
    for i, (a, b) in enumerate(itertools.pairwise(offsets)):
        out.append(CachedExample(ids[a:b], int(t["prompt_lens"][i]), t["taps"][a:b], t["top_ids"][a:b],
                                 t["top_logprobs"][a:b], t["rest_mass"][a:b]))
    return out


def collate_teacher(examples: list[CachedExample], width: int) -> tuple[torch.Tensor, TopKTeacher]:
    """Right-padded taps [B, width, 3H] and TopKTeacher [B, width, k] (padding: zeros, never in the loss)."""
    first = examples[0]
    taps = torch.zeros(len(examples), width, first.taps.shape[-1], dtype=first.taps.dtype)
    k = first.top_ids.shape[-1]
    ids = torch.zeros(len(examples), width, k, dtype=torch.long)
    logp = torch.zeros(len(examples), width, k, dtype=torch.float32)
    rest = torch.zeros(len(examples), width, dtype=torch.float32)
    for b, e in enumerate(examples):
        n = len(e.ids)
        taps[b, :n], ids[b, :n], logp[b, :n], rest[b, :n] = e.taps, e.top_ids.long(), e.top_logprobs, e.rest_mass
    return taps, TopKTeacher(ids, logp, rest)


# ------------------------------------------------------------------------------ reading


class TeacherCache:
    """An opened, complete cache: its manifest and shard reads."""

    def __init__(self, url: str) -> None:
        self.url = url
        manifest = read_manifest(url)
        if manifest is None:
            raise StorageError(f"teacher cache {url}: no {MANIFEST_NAME} (build it with python -m "
                               "jobs.build_teacher_cache <config> data.teacher_cache=<url>)")
        if not manifest.get("complete"):
            raise StorageError(f"teacher cache {url} is incomplete ({len(manifest['shards'])} shards written): "
                               "rerun the build to finish it (it resumes after the last complete shard)")
        if not manifest["shards"]:
            raise StorageError(f"teacher cache {url} holds no examples")
        self.manifest = manifest

    @property
    def fingerprint(self) -> dict:
        return self.manifest["fingerprint"]

    @property
    def kept_target_ids(self) -> torch.Tensor:
        return torch.tensor(self.manifest["draft_vocab"], dtype=torch.long)

    @property
    def shards(self) -> list[dict]:
        return self.manifest["shards"]

    def read_shard(self, index: int) -> list[CachedExample]:
        name = self.shards[index]["name"]
        data = read_bytes(join(self.url, name))
        if data is None:
            raise StorageError(f"teacher cache {self.url}: shard {name} listed in the manifest is missing")
        if hashlib.sha256(data).hexdigest() != self.shards[index]["sha256"]:
            raise StorageError(f"teacher cache {self.url}: shard {name} does not match its checksum")
        return decode_shard(data)

    def check(self, expected: dict) -> None:
        check_fingerprint(self.url, self.fingerprint, expected)


class CachedExampleStream:
    """Cached examples of one data-parallel rank, resumable from (epoch, position); endless.

    Epoch 0 reads the shards and their examples in build order, which is the training stream's
    own (seeded, shuffled) epoch-0 order, so one epoch from the cache sees the examples that
    one epoch of live training would. Later epochs permute the shard order and the examples
    inside each shard (seeded by seed and epoch). Rank r of W reads the shards at positions
    r, r+W, ... of the epoch's shard order; `position` counts examples this rank consumed in the
    epoch, so resuming skips whole shards by their listed counts without reading them.
    """

    def __init__(self, cache: TeacherCache, seed: int, rank: int = 0, world_size: int = 1,
                 epoch: int = 0, position: int = 0) -> None:
        if len(cache.shards) < world_size:
            raise ValueError(f"teacher cache {cache.url} has {len(cache.shards)} shards for {world_size} "
                             "data-parallel workers: each worker reads whole shards; rebuild with a smaller "
                             "cache.shard_tokens or use fewer workers")
        self.cache, self.seed, self.rank, self.world_size = cache, seed, rank, world_size
        self.epoch, self.position = epoch, position
        self.skipped = 0
        self._iter: Iterator[CachedExample] | None = None

    def _shard_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.cache.shards)))
        if epoch > 0:
            random.Random(f"{self.seed}/cache/{epoch}").shuffle(order)
        return order[self.rank :: self.world_size]

    def _examples(self, epoch: int, skip: int) -> Iterator[CachedExample]:
        for shard in self._shard_order(epoch):
            count = self.cache.shards[shard]["examples"]
            if skip >= count:
                skip -= count
                continue
            examples = self.cache.read_shard(shard)
            order = list(range(len(examples)))
            if epoch > 0:
                random.Random(f"{self.seed}/cache/{epoch}/{shard}").shuffle(order)
            for i in order[skip:]:
                yield examples[i]
            skip = 0

    def next_example(self) -> CachedExample:
        if self._iter is None:
            self._iter = self._examples(self.epoch, self.position)
        example = next(self._iter, None)
        if example is None:
            self.epoch, self.position = self.epoch + 1, 0
            self._iter = self._examples(self.epoch, 0)
            example = next(self._iter)
        self.position += 1
        return example
