"""Targets from object storage (dart_worker/artifacts/target_store.py) against a real local S3 server (moto):
one verified download per node, shared by concurrent processes, resumed after an interruption,
refused loudly when the bytes differ from what the store lists, and decoding exactly like the
same model loaded from a local directory."""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
from pathlib import Path

import pytest

from tests.s3_server import running_s3_server

BUCKET = "models"


@pytest.fixture(scope="module")
def s3():
    with running_s3_server(buckets=[BUCKET]) as server:
        yield server


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _upload(s3, local: Path, prefix: str) -> str:
    fs = s3.filesystem()
    for path in sorted(local.iterdir()):
        fs.put_file(str(path), f"{BUCKET}/{prefix}/{path.name}")
    return f"s3://{BUCKET}/{prefix}"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.tiny_models import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("tiny") / "model", "qwen3", seed=3)


class _FaultyFile:
    """A store file whose bytes are cut short after `cut` bytes, or whose first byte is flipped."""

    def __init__(self, inner, cut: int | None, corrupt: bool, counter: dict):
        self.inner, self.cut, self.corrupt, self.counter = inner, cut, corrupt, counter
        self.pos = 0

    def seek(self, offset, whence=0):
        self.pos = self.inner.seek(offset, whence)
        return self.pos

    def read(self, n=-1):
        if self.cut is not None and self.pos >= self.cut:
            return b""
        if self.cut is not None and n is not None and n >= 0:
            n = min(n, self.cut - self.pos)
        data = self.inner.read(n)
        if self.corrupt and self.pos == 0 and data:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        self.pos += len(data)
        self.counter["bytes"] += len(data)
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.inner.close()


class _FaultyFS:
    def __init__(self, fs, name: str | None, cut: int | None = None, corrupt: bool = False):
        self.fs, self.name, self.cut, self.corrupt = fs, name, cut, corrupt
        self.counter = {"bytes": 0}

    def open(self, path, mode="rb"):
        hit = self.name is not None and path.endswith("/" + self.name)
        return _FaultyFile(self.fs.open(path, mode), self.cut if hit else None, self.corrupt and hit, self.counter)


@contextlib.contextmanager
def _faulty_store(monkeypatch, name=None, cut=None, corrupt=False):
    from dart_worker.artifacts import target_store

    real = target_store.list_model
    made = []

    def faulty(url, what="target"):
        fs, files = real(url, what)
        made.append(_FaultyFS(fs, name, cut, corrupt))
        return made[-1], files

    with monkeypatch.context() as mp:
        mp.setattr(target_store, "list_model", faulty)
        yield made


def test_target_from_s3_decodes_like_the_local_copy_and_is_fetched_once(s3, cache, tiny_dir, monkeypatch):
    import torch

    from dart_worker.artifacts.fingerprint import model_files_fingerprint
    from dart_worker.artifacts.loading import load_target, model_fingerprint, resolve_source
    from dart_worker.artifacts.target_store import COMPLETE_MARKER

    url = _upload(s3, tiny_dir, "qwen3-a")
    model, tokenizer = load_target(url, dtype="fp32", device="cpu")
    local, _ = load_target(str(tiny_dir), dtype="fp32", device="cpu")
    prompt = torch.tensor([[1, 5, 9, 17, 33]])
    ours = model.generate(prompt, max_new_tokens=12, do_sample=False)
    reference = local.generate(prompt, max_new_tokens=12, do_sample=False)
    assert ours.tolist() == reference.tolist()
    assert len(tokenizer) == 96

    # content-addressed: the directory is named by the fingerprint the local files have
    source = resolve_source(url)
    fingerprint = model_files_fingerprint(tiny_dir)
    assert Path(source.location).name == fingerprint
    assert model_fingerprint(url) == fingerprint
    assert (Path(source.location) / COMPLETE_MARKER).is_file()

    # a second fetch reads no byte of the store
    with _faulty_store(monkeypatch) as made:
        assert resolve_source(url).location == source.location
    assert made[0].counter["bytes"] == 0

    # the same model under another URL is stored once
    other = _upload(s3, tiny_dir, "qwen3-copy")
    assert resolve_source(other).location == source.location
    assert len([p for p in (cache / "targets").iterdir() if not p.name.startswith(".") and p.is_dir()
                and p.name != "sources"]) == 1


