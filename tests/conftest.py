"""What the suite shares because it is expensive to start: one Ray cluster, one S3 server, one set
of tiny artifacts; and the hypothesis profiles.

Sharing is opt-in by fixture name, so a test that is about Ray's start-up, a GPU-declaring
cluster, the metrics exporter, a two-node cluster or `ray start`/`ray job submit` keeps its own.

- `ray_head` (session): a single-node Ray cluster started once with `ray start --head`, bound to
  127.0.0.1 with every port chosen free (tests/ray_processes.py), 2 CPUs, in a temp dir of its
  own so that stopping it stops nothing else. `shared_ray` (per test) points the test's jobs at
  it through RAY_ADDRESS, which `pipeline.run` joins instead of starting Ray, and hands each job's
  workers the variables a test sets for them (a crash hook, the cache dir, S3 settings) the way a
  private `ray.init` would by inheritance. Each job is a Ray job of its own: its actors end with
  it, so tests do not see each other's workers.
- `s3_server` (session): one moto server on loopback; `s3_bucket` (per test) a new empty
  bucket on it, so tests never see each other's objects.
- `tiny_artifacts` (session): the tiny target, draft head and trie of tests/tiny_models.py,
  built once; tests read them and never write under them.

Hypothesis profiles (`HYPOTHESIS_PROFILE` picks one): `ci` derandomizes (the same examples on
every CI run, so a red run is reproducible) and prints the failing blob; `quick` scales explicit
example counts down (tests/hypothesis_budget.py) for the quick loop `pytest -m "not slow"`,
which uses it unless a profile is named; `dev` (default otherwise) is hypothesis' own default,
randomized, so a session's runs explore new examples.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Ray's single-machine mode for every Ray cluster of the run (what pipeline/startup/ray_connection.py
# uses for a local job): the node's address is 127.0.0.1 and Ray's servers listen there only.
# Set before anything imports Ray, so this process and every Ray process it starts agree on it
# (a driver outside it would turn the address 127.0.0.1 into the machine's network address).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# One intra-op thread for the tests' own torch work (and the processes they start, unless a test or
# a job's config says otherwise): the suite's models are tiny, so a second thread buys nothing, and
# on a 2-core machine where anything else runs (a Ray cluster, a job's workers, another test run)
# OpenMP's spinning threads wait on each other at every op: beside one other busy process,
# test_penalties + test_continuous_batching took 501 s with 2 threads, 36 s with 2 threads and
# OMP_WAIT_POLICY=PASSIVE (what pipeline/run.py gives a job's workers), 32 s with 1. Set before
# torch is imported; the product's workers set their own count from their config
# (dart_worker.hardware.device.configure_cpu_threads), passive where a test gives them two.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tests.hypothesis_budget import PROFILE_ENV, QUICK

REPO = Path(__file__).resolve().parents[1]

settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(QUICK, deadline=None, max_examples=10)

# What a job's workers get from the test process when the job joins the shared cluster.
FORWARDED_TO_WORKERS = (
    "DART_PIPELINE_CRASH_ONCE", "DART_CACHE_DIR", "OMP_WAIT_POLICY",
    "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
    "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE",
)


def pytest_configure(config: pytest.Config) -> None:
    # Token authentication for every Ray cluster of the run, set before any starts: Ray 2.60 turns
    # it on in this process at the first local ray.init anyway (RAY_AUTH_MODE=token, token in
    # ~/.ray/auth_token), and a cluster started out of process before that would otherwise run
    # without it, or with it while this process's drivers do not ask for a token.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if not hasattr(config, "workerinput"):  # the run's one process, or xdist's controller
        make_ray_auth_token_once()
    profile = os.environ.get(PROFILE_ENV)
    if not profile:
        quick_loop = (config.getoption("markexpr", "") or "").replace(" ", "") == "notslow"
        profile = QUICK if quick_loop else "dev"
        os.environ[PROFILE_ENV] = profile  # tests/hypothesis_budget.py reads the same choice
    settings.load_profile(profile)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject.toml): a test process per core this process may run on, at most 4 (each
    test process starts a Ray cluster and an S3 server of its own for its session). One more than
    the cores was slower on 2 cores (844 s against 744 s, docs/testing.md)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


def make_ray_auth_token_once() -> None:
    """Make Ray's token (~/.ray/auth_token) before any test process starts a cluster: test
    processes run in parallel (pytest-xdist), and two that each generate a missing token at the
    same moment would start clusters and drivers holding different tokens."""
    import shutil
    import subprocess

    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token" and shutil.which("ray"):
        subprocess.run(["ray", "get-auth-token", "--generate"], capture_output=True, check=False, timeout=120)


# A test that uses these is on a Ray cluster, hence in the slow tier: the session's (joined for a
# module by test_inputs, test_outputs and test_fuzz_inputs), and test_device_check's GPU-declaring one.
RAY_FIXTURES = {"ray_head", "shared_ray", "join_shared_ray", "ray_session", "ray_with_a_gpu"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tier (`pytest -m "not slow"` leaves it out) holds, besides the tests marked slow
    by hand (a real model, sampling statistics, whole trainings), every test that needs external
    processes (marked integration: an S3 server, a Ray cluster, a job) or the session's cluster."""
    for item in items:
        if item.get_closest_marker("integration") or RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def pytest_report_header(config: pytest.Config) -> str:
    return f"hypothesis profile: {settings._current_profile}"


# ------------------------------------------------------------------------------- artifacts


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory) -> dict[str, str]:
    """The tiny target dir, random draft head checkpoint and trie (tests/tiny_models.py), once per
    session; read-only for tests (a test that must change one copies it first)."""
    from tests.tiny_models import save_tiny_artifacts

    return save_tiny_artifacts(tmp_path_factory.mktemp("tiny-artifacts"))


