"""One Ray job for consecutive pipeline jobs of the suite on the session's cluster, while what
their workers are handed stays the same.

Every `python -m pipeline.run` in production is a Ray job of its own: it connects, Ray starts
worker processes for it (each imports Ray, pyarrow and the job's modules: about a CPU-second
on this machine's cores), and they end with the job. A test suite runs dozens of such jobs on
one cluster, so most of a small job's cost is those new processes. `kept_job_ray` stands in for
`pipeline.run.job_ray` in tests that take `shared_ray`: the first job connects (through the
same reachability check and `ray.init` as the product's join), and later jobs of this run reuse
the connection, hence the job's idle task workers, as long as the connection's *signature* is
unchanged: the cluster's address and the value of every variable the test forwards to the
workers (tests/ray_processes.py `forward_env_hook`, run at `ray.init`). A test that sets a crash
hook, a fault proxy's endpoint or another bucket's credentials changes the signature, so its
job starts a new Ray job whose workers see exactly what it set, as before.

What a kept connection does not change: each pipeline job still builds its own datasets, its
generation actors and N-gram stores are started for it and end with it (Ray Data's actor pool,
`shutdown_ngram_stores`); a job that fails or is stopped ends the kept Ray job, as its driver's
exit would end its Ray job (a write task still retrying would otherwise write after the test
has moved on: the outage test's resume found duplicate rows); and a test that connects Ray
itself (to count the actors of its own job id, say) keeps its own connection: `kept_job_ray`
yields to any connection it did not make.
Worker logs are not sent to the driver on a kept connection (`log_to_driver=False`): a line a
worker logs after its job ended would otherwise land in the next test's captured stderr; they
stay in the session's Ray log directory.

`drop_kept_job()` ends the kept connection; conftest calls it before every test that does not
take `shared_ray`, so no other test finds this process connected.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from tests.ray_processes import FORWARD_ENV_VAR


@dataclass
class _Kept:
    signature: tuple | None = None
    job_id: str | None = None


_KEPT = _Kept()


def connection_signature() -> tuple:
    """What a Ray job started now would hand its workers: the address, the runtime-env hook, and
    the forwarded variables' values (absent ones included, as None)."""
    names = os.environ.get(FORWARD_ENV_VAR, "").split()
    return (os.environ.get("RAY_ADDRESS"), os.environ.get("RAY_RUNTIME_ENV_HOOK"),
            tuple((name, os.environ.get(name)) for name in names))


def holds_kept_job() -> bool:
    """Whether this process is connected, and through the kept job's connection."""
    import ray

    return (_KEPT.job_id is not None and ray.is_initialized()
            and ray.get_runtime_context().get_job_id() == _KEPT.job_id)


def drop_kept_job() -> None:
    """End the kept connection, if this process still holds it (and nothing else)."""
    import ray

    if holds_kept_job():
        ray.shutdown()
    _KEPT.signature = _KEPT.job_id = None


@contextlib.contextmanager
def kept_job_ray(target, num_cpus: int | None = None) -> Iterator[bool]:
    """`pipeline.run.job_ray` for jobs that join the session's cluster: connect once per signature
    and stay connected after the job (see the module docstring). Yields False, as job_ray does
    when this process was already connected (the job did not start Ray)."""
    import ray

    from pipeline.startup import ray_connection

    if ray.is_initialized() and not holds_kept_job():  # the test's own connection: the pipeline keeps it
        yield False
        return
    if target.address is None or target.address != os.environ.get("RAY_ADDRESS"):
        drop_kept_job()  # not the session's cluster: the product's own start or join
        with ray_connection.job_ray(target, num_cpus) as started:
            yield started
        return
    signature = connection_signature()
    if holds_kept_job() and _KEPT.signature != signature:
        drop_kept_job()
    if not holds_kept_job():
        _KEPT.signature = _KEPT.job_id = None
        ray_connection.check_reachable(target)
        ray.init(address=target.address, logging_level="WARNING", log_to_driver=False)
        ray_connection._reinstall_stop_handlers()
        _KEPT.signature, _KEPT.job_id = signature, ray.get_runtime_context().get_job_id()
    try:
        yield False
    except BaseException:
        # A job that failed or was stopped may leave tasks running (a write task still retrying):
        # in production its driver's exit ends them with its Ray job, so here too.
        drop_kept_job()
        raise