def test_reupload_under_the_same_url_is_fetched_again(s3, cache, tmp_path):
    from dart_worker.artifacts.loading import resolve_source
    from tests.tiny_models import save_tiny_target

    first = save_tiny_target(tmp_path / "first", "llama", seed=1)
    second = save_tiny_target(tmp_path / "second", "llama", seed=2)
    url = _upload(s3, first, "moving")
    before = resolve_source(url).location
    _upload(s3, second, "moving")
    after = resolve_source(url).location
    assert before != after
    assert (Path(after) / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()


def _fetch_in_child(url: str, env: dict, queue) -> None:
    """A separate process fetching like a Ray worker would; reports its path and its stderr."""
    os.environ.update(env)
    from dart_worker.artifacts import target_store

    real = target_store._fetch_file

    def slow(*args, **kwargs):  # keep the holder busy so that the others really wait on the lock
        import time

        time.sleep(0.5)
        return real(*args, **kwargs)

    target_store._fetch_file = slow
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        path = target_store.fetch_model_dir(url)
    queue.put((str(path), err.getvalue()))


def test_concurrent_processes_share_one_download(s3, cache, tiny_dir):
    url = _upload(s3, tiny_dir, "qwen3-concurrent")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    env = {**s3.env, "DART_CACHE_DIR": str(cache)}
    procs = [ctx.Process(target=_fetch_in_child, args=(url, env, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert len({path for path, _ in results}) == 1
    downloads = [err for _, err in results if "downloading target" in err]
    assert len(downloads) == 1, [err for _, err in results]
    assert not list((cache / "targets").glob(".partial-*"))


def test_truncated_download_fails_naming_the_file_then_resumes(s3, cache, tiny_dir, monkeypatch):
    from dart_worker.artifacts.target_store import TargetFetchError, fetch_model_dir

    url = _upload(s3, tiny_dir, "qwen3-truncated")
    size = (tiny_dir / "model.safetensors").stat().st_size
    cut = size // 3
    with _faulty_store(monkeypatch, "model.safetensors", cut=cut), \
            pytest.raises(TargetFetchError) as err:
        fetch_model_dir(url)
    message = str(err.value)
    assert "model.safetensors" in message and f"lists {size} bytes" in message and f"after {cut}" in message
    assert not list((cache / "targets").glob("[0-9a-f]" * 4 + "*"))  # nothing usable was published

    with _faulty_store(monkeypatch) as made:
        path = fetch_model_dir(url)
    resumed = made[0].counter["bytes"]
    # the files finished before the cut were kept, the cut file continued from its last byte,
    # and the files after it fetched whole (files go in name order)
    after = sum(p.stat().st_size for p in tiny_dir.iterdir() if p.name > "model.safetensors")
    assert resumed == size - cut + after
    assert (path / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()


def test_corrupt_download_fails_naming_both_checksums(s3, cache, tiny_dir, monkeypatch):
    import hashlib

    from dart_worker.artifacts.target_store import TargetFetchError, fetch_model_dir

    url = _upload(s3, tiny_dir, "qwen3-corrupt")
    good = hashlib.md5((tiny_dir / "config.json").read_bytes()).hexdigest()
    with _faulty_store(monkeypatch, "config.json", corrupt=True), pytest.raises(TargetFetchError) as err:
        fetch_model_dir(url)
    message = str(err.value)
    assert "config.json" in message and good in message and "corrupt" in message
    path = fetch_model_dir(url)  # the corrupt file was dropped: the next fetch is whole
    assert (path / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()


def test_not_a_model_and_missing_urls_are_clear_errors(s3, cache, tmp_path):
    from dart_worker.artifacts.loading import load_target
    from dart_worker.artifacts.target_store import TargetFetchError

    (tmp_path / "notes.txt").write_text("no model here")
    url = _upload(s3, tmp_path, "not-a-model")
    with pytest.raises(TargetFetchError, match=r"not-a-model: not a model directory: no config.json among \['notes"):
        load_target(url)
    with pytest.raises(TargetFetchError, match="nothing there"):
        load_target(f"s3://{BUCKET}/no-such-model")


def test_file_urls_are_local_paths_not_copies(cache, tiny_dir):
    from dart_worker.artifacts.loading import resolve_source

    assert resolve_source(f"file://{tiny_dir}").location == str(tiny_dir.resolve())
    assert not (cache / "targets").exists()


def test_draft_head_from_s3_loads_like_the_local_one(s3, cache, tmp_path):
    import torch

    from dart_worker.head.draft_checkpoint import load_draft_head, resolve_head_dir, save_draft_head
    from dart_worker.head.draft_head import DartDraftHead
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    torch.manual_seed(0)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=3)
    save_draft_head(head, tmp_path / "head")
    url = _upload(s3, tmp_path / "head", "heads/tiny")
    local = resolve_head_dir(url)
    assert local.parent == cache / "heads"
    loaded = load_draft_head(url, model.config, model.get_input_embeddings())
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_later_endpoint_is_used_although_an_earlier_one_built_a_filesystem(monkeypatch):
    """fsspec caches filesystems by constructor arguments: an s3fs built while AWS_ENDPOINT_URL
    named one server must not serve URLs once it names another (the suite starts a server per
    module; a driver can be reconfigured). Every reader of URLs goes through url_filesystem."""
    import fsspec

    from dart_worker.artifacts.url_filesystem import url_filesystem

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    first, _ = url_filesystem("s3://bucket/model")
    fsspec.core.url_to_fs("s3://bucket/model")  # the cached, endpoint-less instance the old code reused
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:2")
    second, path = url_filesystem("s3://bucket/model")
    assert path == "bucket/model"
    assert first.endpoint_url == "http://127.0.0.1:1"
    assert second.endpoint_url == "http://127.0.0.1:2" and second is not first


def test_a_worker_whose_copy_differs_from_the_drivers_stops_naming_both_fingerprints(s3, cache, tmp_path):
    """The driver resolves and fingerprints the target at start-up (the value stamped on every
    row); a worker that fetches other bytes (the model re-uploaded under its URL meanwhile) must
    not decode with them: it stops naming both fingerprints, and the job turns that into one line."""
    from dart_worker.artifacts.loading import model_fingerprint
    from pipeline.settings.config import load_config, to_dict
    from pipeline.startup.preflight import resolve_artifacts
    from pipeline.worker import GenerationWorker, TargetMismatch, target_mismatch
    from tests.tiny_models import save_tiny_target

    first = save_tiny_target(tmp_path / "first", "llama", seed=1)
    second = save_tiny_target(tmp_path / "second", "llama", seed=2)
    url = _upload(s3, first, "job-target")
    (tmp_path / "in.jsonl").write_text('{"prompt": "w5 w6"}\n')
    cfg = load_config(None, [f"input.urls=[{tmp_path}/in.jsonl]", f"output.url={tmp_path}/out",
                             f"model.target={url}", "model.dtype=fp32", "model.device=cpu", "decoding.mode=ar",
                             "resources.torch_threads=1"])
    resolved = resolve_artifacts(cfg, "fingerprints")  # the driver
    driver = resolved["target_fingerprint"]
    assert driver == model_fingerprint(first)
    GenerationWorker(to_dict(cfg), resolved)  # the same bytes: the worker starts

    _upload(s3, second, "job-target")  # re-uploaded after the driver checked it
    with pytest.raises(TargetMismatch) as caught:
        GenerationWorker(to_dict(cfg), resolved)
    message = str(caught.value)
    assert f"has fingerprint {model_fingerprint(second)}, but the driver checked {driver}" in message
    assert message.startswith(f"model.target {url!r}: this worker's copy (")

    # What the driver sees of a worker that died in its constructor: the remote traceback's text.
    remote = RuntimeError(f"ActorDiedError: the actor died in its constructor\nTraceback ...\n"
                          f"pipeline.worker.TargetMismatch: {message}\n")
    assert target_mismatch(remote) == message
    assert target_mismatch(caught.value) == message and target_mismatch(RuntimeError("other")) is None
