"""Per-node N-gram store: opening outside Ray, the store's placement logic, and a real 2-node cluster.

The first half runs in this process (no Ray): URLs, errors, placement, orphan sweeping, the
store body itself. The second half starts a local 2-node Ray cluster and an S3 server (moto)
on loopback, so that the store really fetches, and checks what the issue promises: one store
per node, one shared file per node whatever the number of workers (measured with Pss), a store
that outlives the worker that created it, clear errors in workers, and a shutdown that leaves
neither actors nor files behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest

from ngram_native import NgramTrie, TokenizerMismatchError, TrieFormatError, build_trie
from pipeline.cluster import ngram_store
from pipeline.cluster.ngram_store import (
    NgramStore,
    TrieUnavailableError,
    acquire_trie,
    check_trie_url,
    choose_store_dir,
    is_network_filesystem,
    list_ngram_stores,
    redact_url,
    shutdown_ngram_stores,
    start_store,
    store_actor_name,
    store_file_name,
    sweep_orphans,
    trie_memory_usage,
)
from tests.s3_server import running_s3_server

FP = "ab" * 32
OTHER_FP = "cd" * 32
VOCAB = 20_000


def make_trie(path: Path, seed: int = 0, num_tokens: int = 60_000, fingerprint: str = FP) -> Path:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, VOCAB, size=num_tokens // 20) for _ in range(20)]
    build_trie(docs, path, vocab_size=VOCAB, tokenizer_fingerprint=fingerprint)
    return path


def corrupt_payload(src: Path, dst: Path) -> Path:
    """A copy of `src` with one payload byte flipped: the header is fine, the checksum is not."""
    data = bytearray(src.read_bytes())
    data[len(data) // 2] ^= 0xFF
    dst.write_bytes(bytes(data))
    return dst


@pytest.fixture
def isolated_dirs(tmp_path, monkeypatch):
    """Cache and shared-memory directories private to the test."""
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(ngram_store.SHM_DIR_ENV, str(tmp_path / "shm"))
    return tmp_path


@pytest.fixture
def trie_file(tmp_path) -> Path:
    return make_trie(tmp_path / "small.trie")


@pytest.fixture
def memory_url(trie_file):
    """The trie as an fsspec memory:// object: a remote URL that needs no server."""
    url = f"memory://tries/{uuid.uuid4().hex}.trie"
    fs = fsspec.filesystem("memory")
    fs.pipe(url, trie_file.read_bytes())
    yield url
    with contextlib.suppress(FileNotFoundError):
        fs.rm(url)


# ----- outside Ray -------------------------------------------------------------------------


def test_acquire_local_path_and_file_url_open_in_place(isolated_dirs, trie_file):
    for url in (str(trie_file), trie_file.as_uri()):
        with acquire_trie(url, FP) as trie:
            assert isinstance(trie, NgramTrie)
            assert trie.path == str(trie_file)  # in place: no copy
            assert trie.tokenizer_fingerprint == FP
            assert trie.count([]) == 60_000  # every token counted
    assert not (isolated_dirs / "cache" / "tries").exists()


def test_acquire_remote_url_fetches_once_into_the_cache(isolated_dirs, memory_url, trie_file):
    info = check_trie_url(memory_url, FP)
    with acquire_trie(memory_url, FP) as trie:
        cached = Path(trie.path)
        assert cached == isolated_dirs / "cache" / "tries" / "fetched" / f"{info.content_key}.trie"
        assert cached.read_bytes() == trie_file.read_bytes()
    mtime = cached.stat().st_mtime_ns
    with acquire_trie(memory_url, None) as trie:
        assert trie.path == str(cached)
    assert cached.stat().st_mtime_ns == mtime  # reused, not fetched again


