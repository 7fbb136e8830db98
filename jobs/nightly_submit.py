"""Start tonight's RayJob and wait for it: the nightly schedule on clusters without RayCronJob.

    python -m jobs.nightly_submit /etc/dart-batch/rayjob.yaml                       # in the CronJob pod
    python -m jobs.nightly_submit k8s/rayjob.yaml --date 2026-11-20 --print | kubectl -n dart-batch create -f -

What it does and how: pipeline/nightly_submit.py.
"""

from __future__ import annotations

from pipeline.nightly_submit import main

if __name__ == "__main__":
    raise SystemExit(main())
