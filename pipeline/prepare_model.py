"""From "my model" to a tuned job config: `python -m jobs.prepare_model TARGET [key=value ...]`.

    python -m jobs.prepare_model default                                  # the embedded Gemma-3-270M
    python -m jobs.prepare_model s3://bucket/models/qwen3-8b corpus='s3://bucket/chats/*.jsonl'
    python -m jobs.prepare_model /models/qwen3-8b head.source=/models/qwen8b-dart   # an upstream DART head
    python -m jobs.prepare_model default skip=[head] redo=[bench]

Five steps, each recorded in `<output_dir>/prepare_state.json` with what it was run on and what it
found, so that a rerun skips every step whose inputs have not changed (an interrupted run goes on
where it stopped; the head's training resumes from its last checkpoint), `skip=[...]` leaves steps
out and `redo=[...]` runs them again:

1. check: the target loads (any spec `load_target` takes: a directory, a .gguf, an s3:// or gs://
   URL, fetched once per node), is a decoder the engine can drive, and decodes a few tokens;
2. trie: the N-gram trie of the corpus in the target's tokenizer (`dart_train.ngram_build`, the
   same build as `jobs.build_ngram`);
3. head: train a DART head on the corpus (`jobs.train_draft`), or import one (`head.source`: a head
   directory, a URL of one, or an upstream DART release, checked against the target), or none;
4. bench: decode the corpus' dev prompts with each mode at batch 1 (greedy: every mode must
   produce `ar`'s tokens), tokens per second and tau per mode;
5. config: the `model:` and `decoding:` block to paste into a pipeline config (also written to
   `<output_dir>/pipeline_model.yaml`), with the fastest mode the benchmark found.

Step times are printed at the end. docs/your_model.md walks through it.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf

from dart_worker.defaults import DEFAULT_DTYPE

STEPS = ("check", "trie", "head", "bench", "config")
STATE_NAME = "prepare_state.json"


@dataclass
class TrieStep:
    order: int = 3
    limit: int | None = None  # at most this many corpus conversations (null: all)
    min_count: int = 1


@dataclass
class HeadStep:
    # "train" (jobs.train_draft on the corpus), a head directory / URL / upstream DART release to
    # import, or "none" (the bench then runs the head-less modes only)
    source: str = "train"
    max_steps: int = 1000
    draft_length: int = 7
    draft_vocab_size: int = 16384  # capped at the target's vocabulary
    batch_size: int = 2
    overrides: list[str] = field(default_factory=list)  # further jobs.train_draft keys, key=value


@dataclass
class BenchStep:
    num_prompts: int = 8
    max_new_tokens: int = 64
    max_prompt_tokens: int = 512
    modes: list[str] = field(default_factory=lambda: ["ar", "lookup", "dart", "dart_lookup"])
    budget: int = 32


@dataclass
class PrepareConfig:
    target: str = MISSING
    output_dir: str | None = None  # default: outputs/prepare/<target's name>
    corpus: str = "default"  # conversations for the trie, the head and the bench prompts (any fsspec URL)
    dtype: str = DEFAULT_DTYPE
    device: str = "auto"
    threads: int | None = None
    skip: list[str] = field(default_factory=list)
    redo: list[str] = field(default_factory=list)
    trie: TrieStep = field(default_factory=TrieStep)
    head: HeadStep = field(default_factory=HeadStep)
    bench: BenchStep = field(default_factory=BenchStep)


class PrepareError(RuntimeError):
    """A step that cannot go on; the message names the step and what to change."""


def parse_config(argv: list[str] | None = None) -> PrepareConfig:
    """`TARGET [key=value ...]` (or target=... among the overrides) -> PrepareConfig."""
    from pipeline.settings.config import load_structured

    args = list(sys.argv[1:] if argv is None else argv)
    if args and "=" not in args[0]:
        args[0] = f"target={args[0]}"
    cfg = load_structured(PrepareConfig, None, args, PrepareError)
    for key in ("skip", "redo"):
        unknown = sorted(set(getattr(cfg, key)) - set(STEPS))
        if unknown:
            raise PrepareError(f"{key}: unknown step(s) {unknown}; the steps are {list(STEPS)}")
    if cfg.output_dir is None:
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", cfg.target.rstrip("/").rsplit("/", 1)[-1]).strip("-") or "target"
        cfg.output_dir = str(Path("outputs/prepare") / name)
    return cfg


class State:
    """prepare_state.json: per step, the inputs it ran on, its result and its seconds."""

    def __init__(self, output_dir: Path):
        self.path = output_dir / STATE_NAME
        self.steps: dict[str, Any] = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def done(self, step: str, inputs: dict) -> dict | None:
        entry = self.steps.get(step)
        return entry["result"] if entry and entry.get("inputs") == inputs else None

    def record(self, step: str, inputs: dict, result: dict, seconds: float) -> None:
        from dart_worker.artifacts.cache_dir import write_text_atomically

        self.steps[step] = {"inputs": inputs, "result": result, "seconds": round(seconds, 2)}
        write_text_atomically(self.path, json.dumps(self.steps, indent=1, sort_keys=True))


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------- steps


def step_check(cfg: PrepareConfig, ctx: dict) -> dict:
    """Load the target and decode a few tokens with the engine (`ar`)."""
    from dart_worker.artifacts.loading import target_family
    from dart_worker.engine_factory import EngineParts, build_engine
    from dart_worker.prompt_format import format_user_prompt
    from dart_worker.sampling.params import SamplingParams

    model, tokenizer, load_seconds = _target(cfg, ctx)
    prompt = tokenizer(format_user_prompt(tokenizer, "Write one sentence about the sea."))["input_ids"]
    started = time.perf_counter()
    result = build_engine(EngineParts.from_model(model, tokenizer), "ar").generate(
        [prompt], SamplingParams(temperature=0.0, max_new_tokens=16))[0]
    seconds = time.perf_counter() - started
    if not result.token_ids:
        raise PrepareError(f"check: target {cfg.target!r} generated no token for a plain prompt")
    text = model.config.get_text_config(decoder=True)
    return {"location": ctx["location"], "fingerprint": ctx["fingerprint"], "family": target_family(model),
            "layers": text.num_hidden_layers, "hidden_size": text.hidden_size, "vocab_size": text.vocab_size,
            "dtype": str(model.dtype).removeprefix("torch."), "device": str(model.device),
            "chat_template": bool(getattr(tokenizer, "chat_template", None)), "load_seconds": round(load_seconds, 2),
            "sample": tokenizer.decode(result.token_ids),
            # a first call: includes one-time costs (kernel warm-up, the CPU's deferred-logits timing)
            "first_decode_seconds": round(seconds, 2)}


def step_trie(cfg: PrepareConfig, ctx: dict) -> dict:
    """The corpus' N-gram trie in the target's tokenizer."""
    from dart_train.ngram_build import BuildNgramConfig, build_ngram

    output = ctx["out"] / "trie.ngram"
    sidecar = build_ngram(BuildNgramConfig(input=cfg.corpus, output=str(output), tokenizer=ctx["location"],
                                           order=cfg.trie.order, limit=cfg.trie.limit, min_count=cfg.trie.min_count,
                                           progress=False))
    return {"path": str(output.resolve()), "documents": sidecar["counts"]["documents"],
            "tokens": sidecar["counts"]["tokens"], "bytes": sidecar["trie_bytes"]}


def step_head(cfg: PrepareConfig, ctx: dict) -> dict:
    """Train a head with jobs.train_draft (resuming its checkpoints), or import one and check it."""
    source = cfg.head.source
    if source == "none":
        return {"path": None}
    if source != "train":
        from dart_worker.head.draft_checkpoint import load_draft_head, resolve_head_dir

        model, _, _ = _target(cfg, ctx)
        local = resolve_head_dir(source)
        head = load_draft_head(source, model.config, model.get_input_embeddings())  # refuses another target's
        return {"path": source, "local": str(local), "draft_length": head.config.draft_length,
                "draft_vocab_size": head.config.draft_vocab_size}
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(ctx["location"]).get_text_config(decoder=True).vocab_size
    export = ctx["out"] / "head"
    trie = ctx.get("trie", {}).get("path")
    summary = _train_head(cfg, ctx, [
        f"target={ctx['location']}", f"data.source={cfg.corpus}", f"output_dir={ctx['out'] / 'head_run'}",
        f"export_dir={export}", f"head.draft_length={cfg.head.draft_length}",
        f"head.draft_vocab_size={min(cfg.head.draft_vocab_size, vocab)}", f"trainer.max_steps={cfg.head.max_steps}",
        f"trainer.batch_size={cfg.head.batch_size}", f"trainer.device={cfg.device}",
        f"trainer.target_dtype={cfg.dtype}", f"eval.trie={trie}" if trie else "eval.trie=null",
        *([f"trainer.threads={cfg.threads}"] if cfg.threads else []), *cfg.head.overrides])
    final = summary.get("final_eval") or {}
    return {"path": str(export.resolve()), "steps": summary.get("steps"), "tokens_seen": summary.get("tokens_seen"),
            "dev": {k: v for k, v in final.items() if k in ("dev_loss", "dev_top1", "tau")}}


def _train_head(cfg: PrepareConfig, ctx: dict, args: list[str]) -> dict:
    """jobs.train_draft with these key=value args. The local backend trains on the target this job
    already holds (no second copy in memory); trainer.backend=ray runs as `jobs.train_draft` does,
    each Ray worker loading its own."""
    from omegaconf import OmegaConf

    from dart_train import trainer
    from dart_worker.hardware.device import resolve_device

    tcfg = trainer.parse_config(args)
    if tcfg.trainer.backend != "local":
        return trainer.train(tcfg).get("metrics") or {}
    Path(tcfg.output_dir).mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(tcfg), Path(tcfg.output_dir) / trainer.CONFIG_COPY_NAME)
    model, tokenizer, _ = _target(cfg, ctx)
    context = trainer.WorkerContext(device=resolve_device(tcfg.trainer.device))
    return trainer.train_loop(tcfg, context, model=model, tokenizer=tokenizer)


def step_bench(cfg: PrepareConfig, ctx: dict) -> dict:
    """Each mode over the corpus' dev prompts at batch 1; greedy, so every mode must equal `ar`."""
    from dart_train.corpus import first_user_prompts
    from dart_worker.drafters import drafter_spec
    from dart_worker.engine_factory import EngineParts, build_engine
    from dart_worker.prompt_format import format_user_prompt
    from dart_worker.sampling.params import SamplingParams
    from ngram_native import TreeParams

    model, tokenizer, _ = _target(cfg, ctx)
    b = cfg.bench
    head, trie = ctx.get("head", {}).get("path"), ctx.get("trie", {}).get("path")
    modes = [m for m in b.modes
             if (head or not drafter_spec(m).needs_head) and (trie or not drafter_spec(m).needs_trie)]
    if "ar" not in modes:
        modes.insert(0, "ar")
    prompts: list[list[int]] = []
    for split in ("dev", "train"):  # a small corpus may have no dev conversation: then training prompts
        candidates = first_user_prompts(b.num_prompts * 3, split=split, source=cfg.corpus,
                                        max_chars=8 * b.max_prompt_tokens)
        for p in candidates:
            ids = tokenizer(format_user_prompt(tokenizer, p.text))["input_ids"]
            if len(ids) <= b.max_prompt_tokens:
                prompts.append(ids)
            if len(prompts) == b.num_prompts:
                break
        if prompts:
            break
    if not prompts:
        raise PrepareError(f"bench: corpus {cfg.corpus!r} has no user prompt of at most {b.max_prompt_tokens} tokens")
    parts = EngineParts.from_model(model, tokenizer, head=head, trie=trie)
    params = SamplingParams(temperature=0.0, max_new_tokens=b.max_new_tokens)
    figures: dict[str, dict] = {}
    reference = None
    for mode in modes:
        engine = build_engine(parts, mode, TreeParams(budget=b.budget), sizing="auto")
        started = time.perf_counter()
        results = [engine.generate([p], params)[0] for p in prompts]
        seconds = time.perf_counter() - started
        tokens = [r.token_ids for r in results]
        reference = reference or tokens
        rounds = sum(len(r.stats.accept_lengths) for r in results)
        accepted = sum(sum(r.stats.accept_lengths) for r in results)
        produced = sum(len(t) for t in tokens)
        # tau as the rows report it (dart_worker/stats.py): tokens committed per verification round
        figures[mode] = {"tokens_per_s": round(produced / seconds, 2), "tau": round(1 + accepted / max(rounds, 1), 3),
                         "equals_ar": tokens == reference, "seconds": round(seconds, 2)}
        print(f"bench {mode:12s} {figures[mode]['tokens_per_s']:8.2f} tok/s  tau {figures[mode]['tau']:.2f}"
              f"  {'= ar' if figures[mode]['equals_ar'] else 'DIFFERS FROM ar'}", flush=True)
    lossless = {m: f for m, f in figures.items() if f["equals_ar"]}
    best = max(lossless, key=lambda m: lossless[m]["tokens_per_s"])
    return {"prompts": len(prompts), "max_new_tokens": b.max_new_tokens, "modes": figures, "best_mode": best,
            "speedup": round(figures[best]["tokens_per_s"] / figures["ar"]["tokens_per_s"], 3)}


