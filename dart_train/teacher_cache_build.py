"""Building a teacher cache: the library behind
`python -m jobs.build_teacher_cache config.yaml data.teacher_cache=<url> [key=value ...]`.

    python -m jobs.build_teacher_cache configs/train_default_head.yaml data.teacher_cache=/data/tc \
        cache.max_examples=4000
    python -m jobs.build_teacher_cache my.yaml data.teacher_cache=s3://bucket/tc/llama-8b cache.top_k=128

The config is the training config (dart_train.trainer.TrainConfig, the same file training runs
with), so the cache holds exactly the examples training would see: the data section decides the
examples and their order (epoch 0 of the training stream), the head section the draft
vocabulary (counted exactly as training counts it, or `head.init_from`'s), `target` and
`trainer.target_dtype`/`trainer.device` the teacher, and the `cache` section the format
(top_k, tap_dtype, shard_tokens, max_examples). Training then reads it with the same config:
`python -m jobs.train_draft my.yaml data.teacher_cache=<url>`.

The target runs once per example; each shard (about `cache.shard_tokens` tokens) is written
atomically and then listed in the manifest, so memory stays bounded by one shard and a killed
build, run again with the same command, resumes after its last listed shard and produces the
same files as an uninterrupted one. Format: dart_train/teacher_cache.py and docs/training.md.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from dart_train.corpus import Conversation
from dart_train.draft_training import TeacherPass, top_k_teacher
from dart_train.teacher_cache import (
    FORMAT,
    TAP_DTYPES,
    CachedExample,
    cache_fingerprint,
    check_fingerprint,
    encode_shard,
    join,
    read_manifest,
    remove_unlisted,
    shard_name,
    write_atomically,
    write_manifest,
)
from dart_train.trainer import (
    Example,
    ExampleStream,
    TrainConfig,
    build_draft_vocab,
    collate,
    head_vocab,
    make_head,
)
from dart_worker.hardware.device import resolve_device, resolve_dtype

_DATA_KEYS = ("source", "source_weights", "format", "text_field", "id_field", "dev_fraction", "max_prompt_tokens",
              "max_seq_len", "shuffle_buffer")


def build_settings(cfg: TrainConfig, tap_dtype: torch.dtype, target_dtype: torch.dtype, top_k: int) -> dict:
    """Everything besides the fingerprint that decides a cache's bytes (a resumed build must match it)."""
    return {"data": {k: getattr(cfg.data, k) for k in _DATA_KEYS}, "seed": cfg.trainer.seed, "top_k": top_k,
            "tap_dtype": str(tap_dtype).removeprefix("torch."),
            "target_dtype": str(target_dtype).removeprefix("torch."),
            "shard_tokens": cfg.cache.shard_tokens, "max_examples": cfg.cache.max_examples,
            "batch_size": cfg.cache.batch_size}


def draft_vocabulary(cfg: TrainConfig, model, tokenizer, device,
                     conversations: Callable[[int], Iterator[Conversation]] | None) -> tuple[torch.Tensor, dict]:
    """The draft vocabulary a fresh training run of `cfg` would use (train_loop's own choice)."""
    if cfg.head.init_from:
        head = make_head(cfg, model, torch.empty(0, dtype=torch.long), device)
        kept = head_vocab(head)
        return kept, {"draft_vocab_size": len(kept), "from": str(cfg.head.init_from)}
    vocab_size = model.config.get_text_config(decoder=True).vocab_size
    first = None
    if conversations is not None:
        first = (c for _, c in zip(range(cfg.head.vocab_conversations), conversations(0)))
    return build_draft_vocab(cfg, tokenizer, vocab_size, first)


