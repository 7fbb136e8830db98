"""jobs.nightly: date resolution, config rewriting, the report and the exit code.

The pipeline itself never runs here: `jobs.nightly.run_pipeline` is replaced by a fake that
returns a job summary shaped like pipeline.data.summary.build_summary's (and records its config).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobs import nightly
from pipeline.nightly import (
    REPORT_JSON,
    REPORT_MD,
    NightlyError,
    NightlySettings,
    build_report,
    default_date,
    fill_placeholders,
    load_night,
    parse_date,
)
from pipeline.settings.config import ConfigError

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "configs" / "nightly.yaml"

CONFIG = """
nightly:
  max_failed_fraction: 0.1
pipeline:
  input:
    urls: ["{root}/prompts/{{date}}/*.jsonl", "{root}/static/extra.jsonl"]
  model: {{target: default, draft_head: default, trie: default}}
  output:
    url: "{root}/out/{{year}}/{{month}}/{{day}}"
"""


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    path = tmp_path / "nightly.yaml"
    path.write_text(CONFIG.format(root=tmp_path.as_posix()))
    return path


def fake_summary(*, rows: int, failed: int, this_rows: int | None = None, this_failed: int = 0) -> dict:
    this_rows = rows if this_rows is None else this_rows
    return {
        "run_id": "nightly-2026-11-20",
        "wall_s": 100.0,
        "this_run": {"rows": this_rows, "rows_ok": this_rows - this_failed, "rows_failed": this_failed,
                     "rows_skipped_as_done": rows - this_rows, "generated_tokens": 5000, "rows_per_s": 1.0,
                     "tokens_per_s": 50.0, "tau": {"count": 3, "mean": 2.5, "p50": 2.4},
                     "errors_by_kind": {"prompt too long": this_failed} if this_failed else {}},
        "duplicate_ids": {"count": 0, "examples": []},
        "output": {"rows": rows, "distinct_row_keys": rows, "rows_ok": rows - failed, "rows_failed": failed},
    }


# ------------------------------------------------------------------------------------ dates


def test_parse_date_accepts_only_iso_calendar_dates():
    assert parse_date("2026-02-28") == dt.date(2026, 2, 28)
    for bad in ("2026-2-28", "20260228", "2026-02-30", "yesterday", "2026-02-28T00:00"):
        with pytest.raises(NightlyError, match="date"):
            parse_date(bad)


def test_default_date_is_utc_today_plus_offset():
    # 21:30 in New York on Nov 20 is already Nov 21 in UTC: the UTC date wins.
    evening_ny = dt.datetime(2026, 11, 20, 21, 30, tzinfo=dt.timezone(dt.timedelta(hours=-5)))
    assert default_date(NightlySettings(), evening_ny) == dt.date(2026, 11, 21)
    assert default_date(NightlySettings(date_offset_days=-1), evening_ny) == dt.date(2026, 11, 20)
    assert default_date(NightlySettings()) == dt.datetime.now(dt.timezone.utc).date()


@given(st.dates(min_value=dt.date(1970, 1, 1), max_value=dt.date(9999, 12, 31)))
def test_placeholders_spell_the_date(day):
    text = fill_placeholders("a/{date}/{date_compact}/{year}-{month}-{day}", day, "output.url")
    _, iso, compact, ymd = text.split("/")
    assert parse_date(iso) == day and parse_date(ymd) == day
    assert dt.datetime.strptime(compact, "%Y%m%d").date() == day


def test_unknown_placeholder_is_named():
    with pytest.raises(NightlyError, match=r"output\.url: unknown placeholder \{data\}"):
        fill_placeholders("s3://b/{data}", dt.date(2026, 1, 2), "output.url")
    assert fill_placeholders("s3://b/no-placeholder", dt.date(2026, 1, 2), "x") == "s3://b/no-placeholder"


# ----------------------------------------------------------------------------------- config


def test_load_night_rewrites_the_pipeline_config_for_the_date(config_path, tmp_path):
    night = load_night(config_path, ["date=2026-03-04", "decoding.mode=ar", "nightly.max_failed_fraction=0.2"])
    root = tmp_path.as_posix()
    assert night.date == dt.date(2026, 3, 4)
    assert night.config.input.urls == [f"{root}/prompts/2026-03-04/*.jsonl", f"{root}/static/extra.jsonl"]
    assert night.config.output.url == f"{root}/out/2026/03/04"
    assert night.config.run.run_id == "nightly-2026-03-04"
    assert night.config.run.resume is True
    assert night.config.decoding.mode == "ar"  # a pipeline override
    assert night.settings.max_failed_fraction == 0.2  # a nightly override beats the file's 0.1


def test_load_night_defaults_to_utc_today_and_explicit_date_ignores_offset(config_path):
    now = dt.datetime(2026, 1, 1, 0, 30, tzinfo=dt.timezone.utc)
    assert load_night(config_path, [], now=now).date == dt.date(2026, 1, 1)
    assert load_night(config_path, ["nightly.date_offset_days=-1"], now=now).date == dt.date(2025, 12, 31)
    assert load_night(config_path, ["nightly.date_offset_days=-1", "date=2026-05-05"], now=now).date == \
        dt.date(2026, 5, 5)


def test_same_date_gives_same_run_and_prefix_so_reruns_resume(config_path):
    first = load_night(config_path, ["date=2026-03-04"])
    again = load_night(config_path, ["date=2026-03-04", "resources.num_workers=3"])
    other = load_night(config_path, ["date=2026-03-05"])
    assert (first.config.run.run_id, first.config.output.url) == (again.config.run.run_id, again.config.output.url)
    assert first.config.output.url != other.config.output.url and first.config.run.run_id != other.config.run.run_id


@pytest.mark.parametrize(("args", "message"), [
    (["output.url=/tmp/static"], "holds no date placeholder"),
    (["run.run_id=mine"], r"run\.run_id is set by the nightly runner"),
    (["run.resume=false"], r"run\.resume is set by the nightly runner"),
    (["nightly.max_failed_fraction=1.5"], r"must be in \[0, 1\]"),
    (["nightly.no_such_key=1"], r"nightly\.no_such_key"),
    (["date=2026-13-01"], "not a calendar date"),
    (["decoding.mode"], "expected key=value"),
    (["output.url=/tmp/{when}"], r"unknown placeholder \{when\}"),
])
def test_load_night_rejects_bad_arguments(config_path, args, message):
    with pytest.raises(NightlyError, match=message):
        load_night(config_path, args)


def test_pipeline_schema_errors_come_from_the_pipeline_validator(config_path):
    with pytest.raises(ConfigError, match=r"pipeline\.model\.nope"):
        load_night(config_path, ["model.nope=1"])
    with pytest.raises(ConfigError, match=r"decoding\.mode"):
        load_night(config_path, ["decoding.mode=fast"])


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(NightlyError, match="does not exist"):
        load_night(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nightly: {}\npipeline: {}\nextra: 1\n")
    with pytest.raises(NightlyError, match=r"unknown top-level keys \['extra'\]"):
        load_night(bad)
    bad.write_text("pipeline: [1, 2]\n")
    with pytest.raises(NightlyError, match="'pipeline' must be a mapping"):
        load_night(bad)


def test_shipped_nightly_config_validates():
    night = load_night(SHIPPED, ["date=2026-11-21"])
    assert night.config.output.url.endswith("/2026-11-21")
    assert all("{" not in url for url in night.config.input.urls)
    assert night.config.run.run_id == "nightly-2026-11-21"
    assert night.settings == NightlySettings()  # the file documents the defaults


# ----------------------------------------------------------------------------------- report


def _night(config_path, *args):
    return load_night(config_path, ["date=2026-11-20", *args])


def test_report_uses_whole_night_totals_and_this_attempts_speed(config_path):
    # A resumed attempt: 60 of 100 rows were written by the first attempt (with 8 failures).
    summary = fake_summary(rows=100, failed=10, this_rows=40, this_failed=2)
    report = build_report(summary, _night(config_path))
    assert (report["rows"], report["rows_ok"], report["rows_failed"]) == (100, 90, 10)
    assert report["failed_fraction"] == pytest.approx(0.10)
    assert report["passed"]  # 0.10 is not above the file's threshold 0.1
    assert report["this_attempt"]["rows_skipped_as_done"] == 60
    assert report["this_attempt"]["tokens_per_s"] == 50.0 and report["this_attempt"]["mean_tau"] == 2.5


@pytest.mark.parametrize(("failed", "passed"), [(0, True), (10, True), (11, False), (100, False)])
def test_threshold_is_inclusive(config_path, failed, passed):
    report = build_report(fake_summary(rows=100, failed=failed), _night(config_path))
    assert report["passed"] is passed
    assert bool(report["reasons"]) is not passed


def test_empty_night_fails_unless_allowed(config_path):
    assert not build_report(fake_summary(rows=0, failed=0), _night(config_path))["passed"]
    assert build_report(fake_summary(rows=0, failed=0), _night(config_path, "nightly.allow_empty=true"))["passed"]


def test_report_falls_back_to_this_run_without_output_totals(config_path):
    summary = fake_summary(rows=10, failed=5)
    summary["output"] = {"rows": 0}  # what the pipeline writes when it could not read its output back
    report = build_report(summary, _night(config_path))
    assert (report["rows"], report["rows_failed"]) == (10, 0)


# ------------------------------------------------------------------------------------- main


@pytest.fixture
def fake_pipeline(monkeypatch):
    calls = []

    def install(summary=None, error=None):
        def run(config):
            calls.append(config)
            if error:
                raise error
            return summary

        monkeypatch.setattr(nightly, "run_pipeline", run)
        return calls

    return install


@pytest.mark.parametrize(("failed", "code"), [(3, 0), (20, 1)])
def test_main_writes_reports_and_exits_by_threshold(config_path, tmp_path, fake_pipeline, capsys, failed, code):
    calls = fake_pipeline(fake_summary(rows=100, failed=failed))
    assert nightly.main([str(config_path), "date=2026-11-20"]) == code
    assert len(calls) == 1 and calls[0].run.run_id == "nightly-2026-11-20" and calls[0].run.resume
    out_dir = tmp_path / "out" / "2026" / "11" / "20"
    report = json.loads((out_dir / REPORT_JSON).read_text())
    assert report["passed"] is (code == 0)
    assert report["rows_failed"] == failed and report["date"] == "2026-11-20"
    markdown = (out_dir / REPORT_MD).read_text()
    verdict = "PASSED" if code == 0 else "FAILED"
    assert markdown.startswith(f"# Nightly run 2026-11-20 (nightly-2026-11-20): {verdict}")
    assert "| tokens/s | 50.0 |" in markdown and "| mean tau (p50) | 2.50 (2.40) |" in markdown
    assert str(out_dir / REPORT_JSON) in capsys.readouterr().out


def test_main_config_and_startup_errors_exit_2_without_a_report(config_path, tmp_path, fake_pipeline, capsys):
    calls = fake_pipeline(error=NightlyError("start-up: model.trie 's3://x': not found"))
    assert nightly.main([str(config_path), "date=2026-11-20"]) == 2
    assert "start-up: model.trie" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert nightly.main([str(config_path), "decoding.mode=nope"]) == 2
    assert len(calls) == 1  # the bad config never reached the pipeline


def test_dry_run_prints_the_resolved_config_and_runs_nothing(config_path, fake_pipeline, capsys):
    calls = fake_pipeline(fake_summary(rows=1, failed=0))
    assert nightly.main([str(config_path), "--dry-run", "date=2026-11-20"]) == 0
    out = capsys.readouterr().out
    assert "run_id: nightly-2026-11-20" in out and "/prompts/2026-11-20/*.jsonl" in out
    assert calls == []


def test_pipeline_start_up_storage_and_run_errors_become_nightly_errors(config_path, monkeypatch):
    try:
        import pipeline.run as pipeline_run
        from pipeline.data.storage import StorageError
    except Exception as exc:  # the pipeline package is still being assembled elsewhere
        pytest.skip(f"pipeline.run does not import: {exc}")
    night = _night(config_path)
    for error, prefix in ((pipeline_run.StartupError("model.trie: missing"), "start-up"),
                          (StorageError("no files match s3://b/2026-11-20/*.jsonl"), "storage"),
                          (pipeline_run.JobFailed("cannot read s3://b/2026-11-20/a.jsonl: OSError: reset"), "run")):
        def fail(config, error=error):
            raise error

        monkeypatch.setattr(pipeline_run, "run_pipeline", fail)
        with pytest.raises(NightlyError, match=f"^{prefix}: "):
            nightly.run_pipeline(night.config)


WARM = "nightly.warm_from_previous_night=true"


def test_the_previous_nights_output_warms_the_job_unless_warm_from_is_given(config_path, tmp_path):
    night = load_night(config_path, ["date=2026-11-20", WARM])
    assert night.config.decoding.warm_from == f"{tmp_path.as_posix()}/out/2026/11/19"
    given = load_night(config_path, ["date=2026-11-20", WARM, "decoding.warm_from=s3://b/x"])
    assert given.config.decoding.warm_from == "s3://b/x"
    assert load_night(config_path, ["date=2026-11-20"]).config.decoding.warm_from is None  # opt-in


def test_a_night_without_a_previous_output_starts_cold(config_path, tmp_path, fake_pipeline, capsys):
    import pyarrow.parquet as pq

    from pipeline.data.outputs import OUTPUT_SCHEMA

    calls = fake_pipeline(fake_summary(rows=10, failed=0))
    assert nightly.main([str(config_path), "date=2026-11-20", WARM]) == 0
    assert calls[0].decoding.warm_from is None
    assert "holds no rows" in capsys.readouterr().out
    previous = tmp_path / "out" / "2026" / "11" / "19"
    previous.mkdir(parents=True)
    row = {name: None for name in OUTPUT_SCHEMA.names} | {"row_key": "k", "run_id": "nightly-2026-11-19",
                                                          "text": "hello"}
    pq.write_table(pa_table([row]), previous / "part-0123456789abcdef0123.parquet")
    assert nightly.main([str(config_path), "date=2026-11-20", WARM]) == 0
    assert calls[1].decoding.warm_from == previous.as_posix()
    assert f"warm start: from {previous.as_posix()}" in capsys.readouterr().out


def pa_table(rows):
    import pyarrow as pa

    from pipeline.data.outputs import OUTPUT_SCHEMA

    return pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA)