def test_corrupt_remote_trie_is_refused_and_nothing_is_cached(isolated_dirs, tmp_path, trie_file):
    url = "memory://tries/corrupt.trie"
    fsspec.filesystem("memory").pipe(url, corrupt_payload(trie_file, tmp_path / "bad.trie").read_bytes())
    with pytest.raises(TrieFormatError, match=r"memory://tries/corrupt\.trie.*checksum mismatch"):
        acquire_trie(url, FP)
    fetched = isolated_dirs / "cache" / "tries" / "fetched"
    assert [p.name for p in fetched.iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.parametrize("use_url", [False, True])
def test_corrupt_payload_is_a_format_error_naming_the_trie(isolated_dirs, tmp_path, trie_file, use_url):
    bad = corrupt_payload(trie_file, tmp_path / "bad.trie")
    url = bad.as_uri() if use_url else str(bad)
    with pytest.raises(TrieFormatError, match=r"bad\.trie.*checksum mismatch"):
        acquire_trie(url, FP)
    check_trie_url(url, FP)  # the cheap start-up check only reads the header: it passes


def test_truncated_trie_is_refused_by_acquire_and_by_the_startup_check(tmp_path, trie_file):
    short = tmp_path / "short.trie"
    short.write_bytes(trie_file.read_bytes()[:-100])
    for call in (acquire_trie, check_trie_url):
        with pytest.raises(TrieFormatError, match=r"short\.trie.*truncated"):
            call(str(short), FP)
    tiny = tmp_path / "tiny.trie"
    tiny.write_bytes(trie_file.read_bytes()[:100])
    with pytest.raises(TrieFormatError, match="shorter than the 512-byte header"):
        check_trie_url(str(tiny))


def test_wrong_fingerprint_names_both_fingerprints(tmp_path, trie_file):
    for call in (acquire_trie, check_trie_url):
        with pytest.raises(TokenizerMismatchError, match=f"small\\.trie.*'{FP}'.*'{OTHER_FP}'"):
            call(str(trie_file), OTHER_FP)


def test_check_trie_url_reports_missing_files_and_non_tries(tmp_path, trie_file):
    with pytest.raises(TrieUnavailableError, match=r"nothing\.trie: not found"):
        check_trie_url(str(tmp_path / "nothing.trie"))
    with pytest.raises(TrieUnavailableError, match="not found"):
        check_trie_url("memory://tries/does-not-exist.trie")
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"hello" * 200)
    with pytest.raises(TrieFormatError, match=r"notes\.txt: not a DART trie file"):
        check_trie_url(str(notes))
    altered = bytearray(trie_file.read_bytes())
    altered[20] ^= 1  # vocab_size: the header checksum catches it
    (tmp_path / "altered.trie").write_bytes(bytes(altered))
    with pytest.raises(TrieFormatError, match="header checksum mismatch"):
        check_trie_url(str(tmp_path / "altered.trie"))

    info = check_trie_url(trie_file.as_uri(), FP)
    with NgramTrie.open(trie_file) as trie:
        assert (info.file_size, info.order, info.vocab_size) == (trie.file_size, trie.order, VOCAB)
    assert info.tokenizer_fingerprint == FP and len(info.content_key) == 16


def test_content_key_follows_the_content_not_the_url(tmp_path, trie_file):
    copy = tmp_path / "copy.trie"
    shutil.copy(trie_file, copy)
    other = make_trie(tmp_path / "other.trie", seed=1)
    assert check_trie_url(str(copy)).content_key == check_trie_url(str(trie_file)).content_key
    assert check_trie_url(str(other)).content_key != check_trie_url(str(trie_file)).content_key


def test_redact_url_drops_credentials_and_signed_queries():
    assert redact_url("s3://bucket/t.trie") == "s3://bucket/t.trie"
    assert redact_url("/data/t.trie") == "/data/t.trie"
    assert redact_url("https://user:secret@host:8443/t.trie?X-Amz-Signature=abc") == \
        "https://host:8443/t.trie?<redacted>"
    with pytest.raises(TrieUnavailableError) as err:
        check_trie_url("memory://user:secret@tries/missing.trie")
    assert "secret" not in str(err.value)


MOUNTINFO = """\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
40 22 0:35 / /dev/shm rw,nosuid,nodev shared:5 - tmpfs tmpfs rw
51 22 0:44 / /mnt/shared rw,relatime shared:30 - nfs4 server:/export rw,vers=4.2
52 51 0:45 / /mnt/shared/local\\040disk rw,relatime shared:31 - xfs /dev/vdb rw
53 22 0:46 / /mnt/bucket rw,relatime shared:32 - fuse.s3fs s3fs rw
"""


