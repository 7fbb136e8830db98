"""Target loading: device/dtype resolution, spec handling and errors, fingerprints, the cache's
atomic build helper, and (slow) the real embedded default target."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertLMHeadModel, ViTConfig

from dart_worker.artifacts import cache_dir as cache_mod
from dart_worker.artifacts import default_target, fingerprint
from dart_worker.artifacts.cache_dir import build_atomically, cache_dir, cache_root, file_lock, lock_path_for
from dart_worker.artifacts.loading import load_target, model_fingerprint, resolve_source, target_family
from dart_worker.hardware import device
from dart_worker.hardware.device import configure_cpu_threads, resolve_device, resolve_dtype
from tests.tiny_models import TINY_VOCAB, save_tiny_target, tiny_model, tiny_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]


# --- helpers -------------------------------------------------------------------------------

@pytest.fixture
def tmp_cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("DART_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("llama"), "llama")


# --- device / dtype / threads ----------------------------------------------------------------

def test_resolve_device_cpu_and_auto_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:1", torch.device("cuda", 0)])
def test_resolve_device_cuda_missing_is_a_clear_error(monkeypatch, spec):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"CUDA is not available.*use device 'cpu' or 'auto'"):
        resolve_device(spec)


def test_resolve_device_cuda_indexing_with_fake_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match=r"only 2 CUDA device"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("spec", ["gpu", "tpu", "cuda:x", ""])
def test_resolve_device_rejects_unknown(spec):
    with pytest.raises(ValueError, match=r"device"):
        resolve_device(spec)


@pytest.mark.parametrize(("spec", "expected"), [
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("BF16", torch.bfloat16),
    ("torch.bfloat16", torch.bfloat16), ("fp16", torch.float16), ("float16", torch.float16),
    ("fp32", torch.float32), ("float32", torch.float32), (torch.float16, torch.float16),
])
def test_resolve_dtype_names(spec, expected):
    assert resolve_dtype(spec, torch.device("cpu")) == expected


@pytest.mark.parametrize("spec", ["int8", "fp8", "bf17", torch.int8, torch.float64])
def test_resolve_dtype_rejects_unknown(spec):
    with pytest.raises(ValueError, match=r"dtype"):
        resolve_dtype(spec, "cpu")


@pytest.mark.parametrize("native_bf16", [True, False])
def test_resolve_dtype_auto_on_cpu_follows_native_bf16(monkeypatch, native_bf16):
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: native_bf16)
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native_bf16 else torch.float32)


@pytest.mark.parametrize("bf16_supported", [True, False])
def test_resolve_dtype_auto_on_cuda_follows_bf16_support(monkeypatch, bf16_supported):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
    assert resolve_dtype("auto", torch.device("cuda", 0)) == (torch.bfloat16 if bf16_supported else torch.float32)


def test_configure_cpu_threads(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert configure_cpu_threads(1) == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert configure_cpu_threads() == 2 and torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert configure_cpu_threads() == len(os.sched_getaffinity(0))
        monkeypatch.setenv("OMP_NUM_THREADS", "two")
        with pytest.raises(ValueError, match=r"OMP_NUM_THREADS"):
            configure_cpu_threads()
        with pytest.raises(ValueError, match=r"positive integer"):
            configure_cpu_threads(0)
    finally:
        torch.set_num_threads(before)


# --- loading local directories ---------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_load_target_local_dir(tmp_path, family):
    directory = save_tiny_target(tmp_path / family, family)
    model, tokenizer = load_target(str(directory), dtype="fp32", device="cpu")
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}
    assert model.config._attn_implementation == "sdpa"
    assert target_family(model) == {"llama": "llama", "gemma3": "gemma3_text"}[family]
    assert len(model.model.layers) == 6
    ids = tokenizer("w5 w6 w7", return_tensors="pt").input_ids
    assert ids.tolist() == [[5, 6, 7]]
    # The loaded weights are the saved ones: same logits as the in-memory original.
    reference = tiny_model(family)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)


def test_load_target_casts_to_requested_dtype(llama_dir):
    model, _ = load_target(llama_dir, dtype="bf16", device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_resolve_source_kinds(llama_dir, tmp_path):
    assert resolve_source(str(llama_dir)).kind == "dir"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_source(gguf).kind == "gguf"
    assert resolve_source("some-org/some-model").kind == "hub"


# --- bad specs -------------------------------------------------------------------------------

def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        load_target(str(tmp_path / "nowhere" / "model"), dtype="fp32", device="cpu")
    with pytest.raises(FileNotFoundError, match=r"GGUF file .* does not exist"):
        load_target(str(tmp_path / "missing.gguf"), dtype="fp32", device="cpu")
    with pytest.raises(ValueError, match=r"empty target spec"):
        load_target("  ", dtype="fp32", device="cpu")


def test_directory_without_config_is_a_clear_error(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"not a Hugging Face model directory.*weights.bin"):
        load_target(str(tmp_path), dtype="fp32", device="cpu")


def test_plain_file_is_a_clear_error(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"not a .gguf file"):
        load_target(str(path), dtype="fp32", device="cpu")


def test_non_causal_config_is_a_clear_error(tmp_path):
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type 'vit'.*not a causal language model"):
        load_target(str(tmp_path), dtype="fp32", device="cpu")


def test_causal_lm_without_decoder_layer_list_is_a_clear_error(tmp_path):
    config = BertConfig(vocab_size=TINY_VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, is_decoder=True)
    BertLMHeadModel(config).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"BertLMHeadModel\) has no decoder layer list at model.model.layers"):
        load_target(str(tmp_path), dtype="fp32", device="cpu")


def test_corrupt_files_are_clear_errors(tmp_path):
    directory = save_tiny_target(tmp_path)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"cannot load its weights .*truncated or corrupt"):
        load_target(str(directory), dtype="fp32", device="cpu")
    (directory / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read config.json"):
        load_target(str(directory), dtype="fp32", device="cpu")


def test_tokenizer_larger_than_embedding_is_a_clear_error(tmp_path):
    save_tiny_target(tmp_path, "llama", tokenizer_vocab=TINY_VOCAB + 10)
    with pytest.raises(ValueError, match=rf"tokenizer has {TINY_VOCAB + 10} tokens.*only {TINY_VOCAB} rows"):
        load_target(str(tmp_path), dtype="fp32", device="cpu")


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match=r"offline mode.*Pass a local model directory or a .gguf file"):
        load_target("dart-batch-tests/no-such-model", dtype="fp32", device="cpu")
    with pytest.raises(OSError, match=r"offline mode"):
        model_fingerprint("dart-batch-tests/no-such-model")


# --- fingerprints ----------------------------------------------------------------------------

def test_fingerprint_is_stable_and_content_based(tmp_path, tmp_cache):
    directory = save_tiny_target(tmp_path / "a")
    first = model_fingerprint(directory)
    assert len(first) == 64 and model_fingerprint(str(directory)) == first
    assert (directory / fingerprint.FINGERPRINT_CACHE_NAME).is_file()
    (directory / fingerprint.FINGERPRINT_CACHE_NAME).unlink()
    assert model_fingerprint(directory) == first
    # Same content elsewhere, independently saved: same fingerprint.
    assert model_fingerprint(save_tiny_target(tmp_path / "b")) == first
    # Documentation, licences and our own stamps do not change what the model computes.
    (directory / "README.md").write_text("hello")
    (directory / "NOTICE").write_text("notice")
    (directory / default_target.CONVERSION_STAMP_NAME).write_text("{}")
    assert model_fingerprint(directory) == first


def test_fingerprint_sees_every_model_file(tmp_path, tmp_cache):
    directory = save_tiny_target(tmp_path / "a")
    base = model_fingerprint(directory)
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # same size, one bit of one weight
    weights.write_bytes(bytes(data))
    changed_weights = model_fingerprint(directory)
    assert changed_weights != base

    config = json.loads((directory / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (directory / "config.json").write_text(json.dumps(config))
    changed_config = model_fingerprint(directory)
    assert changed_config not in (base, changed_weights)

    tok = json.loads((directory / "tokenizer_config.json").read_text())
    tok["model_max_length"] = 77
    (directory / "tokenizer_config.json").write_text(json.dumps(tok))
    assert model_fingerprint(directory) not in (base, changed_weights, changed_config)


def test_fingerprint_reuses_cached_hashes(tmp_path, tmp_cache, monkeypatch):
    directory = save_tiny_target(tmp_path / "a")
    first = model_fingerprint(directory)
    calls = []
    real = fingerprint.file_fingerprint
    monkeypatch.setattr(fingerprint, "file_fingerprint", lambda p: calls.append(p.name) or real(p))
    assert model_fingerprint(directory) == first
    assert calls == []
    (directory / "generation_config.json").write_text('{"eos_token_id": 2}')
    model_fingerprint(directory)
    assert calls == ["generation_config.json"]


def test_fingerprint_of_gguf_file(tmp_path, tmp_cache):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    first = model_fingerprint(path)
    assert model_fingerprint(str(path)) == first
    path.write_bytes(b"GGUF" + bytes(99) + b"\1")
    assert model_fingerprint(path) != first


def test_fingerprint_falls_back_to_cache_when_dir_is_read_only(tmp_path, tmp_cache, monkeypatch):
    directory = save_tiny_target(tmp_path / "a")
    real_write = cache_mod.write_text_atomically

    def refuse_model_dir(path, text):
        if Path(path).parent == directory:
            raise PermissionError("read-only")
        real_write(path, text)

    monkeypatch.setattr(fingerprint, "write_text_atomically", refuse_model_dir)
    first = model_fingerprint(directory)
    assert not (directory / fingerprint.FINGERPRINT_CACHE_NAME).exists()
    assert len(list((tmp_cache / "fingerprints").iterdir())) == 1
    assert model_fingerprint(directory) == first


# --- cache directory and atomic builds -------------------------------------------------------

def test_cache_dir_follows_env_and_creates(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "root"))
    assert cache_root() == tmp_path / "root"
    path = cache_dir("models", "x")
    assert path == tmp_path / "root" / "models" / "x" and path.is_dir()
    monkeypatch.delenv("DART_CACHE_DIR")
    assert cache_root() == Path("~/.cache/dart-batch").expanduser()
    for bad in ("..", "/etc", "a/../../b", ""):
        with pytest.raises(ValueError, match=r"cache_dir part"):
            cache_dir(bad)


RACE_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from dart_worker.artifacts.cache_dir import build_atomically

    final, builds_log, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    while not go.exists():
        time.sleep(0.005)

    def build(tmp):
        with open(builds_log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        tmp.mkdir()
        for i in range(5):
            (tmp / f"part{i}").write_text("x" * 1000)
            time.sleep(0.1)
        (tmp / "DONE").write_text("ok")

    out = build_atomically(final, build, is_valid=lambda p: (p / "DONE").is_file())
    print(sorted(os.listdir(out)))
""")


