"""jobs.nightly_submit: the RayJob it renders, what it decides, how it follows the run, and its
Kubernetes API client (against a small HTTP server on 127.0.0.1 that plays the API server)."""

from __future__ import annotations

import copy
import datetime as dt
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from pipeline import nightly_submit
from pipeline.nightly_submit import (
    ATTEMPT_LABEL,
    DATE_LABEL,
    PART_OF_LABEL,
    PART_OF_VALUE,
    KubeApi,
    SubmitError,
    plan_night,
    rayjob_name,
    render_rayjob,
    wait_for,
)

REPO = Path(__file__).resolve().parent.parent
TEMPLATE_PATH = REPO / "k8s" / "rayjob.yaml"
TEMPLATE = yaml.safe_load(TEMPLATE_PATH.read_text())
NIGHT = dt.date(2026, 11, 21)
CONFIG = "/home/ray/dart-batch/configs/nightly.yaml"


def job(day: str, attempt: int, deployment: str = "", status: str = "") -> dict:
    return {"metadata": {"name": f"dart-batch-nightly-{day}-{attempt}",
                         "labels": {PART_OF_LABEL: PART_OF_VALUE, DATE_LABEL: day, ATTEMPT_LABEL: str(attempt)}},
            "status": {"jobDeploymentStatus": deployment, "jobStatus": status}}


# ----------------------------------------------------------------------------------- render


def test_render_keeps_the_cluster_and_sets_name_labels_entrypoint_deadline():
    before = copy.deepcopy(TEMPLATE)
    rendered = render_rayjob(TEMPLATE, prefix="dart-batch-nightly", day=NIGHT, attempt=2, config=CONFIG,
                             active_deadline_s=79_200)
    assert before == TEMPLATE  # the template is not modified
    assert rendered["metadata"]["name"] == "dart-batch-nightly-2026-11-21-2"
    labels = rendered["metadata"]["labels"]
    assert (labels[DATE_LABEL], labels[ATTEMPT_LABEL], labels[PART_OF_LABEL]) == ("2026-11-21", "2", PART_OF_VALUE)
    assert labels["app.kubernetes.io/name"] == "dart-batch"  # the template's labels are kept
    spec = rendered["spec"]
    assert spec["entrypoint"] == f"python -m jobs.nightly {CONFIG} date=2026-11-21"
    assert spec["activeDeadlineSeconds"] == 79_200
    for key in ("rayClusterSpec", "submitterPodTemplate", "shutdownAfterJobFinishes", "ttlSecondsAfterFinished"):
        assert spec[key] == TEMPLATE["spec"][key]
    assert "namespace" not in rendered["metadata"]  # the API path decides the namespace


def test_render_rejects_templates_that_are_not_rayjobs():
    with pytest.raises(SubmitError, match=r"must be a ray\.io/v1 RayJob"):
        render_rayjob({"apiVersion": "batch/v1", "kind": "Job"}, prefix="p", day=NIGHT, attempt=1, config=CONFIG,
                      active_deadline_s=1)
    with pytest.raises(SubmitError, match=r"no spec\.rayClusterSpec"):
        render_rayjob({"apiVersion": "ray.io/v1", "kind": "RayJob", "spec": {"entrypoint": "x"}}, prefix="p",
                      day=NIGHT, attempt=1, config=CONFIG, active_deadline_s=1)


def test_rayjob_names_must_fit_kuberay():
    assert rayjob_name("n", NIGHT, 12) == "n-2026-11-21-12"
    with pytest.raises(SubmitError, match="at most 47"):
        rayjob_name("a-very-long-prefix-for-the-nightly-job", NIGHT, 1)
    with pytest.raises(SubmitError, match="DNS-1035"):
        rayjob_name("Nightly", NIGHT, 1)


# ------------------------------------------------------------------------------------- plan