def step_config(cfg: PrepareConfig, ctx: dict) -> dict:
    """The block to paste into a pipeline config, checked by the pipeline's own schema."""
    from pipeline.settings.config import PipelineConfig, validate

    head, trie = ctx.get("head", {}).get("path"), ctx.get("trie", {}).get("path")
    mode = ctx.get("bench", {}).get("best_mode") or ("dart_lookup" if head and trie else "lookup")
    block = {"model": {"target": cfg.target, "draft_head": head, "trie": trie, "dtype": cfg.dtype},
             "decoding": {"mode": mode, "sizing": "auto", "tree": {"budget": cfg.bench.budget}}}
    merged = OmegaConf.merge(OmegaConf.structured(PipelineConfig),
                             {**block, "input": {"urls": ["x.jsonl"]}, "output": {"url": "out"}})
    validate(OmegaConf.to_object(merged))  # a block the pipeline refuses is a bug here, not the user's
    text = OmegaConf.to_yaml(OmegaConf.create(block))
    (ctx["out"] / "pipeline_model.yaml").write_text(text)
    return {"yaml": text, "path": str((ctx["out"] / "pipeline_model.yaml").resolve())}


# ------------------------------------------------------------------------------------- driver


def _target(cfg: PrepareConfig, ctx: dict):
    """The target, loaded once per run of this job (the check, head import and bench share it)."""
    if "model" not in ctx:
        from dart_worker.artifacts.loading import load_target

        started = time.perf_counter()
        ctx["model"], ctx["tokenizer"] = load_target(ctx["location"], dtype=cfg.dtype, device=cfg.device)
        ctx["load_seconds"] = time.perf_counter() - started
    return ctx["model"], ctx["tokenizer"], ctx["load_seconds"]