def test_build_atomically_two_processes_race(tmp_path):
    final, builds_log, go = tmp_path / "artifact", tmp_path / "builds.log", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", RACE_SCRIPT, str(final), str(builds_log), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    time.sleep(0.3)  # let both interpreters start and spin on the go file
    go.touch()
    results = [p.communicate(timeout=60) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
        assert out.strip() == str(["DONE"] + [f"part{i}" for i in range(5)])
    assert len(builds_log.read_text().split()) == 1, "the artifact was built more than once"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["artifact", "builds.log", "go", lock_path_for(final).name])


def test_build_atomically_failure_leaves_nothing_and_retry_works(tmp_path):
    final = tmp_path / "artifact"

    def failing(tmp):
        tmp.mkdir()
        (tmp / "half").write_text("x")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match=r"disk on fire"):
        build_atomically(final, failing)
    assert sorted(p.name for p in tmp_path.iterdir()) == [lock_path_for(final).name]
    build_atomically(final, lambda tmp: tmp.write_text("ok"))
    assert final.read_text() == "ok"


def test_build_atomically_rejects_invalid_build_output(tmp_path):
    final = tmp_path / "artifact"
    with pytest.raises(RuntimeError, match=r"fails validation"):
        build_atomically(final, lambda tmp: tmp.mkdir(), is_valid=lambda p: (p / "DONE").exists())
    assert not final.exists()


