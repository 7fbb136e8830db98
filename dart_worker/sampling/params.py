"""Sampling parameters, logit warping, and the per-request key every sampled token is drawn with.

Speculative decoding is only lossless if the verifier accepts and resamples against exactly
the distribution plain sampling would draw from. That distribution is defined here, once:
`warp_logits_to_probs` applies temperature, then top-k, then top-p with the same semantics
(ties, order, minimum one kept token) as transformers' `TemperatureLogitsWarper`,
`TopKLogitsWarper` and `TopPLogitsWarper`, so "sampling from the target" means the same
thing here as in `model.generate(do_sample=True, ...)`.

Randomness is per request and per position: a request's key (`request_key`: from its seed, or
fresh OS entropy drawn once per request) and the index t of a generated token give that token's
noise (dart_worker/sampling/gumbel.py: a counter-based hash of (key, t, token id)), and the token
is the Gumbel-max draw of the warped distribution with it (`gumbel_sample_threshold`; before issue
#48 the inverse-CDF draw of one uniform, dart_bench/inverse_cdf.py). So a sampled token depends on
the committed prefix and its position's noise alone: not on which requests share the batch, not
on what was drafted, not on the decoding mode - a seeded request commits the same tokens under
`ar` and every drafter (dart_worker/sampling/verification.py explains why the drafts cannot
change them). Nothing here touches Python's `random` or torch's global RNG.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from dart_worker.hardware.kernels import warp_for
from dart_worker.hardware.transfer import to_device_packed
from dart_worker.sampling.structured_output import StructuredOutput, parse_structured_output

_MAX_SEED = 2**63 - 1


GREEDY = "greedy"  # the band of temperature 0


def temperature_band(temperature: float | None) -> str:
    """A few names for many temperatures: "greedy", the temperature to one decimal, or ">2".

    How often a draft token is accepted depends on the temperature far more than on anything else
    of a request (greedy accepts the argmax, sampling at T=1 a draw), so the cost model calibrates
    acceptance per band and the metrics label tau with it; a label value is a series, so the
    bands must stay few whatever per-row settings hold."""
    if temperature is None:
        return "unknown"
    if temperature == 0:
        return GREEDY
    return ">2" if temperature > 2 else f"{round(float(temperature), 1):.1f}"


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. temperature 0 means greedy (argmax, top-k/top-p irrelevant).

    top_k = 0 and top_p = 1.0 switch those filters off; seed None draws a nondeterministic
    seed; stop_token_ids end generation after the stop token is emitted; a stop string ends it
    once the generated text contains it, and the returned text stops before it (the engine's job,
    which needs a tokenizer for it).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    # vLLM's meanings (see `apply_penalties` and `warp_logits_to_probs`): min_p keeps the tokens
    # whose probability is at least min_p times the most likely one's (0 = off); the penalties
    # change the logits of tokens already seen (1.0 / 0.0 = off).
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Report log-probabilities of the generated tokens and this many top alternatives per token
    # (0 = off; dart_worker.sampling.verification.sampling_log_probs says under which distribution).
    logprobs: int = 0
    # The shape the output must have (a JSON schema, a regex, a choice, a grammar: vLLM's options,
    # dart_worker/sampling/structured_output.py); a mapping or its JSON text is parsed on construction.
    # None = free text.
    structured_output: StructuredOutput | None = None
    # Report each prompt token's log-probability and this many top alternatives (0 = off): computed
    # from the prefill's hidden states, so the prompt rows go through the LM head only when asked.
    prompt_logprobs: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"temperature must be a number, got {type(self.temperature).__name__}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise TypeError(f"top_p must be a number, got {type(self.top_p).__name__}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=0)
        _check_int("logprobs", self.logprobs, minimum=0)
        _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
            if self.seed > _MAX_SEED:
                raise ValueError(f"seed must be <= {_MAX_SEED}, got {self.seed}")
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Sequence):
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids entry", token, minimum=0)
        if isinstance(self.stop, (str, bytes)) or not isinstance(self.stop, Sequence):
            raise TypeError(f"stop must be a sequence of strings, got {self.stop!r}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop strings must be non-empty strings, got {text!r}")
        object.__setattr__(self, "structured_output", parse_structured_output(self.structured_output))
        # Normalise lists to a tuple so the dataclass stays hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def band(self) -> str:
        """This request's `temperature_band` (what the cost model calibrates acceptance by)."""
        return temperature_band(self.temperature)

    @property
    def warp_key(self) -> tuple[float, int, float, float]:
        """The fields that turn (penalised) logits into the sampling distribution (requests with
        equal keys share `warp_logits_to_probs`)."""
        return (self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def has_penalties(self) -> bool:
        """Do this request's logits depend on the tokens before them (`apply_penalties`)?"""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class TokenHistory:
    """What a request's penalties count before its next token: the prompt (`tokens[:num_prompt]`)
    and the tokens generated so far (the rest)."""

    tokens: Sequence[int]
    num_prompt: int

    def counted(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids seen in the prompt or the output, sorted; how often each is in the output)."""
        tokens = np.asarray(self.tokens, dtype=np.int64)
        seen, inverse = np.unique(tokens, return_inverse=True)
        output = np.bincount(inverse[self.num_prompt :], minlength=seen.shape[0])
        return seen, output.astype(np.int64)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory],
                    paths: Sequence[Sequence[int]]) -> torch.Tensor:
    """Penalised float32 copy of logits [R, V]: row r belongs to a request with `params[r]` whose
    committed tokens are `histories[r]`, and predicts the token after `paths[r]` (the tree nodes
    from the root down to the row's node: generated tokens not yet committed).

    vLLM's meanings (`vllm.model_executor.layers.utils.apply_penalties`), in its order: a token seen
    in the prompt or the output has its logit divided by repetition_penalty when positive,
    multiplied by it otherwise; then frequency_penalty x (times in the output) and presence_penalty
    x (in the output at all) are subtracted. The output of a tree row is the committed output plus
    its own path, so every node is penalised as plain decoding would penalise that position, which
    keeps verification lossless (greedy = `ar`, sampling identically distributed).

    Only the (row, token) pairs that were seen are touched: one gather and one scatter of about
    rows x distinct seen tokens, instead of vLLM's [R, V] count tensors.
    """
    out = logits.float().clone()
    if not any(p.has_penalties for p in params):
        return out
    rows, tokens, counts, rep, freq, pres = [], [], [], [], [], []
    bases: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # per history object: a request's rows share it
    for r, (p, history, path) in enumerate(zip(params, histories, paths, strict=True)):
        if not p.has_penalties:
            continue
        base = bases.get(id(history))
        if base is None:
            base = bases[id(history)] = history.counted()
        seen, output = base
        if len(path):
            extra, extra_counts = np.unique(np.asarray(path, dtype=np.int64), return_counts=True)
            at = np.searchsorted(seen, extra)
            found = (at < seen.shape[0]) & (seen[np.minimum(at, seen.shape[0] - 1)] == extra) if seen.size else \
                np.zeros(extra.shape[0], dtype=bool)
            output = output.copy()
            np.add.at(output, at[found], extra_counts[found])
            seen = np.concatenate([seen, extra[~found]])
            output = np.concatenate([output, extra_counts[~found]])
        n = seen.shape[0]
        rows.append(np.full(n, r, dtype=np.int64))
        tokens.append(seen)
        counts.append(output)
        rep.append(np.full(n, p.repetition_penalty, dtype=np.float32))
        freq.append(np.full(n, p.frequency_penalty, dtype=np.float32))
        pres.append(np.full(n, p.presence_penalty, dtype=np.float32))
    device = out.device
    row_index, token_index, count, rep_t, freq_t, pres_t = to_device_packed(  # one non-blocking upload
        [np.concatenate(rows), np.concatenate(tokens), np.concatenate(counts).astype(np.float32),
         *(np.concatenate(a) for a in (rep, freq, pres))], device)
    values = out[row_index, token_index]
    values = torch.where(values > 0, values / rep_t, values * rep_t)
    values = values - freq_t * count
    values = values - pres_t * (count > 0).float()
    out[row_index, token_index] = values
    return out


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def warp_logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [R, V] (float32) that sampling with `params` draws each row's next token from.

    The pipeline of transformers' sampling: scores = logits (in float32) / temperature; top-k
    keeps every token whose score is >= the k-th largest (ties survive); top-p keeps a token iff
    the probability of the tokens scoring strictly higher is < top_p (so the most likely token
    always survives); softmax over what is kept. temperature 0 gives the one-hot distribution of
    the argmax (first maximum).

    min_p (vLLM's rule, applied after temperature and before top-k / top-p, as vLLM does) keeps a
    token iff its probability is >= min_p times the largest; the filters after it see only what it
    kept. Penalties (`apply_penalties`) belong to the logits, before this.

    Top-p is transformers' rule (it drops a token iff the ascending cumulative probability up
    to it is <= 1 - top_p, i.e. iff the mass above it is >= top_p). The results agree except
    within float rounding of the cut, and where tied scores straddle the cut: there
    transformers' answer depends on the order its unstable sort gives equal values, while this
    rule keeps or drops tied tokens together.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    scores = logits.float()
    if params.is_greedy:
        probs = torch.zeros_like(scores)
        return probs.scatter_(-1, scores.argmax(dim=-1, keepdim=True), 1.0)
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.min_p > 0.0 and scores.shape[0]:
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    vocab = scores.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if (top_k == 0 and params.top_p >= 1.0) or scores.shape[0] == 0:
        return scores.softmax(dim=-1)
    if _use_candidates(scores):
        if top_k:
            candidates = _top_k_candidates(scores, top_k, params.top_p)
        else:
            candidates = _top_p_candidates(scores, params.top_p)
        if candidates is not None:
            values, index, keep = candidates
            kept = values.masked_fill(~keep, float("-inf")).softmax(dim=-1)
            return torch.zeros_like(scores).scatter_(-1, index, kept)
    return _warp_dense(scores, top_k, params.top_p)


def _use_candidates(scores: torch.Tensor) -> bool:
    """Work on the few candidate tokens instead of whole rows (the `warp` strategy of
    `dart_worker.hardware.kernels`)? On a CPU every pass over a 262k vocabulary costs milliseconds and a
    host sync is free; on an accelerator passes are cheap and the syncs of the candidate search
    would stall the stream. Both give the same probabilities (tests run both on CPU tensors)."""
    return warp_for(scores.device) == "candidates"


def _nucleus_keep(values: torch.Tensor, mass: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p on candidates sorted by score, descending: keep iff the mass scoring strictly
    higher is < top_p. mass: float64 probabilities of the candidates (of the whole row)."""
    exclusive = mass.cumsum(dim=-1) - mass
    ascending = -values
    group_start = torch.searchsorted(ascending, ascending, side="left")  # first of each tie group
    return exclusive.gather(-1, group_start) < top_p


def _top_k_candidates(scores: torch.Tensor, top_k: int, top_p: float):
    """The k best tokens are all that can survive: decide top-p among them. None (use the dense
    path) if some row has ties at the k-th score, since top-k then keeps more than k tokens."""
    values, index = scores.topk(top_k, dim=-1)
    if bool(((scores >= values[:, -1:]).sum(dim=-1) > top_k).any()):
        return None
    if top_p >= 1.0:
        return values, index, torch.ones_like(values, dtype=torch.bool)
    return values, index, _nucleus_keep(values, values.double().softmax(dim=-1), top_p)


# Candidates examined first by top-p alone; grown 16x while the nucleus may reach beyond them.
_TOP_P_CANDIDATES = 1024


def _top_p_candidates(scores: torch.Tensor, top_p: float):
    """A full sort of a 262k vocabulary per row is a large share of a round's non-model time on a
    CPU, and the nucleus is nearly always far smaller: take the m best tokens, decide them, and
    stop once the worst candidate is dropped - every token outside scores no higher, so has at
    least as much mass above it and is dropped too. Otherwise grow m (at worst to the whole vocabulary)."""
    probs = scores.softmax(dim=-1)
    # float32 softmax over a large vocabulary is off by a common factor ~1e-5 (its normaliser);
    # measuring masses against the actual total cancels that factor.
    total = probs.sum(dim=-1, keepdim=True, dtype=torch.float64)
    vocab = scores.shape[-1]
    m = min(vocab, _TOP_P_CANDIDATES)
    while True:
        if m < vocab:
            values, index = scores.topk(m, dim=-1)  # descending
        else:  # a full sort is cheaper than topk of everything
            values, index = scores.sort(dim=-1, descending=True)
        keep = _nucleus_keep(values, probs.gather(-1, index).double() / total, top_p)
        if m == vocab or not bool(keep[:, -1].any()):
            return values, index, keep
        m = min(vocab, 16 * m)


def _warp_dense(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Whole-row top-k / top-p / softmax, no host syncs (accelerators; CPU rows with k-th ties)."""
    if top_k:
        kth_largest = scores.topk(top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth_largest, float("-inf"))
    if top_p < 1.0:
        values, index = scores.sort(dim=-1, descending=True)
        mass = values.softmax(dim=-1).double()
        keep_sorted = _nucleus_keep(values, mass / mass.sum(dim=-1, keepdim=True), top_p)
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, index, keep_sorted)
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(dim=-1)


_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of sample `sample` (0, 1, ...) of a request seeded `seed`, for n completions of one
    prompt: sample 0 keeps `seed` (so n = 1 decodes exactly as before, and sample 0 of n equals the
    request alone), sample i > 0 a hash of (seed, i) in [0, 2**63). Any sample is therefore
    reproducible alone: decode the prompt with `for_sample(params, i)`. None stays None (every
    sample then draws its own fresh entropy in `request_key`)."""
    if sample < 0:
        raise ValueError(f"sample index must be >= 0, got {sample}")
    if seed is None or sample == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:sample:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def for_sample(params: SamplingParams, sample: int) -> SamplingParams:
    """`params` for sample `sample` of n completions of one prompt (its own seed, `sample_seed`)."""
    return params if sample == 0 else replace(params, seed=sample_seed(params.seed, sample))


def request_key(params: SamplingParams) -> int:
    """A request's 64-bit noise key: a hash of params.seed (so seeds 1 and 2 give unrelated
    streams), else fresh OS entropy (a nondeterministic request)."""
    if params.seed is None:
        return secrets.randbits(64)
    return int(_splitmix64(np.asarray([params.seed], dtype=_U64) ^ _U64(0x5EED5EED5EED5EED))[0])


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        return z ^ (z >> _U64(31))