def _inputs(step: str, cfg: PrepareConfig, ctx: dict) -> dict:
    """What a step's result depends on: when any of it changes, the step runs again."""
    base = {"target": ctx["fingerprint"]}
    if step == "check":
        return {**base, "dtype": cfg.dtype, "device": cfg.device}
    if step == "trie":
        return {**base, "corpus": cfg.corpus, "trie": OmegaConf.to_container(OmegaConf.structured(cfg.trie))}
    if step == "head":
        head = OmegaConf.to_container(OmegaConf.structured(cfg.head))
        return {**base, "corpus": cfg.corpus, "head": head, "trie": _digest(ctx.get("trie"))}
    if step == "bench":
        return {**base, "bench": OmegaConf.to_container(OmegaConf.structured(cfg.bench)), "dtype": cfg.dtype,
                "device": cfg.device, "head": _digest(ctx.get("head")), "trie": _digest(ctx.get("trie"))}
    return {**base, "spec": cfg.target, "head": ctx.get("head"), "trie": ctx.get("trie"),
            "bench": _digest(ctx.get("bench")), "dtype": cfg.dtype}


STEP_FUNCTIONS = {"check": step_check, "trie": step_trie, "head": step_head, "bench": step_bench,
                  "config": step_config}


def run(cfg: PrepareConfig) -> dict:
    """Run (or skip) every step in order; returns {step: {"status", "seconds", "result"}}."""
    from dart_worker.artifacts.loading import model_fingerprint, resolve_source
    from dart_worker.hardware.device import configure_cpu_threads

    if cfg.threads:
        configure_cpu_threads(cfg.threads)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = resolve_source(cfg.target)  # a URL is fetched here, once per node
    ctx: dict[str, Any] = {"out": out, "location": source.location, "fingerprint": model_fingerprint(source.location)}
    state = State(out)
    report: dict[str, dict] = {}
    for step in STEPS:
        inputs = _inputs(step, cfg, ctx)
        previous = state.done(step, inputs)
        if step in cfg.skip:
            report[step] = {"status": "skipped (skip=)", "seconds": 0.0, "result": previous}
            if previous is not None:
                ctx[step] = previous  # a skipped step's earlier result still feeds the later ones
            continue
        if previous is not None and step not in cfg.redo:
            report[step] = {"status": "done earlier", "seconds": state.steps[step]["seconds"], "result": previous}
            ctx[step] = previous
            continue
        print(f"[prepare] {step}: {STEP_FUNCTIONS[step].__doc__.splitlines()[0]}", flush=True)
        started = time.perf_counter()
        try:
            result = STEP_FUNCTIONS[step](cfg, ctx)
        except PrepareError:
            raise
        except (OSError, ValueError) as exc:
            raise PrepareError(f"{step}: {exc}") from exc
        seconds = time.perf_counter() - started
        state.record(step, inputs, result, seconds)
        ctx[step] = result
        report[step] = {"status": "ran", "seconds": round(seconds, 2), "result": result}
    return report


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
        report = run(cfg)
    except PrepareError as exc:
        print(f"prepare_model: {exc}", file=sys.stderr)
        return 2
    print("\nstep     status          seconds")
    for step, entry in report.items():
        print(f"{step:8s} {entry['status']:15s} {entry['seconds']:8.1f}")
    bench = (report.get("bench") or {}).get("result")
    if bench:
        print(f"\nfastest lossless mode on {bench['prompts']} prompts: {bench['best_mode']} "
              f"({bench['speedup']:.2f}x ar at batch 1)")
    config = (report.get("config") or {}).get("result")
    if config:
        print(f"\npaste into your pipeline config (also in {config['path']}):\n\n{config['yaml']}")
    return 0
