"""The pipeline's configuration: a typed schema, loaded from YAML plus dotlist overrides.

    python -m pipeline.run configs/local.yaml decoding.mode=ar resources.num_workers=2

OmegaConf merges the YAML and the overrides onto the structured schema below, which already
rejects unknown keys and wrong types; `validate` then checks values and cross-field rules. All
of it happens on the driver before any Ray work starts, and every problem comes back as one
`ConfigError` naming the key. Credentials never appear here: object-storage endpoints and
keys come from the environment or the standard credential chain. Every key, its default and what
it does: docs/config.md (tests/test_defaults.py holds it to this schema).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dart_worker.defaults import DEFAULT_DTYPE, DEFAULT_MODE
from dart_worker.drafters import SIZING_MODES, drafter_names, drafter_spec
from dart_worker.sampling.structured_output import StructuredOutputError, check_syntax, parse_structured_output
from ngram_native.builders import InvalidTreeParams, TreeParams
from pipeline.settings.row_settings import MAX_SAMPLES, SETTING_NAMES, default_settings_columns

T = TypeVar("T")

FORMATS = ("jsonl", "parquet", "openai_batch")  # openai_batch: Batch API request lines (pipeline/data/openai_batch.py)
# What a run does when output.url already holds rows (pipeline/startup/output_modes.py).
IF_EXISTS = ("error", "resume", "beside", "replace")


class ConfigError(ValueError):
    """A configuration problem found before any work starts."""


@dataclass
class InputConfig:
    urls: list[str] = MISSING  # fsspec URLs, paths or globs (s3://bucket/prompts/*.jsonl)
    format: str = "jsonl"  # jsonl | parquet | openai_batch
    id_column: str = "id"
    prompt_column: str | None = "prompt"  # plain user message text ...
    messages_column: str | None = None  # ... or a list of {role, content} chat messages
    apply_chat_template: bool = True  # the target's chat template; plain "User:/Assistant:" if it has none
    max_prompt_chars: int = 32_000  # longer prompts become error rows
    # false: special-token strings in a row's text (<eos>, <start_of_turn>, ...) are tokenized as
    # text, only the chat template's own markers are control tokens; true: they are parsed as
    # control tokens too, for prompts already formatted for the target (dart_worker/prompt_format.py)
    parse_special_tokens: bool = False
    # Per-row settings (pipeline/settings/row_settings.py): setting -> the input column holding it, read when
    # the input has that column (a null value there: the decoding.* value). Null ignores a setting.
    settings_columns: dict[str, str | None] = field(default_factory=default_settings_columns)


@dataclass
class ModelConfig:
    target: str = "default"  # "default" (embedded Gemma-3-270M), a local HF dir, a .gguf file, a URL of
    # either (s3://, gs://: downloaded once per node, dart_worker/artifacts/target_store.py) or a hub id
    # "default" (shipped head), a checkpoint dir, a URL of one, an upstream DART release dir (mapped once:
    # dart_worker/head/draft_checkpoint.py), or null (mode ar)
    draft_head: str | None = "default"
    trie: str | None = "default"  # "default" (built from ShareGPT on first use), a URL, or null
    dtype: str = DEFAULT_DTYPE  # auto | bf16 | fp16 | fp32 (auto: bf16 where the device computes it natively)
    # auto | cpu | cuda | cuda:N. Workers follow their Ray reservation: auto is CUDA when
    # resources.num_gpus_per_worker > 0 and the CPU otherwise; a worker holding GPUs that torch
    # cannot use stops the job at start-up (pipeline/cluster/device_check.py), never falls back to the CPU.
    device: str = "auto"
    tap_layers: list[int] | None = None  # default: inputs of layers 2, L//2, L-3


@dataclass
class DecodingConfig:
    # A registered drafter: any name in dart_worker.drafters.drafter_names() (docs/config.md lists the
    # built-ins, checked against the registry by tests/test_defaults.py).
    mode: str = DEFAULT_MODE
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    # vLLM's meanings, applied to every draft-tree node by its own path, so verification stays
    # lossless (dart_worker.sampling.params.apply_penalties): min_p keeps tokens at least min_p times as
    # likely as the most likely one (0 = off); repetition_penalty divides (positive) or multiplies
    # (negative) the logits of tokens seen in the prompt or output (1 = off); presence_penalty and
    # frequency_penalty subtract from tokens in the output, once / per occurrence (0 = off).
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # > 0: write each generated token's log-probability and the top-k alternatives (output columns
    # logprobs, top_logprob_ids, top_logprobs; docs/output_schema.md), from the verify forward.
    logprobs: int = 0
    # > 0: each prompt token's log-probability under the target and the top-k alternatives (output
    # columns prompt_logprobs, prompt_top_logprob_ids, prompt_top_logprobs), from the prefill: the
    # prompt's rows go through the LM head only when asked (about one verify row's projection each).
    prompt_logprobs: int = 0
    seed: int = 0  # per-row seeds derive from (seed, row key): reproducible whatever the batching
    # Completions per prompt (the row's `n` setting overrides it). They share one prefill (the prompt's
    # KV cache rows are copied) and each has its own seed, from (seed, row key, sample index); output
    # rows are keyed by (row, sample_index). n > 1 needs temperature > 0 (greedy samples are copies).
    n: int = 1
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the target's EOS ids
    stop: list[str] = field(default_factory=list)  # stop strings: the text ends before the first one
    # The shape every output must have (a row's `structured_output` setting overrides it): null = free
    # text, or a mapping with exactly one of vLLM's keys: json (a JSON schema, a mapping or its JSON
    # text), json_object: true, regex, choice (a list of strings), grammar (EBNF). Lossless under every
    # mode; forbidden drafts are cut and forced text is drafted (dart_worker/sampling/grammar.py, docs/usage.md).
    structured_output: Any = None
    # How draft trees are built (budget = nodes per round, top_k, beam_width, the DART weights,
    # max_depth): ngram_native.trees.TreeParams, handed as is to the drafter.
    tree: TreeParams = field(default_factory=TreeParams)
    # "auto": a measured cost model cuts every round's trees to the size that maximises expected
    # tokens per second (0 included: a plain step), up to tree.budget nodes, and pauses the draft
    # head while it does not pay (dart_worker/sizing/); "fixed": every tree as built.
    sizing: str = "auto"
    # An earlier run's output URL (same target): its generated rows warm every worker's job-level
    # drafting state (the job cache and the job n-gram, decoding.tree) before the first row, so a
    # nightly job drafts from last night's outputs from its first row; the first `warm_rows` rows.
    warm_from: str | None = None
    warm_rows: int = 4096
    # Which job-level state they warm: the job n-gram only (default), or the job cache too. Measured
    # on ShareGPT-like prompts, a job cache warmed with other prompts' outputs displaced the head's
    # nodes and made dart_lookup slower (docs/ngram.md); templated jobs may gain from it.
    warm_job_cache: bool = False


@dataclass
class ResourcesConfig:
    num_workers: int = 1  # fixed actor pool size ...
    min_workers: int | None = None  # ... or an autoscaling range (both set)
    max_workers: int | None = None
    num_cpus_per_worker: float = 1.0  # Ray's CPU reservation per worker actor
    # torch threads per worker on CPU (null: the reservation, rounded down). May exceed the
    # reservation: the reading and writing stages need CPU slots too, and leaving them one
    # while the engine's threads use every core keeps a small machine from deadlocking.
    torch_threads: int | None = None
    num_gpus_per_worker: float = 0.0  # > 0 puts one engine per GPU share (and model.device auto on CUDA)
    batch_size: int = 4  # rows handed to one engine per call (Ray Data's map_batches batch)
    # sequences decoding together inside the engine (null: batch_size, a static batch). Below
    # batch_size the engine batches continuously: a finished row's slot is refilled from the
    # rest of the batch at once, so slots do not idle while the longest row ends.
    max_live: int | None = None

    @property
    def live_rows(self) -> int:
        """Sequences one engine decodes together: max_live, else batch_size (a static batch)."""
        return self.max_live or self.batch_size


@dataclass
class OutputConfig:
    url: str = MISSING  # directory URL for Parquet parts and the job summary
    rows_per_file: int = 256
    include_token_ids: bool = True
    # Also write each row as chat messages ready for SFT: the input's messages (or its text prompt as
    # a user message) plus the assistant's reply, in the `messages` column (docs/output_schema.md).
    messages: bool = False
    # When url already holds parts: error (stop at start-up, saying what is there), resume (the same
    # as run.resume: true), beside (write this run to <url>-<run id>), replace (write it aside and
    # replace the old rows once it has finished). pipeline/startup/output_modes.py
    if_exists: str = "error"
    # Also write the OpenAI Batch API's output file, <url>/_openai_batch_output.jsonl, when the job has
    # finished: one line per request line of an input.format=openai_batch job (pipeline/data/openai_batch.py).
    openai_batch: bool = False


@dataclass
class RunConfig:
    run_id: str | None = None  # default: derived from the start time
    resume: bool = False  # skip rows already written under output.url
    progress_interval_s: float = 30.0
    # The Ray cluster to run on ("host:port" of its GCS, or ray://host:port); null: RAY_ADDRESS if set
    # (ray job submit, KubeRay), else a private Ray started for this job on 127.0.0.1
    # (pipeline/startup/ray_connection.py). A named cluster that does not answer stops the job at start-up.
    ray_address: str | None = None
    # Object-storage I/O: a transient failure (HTTP 5xx, throttling, reset, timeout) is retried with
    # backoff for this long after the operation's first failure; permanent ones stop at once
    # (dart_worker/artifacts/io_retry.py). 0: no retries beyond the storage client's own.
    io_retry_s: float = 600.0


@dataclass
class PipelineConfig:
    input: InputConfig = field(default_factory=InputConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    run: RunConfig = field(default_factory=RunConfig)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> PipelineConfig:
    """Schema <- YAML file <- dotlist overrides, then `validate`; raises ConfigError."""
    try:
        cfg = load_structured(PipelineConfig, path, overrides, ConfigError)
    except InvalidTreeParams as exc:
        raise _tree_error(exc) from None
    validate(cfg)
    return cfg


def load_structured(schema: type[T], path: str | os.PathLike | None, overrides: list[str] | None,
                    error: type[Exception]) -> T:
    """The one way every job reads its config: the dataclass `schema`'s defaults <- a YAML file
    (optional) <- dotlist overrides (`key=value`), as an instance of `schema`. Unknown keys, wrong
    types and unparseable YAML raise `error` with a message naming the key or the file."""
    try:
        merged = OmegaConf.structured(schema)
        if path is not None:
            if not Path(path).is_file():
                raise error(f"config file {path} does not exist")
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        if overrides:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise error(_describe(exc)) from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:  # not OmegaConf's own: a file or override YAML cannot parse
        where = "an override" if isinstance(exc, yaml.YAMLError) and "<unicode string>" in str(exc) else str(path)
        raise error(f"invalid config: cannot parse {where}: {' '.join(str(exc).split())}") from None


def to_dict(cfg: PipelineConfig) -> dict[str, Any]:
    """Plain dict (picklable, JSON-able) for shipping to workers and stamping summaries."""
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def from_dict(data: dict[str, Any]) -> PipelineConfig:
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PipelineConfig), data))
    except InvalidTreeParams as exc:
        raise _tree_error(exc) from None


def _tree_error(exc: InvalidTreeParams) -> ConfigError:
    """`decoding.tree` is a TreeParams, which checks itself as OmegaConf builds it (the one check
    of the tree parameters): its problems, under their config keys."""
    return ConfigError("invalid config:\n  " + "\n  ".join(
        f"decoding.tree.{name}: {message}" for name, message in exc.problems))


def _describe(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    message = str(exc).splitlines()[0]
    return f"invalid config at '{key}': {message}" if key else f"invalid config: {message}"


def validate(cfg: PipelineConfig) -> None:
    """Value checks the schema cannot express; every problem is listed in one error."""
    problems = []

    def check(ok: bool, key: str, message: str) -> None:
        if not ok:
            problems.append(f"{key}: {message}")

    i, m, d, r, o = cfg.input, cfg.model, cfg.decoding, cfg.resources, cfg.output
    check(len(i.urls) > 0, "input.urls", "at least one input URL is required")
    check(i.format in FORMATS, "input.format", f"must be one of {FORMATS}, got {i.format!r}")
    check((i.prompt_column is None) != (i.messages_column is None), "input.prompt_column",
          "set exactly one of input.prompt_column and input.messages_column")
    check(d.warm_rows >= 1, "decoding.warm_rows", f"must be >= 1, got {d.warm_rows}")
    check(i.max_prompt_chars > 0, "input.max_prompt_chars", "must be > 0")
    for name, column in i.settings_columns.items():
        check(name in SETTING_NAMES, f"input.settings_columns.{name}", f"is not a per-row setting; known: "
              f"{list(SETTING_NAMES)}")
        check(column is None or (bool(column) and column not in (i.id_column, i.prompt_column, i.messages_column)),
              f"input.settings_columns.{name}", f"must be null or a column other than the id and prompt, "
              f"got {column!r}")
    if d.mode in drafter_names():
        spec = drafter_spec(d.mode)
        check(not spec.needs_head or m.draft_head is not None, "model.draft_head",
              f"mode {d.mode!r} needs a draft head (or use decoding.mode=ar)")
        check(not spec.needs_trie or m.trie is not None, "model.trie", f"mode {d.mode!r} needs an N-gram trie")
    else:
        check(False, "decoding.mode", f"must be one of {list(drafter_names())}, got {d.mode!r}")
    check(d.temperature >= 0, "decoding.temperature", "must be >= 0 (0 = greedy)")
    check(0 < d.top_p <= 1, "decoding.top_p", "must be in (0, 1]")
    check(d.top_k >= 0, "decoding.top_k", "must be >= 0 (0 = off)")
    check(0 <= d.min_p <= 1, "decoding.min_p", "must be in [0, 1] (0 = off)")
    check(d.repetition_penalty > 0, "decoding.repetition_penalty", "must be > 0 (1 = off)")
    check(-2 <= d.presence_penalty <= 2, "decoding.presence_penalty", "must be in [-2, 2] (0 = off)")
    check(-2 <= d.frequency_penalty <= 2, "decoding.frequency_penalty", "must be in [-2, 2] (0 = off)")
    check(d.logprobs >= 0, "decoding.logprobs", "must be >= 0 (0 = off)")
    check(d.prompt_logprobs >= 0, "decoding.prompt_logprobs", "must be >= 0 (0 = off)")
    check(d.seed >= 0, "decoding.seed", "must be >= 0")
    check(1 <= d.n <= MAX_SAMPLES, "decoding.n", f"must be in [1, {MAX_SAMPLES}]")
    check(d.n == 1 or d.temperature > 0, "decoding.n",
          f"n={d.n} completions at temperature 0 would be {d.n} identical copies of the greedy reply: "
          "set decoding.temperature > 0 or n = 1")
    check(d.max_new_tokens >= 1, "decoding.max_new_tokens", "must be >= 1")
    try:
        check_syntax(parse_structured_output(d.structured_output))
    except StructuredOutputError as exc:
        check(False, "decoding.structured_output", str(exc))
    check(all(d.stop), "decoding.stop", "stop strings must not be empty")
    check(d.tree.budget >= 1, "decoding.tree.budget", "must be >= 1")
    check(d.sizing in SIZING_MODES, "decoding.sizing", f"must be one of {list(SIZING_MODES)}, got {d.sizing!r}")
    check(m.tap_layers is None or len(m.tap_layers) == 3, "model.tap_layers", "must list 3 layer indices")
    check(r.num_workers >= 1, "resources.num_workers", "must be >= 1")
    check((r.min_workers is None) == (r.max_workers is None), "resources.min_workers",
          "set both min_workers and max_workers, or neither")
    if r.min_workers is not None and r.max_workers is not None:
        check(1 <= r.min_workers <= r.max_workers, "resources.min_workers", "need 1 <= min_workers <= max_workers")
    check(r.num_cpus_per_worker > 0, "resources.num_cpus_per_worker", "must be > 0")
    check(r.torch_threads is None or r.torch_threads >= 1, "resources.torch_threads", "must be >= 1 or null")
    check(r.num_gpus_per_worker >= 0, "resources.num_gpus_per_worker", "must be >= 0")
    device = m.device.strip().lower()
    check(not device.startswith("cuda") or r.num_gpus_per_worker > 0, "model.device",
          f"{m.device!r} needs resources.num_gpus_per_worker > 0 (Ray gives a worker only the GPUs it reserves)")
    check(device not in ("cpu", "mps") or r.num_gpus_per_worker == 0, "resources.num_gpus_per_worker",
          f"reserves GPUs that model.device={m.device!r} never uses: set it to 0")
    check(r.batch_size >= 1, "resources.batch_size", "must be >= 1")
    check(r.max_live is None or 1 <= r.max_live <= r.batch_size, "resources.max_live",
          "must be null (= batch_size) or between 1 and resources.batch_size")
    check(o.rows_per_file >= 1, "output.rows_per_file", "must be >= 1")
    check(not o.openai_batch or i.format == "openai_batch", "output.openai_batch",
          f"needs input.format: openai_batch (its lines answer the request lines), got {i.format!r}")
    check(not o.openai_batch or o.include_token_ids, "output.openai_batch",
          "needs output.include_token_ids: true (a response's logprobs name their tokens from them)")
    check(o.if_exists in IF_EXISTS, "output.if_exists", f"must be one of {IF_EXISTS}, got {o.if_exists!r}")
    check(not cfg.run.resume or o.if_exists in ("error", "resume"), "run.resume",
          f"run.resume=true resumes the output, which contradicts output.if_exists={o.if_exists}; set one of them")
    check(cfg.run.progress_interval_s > 0, "run.progress_interval_s", "must be > 0")
    check(cfg.run.io_retry_s >= 0, "run.io_retry_s", "must be >= 0 (0: no retries beyond the storage client's own)")
    check(cfg.run.ray_address is None or bool(cfg.run.ray_address.strip()), "run.ray_address",
          "must be null (RAY_ADDRESS, else a private local Ray) or an address such as 10.0.0.5:6379")
    if cfg.run.run_id is not None:
        check(cfg.run.run_id.replace("-", "").replace("_", "").replace(".", "").isalnum(), "run.run_id",
              "may hold only letters, digits, '-', '_' and '.'")
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