def test_build_atomically_replaces_invalid_and_clears_stale_temporaries(tmp_path, caplog):
    final = tmp_path / "artifact"
    final.mkdir()
    (final / "partial").write_text("x")
    stale = tmp_path / ".artifact.tmp-999-dead"
    stale.mkdir()

    def build(tmp):
        tmp.mkdir()
        (tmp / "DONE").write_text("ok")

    with caplog.at_level(logging.INFO, logger=cache_mod.__name__):
        build_atomically(final, build, is_valid=lambda p: (p / "DONE").is_file())
    assert sorted(p.name for p in final.iterdir()) == ["DONE"]
    assert not stale.exists()
    assert "replacing invalid or incomplete artifact" in caplog.text
    # Valid now: a second call must not build again.
    build_atomically(final, lambda tmp: pytest.fail("rebuilt a valid artifact"),
                     is_valid=lambda p: (p / "DONE").is_file())


def test_file_lock_timeout_names_the_lock(tmp_path):
    lock = tmp_path / "x.lock"
    with open(lock, "w") as holder:  # a second open file description = another holder
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match=r"x\.lock"), file_lock(lock, timeout=0.3, poll_seconds=0.05):
            pass
    with file_lock(lock, timeout=1):
        pass


# --- default target: the cache logic (fast, with a fake conversion) --------------------------