def build_teacher_cache(cfg: TrainConfig, model=None, tokenizer=None,
                        conversations: Callable[[int], Iterator[Conversation]] | None = None,
                        target_fingerprint: str | None = None, progress: bool = True,
                        stop_after_shards: int | None = None) -> dict:
    """Build (or finish) the cache at cfg.data.teacher_cache; returns its manifest (+ `last_run`:
    tokens, seconds and tokens/s of this call's target forwards and writes, when it built any).

    `model`/`tokenizer` may be given (already loaded); `target_fingerprint` defaults to the files
    behind `cfg.target`. `stop_after_shards` stops after writing that many new shards (tests).
    """
    from dart_worker.artifacts.fingerprint import tokenizer_fingerprint
    from dart_worker.artifacts.loading import load_target, model_fingerprint

    url = cfg.data.teacher_cache
    if not url:
        raise ValueError("set data.teacher_cache=<url> (a local directory or any fsspec URL) to build a cache")
    device = resolve_device(cfg.trainer.device)
    if model is None:
        model, tokenizer = load_target(cfg.target, dtype=resolve_dtype(cfg.trainer.target_dtype, device),
                                       device=device)
    model.requires_grad_(False)
    device = next(model.parameters()).device
    target_dtype = next(model.parameters()).dtype
    tap_dtype = target_dtype if cfg.cache.tap_dtype == "model" else TAP_DTYPES.get(cfg.cache.tap_dtype)
    if tap_dtype is None:
        raise ValueError(f"cache.tap_dtype must be one of {[*TAP_DTYPES, 'model']}, got {cfg.cache.tap_dtype!r}")

    kept, vocab_info = draft_vocabulary(cfg, model, tokenizer, device, conversations)
    top_k = min(cfg.cache.top_k, len(kept))
    teacher = TeacherPass(model, kept)
    fingerprint = cache_fingerprint(target_fingerprint or model_fingerprint(cfg.target),
                                    tokenizer_fingerprint(tokenizer), teacher.tap_layers, kept)
    settings = build_settings(cfg, tap_dtype, target_dtype, top_k)

    manifest = read_manifest(url)
    if manifest is not None:
        check_fingerprint(url, {**manifest["fingerprint"], "build": manifest["build"]},
                          {**fingerprint, "build": settings}, fields=(*fingerprint, "build"), what="this build")
        if manifest.get("complete"):
            print(f"teacher cache {url} is complete: {manifest['examples']} examples, {manifest['tokens']} tokens",
                  flush=True)
            return manifest
        removed = remove_unlisted(url, {s["name"] for s in manifest["shards"]})
        print(f"resuming {url} after {len(manifest['shards'])} complete shards"
              + (f" (removed incomplete files {removed})" if removed else ""), flush=True)
    else:
        remove_unlisted(url, set())
        manifest = {"format": FORMAT, "fingerprint": fingerprint, "build": settings,
                    "draft_vocab": kept.tolist(), "vocab_info": vocab_info, "shards": [], "complete": False}
        write_manifest(url, manifest)

    shards = manifest["shards"]
    examples_done = sum(s["examples"] for s in shards)
    position = shards[-1]["end_position"] if shards else 0
    stream = ExampleStream(cfg.data, tokenizer, cfg.trainer.seed, position=position, conversations=conversations)
    limit = cfg.cache.max_examples

    def next_batch() -> list[Example]:
        batch: list[Example] = []
        while len(batch) < cfg.cache.batch_size and (limit is None or examples_done + len(batch) < limit):
            example = stream.next_example()
            if stream.epoch > 0:  # one pass over the split: the next epoch's first example is not ours
                return [*batch, None]
            batch.append(example)
        return batch

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=None, unit="tok", unit_scale=True, desc=f"teacher cache {url}", dynamic_ncols=True)
    started, new_tokens, new_shards = time.perf_counter(), 0, 0
    pending: list[CachedExample] = []
    pending_sources: dict[str, dict[str, int]] = {}
    finished = False
    while not finished:
        batch = next_batch()
        if batch and batch[-1] is None:
            batch, finished = batch[:-1], True
        if not batch:
            finished = True
        else:
            padded = collate(batch)
            out = teacher(padded.input_ids.to(device))
            for b, example in enumerate(batch):
                n = len(example.ids)
                top = top_k_teacher(out.logits[b, :n], top_k)
                pending.append(CachedExample(example.ids, example.prompt_len, out.taps[b, :n].to(tap_dtype).cpu(),
                                             top.ids.cpu(), top.logprobs.cpu(), top.rest.cpu()))
                _count_source(pending_sources, example)
            examples_done += len(batch)
            new_tokens += padded.num_tokens
            if bar is not None:
                bar.update(padded.num_tokens)
                bar.set_postfix(examples=examples_done, shards=len(shards))
            if limit is not None and examples_done >= limit:
                finished = True
        # A shard closes at a batch boundary, so a resumed build forms the same batches (same
        # padding, same numerics) as an uninterrupted one.
        if pending and (finished or sum(len(e.ids) for e in pending) >= cfg.cache.shard_tokens):
            _write_shard(url, manifest, pending, pending_sources, len(kept), stream.position if not finished or
                         stream.epoch == 0 else None)
            pending, pending_sources = [], {}
            new_shards += 1
            if stop_after_shards is not None and new_shards >= stop_after_shards and not finished:
                if bar is not None:
                    bar.close()
                return manifest
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - started
    tokens = sum(s["tokens"] for s in shards)
    manifest.update(complete=True, examples=sum(s["examples"] for s in shards), tokens=tokens,
                    bytes=sum(s["bytes"] for s in shards),
                    mean_rest_mass=sum(s["rest_mass_sum"] for s in shards) / max(tokens, 1),
                    skipped_examples=stream.skipped, sources=_sum_sources(s["sources"] for s in shards))
    write_manifest(url, manifest)  # deterministic: a resumed build writes the same bytes
    print(f"teacher cache {url}: {manifest['examples']} examples, {tokens} tokens, {len(shards)} shards, "
          f"{manifest['bytes'] / max(tokens, 1):.0f} bytes/token, mean remaining mass outside the top {top_k}: "
          f"{manifest['mean_rest_mass']:.4f}; by source {json.dumps(manifest['sources'])}; "
          f"this run {new_tokens} tokens in {elapsed:.1f} s ({new_tokens / max(elapsed, 1e-9):.0f} tokens/s)",
          flush=True)
    return {**manifest, "last_run": {"tokens": new_tokens, "seconds": elapsed,
                                     "tokens_per_s": new_tokens / max(elapsed, 1e-9)}}


