"""Start tonight's RayJob and wait for it: the nightly schedule on clusters without RayCronJob.

    python -m jobs.nightly_submit /etc/dart-batch/rayjob.yaml                       # in the CronJob pod
    python -m jobs.nightly_submit k8s/rayjob.yaml --date 2026-11-20 --print | kubectl -n dart-batch create -f -

A plain Kubernetes CronJob (k8s/cronjob.yaml, concurrencyPolicy Forbid) runs this in a pod
with a ServiceAccount that may only create, get and list RayJobs in its namespace. It:

1. resolves the night's date the way jobs.nightly does (today in UTC + date_offset_days of
   the nightly config, which it also validates, so a broken config fails here and not after
   a GPU cluster came up), unless --date is given;
2. lists the nightly RayJobs (by label) and decides: another night's run still active ->
   refuse to start (no overlapping runs, even if an earlier CronJob pod was killed while its
   RayJob went on); this night's run active -> follow it; this night already succeeded ->
   nothing to do; otherwise create attempt n+1 (up to --max-attempts). Every attempt of a
   night has the same run id and output prefix, so a new attempt resumes the last one;
3. creates the RayJob from the template (k8s/rayjob.yaml: its cluster, submitter and
   deadlines), with name <name>-<date>-<attempt>, the nightly labels, the entrypoint
   `python -m jobs.nightly <config> date=<date>` and --active-deadline-seconds;
4. polls it until KubeRay reports an end state and exits 0 if the Ray job SUCCEEDED, else 1,
   so that the CronJob's Job history shows every night's verdict.

The Kubernetes API is reached with the pod's own ServiceAccount token (in-cluster config);
no client library is needed beyond the standard library.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import re
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline.nightly import NightlyError, load_night, parse_date
from pipeline.settings.config import ConfigError

GROUP_VERSION = "ray.io/v1"
PART_OF_LABEL = "app.kubernetes.io/part-of"
PART_OF_VALUE = "dart-batch-nightly"
DATE_LABEL = "dart-batch/nightly-date"
ATTEMPT_LABEL = "dart-batch/nightly-attempt"
IMAGE_CONFIG = "/home/ray/dart-batch/configs/nightly.yaml"
# KubeRay's end states of a RayJob deployment; the Ray job's own verdict is status.jobStatus.
FINISHED_STATES = {"Complete", "Failed", "ValidationFailed"}
MAX_RAYJOB_NAME = 47  # KubeRay appends 6 characters for the cluster name and caps that at 53
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class SubmitError(RuntimeError):
    """The night cannot be started or followed; the message says why."""


# ---------------------------------------------------------------------- the RayJob to create


def rayjob_name(prefix: str, day: dt.date, attempt: int) -> str:
    name = f"{prefix}-{day.isoformat()}-{attempt}"
    if len(name) > MAX_RAYJOB_NAME or not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):
        raise SubmitError(f"RayJob name {name!r} must be a DNS-1035 label of at most {MAX_RAYJOB_NAME} "
                          "characters: shorten --name")
    return name


def render_rayjob(template: dict[str, Any], *, prefix: str, day: dt.date, attempt: int, config: str,
                  active_deadline_s: int) -> dict[str, Any]:
    """The night's RayJob: the template's spec with the nightly name, labels, entrypoint and
    deadline. Everything that describes the cluster comes from the template unchanged."""
    if template.get("apiVersion") != GROUP_VERSION or template.get("kind") != "RayJob":
        raise SubmitError(f"the template must be a {GROUP_VERSION} RayJob, got "
                          f"{template.get('apiVersion')}/{template.get('kind')}")
    if not isinstance(template.get("spec"), dict) or "rayClusterSpec" not in template["spec"]:
        raise SubmitError("the template RayJob has no spec.rayClusterSpec")
    spec = copy.deepcopy(template["spec"])
    spec["entrypoint"] = f"python -m jobs.nightly {config} date={day.isoformat()}"
    spec["activeDeadlineSeconds"] = int(active_deadline_s)
    labels = dict((template.get("metadata") or {}).get("labels") or {})
    labels.update({PART_OF_LABEL: PART_OF_VALUE, DATE_LABEL: day.isoformat(), ATTEMPT_LABEL: str(attempt),
                   "app.kubernetes.io/component": "nightly"})
    return {"apiVersion": GROUP_VERSION, "kind": "RayJob",
            "metadata": {"name": rayjob_name(prefix, day, attempt), "labels": labels}, "spec": spec}


# ------------------------------------------------------------------------------- the decision


def _labels(job: dict[str, Any]) -> dict[str, str]:
    return (job.get("metadata") or {}).get("labels") or {}


def _name(job: dict[str, Any]) -> str:
    return (job.get("metadata") or {}).get("name", "?")


def is_finished(job: dict[str, Any]) -> bool:
    return (job.get("status") or {}).get("jobDeploymentStatus") in FINISHED_STATES


def succeeded(job: dict[str, Any]) -> bool:
    return is_finished(job) and (job.get("status") or {}).get("jobStatus") == "SUCCEEDED"


@dataclass
class Plan:
    action: str  # create | follow | done | busy | give-up
    name: str | None = None
    attempt: int | None = None
    reason: str = ""


def plan_night(jobs: list[dict[str, Any]], day: dt.date, max_attempts: int) -> Plan:
    """What to do for `day`, given every nightly RayJob of the namespace."""
    tonight = [j for j in jobs if _labels(j).get(DATE_LABEL) == day.isoformat()]
    others_active = [j for j in jobs if j not in tonight and not is_finished(j)]
    if others_active:
        other = others_active[0]
        return Plan("busy", _name(other), reason=f"the run of {_labels(other).get(DATE_LABEL)} ({_name(other)}) "
                                                 "is still active: nightly runs never overlap")
    active = [j for j in tonight if not is_finished(j)]
    if active:
        return Plan("follow", _name(active[0]), reason="this night's run is already active")
    done = [j for j in tonight if succeeded(j)]
    if done:
        return Plan("done", _name(done[0]), reason="this night already succeeded")
    attempts = [int(_labels(j).get(ATTEMPT_LABEL, "0") or 0) for j in tonight]
    if len(tonight) >= max_attempts:
        return Plan("give-up", reason=f"{len(tonight)} attempts of this night failed (max {max_attempts})")
    return Plan("create", attempt=max(attempts, default=0) + 1,
                reason=f"attempt {len(tonight) + 1} of {max_attempts}" + (" (resumes)" if tonight else ""))


# ----------------------------------------------------------------------- the Kubernetes API


class KubeApi:
    """Just enough of the Kubernetes REST API for RayJobs, with in-cluster credentials."""

    def __init__(self, base_url: str, namespace: str, token_path: Path, ca_path: Path | None = None):
        self.base_url = base_url.rstrip("/")
        self.namespace = namespace
        self.token_path = token_path
        self.context = ssl.create_default_context(cafile=str(ca_path) if ca_path else None)

    @classmethod
    def in_cluster(cls, namespace: str | None = None) -> KubeApi:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host or not (SERVICE_ACCOUNT_DIR / "token").is_file():
            raise SubmitError("not running in a Kubernetes pod with a ServiceAccount token "
                              "(outside a cluster, use --print and kubectl)")
        host = f"[{host}]" if ":" in host else host
        namespace = namespace or (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip()
        return cls(f"https://{host}:{port}", namespace, SERVICE_ACCOUNT_DIR / "token", SERVICE_ACCOUNT_DIR / "ca.crt")

    def _path(self, name: str = "") -> str:
        return f"/apis/{GROUP_VERSION}/namespaces/{self.namespace}/rayjobs" + (f"/{name}" if name else "")

    def _request(self, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
        # The token is read at every call: projected ServiceAccount tokens are rotated.
        request = urllib.request.Request(
            self.base_url + path, method=method, data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.token_path.read_text().strip()}",
                     "Accept": "application/json", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, context=self.context, timeout=30) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("message", "")
            except ValueError:
                message = ""
            raise SubmitError(f"{method} {path}: HTTP {exc.code} {message or exc.reason}") from None

    def list_nightly(self) -> list[dict[str, Any]]:
        query = urllib.parse.urlencode({"labelSelector": f"{PART_OF_LABEL}={PART_OF_VALUE}"})
        return self._request("GET", f"{self._path()}?{query}").get("items", [])

    def get(self, name: str) -> dict[str, Any]:
        return self._request("GET", self._path(name))

    def create(self, job: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", self._path(), job)


def wait_for(api: KubeApi, name: str, poll_s: float, sleep: Callable[[float], None] = time.sleep,
             max_errors: int = 10) -> dict[str, Any]:
    """Poll the RayJob until it is finished; a few failed polls in a row are tolerated."""
    errors, last = 0, None
    while True:
        try:
            job = api.get(name)
            errors = 0
        except (SubmitError, OSError) as exc:
            errors += 1
            if errors >= max_errors:
                raise SubmitError(f"lost track of RayJob {name}: {exc}") from None
            print(f"warning: polling {name} failed ({exc}); retrying", file=sys.stderr, flush=True)
            sleep(poll_s)
            continue
        status = job.get("status") or {}
        state = (status.get("jobDeploymentStatus"), status.get("jobStatus"))
        if state != last:
            print(f"{name}: deployment {state[0] or 'New'}, job {state[1] or '-'}", flush=True)
            last = state
        if is_finished(job):
            return job
        sleep(poll_s)


# -------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.nightly_submit", description=__doc__.split("\n\n")[0])
    parser.add_argument("template", help="a RayJob manifest (k8s/rayjob.yaml) whose cluster the night uses")
    parser.add_argument("--config", default=IMAGE_CONFIG,
                        help=f"the nightly config, as a path inside the image (default {IMAGE_CONFIG})")
    parser.add_argument("--date", help="YYYY-MM-DD (default: today in UTC + nightly.date_offset_days of --config)")
    parser.add_argument("--name", default="dart-batch-nightly", help="RayJob name prefix")
    parser.add_argument("--namespace", help="default: the pod's own namespace")
    parser.add_argument("--active-deadline-seconds", type=int, default=79_200,
                        help="the RayJob's deadline (default 22 h: with a 1 h TTL a night ends before the next)")
    parser.add_argument("--max-attempts", type=int, default=3, help="attempts per night, retries included")
    parser.add_argument("--poll-seconds", type=float, default=60.0)
    parser.add_argument("--print", action="store_true", help="print the RayJob for --date as YAML and exit")
    return parser.parse_args(argv)


def night_date(args: argparse.Namespace) -> dt.date:
    if args.date:
        return parse_date(args.date)
    if not Path(args.config).is_file():
        raise NightlyError(f"nightly config {args.config} not found here: pass --date")
    return load_night(args.config).date  # also validates the whole config


def main(argv: list[str] | None = None, api: KubeApi | None = None,
         sleep: Callable[[float], None] = time.sleep) -> int:
    args = parse_args(argv)
    try:
        day = night_date(args)
        template = yaml.safe_load(Path(args.template).read_text())
        if args.print:
            job = render_rayjob(template, prefix=args.name, day=day, attempt=1, config=args.config,
                                active_deadline_s=args.active_deadline_seconds)
            print(yaml.safe_dump(job, sort_keys=False), end="")
            return 0
        render_rayjob(template, prefix=args.name, day=day, attempt=1, config=args.config,
                      active_deadline_s=args.active_deadline_seconds)  # a bad template fails before any API call
    except (NightlyError, ConfigError, SubmitError, OSError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    try:
        api = api or KubeApi.in_cluster(args.namespace)
        plan = plan_night(api.list_nightly(), day, args.max_attempts)
        print(f"night {day}: {plan.action} {plan.name or ''} {plan.reason}".rstrip(), flush=True)
        if plan.action in ("busy", "give-up"):
            return 1
        if plan.action == "done":
            return 0
        name = plan.name
        if plan.action == "create":
            job = render_rayjob(template, prefix=args.name, day=day, attempt=plan.attempt, config=args.config,
                                active_deadline_s=args.active_deadline_seconds)
            name = api.create(job)["metadata"]["name"]
            print(f"created RayJob {name}", flush=True)
        final = wait_for(api, name, args.poll_seconds, sleep)
    except SubmitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    status = final.get("status") or {}
    if succeeded(final):
        print(f"{name}: SUCCEEDED", flush=True)
        return 0
    print(f"{name}: {status.get('jobDeploymentStatus')} / {status.get('jobStatus') or '-'}: "
          f"{status.get('reason') or ''} {status.get('message') or ''}".rstrip(), file=sys.stderr)
    return 1