@pytest.mark.parametrize(("path", "network"), [
    ("/home/u/t.trie", False),
    ("/dev/shm/t.trie", False),
    ("/mnt/shared/t.trie", True),
    ("/mnt/shared/local disk/t.trie", False),  # a local mount inside a network one
    ("/mnt/sharedother/t.trie", False),  # a prefix of the name is not a parent directory
    ("/mnt/bucket/t.trie", True),
])
def test_network_filesystems_are_recognised(path, network):
    assert is_network_filesystem(path, MOUNTINFO) is network


def test_choose_store_dir_prefers_shm_and_falls_back_to_disk(tmp_path, monkeypatch):
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    assert choose_store_dir(1 << 20, shm, disk) == (shm, "shm")
    assert choose_store_dir(1 << 20, tmp_path / "no-such-mount" / "dart", disk) == (disk, "disk")
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    # Fits on the filesystem, but not with the shared-memory reserve left: goes to disk.
    monkeypatch.setattr(ngram_store, "_free_bytes", lambda p: (free, free) if p == shm else (10 * free, 10 * free))
    assert choose_store_dir(free - (1 << 20), shm, disk) == (disk, "disk")
    with pytest.raises(TrieUnavailableError, match="no room for an N-gram trie"):
        choose_store_dir(20 * free, shm, disk)


def test_sweep_removes_only_files_whose_store_is_gone(tmp_path):
    node, key = "a" * 56, "0123456789abcdef"
    live = tmp_path / store_file_name(node, key)
    orphan = tmp_path / store_file_name("b" * 56, key)
    young_tmp = tmp_path / f".{store_file_name('c' * 56, key)}.tmp-123"
    old_tmp = tmp_path / f".{store_file_name('d' * 56, key)}.tmp-456"
    unrelated = tmp_path / "ngram-notes.trie"
    for p in (live, orphan, young_tmp, old_tmp, unrelated):
        p.write_bytes(b"x")
    past = time.time() - 2 * ngram_store.ORPHAN_TMP_MIN_AGE_S
    os.utime(old_tmp, (past, past))
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live store holds this lock
    try:
        assert sorted(sweep_orphans(tmp_path)) == sorted([orphan, old_tmp])
    finally:
        os.close(fd)
    assert live.exists() and young_tmp.exists() and unrelated.exists()
    assert sweep_orphans(tmp_path) == [live]  # its lock is free now


def test_store_body_places_verifies_and_removes_its_file(isolated_dirs, memory_url, trie_file):
    node = "e" * 56
    key = check_trie_url(memory_url).content_key
    store = NgramStore(memory_url, key, node)
    answer = store.path()
    placed = Path(answer["path"])
    assert answer["placement"] == "shm" and placed.parent == isolated_dirs / "shm"
    assert placed.name == store_file_name(node, key) and placed.read_bytes() == trie_file.read_bytes()
    assert [p.name for p in placed.parent.iterdir()] == [placed.name]  # no temporary left
    assert sweep_orphans(placed.parent) == []  # locked while the store lives
    assert store.close() is True and not placed.exists()
    assert store.close() is False  # idempotent (atexit calls it again)


def test_store_body_reports_errors_and_retries_later(isolated_dirs, tmp_path, trie_file, monkeypatch):
    url = "memory://tries/being-uploaded.trie"
    fs = fsspec.filesystem("memory")
    fs.pipe(url, corrupt_payload(trie_file, tmp_path / "bad.trie").read_bytes())
    key = check_trie_url(url).content_key  # the header is intact: same key as the good file
    store = NgramStore(url, key, "f" * 56)
    answer = store.path()
    assert answer["error_type"] == "TrieFormatError"
    assert url in answer["message"] and "checksum mismatch" in answer["message"]
    assert list((isolated_dirs / "shm").iterdir()) == []  # the bad download was removed
    fs.pipe(url, trie_file.read_bytes())
    assert store.path()["error_type"] == "TrieFormatError"  # within the retry window: same answer
    monkeypatch.setattr(ngram_store, "FAILURE_RETRY_AFTER_S", 0.0)
    assert store.path()["placement"] == "shm"  # after it: fetched again, now good
    assert store.close()
    # A URL that holds other content than the workers asked for is refused.
    fs.pipe(url, make_trie(tmp_path / "other.trie", seed=3).read_bytes())
    other = NgramStore(url, key, "f" * 56)
    assert other.path()["error_type"] == "TrieUnavailableError" and "changed" in other.path()["message"]
    fs.rm(url)