@pytest.mark.parametrize(("jobs", "action", "attempt"), [
    ([], "create", 1),
    ([job("2026-11-20", 1, "Complete", "SUCCEEDED")], "create", 1),  # yesterday ended: go
    ([job("2026-11-20", 1, "Failed", "FAILED")], "create", 1),
    ([job("2026-11-20", 2, "Running", "RUNNING")], "busy", None),  # yesterday still running: no overlap
    ([job("2026-11-20", 1, "", "")], "busy", None),  # just created, no status yet
    ([job("2026-11-21", 1, "Initializing")], "follow", None),
    ([job("2026-11-21", 1, "Failed", "FAILED")], "create", 2),  # a new attempt resumes the night
    ([job("2026-11-21", 1, "ValidationFailed")], "create", 2),
    ([job("2026-11-21", 1, "Failed", "FAILED"), job("2026-11-21", 4, "Complete", "STOPPED")], "create", 5),
    ([job("2026-11-21", 1, "Failed", "FAILED"), job("2026-11-21", 2, "Complete", "SUCCEEDED")], "done", None),
    ([job("2026-11-21", a, "Failed", "FAILED") for a in (1, 2, 3)], "give-up", None),
])
def test_plan_night(jobs, action, attempt):
    plan = plan_night(jobs, NIGHT, max_attempts=3)
    assert plan.action == action and plan.attempt == attempt, plan


# ------------------------------------------------------------------------------------- main


class FakeApi:
    """The three calls the submitter makes, over an in-memory list; each get() advances the
    created job through the given status sequence."""

    def __init__(self, jobs=(), statuses=(("Initializing", ""), ("Running", "RUNNING"), ("Complete", "SUCCEEDED"))):
        self.jobs = [copy.deepcopy(j) for j in jobs]
        self.statuses = list(statuses)
        self.created = []
        self.gets = 0

    def list_nightly(self):
        return copy.deepcopy(self.jobs)

    def create(self, body):
        self.created.append(body)
        self.jobs.append(copy.deepcopy(body))
        return body

    def get(self, name):
        self.gets += 1
        (found,) = [j for j in self.jobs if j["metadata"]["name"] == name]
        if self.statuses:
            deployment, status = self.statuses.pop(0)
            found["status"] = {"jobDeploymentStatus": deployment, "jobStatus": status}
        return copy.deepcopy(found)


def run_main(api, *args):
    sleeps = []
    code = nightly_submit.main([str(TEMPLATE_PATH), "--date", "2026-11-21", *args], api=api, sleep=sleeps.append)
    return code, sleeps


def test_main_creates_the_night_and_follows_it_to_success(capsys):
    api = FakeApi()
    code, sleeps = run_main(api, "--poll-seconds", "7")
    assert code == 0
    (created,) = api.created
    assert created["metadata"]["name"] == "dart-batch-nightly-2026-11-21-1"
    assert created["spec"]["entrypoint"].endswith("date=2026-11-21")
    assert api.gets == 3 and sleeps == [7.0, 7.0]
    out = capsys.readouterr().out
    assert "deployment Running, job RUNNING" in out and "SUCCEEDED" in out


def test_main_exits_1_when_the_ray_job_fails(capsys):
    api = FakeApi(statuses=[("Running", "RUNNING"), ("Failed", "FAILED")])
    assert run_main(api)[0] == 1
    assert "Failed / FAILED" in capsys.readouterr().err


def test_main_never_overlaps_and_never_redoes_a_finished_night():
    busy = FakeApi(jobs=[job("2026-11-20", 1, "Running", "RUNNING")])
    assert run_main(busy)[0] == 1 and busy.created == [] and busy.gets == 0
    done = FakeApi(jobs=[job("2026-11-21", 1, "Complete", "SUCCEEDED")])
    assert run_main(done)[0] == 0 and done.created == []


def test_main_follows_an_active_attempt_instead_of_creating_one():
    api = FakeApi(jobs=[job("2026-11-21", 2, "Running", "RUNNING")])
    assert run_main(api)[0] == 0 and api.created == []