def _count_source(counts: dict[str, dict[str, int]], example: Example) -> None:
    """What one example adds to its source's tally: examples, tokens, and the tokens after the
    prompt (where the loss is, by default), so a mixture's shares can be reported."""
    entry = counts.setdefault(example.origin, {"examples": 0, "tokens": 0, "reply_tokens": 0})
    entry["examples"] += 1
    entry["tokens"] += len(example.ids)
    entry["reply_tokens"] += len(example.ids) - example.prompt_len


def _sum_sources(per_shard: Iterable[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    total: dict[str, dict[str, int]] = {}
    for counts in per_shard:
        for origin, entry in counts.items():
            into = total.setdefault(origin, dict.fromkeys(entry, 0))
            for key, value in entry.items():
                into[key] += value
    return dict(sorted(total.items()))


def _write_shard(url: str, manifest: dict, examples: list[CachedExample], sources: dict[str, dict[str, int]],
                 draft_vocab_size: int, end_position: Any) -> None:
    """Write one shard atomically, then list it in the manifest (also written atomically)."""
    index = len(manifest["shards"])
    name = shard_name(index)
    data = encode_shard(examples, draft_vocab_size)
    write_atomically(join(url, name), data)
    manifest["shards"].append({
        "name": name, "examples": len(examples), "tokens": sum(len(e.ids) for e in examples), "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(), "end_position": end_position,
        "rest_mass_sum": float(sum(float(e.rest_mass.double().sum()) for e in examples)),
        "sources": dict(sorted(sources.items())),
    })
    write_manifest(url, manifest)
