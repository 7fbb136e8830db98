"""Nightly batch job: `python -m jobs.nightly configs/nightly.yaml [date=YYYY-MM-DD] [key=value ...]`.

    python -m jobs.nightly configs/nightly.yaml                          # today (UTC) + date_offset_days
    python -m jobs.nightly configs/nightly.yaml date=2026-11-20          # a given night (backfill, rerun)
    python -m jobs.nightly configs/nightly.yaml nightly.max_failed_fraction=0.1 decoding.mode=ar
    python -m jobs.nightly configs/nightly.yaml --dry-run                # print the resolved config only

What a night does (placeholders, run id, resume, the report): pipeline/nightly.py.

Exit codes, so that a scheduler (RayJob, CronJob) sees a bad night as a failed job:
0 the night passed; 1 the failed-row fraction over the whole night's output exceeded
nightly.max_failed_fraction (or the night had no rows and allow_empty is false);
2 a config, start-up or storage error (e.g. the night's input is not there).
"""

from __future__ import annotations

import sys

from omegaconf import OmegaConf

from pipeline.nightly import (
    NightlyError,
    build_report,
    check_warm_start,
    load_night,
    render_markdown,
    run_pipeline,
    write_report,
)
from pipeline.settings.config import ConfigError, to_dict


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    dry_run = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    try:
        night = load_night(argv[0], argv[1:])
        if dry_run:
            print(OmegaConf.to_yaml(to_dict(night.config)), end="")
            return 0
        print(f"nightly {night.date}: run {night.config.run.run_id}, output {night.config.output.url}", flush=True)
        if night.settings.warm_from_previous_night:
            print(check_warm_start(night), flush=True)
        summary = run_pipeline(night.config)
    except (NightlyError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = build_report(summary, night)
    paths = write_report(report, night.config.output.url)
    print(render_markdown(report))
    print("report: " + ", ".join(paths))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