def test_main_print_needs_no_cluster(capsys):
    assert nightly_submit.main([str(TEMPLATE_PATH), "--date", "2026-11-21", "--print"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["kind"] == "RayJob" and printed["metadata"]["name"] == "dart-batch-nightly-2026-11-21-1"


def test_main_default_date_comes_from_the_nightly_config(capsys):
    before = dt.datetime.now(dt.timezone.utc).date()
    code = nightly_submit.main([str(TEMPLATE_PATH), "--config", str(REPO / "configs" / "nightly.yaml"), "--print"])
    after = dt.datetime.now(dt.timezone.utc).date()
    assert code == 0
    name = yaml.safe_load(capsys.readouterr().out)["metadata"]["name"]
    assert name in {f"dart-batch-nightly-{d.isoformat()}-1" for d in (before, after)}


@pytest.mark.parametrize("args", [["--date", "21/11/2026"], ["--config", "/nowhere/nightly.yaml"]])
def test_main_bad_arguments_exit_2_before_any_api_call(args, capsys):
    api = FakeApi()
    argv = [str(TEMPLATE_PATH), *args]
    assert nightly_submit.main(argv, api=api) == 2 and api.created == [] and api.gets == 0
    assert "error:" in capsys.readouterr().err


def test_main_outside_a_cluster_says_so(monkeypatch, capsys):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert nightly_submit.main([str(TEMPLATE_PATH), "--date", "2026-11-21"]) == 1
    assert "not running in a Kubernetes pod" in capsys.readouterr().err


def test_wait_for_tolerates_a_few_failed_polls_then_gives_up():
    class Flaky(FakeApi):
        def __init__(self, failures):
            super().__init__(jobs=[job("2026-11-21", 1)], statuses=[("Complete", "SUCCEEDED")])
            self.failures = failures

        def get(self, name):
            if self.failures:
                self.failures -= 1
                raise SubmitError("GET: HTTP 503 unavailable")
            return super().get(name)

    name = "dart-batch-nightly-2026-11-21-1"
    assert wait_for(Flaky(3), name, 1, sleep=lambda _: None, max_errors=4)["status"]["jobStatus"] == "SUCCEEDED"
    with pytest.raises(SubmitError, match="lost track"):
        wait_for(Flaky(4), name, 1, sleep=lambda _: None, max_errors=4)


# ------------------------------------------------------------------------------- API client


@pytest.fixture
def api_server(tmp_path):
    """A stand-in API server: stores RayJobs POSTed to it, lists them by label, checks the token."""
    store, seen = {}, []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            seen.append(("GET", self.path, self.headers["Authorization"]))
            url = urllib.parse.urlparse(self.path)
            base = "/apis/ray.io/v1/namespaces/night/rayjobs"
            if url.path == base:
                selector = urllib.parse.parse_qs(url.query)["labelSelector"][0]
                key, value = selector.split("=")
                self.reply(200, {"items": [j for j in store.values() if j["metadata"]["labels"].get(key) == value]})
            elif url.path.removeprefix(base + "/") in store:
                self.reply(200, store[url.path.removeprefix(base + "/")])
            else:
                self.reply(404, {"kind": "Status", "message": "rayjobs.ray.io not found"})

        def do_POST(self):
            seen.append(("POST", self.path, self.headers["Authorization"]))
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            name = body["metadata"]["name"]
            if name in store:
                self.reply(409, {"kind": "Status", "message": f'rayjobs.ray.io "{name}" already exists'})
                return
            store[name] = body
            self.reply(201, body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    token = tmp_path / "token"
    token.write_text("secret-token\n")
    try:
        yield KubeApi(f"http://127.0.0.1:{server.server_address[1]}", "night", token), seen
    finally:
        server.shutdown()
        server.server_close()


def test_kube_api_create_list_get_and_errors(api_server):
    api, seen = api_server
    body = render_rayjob(TEMPLATE, prefix="dart-batch-nightly", day=NIGHT, attempt=1, config=CONFIG,
                         active_deadline_s=100)
    assert api.create(body)["metadata"]["name"] == "dart-batch-nightly-2026-11-21-1"
    assert [j["metadata"]["name"] for j in api.list_nightly()] == ["dart-batch-nightly-2026-11-21-1"]
    assert api.get("dart-batch-nightly-2026-11-21-1")["spec"]["activeDeadlineSeconds"] == 100
    with pytest.raises(SubmitError, match=r"HTTP 409 .*already exists"):
        api.create(body)
    with pytest.raises(SubmitError, match=r"HTTP 404 rayjobs\.ray\.io not found"):
        api.get("missing")
    assert all(auth == "Bearer secret-token" for _, _, auth in seen)
    assert seen[0] == ("POST", "/apis/ray.io/v1/namespaces/night/rayjobs", "Bearer secret-token")
    assert "labelSelector=app.kubernetes.io%2Fpart-of%3Ddart-batch-nightly" in seen[1][1]