# ------------------------------------------------------------------------------------- S3


@pytest.fixture(scope="session")
def s3_server():
    """One moto S3 server on 127.0.0.1 for the session (the AWS_* variables are NOT set here:
    `s3_bucket` and `use_s3` set them per test)."""
    from tests.s3_server import start_s3_server

    server = start_s3_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch) -> str:
    """A new, empty bucket on the session's S3 server, with this test's environment pointed at
    the server; returns the bucket's name."""
    from tests.s3_server import use_s3_server

    use_s3_server(monkeypatch, s3_server)
    name = f"t-{uuid.uuid4().hex[:16]}"
    s3_server.create_bucket(name)
    return name


# ------------------------------------------------------------------------------------- Ray


# Ray kills a job's idle worker processes beyond one per CPU after a second idle (raylet flags
# num_workers_soft_limit, idle_worker_killing_time_threshold_ms), so each phase of a pipeline job
# (the probe, the duplicate pass, the dataset's reads and writes) and each job on a kept Ray job
# (tests/kept_ray_job.py) started new ones: about 1.5 CPU-seconds each, 80-100 per run of the job
# tests. The session's cluster keeps them while their Ray job lives.
KEEP_IDLE_WORKERS = {"RAY_num_workers_soft_limit": "8", "RAY_idle_worker_killing_time_threshold_ms": "600000"}


@pytest.fixture(scope="session")
def ray_head(s3_server, tmp_path_factory):
    """The session's Ray cluster (see the module docstring); its workers start with the S3
    server's variables and a cache dir of the session's, like pods with a mounted config."""
    from tests.ray_processes import start_ray_head

    env = {**os.environ, **s3_server.env, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    env.setdefault("DART_CACHE_DIR", str(tmp_path_factory.mktemp("ray-head-cache")))
    env.update(KEEP_IDLE_WORKERS)
    # With the dashboard (on 127.0.0.1): Ray's state API (`ray.util.state.list_actors`) asks it.
    head = start_ray_head(num_cpus=2, env=env, dashboard=True, prefix="rs-",
                          extra_args=("--object-store-memory=1000000000",))
    try:
        yield head
    finally:
        import ray

        ray.shutdown()
        head.stop()


@contextlib.contextmanager
def joined(head, forward: tuple[str, ...] = (), connect: bool = False, keep: bool = False):
    """While inside: Ray jobs started in this process join `head` (RAY_ADDRESS), and each hands its
    workers this process's values of FORWARDED_TO_WORKERS and `forward`. With `connect`, this
    process is one such job for the whole block (for tests that run Ray Data in-process, without
    the pipeline's driver), progress bars off. With `keep`, pipeline jobs share one Ray job while
    what they forward is unchanged (tests/kept_ray_job.py), and it outlives the block. For
    module-scoped fixtures; tests use `shared_ray`."""
    import ray

    from tests.kept_ray_job import drop_kept_job, kept_job_ray
    from tests.ray_processes import FORWARD_ENV_VAR

    keep = keep and not os.environ.get(FRESH_RAY_JOBS_ENV)
    if keep:
        leave_kept_job_only()
    else:
        drop_kept_job()
        ray.shutdown()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_ADDRESS", head.address)
        mp.setenv("RAY_RUNTIME_ENV_HOOK", "tests.ray_processes.forward_env_hook")
        mp.setenv(FORWARD_ENV_VAR, " ".join((*FORWARDED_TO_WORKERS, *forward)))
        if keep:
            mp.setattr("pipeline.run.job_ray", kept_job_ray)
        try:
            if connect:
                import ray.data

                ray.init(logging_level="ERROR")
                ray.data.DataContext.get_current().enable_progress_bars = False
            yield head
        finally:
            if keep:
                leave_kept_job_only()
            else:
                ray.shutdown()


# Set (to anything) to give every pipeline job of `shared_ray` a Ray job of its own, as before the
# kept connection (to compare their cost, or to rule the kept connection out when a test fails).
FRESH_RAY_JOBS_ENV = "DART_TEST_FRESH_RAY_JOBS"


def leave_kept_job_only() -> None:
    """Shut down any connection of this process except the kept job's (a test's own ray.init)."""
    import ray

    from tests.kept_ray_job import holds_kept_job

    if ray.is_initialized() and not holds_kept_job():
        ray.shutdown()


@pytest.fixture(autouse=True)
def _no_kept_ray_job_outside_shared_ray(request):
    """A test that does not take `shared_ray` starts with this process connected to no Ray job
    that an earlier test kept (tests/kept_ray_job.py)."""
    if "shared_ray" not in request.fixturenames:
        from tests.kept_ray_job import drop_kept_job

        drop_kept_job()
    yield


@pytest.fixture
def shared_ray(ray_head):
    """This test's pipeline jobs join the session's cluster (RAY_ADDRESS); the variables in
    FORWARDED_TO_WORKERS that the test sets reach the job's workers. Consecutive jobs that forward
    the same values share one Ray job (tests/kept_ray_job.py: no new worker processes per job)."""
    with joined(ray_head, keep=True) as head:
        yield head


@pytest.fixture(scope="session")
def join_shared_ray(ray_head):
    """`with join_shared_ray(forward=(...), connect=...):` joins the session's cluster for a
    module-scoped fixture (a finished job several tests read; Ray Data run in-process), like
    `shared_ray` for one test."""
    return lambda forward=(), connect=False: joined(ray_head, forward, connect)
