"""The Ray clusters the tests start out of process (tests/ray_processes.py): bound to loopback,
answering, and stopped without touching anything else."""

from __future__ import annotations

import psutil

from tests.ray_processes import forward_env_hook, kill_ray_processes_under, start_ray_head

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def listening_addresses(temp_dir: str) -> set[tuple[str, int]]:
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if temp_dir in " ".join(proc.info["cmdline"] or []):
                found |= {(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    return found


def test_the_session_head_listens_on_loopback_only_and_takes_jobs(ray_head, shared_ray):
    import ray

    listening = listening_addresses(ray_head.temp_dir)
    assert listening, "no listening socket found for the session's Ray processes"
    assert {ip for ip, _ in listening} <= LOOPBACK, sorted(listening)
    ray.init()
    assert ray.cluster_resources()["CPU"] == 2
    assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42


def test_a_head_of_its_own_is_stopped_alone(ray_head):
    other = start_ray_head(num_cpus=1, prefix="rt-")
    assert listening_addresses(other.temp_dir)
    other.stop()
    assert not listening_addresses(other.temp_dir)
    assert listening_addresses(ray_head.temp_dir), "stopping one head stopped the session's"
    assert kill_ray_processes_under(other.temp_dir) == 0


def test_the_forward_hook_adds_only_named_variables_that_are_set(monkeypatch):
    monkeypatch.setenv("DART_TEST_FORWARD_ENV", "A_SET B_UNSET")
    monkeypatch.setenv("A_SET", "1")
    monkeypatch.delenv("B_UNSET", raising=False)
    monkeypatch.setenv("C_NOT_NAMED", "x")
    assert forward_env_hook({"env_vars": {"KEEP": "k"}, "pip": ["x"]}) == {"env_vars": {"KEEP": "k", "A_SET": "1"},
                                                                         "pip": ["x"]}
    monkeypatch.setenv("DART_TEST_FORWARD_ENV", "")
    assert forward_env_hook(None) == {}
