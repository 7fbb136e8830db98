"""The Ray Data actor that turns prompt rows into completion rows with one decoding engine.

Each actor builds one `DecodingEngine` at start-up (target, draft head, the node's shared
N-gram trie) and reuses it for every batch. Every input row yields exactly one output row:
rows that arrive with an error pass through, a request the engine rejects gets its message,
and an unexpected failure of a whole batch is retried row by row so that one bad prompt
cannot take its neighbours down with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import socket
import time
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa

from dart_worker.artifacts import io_retry
from dart_worker.artifacts.fingerprint import cached_tokenizer_fingerprint
from dart_worker.artifacts.loading import load_target
from dart_worker.drafters import drafter_spec
from dart_worker.engine import GenerationResult
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.hardware.device import configure_cpu_threads, resolve_dtype, resolve_worker_device, worker_devices
from dart_worker.prompt_format import PromptEncoder
from dart_worker.sampling.params import SamplingParams, for_sample
from pipeline.cluster.device_check import assigned_gpus
from pipeline.cluster.metrics import record_batch
from pipeline.cluster.ngram_store import acquire_trie, start_store
from pipeline.cluster.remote_errors import exception_chain
from pipeline.data.outputs import result_rows_to_table, sample_key, storable_text
from pipeline.data.storage import retry_policy
from pipeline.settings.config import PipelineConfig, from_dict
from pipeline.settings.row_settings import decode_settings, row_sample_count, row_sampling_params
from pipeline.settings.sampling_settings import PARAMS_SETTINGS, RECORDED_SETTINGS

log = logging.getLogger(__name__)

# Test hook: when set to a file path that does not exist yet, the first batch this process
# sees creates the file and kills the process, as a crashed worker would (see tests).
CRASH_ONCE_ENV = "DART_PIPELINE_CRASH_ONCE"


def row_seed(base_seed: int, row_key: str) -> int:
    """Per-row sampling seed: reproducible whatever the batching, distinct across rows."""
    digest = hashlib.sha256(f"{base_seed}:{row_key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# SamplingParams fields written on every output row as they are: the settings the row decoded with
# (`n` and `structured_output`, recorded too, are written on their own: a count and a JSON text).
_SETTING_COLUMNS = tuple(name for name in RECORDED_SETTINGS if name in PARAMS_SETTINGS and name != "structured_output")


class TargetMismatch(RuntimeError):
    """This worker's copy of the target is not the one the driver checked and stamps on rows."""


_REMOTE_TARGET_MISMATCH = re.compile(r"TargetMismatch: (.+)$", re.MULTILINE)


def check_target_fingerprint(spec: str, expected: str | None) -> str | None:
    """The fingerprint of this node's copy of target `spec` (fetched once per node for a URL; the
    per-file hashes are cached), which must be `expected`, the driver's: a re-upload under the
    same URL after the driver resolved it, or nodes holding different files at one path, would
    otherwise decode with another model than the one every output row names."""
    from dart_worker.artifacts.loading import model_fingerprint, resolve_source

    if not expected:  # nothing to hold it to (a worker built outside a job)
        return None
    found = model_fingerprint(spec)
    if found != expected:
        location = resolve_source(spec).location
        raise TargetMismatch(f"model.target {spec!r}: this worker's copy ({location} on {socket.gethostname()}) "
                             f"has fingerprint {found}, but the driver checked {expected} at start-up: the "
                             "target changed under its URL since the job started, or nodes hold different "
                             "files at that path; make the target immutable (a new URL per version) and rerun")
    return found


def target_mismatch(exc: BaseException) -> str | None:
    """The TargetMismatch line behind a failed Ray actor (None if that is not the cause): Ray
    re-raises the worker's exception, or only carries its traceback text."""
    for e in exception_chain(exc):
        found = _REMOTE_TARGET_MISMATCH.search(str(e))
        if isinstance(e, TargetMismatch) and not found:
            return str(e)
        if found:
            return found.group(1)
    return None


