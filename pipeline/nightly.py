"""A nightly batch job: one night = one date, run by `python -m jobs.nightly configs/nightly.yaml [date=...]`.

One night = one date. The config (configs/nightly.yaml) has two sections: `nightly` (the
settings below) and `pipeline` (an ordinary pipeline config whose input.urls and output.url
may hold date placeholders). For the date, the runner fills the placeholders, fixes
run.run_id=<run_id_prefix>-<date> and run.resume=true (and, with warm_from_previous_night,
decoding.warm_from to the previous night's output when it holds rows), runs the pipeline, and writes a short
report next to the output (_nightly_report.json and _nightly_report.md, beside the pipeline's
own _job_summary.json). Because the output prefix and the run id depend only on the date, a
rerun for the same date (a RayJob retry, a manual rerun after a crash) resumes: it generates
only the rows not yet written, and a night that finished generates nothing and is judged again.
That is the nightly's only output mode: the runner owns run.run_id, run.resume and
output.if_exists (resume; any other value is refused), so a night never stops on, writes beside
or replaces its own earlier attempt (pipeline/startup/output_modes.py has the other modes).

Exit codes, so that a scheduler (RayJob, CronJob) sees a bad night as a failed job:
0 the night passed; 1 the failed-row fraction over the whole night's output exceeded
nightly.max_failed_fraction (or the night had no rows and allow_empty is false);
2 a config, start-up or storage error (e.g. the night's input is not there).
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dart_worker.artifacts.url_filesystem import url_filesystem
from pipeline.settings.config import ConfigError, PipelineConfig, from_dict, validate

REPORT_JSON = "_nightly_report.json"
REPORT_MD = "_nightly_report.md"
DATE_ARG = "date"
RUNNER_OWNED = ("run_id", "resume")  # run.* keys the runner derives from the date
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


class NightlyError(ValueError):
    """A problem with the nightly config or arguments, found before any work starts."""


@dataclass
class NightlySettings:
    max_failed_fraction: float = 0.05  # the night fails above this fraction of failed rows
    allow_empty: bool = False  # a night with zero rows is a failure unless this is true
    date_offset_days: int = 0  # default date = today (UTC) + offset; -1 = yesterday's partition
    run_id_prefix: str = "nightly"
    # Warm every worker's job n-gram from the previous night's output (its prefix: output.url
    # filled with the date before), unless decoding.warm_from is set; a night without a previous
    # output (the first one) starts cold. Opt-in: see docs/ngram.md ("Warm start").
    warm_from_previous_night: bool = False


@dataclass
class Night:
    """Everything resolved for one night: the pipeline config to run and how to judge it."""

    date: dt.date
    settings: NightlySettings
    config: PipelineConfig


# ----------------------------------------------------------------------------------- dates


def parse_date(text: str) -> dt.date:
    """A calendar date written exactly as YYYY-MM-DD."""
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
        raise NightlyError(f"date must be written YYYY-MM-DD, got {text!r}")
    try:
        return dt.date.fromisoformat(text)
    except ValueError as exc:
        raise NightlyError(f"date {text!r} is not a calendar date: {exc}") from None


def default_date(settings: NightlySettings, now: dt.datetime | None = None) -> dt.date:
    """Today in UTC (never the machine's local zone) shifted by date_offset_days."""
    now = now or dt.datetime.now(dt.timezone.utc)
    return now.astimezone(dt.timezone.utc).date() + dt.timedelta(days=settings.date_offset_days)


def date_fields(day: dt.date) -> dict[str, str]:
    return {"date": day.isoformat(), "date_compact": day.strftime("%Y%m%d"),
            "year": f"{day.year:04d}", "month": f"{day.month:02d}", "day": f"{day.day:02d}"}


def fill_placeholders(text: str, day: dt.date, key: str) -> str:
    """Replace {date}, {date_compact}, {year}, {month}, {day}; any other {...} is an error
    (a typo such as {data} would otherwise silently write every night to the same prefix)."""
    values = date_fields(day)

    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            raise NightlyError(f"pipeline.{key}: unknown placeholder {{{name}}} in {text!r}; "
                               f"known: {', '.join('{' + k + '}' for k in values)}")
        return values[name]

    return _PLACEHOLDER.sub(replace, text)


# ---------------------------------------------------------------------------------- config


def split_args(args: list[str]) -> tuple[dt.date | None, list[str], list[str]]:
    """(date, nightly overrides, pipeline overrides) from `key=value` command-line items."""
    day, nightly, pipeline = None, [], []
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise NightlyError(f"expected key=value, got {arg!r}")
        if key == DATE_ARG:
            day = parse_date(value)
        elif key.startswith("nightly."):
            nightly.append(arg.removeprefix("nightly."))
        else:
            pipeline.append(arg.removeprefix("pipeline."))
    return day, nightly, pipeline


def _omegaconf_error(section: str, exc: Exception) -> str:
    key = getattr(exc, "full_key", None)
    where = f"{section}.{key}" if key else section
    return f"{where}: {' '.join(str(exc).split()) if isinstance(exc, yaml.YAMLError) else str(exc).splitlines()[0]}"


def _read_sections(path: str | Path) -> tuple[DictConfig, DictConfig]:
    """The `nightly` and `pipeline` sections of the YAML file (either may be absent)."""
    if not Path(path).is_file():
        raise NightlyError(f"config file {path} does not exist")
    try:
        raw = OmegaConf.load(path)
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        raise NightlyError(f"{path}: {' '.join(str(exc).split())}") from None
    if not isinstance(raw, DictConfig):
        raise NightlyError(f"{path}: expected a mapping with 'nightly' and 'pipeline' sections")
    unknown = sorted(set(raw.keys()) - {"nightly", "pipeline"})
    if unknown:
        raise NightlyError(f"{path}: unknown top-level keys {unknown}; expected 'nightly' and 'pipeline'")
    sections = []
    for name in ("nightly", "pipeline"):
        section = raw.get(name)
        if section is not None and not isinstance(section, DictConfig):
            raise NightlyError(f"{path}: '{name}' must be a mapping")
        sections.append(section if section is not None else OmegaConf.create({}))
    return sections[0], sections[1]


def load_night(path: str | Path, args: list[str] | None = None, now: dt.datetime | None = None) -> Night:
    """Read the nightly config, apply the command line, resolve the date, rewrite the pipeline
    config for that date and validate it with the pipeline's own schema."""
    day, nightly_overrides, pipeline_overrides = split_args(list(args or []))
    nightly_node, pipeline_node = _read_sections(path)
    try:
        settings: NightlySettings = OmegaConf.to_object(OmegaConf.merge(
            OmegaConf.structured(NightlySettings), nightly_node, OmegaConf.from_dotlist(nightly_overrides)))
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        raise NightlyError(_omegaconf_error("nightly", exc)) from None
    if not 0 <= settings.max_failed_fraction <= 1:
        raise NightlyError(f"nightly.max_failed_fraction must be in [0, 1], got {settings.max_failed_fraction}")
    try:
        pipeline = OmegaConf.to_container(OmegaConf.merge(pipeline_node, OmegaConf.from_dotlist(pipeline_overrides)),
                                          resolve=True)
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        raise NightlyError(_omegaconf_error("pipeline", exc)) from None
    fixed = sorted(k for k in RUNNER_OWNED if k in (pipeline.get("run") or {}))
    if fixed:
        raise NightlyError(f"pipeline.run.{fixed[0]} is set by the nightly runner (run id "
                           "<nightly.run_id_prefix>-<date>, resume on): remove it from the config and overrides")
    if_exists = pipeline["output"].get("if_exists") if isinstance(pipeline.get("output"), dict) else None
    if if_exists not in (None, "resume"):
        raise NightlyError(f"pipeline.output.if_exists={if_exists}: a night always resumes its own output (its "
                           "prefix and run id come from the date); to generate a night again, delete its prefix")

    day = day or default_date(settings, now)
    template = (pipeline.get("output") or {}).get("url") if isinstance(pipeline.get("output"), dict) else None
    pipeline = apply_date(pipeline, day)
    decoding = pipeline.get("decoding")
    if settings.warm_from_previous_night and isinstance(template, str) and isinstance(decoding or {}, dict) \
            and not (decoding or {}).get("warm_from"):
        pipeline["decoding"] = {**(decoding or {}),
                                "warm_from": fill_placeholders(template, day - dt.timedelta(days=1), "output.url")}
    pipeline["run"] = pipeline.get("run") or {}
    pipeline["run"]["run_id"] = f"{settings.run_id_prefix}-{day.isoformat()}"
    pipeline["run"]["resume"] = True
    try:
        config = from_dict(pipeline)
    except OmegaConfBaseException as exc:
        raise ConfigError("invalid config: " + _omegaconf_error("pipeline", exc)) from None
    validate(config)
    return Night(date=day, settings=settings, config=config)


def apply_date(pipeline: dict[str, Any], day: dt.date) -> dict[str, Any]:
    """Fill the date placeholders of input.urls and output.url (the only fields that take
    them); output.url must hold at least one. Anything malformed is left to the validator."""
    out = copy.deepcopy(pipeline)
    inputs = out.get("input")
    if isinstance(inputs, dict):
        urls = inputs.get("urls")
        if isinstance(urls, str):
            urls = [urls]
        if isinstance(urls, list):
            inputs["urls"] = [fill_placeholders(u, day, "input.urls") if isinstance(u, str) else u for u in urls]
    output = out.get("output")
    url = output.get("url") if isinstance(output, dict) else None
    if isinstance(url, str):
        filled = fill_placeholders(url, day, "output.url")
        if filled == url:
            raise NightlyError(f"pipeline.output.url {url!r} holds no date placeholder such as {{date}}: "
                               "every night must write its own prefix (and resume only its own rows)")
        output["url"] = filled
    return out


def check_warm_start(night: Night) -> str:
    """Keep decoding.warm_from when that output holds rows; else drop it (the first night, or a
    night after a gap: the job starts cold). Returns the line to log."""
    from pipeline.data.outputs import read_output  # imported here: it pulls in Ray
    from pipeline.data.storage import StorageError

    url = night.config.decoding.warm_from
    if not url:
        return "warm start: off (no decoding.warm_from)"
    try:
        rows = len(read_output(url, ["error"], max_rows=1))
    except StorageError as exc:
        rows, why = 0, f" ({exc})"
    else:
        why = ""
    if rows:
        return f"warm start: from {url}"
    night.config.decoding.warm_from = None
    return f"warm start: none, {url} holds no rows{why}; starting cold"


# ---------------------------------------------------------------------------------- report


def build_report(summary: dict[str, Any], night: Night) -> dict[str, Any]:
    """Judge the night from the pipeline's job summary.

    Row counts and the failed fraction cover the whole night's output (this attempt plus any
    earlier attempt it resumed), since a resumed attempt alone only sees the remainder.
    Throughput and tau describe this attempt, the only one whose timing we know."""
    this = summary.get("this_run", {})
    totals = summary.get("output") or {}
    have_totals = "rows_failed" in totals
    rows = int(totals["rows"] if have_totals else this.get("rows", 0))
    failed = int(totals["rows_failed"] if have_totals else this.get("rows_failed", 0))
    failed_fraction = failed / rows if rows else 0.0
    threshold = night.settings.max_failed_fraction
    reasons = []
    if rows == 0 and not night.settings.allow_empty:
        reasons.append("no rows: the night's input is empty (set nightly.allow_empty=true if that is expected)")
    if failed_fraction > threshold:
        reasons.append(f"failed fraction {failed_fraction:.4f} > max_failed_fraction {threshold}")
    tau = this.get("tau") or {}
    return {
        "date": night.date.isoformat(),
        "run_id": summary.get("run_id", night.config.run.run_id),
        "passed": not reasons,
        "reasons": reasons,
        "rows": rows,
        "rows_ok": rows - failed,
        "rows_failed": failed,
        "failed_fraction": failed_fraction,
        "max_failed_fraction": threshold,
        "this_attempt": {
            "rows": this.get("rows", 0),
            "rows_failed": this.get("rows_failed", 0),
            "rows_skipped_as_done": this.get("rows_skipped_as_done", 0),
            "generated_tokens": this.get("generated_tokens", 0),
            "wall_s": summary.get("wall_s"),
            "tokens_per_s": this.get("tokens_per_s"),
            "rows_per_s": this.get("rows_per_s"),
            "mean_tau": tau.get("mean"),
            "p50_tau": tau.get("p50"),
            "errors_by_kind": this.get("errors_by_kind", {}),
        },
        "duplicate_ids": (summary.get("duplicate_ids") or {}).get("count", 0),
        "input_urls": list(night.config.input.urls),
        "output_url": night.config.output.url,
        "mode": night.config.decoding.mode,
        "settings": asdict(night.settings),
    }


def _fmt(value: Any, spec: str = "") -> str:
    return "n/a" if value is None else format(value, spec)


def render_markdown(report: dict[str, Any]) -> str:
    a = report["this_attempt"]
    verdict = "PASSED" if report["passed"] else "FAILED: " + "; ".join(report["reasons"])
    lines = [
        f"# Nightly run {report['date']} ({report['run_id']}): {verdict}",
        "",
        "| figure | value |",
        "|---|---|",
        f"| rows (whole night) | {report['rows']} |",
        f"| rows ok / failed | {report['rows_ok']} / {report['rows_failed']} |",
        f"| failed fraction (max) | {report['failed_fraction']:.4f} ({report['max_failed_fraction']}) |",
        f"| rows this attempt (skipped as already done) | {a['rows']} ({a['rows_skipped_as_done']}) |",
        f"| generated tokens this attempt | {a['generated_tokens']} |",
        f"| tokens/s | {_fmt(a['tokens_per_s'], '.1f')} |",
        f"| mean tau (p50) | {_fmt(a['mean_tau'], '.2f')} ({_fmt(a['p50_tau'], '.2f')}) |",
        f"| wall time (s) | {_fmt(a['wall_s'], '.0f')} |",
        f"| duplicate ids | {report['duplicate_ids']} |",
        f"| decoding mode | {report['mode']} |",
        f"| output | {report['output_url']} |",
        "",
    ]
    if a["errors_by_kind"]:
        lines += ["Errors by kind (this attempt):", ""]
        lines += [f"- {kind}: {count}" for kind, count in a["errors_by_kind"].items()]
        lines.append("")
    return "\n".join(lines)


def write_report(report: dict[str, Any], output_url: str) -> list[str]:
    """Write the JSON and Markdown report next to the job's output; return their URLs."""
    fs, root = url_filesystem(output_url)
    fs.makedirs(root, exist_ok=True)
    written = []
    for name, text in ((REPORT_JSON, json.dumps(report, indent=1, default=str)),
                       (REPORT_MD, render_markdown(report))):
        path = f"{root.rstrip('/')}/{name}"
        fs.pipe_file(path, text.encode())
        written.append(f"{output_url.rstrip('/')}/{name}")
    return written


# ------------------------------------------------------------------------------------- run


def run_pipeline(config: PipelineConfig) -> dict[str, Any]:
    """The pipeline itself (imported here: it pulls in Ray). Tests replace this function."""
    from pipeline.data.storage import StorageError
    from pipeline.run import JobFailed, StartupError
    from pipeline.run import run_pipeline as run

    try:
        return run(config)
    except StartupError as exc:
        raise NightlyError(f"start-up: {exc}") from None
    except JobFailed as exc:  # an input or the output failed mid-run; rerunning tonight's job resumes it
        raise NightlyError(f"run: {exc}") from None
    except StorageError as exc:  # e.g. tonight's input partition is not there (yet)
        raise NightlyError(f"storage: {exc}") from None