def _fake_conversion(out_dir: Path) -> None:
    package = default_target._source_package()
    out_dir.mkdir()
    (out_dir / "config.json").write_text("{}")
    (out_dir / "model.safetensors").write_bytes(bytes(10))
    stamp = {"stamp_version": default_target.STAMP_VERSION, "gguf_sha256": package.EXPECTED_SHA256,
             "files": {"config.json": 2, "model.safetensors": 10}}
    (out_dir / default_target.CONVERSION_STAMP_NAME).write_text(json.dumps(stamp))


def test_default_target_dir_converts_once_and_rebuilds_when_corrupt(tmp_cache, monkeypatch, caplog):
    conversions = []
    monkeypatch.setattr(default_target, "_convert_into", lambda out: conversions.append(1) or _fake_conversion(out))
    path = default_target.default_target_dir()
    assert path == tmp_cache / "models" / default_target.CONVERTED_DIR_NAME
    assert default_target.check_converted_dir(path) is None
    assert default_target.default_target_dir() == path and len(conversions) == 1

    (path / "model.safetensors").write_bytes(bytes(5))  # truncated
    assert "model.safetensors has 5 bytes, stamp says 10" in default_target.check_converted_dir(path)
    with caplog.at_level(logging.WARNING):
        default_target.default_target_dir()
    assert len(conversions) == 2 and "unusable" in caplog.text
    assert (path / "model.safetensors").stat().st_size == 10