def _show_worker_logs() -> None:
    """INFO lines of this package in a Ray worker's log (`ray logs`, the dashboard; the driver's
    terminal too with Ray's default log_to_driver): a Ray worker process configures no logging, so
    the worker's start-up breakdown and calibration lines were dropped. Leaves a process that has
    configured logging itself (a driver, a test) alone."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        for name in ("pipeline", "dart_worker", "ngram_native"):
            logging.getLogger(name).setLevel(logging.INFO)


class _StartupClock:
    """Seconds of each step of a worker's start-up, for the log line that says where it went
    (a drafting job's start-up against an `ar` job's is one of the pipeline's measured goals)."""

    def __init__(self):
        self.started = self._last = time.perf_counter()
        self.laps: list[tuple[str, float]] = []

    def lap(self, step: str) -> None:
        now = time.perf_counter()
        self.laps.append((step, now - self._last))
        self._last = now

    def __str__(self) -> str:
        steps = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in self.laps)
        return f"{time.perf_counter() - self.started:.1f} s ({steps})"


class GenerationWorker:
    """Callable class for `Dataset.map_batches`: one engine per actor."""

    def __init__(self, config: dict[str, Any], resolved: dict[str, Any]):
        """`resolved` carries what the driver already fixed: the head dir, the trie URL and the
        artifact fingerprints stamped on every output row. The start-up's artifact fetches (target,
        tokenizer, head, the node's trie store) wait out a storage outage under the job's
        `run.io_retry_s`, as its reads and writes do (dart_worker/artifacts/io_retry.py)."""
        _show_worker_logs()
        self.cfg: PipelineConfig = from_dict(config)
        with io_retry.using(retry_policy(self.cfg.run.io_retry_s)):
            self._start_up(resolved)

    def _start_up(self, resolved: dict[str, Any]) -> None:
        clock = _StartupClock()
        self.resolved = {k: v for k, v in resolved.items() if k not in ("warm_documents", "written_samples")}
        # A resumed run's input rows with some samples written: {row_key: (their n, written indices)}.
        self._written_samples: dict[str, tuple[int, tuple[int, ...]]] = resolved.get("written_samples") or {}
        model_cfg, decoding = self.cfg.model, self.cfg.decoding
        gpus = assigned_gpus()
        device = resolve_worker_device(model_cfg.device, gpus)  # what Ray assigned, or an error
        if device.type == "cpu":
            resources = self.cfg.resources
            configure_cpu_threads(resources.torch_threads or max(1, int(resources.num_cpus_per_worker)))
        check_target_fingerprint(model_cfg.target, resolved.get("target_fingerprint"))  # the driver's bytes
        # A worker holding several GPUs (resources.num_gpus_per_worker > 1) spreads its target over them.
        devices = worker_devices(device, gpus)
        spec = drafter_spec(decoding.mode)
        if spec.needs_trie:
            start_store(resolved["trie_url"])  # the node's shared copy is placed while the target loads
        model, self.tokenizer = load_target(model_cfg.target, dtype=resolve_dtype(model_cfg.dtype, device),
                                            device=device, devices=devices if len(devices) > 1 else None)
        clock.lap("target")
        trie = None
        if spec.needs_trie:
            trie = acquire_trie(resolved["trie_url"], cached_tokenizer_fingerprint(self.tokenizer))
            clock.lap("trie")
        parts = EngineParts.from_model(model, self.tokenizer, tap_layers=model_cfg.tap_layers,
                                       head=resolved["head_dir"] if spec.needs_head else None, trie=trie)
        clock.lap("head" if spec.needs_head else "adapter")
        live = self.cfg.resources.live_rows
        self.engine = build_engine(parts, decoding.mode, decoding.tree, sizing=decoding.sizing, batches=(1, live))
        clock.lap("engine")  # with the verify-cost calibration when it is not cached yet
        self.worker_name = f"{socket.gethostname()}:{os.getpid()}"
        warm = resolved.get("warm_documents")
        if warm:  # an earlier run's outputs, as if this worker had finished those rows itself
            kinds = ("job_ngram", "job_cache") if decoding.warm_job_cache else ("job_ngram",)
            self.engine.warm(warm, kinds)
            log.info("worker %s warmed from %d rows of %s: %s", self.worker_name, len(warm), decoding.warm_from,
                     self.engine.job_state())
        log.info("worker %s ready in %s: mode %s on %s", self.worker_name, clock, decoding.mode,
                 ", ".join(str(d) for d in devices))
        calibration = self.engine.sizing_calibration()
        if calibration is not None:
            log.info("worker %s tree sizing calibrated: %s", self.worker_name, calibration)

    # ------------------------------------------------------------------ batch

    def __call__(self, batch: pa.Table) -> pa.Table:
        """One output row per completion of each input row: n rows (keyed by `sample_key`) for a row
        whose prompt decodes, one error row for a row that cannot (its settings, its prompt). Samples
        a resumed run found written already (`resolved["written_samples"]`) are not generated again."""
        _maybe_crash_for_test()
        started = time.perf_counter()
        rows = batch.to_pylist()
        outputs: list[list[dict]] = [[] for _ in rows]
        requests = []  # (row index, token ids, [(sample index, params)], n)
        params: list[SamplingParams | None] = [None] * len(rows)
        for k, row in enumerate(rows):
            if row.get("error"):
                outputs[k].append(self._row(row, GenerationResult(finish_reason="error", error=row["error"])))
                continue
            try:
                params[k] = self._params(row)
                n = row_sample_count(self.cfg.decoding.n, decode_settings(row.get("settings")), params[k])
                # a partly written row is completed to the n it was started with, whatever n is now
                n, written = self._written_samples.get(row["row_key"], (n, ()))
                samples = [(j, for_sample(params[k], j)) for j in range(n) if j not in written]
                if samples:
                    requests.append((k, self._encode(row), samples, n))
            except (ValueError, TypeError) as exc:
                outputs[k].append(self._row(row, GenerationResult(finish_reason="error", error=str(exc)), params[k]))
        for (k, _, samples, n), results in zip(requests, self._generate(requests)):
            for (j, sample_params), result in zip(samples, results, strict=True):
                out = self._row(rows[k], result, sample_params, sample=j, n=n)
                # Each row's own finish (rows of one batch finish at different rounds, and with
                # continuous batching start at different ones too); rows that never ran: the batch's end.
                if result.finished_unix is not None:
                    out["finished_at"] = datetime.fromtimestamp(result.finished_unix, timezone.utc)
                outputs[k].append(out)
        outputs = [out for per_row in outputs for out in per_row]
        batch_end = datetime.now(timezone.utc)
        for out in outputs:
            out.setdefault("finished_at", batch_end)
        resources = self.cfg.resources
        record_batch(outputs, run_id=self.resolved["run_id"], worker=self.worker_name, mode=self.cfg.decoding.mode,
                     batch_size=resources.live_rows, wall_s=time.perf_counter() - started,
                     job_state=self.engine.job_state())
        return result_rows_to_table(outputs)

    def _generate(self, requests: list) -> list[list[GenerationResult]]:
        """Per request, the results of its samples, in order (a prompt's samples share its prefill)."""
        if not requests:
            return []
        try:
            return self.engine.generate_samples([r[1] for r in requests], [[p for _, p in r[2]] for r in requests],
                                                max_live=self.cfg.resources.max_live)
        except Exception:  # one bad request must not fail its neighbours: retry one by one
            log.exception("batch of %d failed; retrying its rows one at a time", len(requests))
        out = []
        for _, ids, samples, _ in requests:
            try:
                out.append(self.engine.generate_samples([ids], [[p for _, p in samples]],
                                                        max_live=self.cfg.resources.max_live)[0])
            except Exception as exc:  # recorded in the rows; the job goes on
                out.append([GenerationResult(finish_reason="error", error=f"internal error: {exc!r}")] * len(samples))
        return out

    def _encode(self, row: dict) -> list[int]:
        """The row's prompt ids: its text is tokenized as text, the chat template's markers are control
        tokens (input.parse_special_tokens=true parses special-token strings in the text as well)."""
        encoder = getattr(self, "_prompt_encoder", None)
        if encoder is None:  # once per worker: it indexes the tokenizer's special tokens
            i = self.cfg.input
            encoder = self._prompt_encoder = PromptEncoder(self.tokenizer, i.apply_chat_template,
                                                           i.parse_special_tokens)
        if row.get("prompt_kind") == "messages":
            messages = json.loads(row["prompt"])
            if not isinstance(messages, list):
                raise ValueError("messages must be a JSON list of {role, content} objects")
            return encoder.encode_messages(messages)
        return encoder.encode_text(row["prompt"])

    def _params(self, row: dict) -> SamplingParams:
        """The config's sampling settings with the row's own (its `settings` column) applied; a bad
        row setting raises SettingError (a ValueError: the row becomes an error row)."""
        return row_sampling_params(self._config_params(), decode_settings(row.get("settings")),
                                   lambda base: row_seed(base, row["row_key"]))

    def _config_params(self) -> SamplingParams:
        """The config's sampling settings (seed = decoding.seed, the base of per-row seeds)."""
        d = self.cfg.decoding
        values = {name: getattr(d, name) for name in PARAMS_SETTINGS}
        return SamplingParams(**{name: tuple(v) if isinstance(v, list) else v for name, v in values.items()})

    def _row(self, row: dict, result: GenerationResult, params: SamplingParams | None = None, sample: int = 0,
             n: int = 1) -> dict:
        """The output row of completion `sample` of `n`; its settings columns are the ones it decoded
        with (seed: the sample's own; the config's for an error row without settings of its own,
        nulls for one whose settings were not usable). A row that failed as a whole is one row, n 1."""
        d = self.cfg.decoding
        ok = result.error is None
        if params is None and not row.get("settings"):
            try:
                params = dataclasses.replace(self._config_params(), seed=row_seed(d.seed, row["row_key"]))
            except (ValueError, TypeError):  # settings nothing can decode with: the row's error says why
                params = None
        return {
            "row_key": sample_key(row["row_key"], sample),
            "id": row.get("id"),
            "sample_index": sample,
            "n": n,
            "source": row.get("source"),
            "text": result.text if ok else None,
            "token_ids": result.token_ids if ok and self.cfg.output.include_token_ids else None,
            "messages": sft_messages(row, result.text) if ok and self.cfg.output.messages else None,
            "finish_reason": result.finish_reason,
            "error": result.error,
            **result.stats.to_row(),
            "mode": d.mode,
            **{name: getattr(params, name) if params else None for name in _SETTING_COLUMNS},
            **{name: getattr(result, name) if ok else None for name in ("logprobs", "top_logprob_ids", "top_logprobs",
                                                                      "prompt_logprobs", "prompt_top_logprob_ids",
                                                                      "prompt_top_logprobs")},
            "structured_complete": result.structured_complete if ok else None,
            "structured_output": (json.dumps(params.structured_output.to_dict(), ensure_ascii=False)
                                  if params is not None and params.structured_output is not None else None),
            "target_fingerprint": self.resolved.get("target_fingerprint"),
            "head_fingerprint": self.resolved.get("head_fingerprint"),
            "trie_fingerprint": self.resolved.get("trie_fingerprint"),
            "run_id": self.resolved["run_id"],
            "worker": self.worker_name,
        }


def sft_messages(row: dict, reply: str) -> list[dict[str, str]]:
    """The row as a chat for supervised fine-tuning: the input's messages (role and content, the
    fields the prompt was built from) or its text prompt as one user message, then the reply as the
    assistant's message. The prompt was checked when it was encoded, so it parses here."""
    if row.get("prompt_kind") == "messages":
        chat = [{"role": m["role"], "content": m["content"]} for m in json.loads(row["prompt"])]
    else:
        chat = [{"role": "user", "content": row["prompt"]}]
    return [*chat, {"role": "assistant", "content": storable_text(reply)}]  # as the text column stores it


def _maybe_crash_for_test() -> None:
    marker = os.environ.get(CRASH_ONCE_ENV)
    if marker and not os.path.exists(marker):
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        log.error("test hook %s: killing worker process %d mid-batch", CRASH_ONCE_ENV, os.getpid())
        os._exit(1)


