"""Batch generation job: `python -m pipeline.run config.yaml [key=value ...] [--dry-run]`.

Without an address this starts a private Ray instance on 127.0.0.1; with `run.ray_address` or
RAY_ADDRESS (as under `ray job submit`) it joins that cluster only (pipeline/startup/ray_connection.py).
The flow:

    inputs (fsspec: s3://, file://, ...) --Ray Data read--> prompt rows (bad rows -> error rows)
      -> drop rows already written (resume) -> GenerationWorker actor pool (one engine each)
      -> write tasks: one atomic Parquet part per group of rows -> per-row stats to the driver
      -> progress lines, then the job summary (printed and written next to the output)

Everything that can be checked before work starts is checked first (pipeline/startup/preflight.py): the
config, the inputs, the output location, the target, the draft head and the N-gram trie.
`--dry-run` runs those checks, prints the inputs (with a row estimate), the output and resume
state and the worker plan, and exits 0 without starting Ray (pipeline/startup/dry_run.py).

Exit status: 0 when every input row has its output row (bad rows are error rows, not failures);
2 for a problem found before any generation (config, artifacts, an input file that cannot be
read); 1 when reading an input or writing a part fails for an I/O reason after generation began:
the message names the file, the parts written stay, and `run.resume=true` finishes the job;
128 + the signal's number (143, 130) when SIGTERM or SIGINT stopped it: the parts written stay, and
the note says how to resume.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from typing import Any

import ray

from dart_worker.artifacts import io_retry
from dart_worker.hardware.device import DeviceUnavailable
from pipeline.cluster.device_check import DeviceProbe, start_probe, worker_failure
from pipeline.cluster.ngram_store import shutdown_ngram_stores, start_store_for_one_node_cluster
from pipeline.cluster.remote_errors import exception_chain
from pipeline.data.inputs import InputError, PromptFields, scan_prompts
from pipeline.data.openai_batch import write_job_batch_output  # also registers the openai_batch reader
from pipeline.data.outputs import (
    ResumeProgress,
    filter_done,
    remove_temp_files,
    resume_progress,
    written_rows,
)
from pipeline.data.storage import StorageError, filesystem_for, retry_policy
from pipeline.data.summary import SUMMARY_NAME, RunTally, build_summary, output_totals
from pipeline.data.write_task import add_write_retries, write_rows
from pipeline.settings.config import ConfigError, PipelineConfig, load_config, to_dict
from pipeline.settings.row_settings import settings_columns
from pipeline.startup.output_modes import commit_output, open_output
from pipeline.startup.preflight import StartupError, cpu_budget_problem, resolve_artifacts
from pipeline.startup.ray_connection import JobStopped, RayTarget, check_reachable, job_ray, ray_target, stop_on_signals
from pipeline.worker import GenerationWorker, target_mismatch

log = logging.getLogger("pipeline")


class JobFailed(RuntimeError):
    """An input file could not be read, or a part not written, after generation began.

    Content never fails a job (bad rows are error rows); this is I/O: a file that became
    unreadable, a store that went away. Parts already written stay, so `run.resume=true` finishes.
    """


# The line a remote traceback ends with, named from the classes (a class that moves modules must
# still be found: StorageError moved to dart_worker.artifacts.url_filesystem and this pattern, spelled out,
# stopped matching).
_REMOTE_FAILURE = re.compile(
    "^(?:" + "|".join(re.escape(f"{cls.__module__}.{cls.__qualname__}") for cls in (StorageError, InputError))
    + r"): (.+)$", re.MULTILINE)


def storage_failure(exc: BaseException) -> str | None:
    """The one-line message of the InputError or StorageError behind `exc`, or None if there is none.

    Ray Data raises a read task's error as RayTaskError(InputError), with Ray's notes appended to
    the message. A UDF's error (the writer's StorageError) arrives as a UserCodeException that
    no longer carries it, only its traceback text, where the original line is found instead.
    """
    for e in exception_chain(exc):
        if isinstance(e, (InputError, StorageError)):
            original = getattr(e, "cause", None)
            return str(original if isinstance(original, (InputError, StorageError)) else e).split("\n", 1)[0]
    found = _REMOTE_FAILURE.search(str(exc))
    return found.group(1) if found else None


# -------------------------------------------------------------------------------- dataflow


def build_dataset(cfg: PipelineConfig, resolved: dict[str, Any], done_keys: set[str]):
    """The lazy Ray Data pipeline; returns (dataset, duplicate ids), the dataset None when a resumed
    run finds every input row written already (then no worker is started)."""
    i, r = cfg.input, cfg.resources
    # Duplicate ids are resolved while reading: the first occurrence is generated, the others
    # become "duplicate id" error rows with keys of their own.
    read = scan_prompts(resolved["input_files"], i.format,
                        PromptFields(i.id_column, i.prompt_column, i.messages_column, i.max_prompt_chars,
                                     settings_columns(i.settings_columns)),
                        done_keys=frozenset(done_keys) if done_keys else None)
    if read.pending == 0:
        print(f"resume: all {read.rows} input rows are written already; nothing to generate")
        return None, read.duplicates
    ds, duplicates = read.dataset, read.duplicates
    if done_keys:
        ds = filter_done(ds, done_keys)
    # One batch per block: the read side makes blocks of thousands of rows, and an actor task
    # returns its output only when its whole block is done. Small blocks spread the rows over
    # every worker, let results be written as they come, and make a crash cost one batch.
    ds = ds.repartition(target_num_rows_per_block=r.batch_size)
    if r.min_workers is not None:
        pool = ray.data.ActorPoolStrategy(min_size=r.min_workers, max_size=r.max_workers)
    else:
        pool = ray.data.ActorPoolStrategy(size=r.num_workers)
    ds = ds.map_batches(
        GenerationWorker,
        fn_constructor_kwargs={"config": to_dict(cfg), "resolved": resolved},
        batch_size=r.batch_size,
        batch_format="pyarrow",
        compute=pool,
        num_cpus=r.num_cpus_per_worker,
        num_gpus=r.num_gpus_per_worker or None,
        # A crashed worker is restarted and its batch redone: Ray Data's actor pools default to
        # max_restarts=-1 and max_task_retries=-1 (tests/test_pipeline_run.py crashes one).
        # Idle OpenMP threads sleep instead of spinning: on a CPU shared with the read/write
        # tasks and Ray's own processes, spinning threads take the cores the decoding needs.
        runtime_env={"env_vars": {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}},
    )
    ds = ds.map_batches(write_rows, fn_kwargs={"output_url": cfg.output.url, "run_id": resolved["run_id"],
                                               "io_retry_s": cfg.run.io_retry_s},
                        batch_size=cfg.output.rows_per_file, batch_format="pyarrow", num_cpus=0.25)
    return ds, duplicates


def check_cpu_budget(cfg: PipelineConfig, target: RayTarget | None = None) -> None:
    """Workers that reserve every CPU leave none for the read and write tasks: Ray Data then
    waits forever. On a cluster started here that is certain, so it is an error; on an external
    cluster the autoscaler may add nodes, so it is a warning."""
    message = cpu_budget_problem(cfg, ray.cluster_resources().get("CPU", 0.0))
    if message is None:
        return
    if (target or ray_target(cfg.run.ray_address)).address is not None:
        log.warning("%s (waiting for the autoscaler to add CPUs)", message)
    else:
        raise StartupError(message)


def run_id_of(cfg: PipelineConfig) -> str:
    return cfg.run.run_id or time.strftime("run-%Y%m%d-%H%M%S")


def rows_on_storage(url: str, counted_by_driver: int, earlier: int) -> tuple[int, bool]:
    """(rows of this run durable under `url`, whether that is exact): read from the parts' footers,
    as a rerun will find them. The driver's own tally lags behind (a write task has finished before
    its result reaches the driver), so it is only the fallback, a lower bound, when the store cannot
    be read."""
    try:
        with io_retry.using(io_retry.NO_RETRY):  # one try: the job is stopping already
            return max(0, written_rows(url) - earlier), True
    except Exception as exc:  # the store that stopped the job may not answer a listing either
        log.warning("cannot count the rows under %s (%s); the driver's count is a lower bound", url, exc)
        return counted_by_driver, False


def stop_note(plan, tally: RunTally, progress: ResumeProgress, cause: str = "once the cause is fixed") -> str:
    """What a job that stops mid-way leaves, with the rows counted on storage."""
    rows, exact = rows_on_storage(plan.write_url, tally.rows, progress.rows_written)
    return plan.failure_note(rows, progress.rows_written, exact=exact, cause=cause)


def run_pipeline(cfg: PipelineConfig) -> dict[str, Any]:
    """The job: every storage operation of the driver follows the job's retry policy
    (run.io_retry_s, dart_worker/artifacts/io_retry.py), and the summary counts the retries of all of them."""
    with io_retry.using(retry_policy(cfg.run.io_retry_s)) as policy:
        return _run_pipeline(cfg, policy)


def _run_pipeline(cfg: PipelineConfig, policy: io_retry.RetryPolicy) -> dict[str, Any]:
    target = ray_target(cfg.run.ray_address)
    check_reachable(target)  # before the artifacts: a cluster that is not there fails in seconds
    run_id = run_id_of(cfg)
    resolved = resolve_artifacts(cfg, run_id)
    # An output holding rows stops the run here unless output.if_exists says what to do with them.
    configured, plan = cfg, open_output(cfg, run_id)
    cfg, run_id = plan.job_config(cfg), plan.run_id
    resolved["run_id"] = run_id
    removed = remove_temp_files(cfg.output.url)  # leftovers of writers killed mid-write
    if removed:
        log.info("removed %d temporary files left by an interrupted run", removed)
    # Input rows whose every sample is written are skipped; a row with only some of its samples
    # written (a crash between two parts) is generated again for the missing samples only.
    progress = resume_progress(cfg.output.url) if plan.resumes else ResumeProgress(frozenset(), {}, 0)
    done_keys = set(progress.done)
    resolved["written_samples"] = progress.partial
    if progress.rows_written:
        partly = f" ({len(progress.partial)} of them partly)" if progress.partial else ""
        print(f"resume: {progress.rows_written} rows already written under {cfg.output.url} for "
              f"{len(progress.done) + len(progress.partial)} input rows{partly}; generating the rest")
    tally = RunTally()
    try:
        with job_ray(target):
            log.info("running on %s", target.describe())
            duplicates = generate(cfg, resolved, done_keys, target, tally, plan, progress)
    except JobStopped as stop:
        stop.note = stop_note(plan, tally, progress, cause="when it may run again")
        raise
    print(tally.progress_line())
    summary = build_summary(tally, run_id=run_id, config=to_dict(configured), resumed_rows=progress.rows_written,
                            duplicates=duplicates, output_totals=output_totals(cfg.output.url),
                            output_plan=plan.as_dict())
    # Retries per operation: the driver's own (listing, reading parts, the summary) and the write tasks'.
    summary["storage_retries"] = policy.ledger.as_dict()
    if policy.ledger.total_retries():
        print("storage: " + "; ".join(f"{op}: {c['retries']} retries, {c['waited_s']:.0f} s waited"
                                      for op, c in summary["storage_retries"].items()))
    fs, path = filesystem_for(cfg.output.url)
    summary_url = f"{cfg.output.url.rstrip('/')}/{SUMMARY_NAME}"
    text = json.dumps(summary, indent=1, default=str)
    policy.call("write summary", summary_url, lambda: fs.pipe_file(f"{path.rstrip('/')}/{SUMMARY_NAME}",
                                                                    text.encode()))
    commit_output(plan)  # replace: only now, with every row and the summary written, is the old run replaced
    if cfg.output.openai_batch:  # the Batch API's output lines, from every part of the committed output
        final_url = plan.url if plan.stages else cfg.output.url
        print(f"openai batch output: {write_job_batch_output(cfg, resolved, final_url)}")
    return summary


def generate(cfg: PipelineConfig, resolved: dict[str, Any], done_keys: set[str], target: RayTarget,
             tally: RunTally, plan, progress: ResumeProgress) -> dict:
    """Every pending row through the workers and into parts, on the Ray this process is connected
    to; rows are tallied into `tally` as their results arrive. Returns the duplicate ids found."""
    check_cpu_budget(cfg, target)
    io_retry.add_to_ray_data(ray.data.DataContext.get_current())  # its readers retry the transient errors too
    try:
        # The device probe runs while the inputs are read: its process start and torch import
        # overlap the duplicate pass instead of coming before it. A device problem is still the
        # error reported first when both fail.
        probe = start_probe(cfg)
    except DeviceUnavailable as exc:
        raise StartupError(f"model.device: {exc}") from None
    try:
        try:  # reads every input once (the duplicate-id pass): an unreadable file stops the job here
            ds, duplicates = build_dataset(cfg, resolved, done_keys)
            input_problem = None
        except (InputError, StorageError) as exc:
            input_problem = exc
        if input_problem is None and ds is not None and "trie_url" in resolved:
            # rows to generate with a trie: on a one-node cluster the node's store starts placing
            # it now, while the probe answers and the workers start (ngram_store's docstring)
            start_store_for_one_node_cluster(resolved["trie_url"], worker_cpus=cfg.resources.num_cpus_per_worker,
                                             worker_gpus=cfg.resources.num_gpus_per_worker)
        await_device(probe)
        if input_problem is not None:
            raise StartupError(f"input: {input_problem}") from None
        try:
            ledger, retries_shown = io_retry.active().ledger, 0
            for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None) if ds is not None else ():
                tally.add(batch)
                add_write_retries(ledger, batch)
                tally.maybe_print(cfg.run.progress_interval_s)
                if ledger.total_retries() != retries_shown:  # the storage waits behind the rows just counted
                    retries_shown = ledger.total_retries()
                    print("storage: rode out transient failures so far: " + "; ".join(
                        f"{op} {c['retries']} retries, {c['waited_s']:.0f} s waited"
                        for op, c in ledger.as_dict().items() if c["retries"]))
        except Exception as exc:
            device_problem = worker_failure(exc)  # a worker on another node than the probe's
            if device_problem is not None:
                raise StartupError(f"model.device: {device_problem}") from None
            mismatch = target_mismatch(exc)  # a worker fetched other bytes than the driver checked
            if mismatch is not None:
                raise StartupError(mismatch) from None
            reason = storage_failure(exc)
            if reason is None:
                raise
            raise JobFailed(f"{reason}\n  {stop_note(plan, tally, progress)}") from None
    finally:
        shutdown_ngram_stores()
    return duplicates


def await_device(probe: DeviceProbe) -> dict[str, Any]:
    """The probe's device report, logged; a device problem is a StartupError with its line."""
    try:
        device = probe.result()
    except DeviceUnavailable as exc:
        raise StartupError(f"model.device: {exc}") from None
    log.info("workers decode on %s (%s, %s; kernels %s)", device["device"], device.get("gpu_name", device["node"]),
             device["dtype"], device["kernels"])
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. decoding.mode=ar")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the config and every artifact, list inputs, output, worker plan; no generation")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with stop_on_signals():
            cfg = load_config(args.config, args.overrides)
            if args.dry_run:
                from pipeline.startup.dry_run import dry_run, format_report

                target = ray_target(cfg.run.ray_address)
                check_reachable(target)
                print(format_report(dry_run(cfg, run_id_of(cfg))))
                print(f"ray: {target.describe()}" + (" (answered)" if target.address else ""))
                return 0
            summary = run_pipeline(cfg)
    except (ConfigError, StartupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except JobFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except JobStopped as stop:
        print(f"stopped by {stop}: {stop.note or 'before any row was generated; nothing was written'}",
              file=sys.stderr)
        return stop.exit_status
    this = summary["this_run"]
    print(json.dumps({k: this[k] for k in ("rows", "rows_ok", "rows_failed", "generated_tokens", "tokens_per_s")}
                     | {"mean_tau": this["tau"].get("mean"), "output": summary["output"]}, indent=1))
    return 0


if __name__ == "__main__":
    status = main()
    if status >= 128:  # stopped by a signal: Ray is already shut down and the note printed, so the
        # interpreter's teardown (seconds of Ray's and torch's native destructors) is skipped
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