def test_in_place_store_never_removes_the_users_file(isolated_dirs, trie_file):
    store = NgramStore(str(trie_file), check_trie_url(str(trie_file)).content_key, "f" * 56)
    assert store.path()["placement"] == "in-place" and store.path()["path"] == str(trie_file)
    assert store.close() is False and trie_file.exists()


def test_memory_usage_counts_the_mapped_pages(trie_file):
    with NgramTrie.open(trie_file) as trie:
        trie.verify()  # reads every page of the mapping
        mem = trie_memory_usage(trie_file)
    page = os.sysconf("SC_PAGE_SIZE")
    assert mem.size >= trie.file_size and mem.rss >= trie.file_size - page
    assert 0 < mem.pss <= mem.rss
    assert trie_memory_usage(trie_file) == ngram_store.MappingMemory(0, 0, 0)  # unmapped on close


def test_without_ray_there_are_no_stores_to_list_or_stop():
    assert list_ngram_stores() == []
    assert shutdown_ngram_stores() == 0


def test_starting_a_store_early_is_a_no_op_without_ray_and_never_raises(tmp_path):
    start_store(str(tmp_path / "missing.trie"))  # acquire_trie is what reports a bad trie
    assert list_ngram_stores() == []


# ----- a local two-node Ray cluster --------------------------------------------------------


@contextlib.contextmanager
def moto_s3():
    """An S3 server on loopback (tests/s3_server.py), its endpoint and dummy credentials in the environment."""
    with running_s3_server() as server:
        yield server.endpoint