@pytest.mark.parametrize(("mutate", "reason"), [
    (lambda d, s: (d / default_target.CONVERSION_STAMP_NAME).unlink(), "conversion never finished"),
    (lambda d, s: s.update(stamp_version=0), "stamp version 0"),
    (lambda d, s: s.update(gguf_sha256="0" * 64), "made from GGUF sha256"),
    (lambda d, s: (d / "config.json").unlink(), "file config.json missing"),
    (lambda d, s: s.update(files={}), "stamp lists no files"),
])
def test_check_converted_dir_reasons(tmp_path, mutate, reason):
    directory = tmp_path / "converted"
    _fake_conversion(directory)
    stamp_path = directory / default_target.CONVERSION_STAMP_NAME
    stamp = json.loads(stamp_path.read_text())
    mutate(directory, stamp)
    if stamp_path.exists():
        stamp_path.write_text(json.dumps(stamp))
    assert reason in default_target.check_converted_dir(directory)


def test_the_gguf_reference_catches_a_converted_model_that_computes_something_else():
    """What the conversion and the real-model test rely on: the stamp's few logits of the GGUF
    tell the model they came from apart from one whose weights were scaled or whose output rows
    were swapped, and accept the same model in bf16."""
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    reference = default_target.reference_logits(model, tokenizer, text="w5 w9 w14 w7 w30 w5 w9")
    assert len(reference["top_ids"]) == len(reference["token_ids"]) >= 7
    assert len(reference["top_ids"][0]) == min(default_target.CHECK_TOP_K, TINY_VOCAB)
    assert default_target.reference_mismatch(model, reference) is None
    assert default_target.reference_mismatch(model.to(torch.bfloat16).float(), reference) is None

    scaled = tiny_model("llama")
    with torch.no_grad():
        scaled.model.layers[2].mlp.down_proj.weight.mul_(3.0)
    assert default_target.reference_mismatch(scaled, reference) is not None

    swapped = tiny_model("llama")
    top = reference["top_ids"][0][0]
    other = reference["top_ids"][0][-1]
    with torch.no_grad():
        rows = swapped.lm_head.weight
        rows[[top, other]] = rows[[other, top]]
    assert "position 0: top token" in default_target.reference_mismatch(swapped, reference)


# --- the real default target (slow: converts once, ~1 min) ------------------------------------

@pytest.mark.slow
def test_default_target_real_model():
    """Uses the real cache (converting if needed), so later runs and other tests reuse it."""
    directory = default_target.default_target_dir()
    stamp = json.loads((directory / default_target.CONVERSION_STAMP_NAME).read_text())
    assert stamp["dtype"] == "bfloat16" and stamp["gguf_sha256"] == default_target._source_package().EXPECTED_SHA256
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106]
    assert (directory / "NOTICE").read_text().startswith(default_target.GEMMA_NOTICE)

    started = time.monotonic()
    model, tokenizer = load_target("default", dtype="bf16", device="cpu")
    load_seconds = time.monotonic() - started
    assert load_seconds < 20, f"reloading the converted default took {load_seconds:.1f} s"
    assert target_family(model) == "gemma3_text" and len(model.model.layers) == 18
    assert tokenizer.convert_ids_to_tokens([1, 2, 106]) == ["<eos>", "<bos>", "<end_of_turn>"]
    assert tokenizer.chat_template is None  # a base model: prompts are formatted plainly

    prompt = tokenizer("1, 2, 3, 4, 5,", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(out[0, prompt.input_ids.shape[1]:], skip_special_tokens=True)
    assert text.strip().startswith("6, 7"), text

    # The converted directory computes what the GGUF computes, up to bf16 rounding of the
    # weights: the GGUF's fp32 logits on the check prompt were kept in the stamp when it was
    # read for the conversion (reading it again costs a minute); compare in fp32.
    reference = stamp["gguf_reference"]
    assert reference["token_ids"] == tokenizer(default_target.CHECK_TEXT).input_ids
    converted, _ = load_target("default", dtype="fp32", device="cpu")
    assert default_target.reference_mismatch(converted, reference) is None
    assert model_fingerprint("default") == model_fingerprint(directory)