@contextlib.contextmanager
def environment(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Head (resource node_a) + one node (node_b), 2 CPUs each, with tries in a local S3 bucket.

    The environment (S3 endpoint and credentials, shared-memory dir, cache dir) is set before
    the nodes start, so their workers inherit it as they would from a pod spec.
    """
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    tmp = tmp_path_factory.mktemp("ngram_cluster")
    shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp
    shm = shm_root / f"dart-batch-test-{uuid.uuid4().hex[:8]}"
    with moto_s3() as endpoint, environment(
        AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1", DART_CACHE_DIR=str(tmp / "cache"),
        **{ngram_store.SHM_DIR_ENV: str(shm)},
    ):
        fs = fsspec.filesystem("s3")
        fs.mkdir("tries")
        urls = {}
        for name, seed in (("main", 0), ("second", 1), ("third", 2), ("fourth", 5), ("early", 6)):
            urls[name] = f"s3://tries/{name}.trie"
            fs.put_file(str(make_trie(tmp / f"{name}.trie", seed=seed, num_tokens=400_000)), urls[name])
        # Corrupt a trie of its own: a corrupt copy of "main" has main's header, hence main's
        # content key, and a node that already holds main would rightly hand out its good copy.
        good = make_trie(tmp / "broken-source.trie", seed=4, num_tokens=100_000)
        fs.pipe("tries/corrupt.trie", corrupt_payload(good, tmp / "corrupt.trie").read_bytes())
        urls["corrupt"] = "s3://tries/corrupt.trie"

        c = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "resources": {"node_a": 100}, "include_dashboard": False})
        c.add_node(num_cpus=2, resources={"node_b": 100})
        try:
            ray.init(address=c.address, logging_level="warning")
            c.wait_for_nodes()
            yield {"urls": urls, "shm": shm, "tmp": tmp}
        finally:
            with contextlib.suppress(Exception):
                shutdown_ngram_stores()
            ray.shutdown()
            c.shutdown()
            shutil.rmtree(shm, ignore_errors=True)


@functools.cache
def _user_class():
    import ray

    @ray.remote(num_cpus=0)
    class TrieUser:
        """Stands in for a pipeline worker: acquires the trie once and keeps it mapped."""

        def acquire(self, url, fingerprint):
            self.trie = acquire_trie(url, fingerprint, timeout_s=60)
            return {"path": self.trie.path, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

        def start(self, url):
            start_store(url)

        def try_acquire(self, url, fingerprint, timeout_s=60):
            start = time.monotonic()
            try:
                acquire_trie(url, fingerprint, timeout_s=timeout_s)
            except Exception as exc:
                return type(exc).__name__, str(exc), time.monotonic() - start
            return None, "", time.monotonic() - start

        def touch(self):
            self.trie.verify()  # reads every page through this process's mapping

        def measure(self):
            return trie_memory_usage(self.trie.path)

        def touch_and_measure(self):
            self.touch()
            return self.measure()

    return TrieUser


def _users(node: str, count: int):
    return [_user_class().options(resources={node: 1}).remote() for _ in range(count)]


def _store_answer(node_id: str, url: str) -> dict:
    import ray

    name = store_actor_name(node_id, check_trie_url(url).content_key)
    return ray.get(ray.get_actor(name, namespace=ngram_store.NAMESPACE).path.remote(), timeout=30)


def _store_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


@pytest.mark.integration
def test_one_store_and_one_shared_copy_per_node(cluster):
    import ray

    url = cluster["urls"]["main"]
    users = {"node_a": _users("node_a", 2), "node_b": _users("node_b", 2)}
    got = {node: ray.get([u.acquire.remote(url, FP) for u in us], timeout=120) for node, us in users.items()}

    paths = {node: {g["path"] for g in gs} for node, gs in got.items()}
    assert all(len(p) == 1 for p in paths.values()), paths  # every worker of a node: the same file
    assert paths["node_a"] != paths["node_b"]  # each node its own copy
    node_ids = {node: {g["node"] for g in gs} for node, gs in got.items()}
    assert all(len(n) == 1 for n in node_ids.values()) and node_ids["node_a"] != node_ids["node_b"]
    key = check_trie_url(url).content_key
    for node, (node_id,) in node_ids.items():
        (path,) = paths[node]
        assert Path(path) == cluster["shm"] / store_file_name(node_id, key)
        assert store_actor_name(node_id, key) in list_ngram_stores()
        answer = _store_answer(node_id, url)
        assert answer["placement"] == "shm" and answer["path"] == path
        assert answer["pid"] not in {g["pid"] for g in got[node]}  # an actor of its own

    # N workers, one copy: each worker touched every page, the node pays for them once.
    size = os.path.getsize(next(iter(paths["node_a"])))
    assert size > 2 << 20
    for node, us in users.items():
        # Every worker touches before any measures: PSS splits a page only among processes
        # that have it mapped at that moment, so measuring one worker before the other has
        # touched would charge it the whole file.
        ray.get([u.touch.remote() for u in us], timeout=60)
        mems = ray.get([u.measure.remote() for u in us], timeout=60)
        assert all(m.rss >= 0.95 * size for m in mems), (node, mems, size)
        assert sum(m.pss for m in mems) <= 1.05 * size, (node, mems, size)  # 2 private copies: 2x
    for u in users["node_a"] + users["node_b"]:
        ray.kill(u)


@pytest.mark.integration
def test_store_outlives_the_worker_that_created_it(cluster):
    import ray

    url = cluster["urls"]["second"]
    (creator,) = _users("node_b", 1)
    first = ray.get(creator.acquire.remote(url, FP), timeout=120)
    store_before = _store_answer(first["node"], url)
    ray.kill(creator)  # as a crashed worker would die
    time.sleep(0.5)
    (successor,) = _users("node_b", 1)
    second = ray.get(successor.acquire.remote(url, FP), timeout=120)
    assert second["pid"] != first["pid"] and second["path"] == first["path"]
    assert _store_answer(first["node"], url) == store_before  # same store process, same file
    ray.kill(successor)


@pytest.mark.integration
def test_a_store_started_early_is_placing_the_trie_before_the_worker_asks(cluster):
    """A worker starts its node's store before loading its target (the store's process start and
    copy overlap the load); the acquire that follows finds that store and its file."""
    import ray

    url = cluster["urls"]["early"]
    key = check_trie_url(url).content_key
    (user,) = _users("node_a", 1)
    ray.get(user.start.remote(url), timeout=60)  # returns at once: nothing waits for the store
    deadline = time.monotonic() + 60
    while not (started := [n for n in list_ngram_stores() if n.endswith(key)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(started) == 1, started
    got = ray.get(user.acquire.remote(url, FP), timeout=120)
    assert store_actor_name(got["node"], key) == started[0]
    assert got["path"] == _store_answer(got["node"], url)["path"]
    ray.kill(user)


@pytest.mark.integration
def test_the_driver_starts_no_store_on_a_cluster_of_several_nodes(cluster):
    """The driver's early start is for a one-node cluster only: with two nodes it cannot know
    where the workers go, and a store on a node without workers would hold the trie for nothing."""
    before = set(list_ngram_stores())
    assert not ngram_store.start_store_for_one_node_cluster(cluster["urls"]["second"], worker_cpus=0.5, worker_gpus=0)
    assert set(list_ngram_stores()) == before


@pytest.mark.integration
def test_store_errors_reach_the_worker_as_clear_exceptions(cluster):
    import ray

    (user,) = _users("node_a", 1)
    name, message, _ = ray.get(user.try_acquire.remote(cluster["urls"]["corrupt"], FP), timeout=120)
    assert name == "TrieFormatError" and "s3://tries/corrupt.trie" in message and "checksum mismatch" in message
    name, message, seconds = ray.get(user.try_acquire.remote(cluster["urls"]["corrupt"], FP), timeout=60)
    assert name == "TrieFormatError" and seconds < 5  # the failed store answers again at once
    name, message, _ = ray.get(user.try_acquire.remote("s3://tries/missing.trie", FP), timeout=60)
    assert name == "TrieUnavailableError" and "s3://tries/missing.trie: not found" in message
    name, message, _ = ray.get(user.try_acquire.remote(cluster["urls"]["main"], OTHER_FP), timeout=60)
    assert name == "TokenizerMismatchError" and OTHER_FP in message
    # A store that cannot answer in time (here: not even started yet) is a timeout, not a hang.
    name, message, seconds = ray.get(user.try_acquire.remote(cluster["urls"]["fourth"], FP, 0.01), timeout=60)
    assert name == "TimeoutError" and "s3://tries/fourth.trie" in message and seconds < 5
    assert not [f for f in _store_files(cluster["shm"]) if ".tmp-" in f]  # the bad download is gone
    ray.kill(user)


@pytest.mark.integration
def test_sigterm_and_shutdown_remove_files_and_actors(cluster):
    import ray

    url = cluster["urls"]["third"]
    users = {node: _users(node, 1)[0] for node in ("node_a", "node_b")}
    got = {node: ray.get(u.acquire.remote(url, FP), timeout=120) for node, u in users.items()}

    # A store stopped with SIGTERM (node drain, `ray stop`) removes its file on the way out.
    node_b = got["node_b"]["node"]
    store_b = _store_answer(node_b, url)
    os.kill(store_b["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 20
    while Path(store_b["path"]).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(store_b["path"]).exists()
    ray.get(users["node_b"].touch_and_measure.remote(), timeout=60)  # its mapping still works

    # A store killed outright cannot clean up; the next store in that directory sweeps its file.
    node_a = got["node_a"]["node"]
    store_a = _store_answer(node_a, url)
    name_a = store_actor_name(node_a, check_trie_url(url).content_key)
    ray.kill(ray.get_actor(name_a, namespace=ngram_store.NAMESPACE))
    deadline = time.monotonic() + 20
    while name_a in list_ngram_stores() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert Path(store_a["path"]).exists()  # orphaned
    (fresh,) = _users("node_b", 1)
    ray.get(fresh.acquire.remote(url, FP), timeout=120)  # node_b needs a new store: it sweeps
    assert not Path(store_a["path"]).exists()

    assert list_ngram_stores()
    assert shutdown_ngram_stores() >= 1
    assert list_ngram_stores() == []
    assert [f for f in _store_files(cluster["shm"]) if f.endswith(".trie")] == []
    assert shutdown_ngram_stores() == 0  # nothing left: a second call is harmless
    for u in [*users.values(), fresh]:
        ray.kill(u)
