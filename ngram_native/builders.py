"""Draft-tree builders: per-position draft scores of a batch -> one `DraftTree` per sequence.

Three builders run in C++ with the GIL released: DART's n-gram beam search
(`build_dart_trees`), DDTree's best-first tree (`build_ddtree_trees`) and the top-1 chain
(`build_chain_trees`); `TreeParams` is how a tree is built, one typed object from the config to
the C++ struct. The tree they return and every operation on it (validation, masks, positions,
walks, cuts, merges) live in `ngram_native.trees`; this module is the builders' side only: their
parameters and the checks of their numpy inputs, kept apart so that the tree type reads on its
own. After the first call on a thread a builder allocates nothing per tree except the output
arrays.

Draft scores come in one of two forms:

- ``logits``: float [B, D, V], one row of logits per draft position (C++ picks the top-k
  per row with one scan). Convenient, but every row costs an O(V) pass.
- ``topk_ids`` int [B, D, K] with ``topk_values`` float [B, D, K]: pre-selected
  candidates (logits or log-probs), e.g. from ``torch.topk`` on the device. This is the
  hot-path form (the first two positional arguments of every builder): nothing of size V
  crosses into C++. The order within a row does not matter; ids must be distinct within a
  row.

Every builder also takes `eos_ids` (nodes carrying one get no children), `budget` (nodes
per tree, root excluded) and `max_depths` (a per-sequence depth limit, e.g. the tokens a
sequence may still generate). Bad input raises ValueError/TypeError naming the offending
argument (and position, for NaN, +inf, out-of-range or duplicate ids).

    trees = build_dart_trees(ids, values, contexts, trie, budget=60, eos_ids=[eos])
    tree = trees[0]
    mask = tree.ancestor_mask()          # [N + 1, N + 1], index 0 = root
    positions = start + tree.position_offsets()
    child = tree.find_child(-1, token)   # verification walk from the root
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ngram_native import _core
from ngram_native.trees import DraftTree

NgramScorer = _core.NgramScorer
ValuesKind = Literal["logits", "logprobs"]

_INT32_LIMIT = 2**31


_NATIVE_DEFAULTS = _core.DartParams()
# Draft nodes per tree (root excluded) wherever none is given: the C++ reference value, so every
# builder, `TreeParams` and the jobs share one number (dart_worker.defaults re-exports it).
DEFAULT_BUDGET = _NATIVE_DEFAULTS.budget


class InvalidTreeParams(ValueError):
    """A `TreeParams` with bad fields, raised as it is built (a config loads, `TreeParams(...)`,
    `dataclasses.replace`). `problems` lists every bad field as (name, what is wrong); the message
    names them all."""

    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__(problems)
        self.problems = problems

    def __str__(self) -> str:
        return "; ".join(f"{name} {message}" for name, message in self.problems)


class TreeParamsTypeError(InvalidTreeParams, TypeError):
    """An `InvalidTreeParams` where some field has the wrong type (a count that is no integer)."""


@dataclass(frozen=True)
class TreeParams:
    """How draft trees are built: one typed object from the config to the C++ builders.

    The DART defaults are those of the C++ `trees::DartParams` (the DART reference
    implementation), read from the extension, so they are written down once. `budget` and
    `max_depth` apply to every builder, `top_k` to DART and DDTree, `lookup_*` to the context
    lookup trees (`ngram_native.context`), the rest to DART's n-gram beam search only.

    Checked once, when built: bad fields raise `InvalidTreeParams` naming each of them, so an
    instance is always usable and nothing downstream checks it again. The fields marked
    *expert* in docs/config.md (`keep_pruned`, `prune`, `ngram_first_level`) exist for the
    reference tests and for studies; the shipped configs leave them alone.
    """

    budget: int = DEFAULT_BUDGET  # draft nodes per tree, root excluded
    top_k: int = _NATIVE_DEFAULTS.top_k  # candidates per draft position
    beam_width: int = _NATIVE_DEFAULTS.beam_width  # beam nodes kept per level
    depth_decay: float = _NATIVE_DEFAULTS.depth_decay  # level weight (l + 1) ** -depth_decay
    draft_decay: float = _NATIVE_DEFAULTS.draft_decay  # draft log-prob weight decay per level
    ngram_weight: float = _NATIVE_DEFAULTS.ngram_weight  # weight of the n-gram log-prob
    max_depth: int | None = None  # deepest draft level; None = every position the drafter predicts
    # Expert (docs/config.md): the reference's choices, switched only by tests and studies.
    keep_pruned: bool = _NATIVE_DEFAULTS.keep_pruned  # beam-pruned children may still be leaves
    prune: bool = _NATIVE_DEFAULTS.prune  # skip provably hopeless children (exact; False for tests)
    ngram_first_level: bool = _NATIVE_DEFAULTS.ngram_first_level  # n-gram term at depth 1 too (reference: no)
    # Context lookup (the `lookup` drafter and the hybrids; ngram_native.context):
    lookup_min_match: int = 2  # shortest suffix match worth drafting from (transformers uses 2)
    lookup_depth_factor: float = 4.0  # draft depth <= factor x match length (SuffixDecoding's rule)
    lookup_max_occurrences: int = 32  # most recent earlier occurrences that vote on the continuation
    # The job-level cache (ngram_native.context.JobCache) of the lookup drafters: earlier rows'
    # finished outputs, one cache per worker; its token budget (oldest rows evicted first), 0 = off.
    lookup_cache_tokens: int = 262144
    lookup_cache_prompts: bool = False  # also cache each finished row's prompt (before its output)
    # The job n-gram (ngram_native.job_ngram.JobNgram) of DART's beam: the n-gram counts of the
    # worker's finished outputs, mixed into the static trie's estimate; its token budget (oldest
    # rows evicted first), 0 = off; its order; its prior (the job context count at which job and
    # trie weigh the same).
    job_ngram_tokens: int = 262144
    job_ngram_order: int = 4
    job_ngram_prior: float = 4.0
    # Coupled drafting (issue #48; dart_worker.drafters.coupling): the head drafters (chain, ddtree,
    # dart and the hybrids' head part) build a sampled row's tree from (log q + a g) / s instead of
    # the head's logits, g the target sampler's noise at each drafted position; a =
    # coupling_noise_weight (0 = off: the head's own distribution, as before #48), s = coupling_scale.
    # Greedy rows are never coupled. The defaults were the best by replay (docs/benchmarks.md).
    coupling_noise_weight: float = 0.75
    coupling_scale: float = 1.0

    def __post_init__(self) -> None:
        bad = _problems(self)
        if bad:
            wrong_type = any(message.startswith("must be an integer") for _, message in bad)
            raise (TreeParamsTypeError if wrong_type else InvalidTreeParams)(bad)

    def to_native(self) -> _core.DartParams:
        """The C++ struct the DART builder reads."""
        native = _core.DartParams()
        for name in ("budget", "top_k", "beam_width"):
            setattr(native, name, int(getattr(self, name)))
        for name in ("depth_decay", "draft_decay", "ngram_weight"):
            setattr(native, name, float(getattr(self, name)))
        native.keep_pruned, native.prune = bool(self.keep_pruned), bool(self.prune)
        native.ngram_first_level = bool(self.ngram_first_level)
        return native


def _problems(params: TreeParams) -> list[tuple[str, str]]:
    """Every invalid field of `params` as (name, what is wrong); empty when they are usable."""
    out = []
    for name, minimum in (("budget", 0), ("top_k", 1), ("beam_width", 1), ("lookup_min_match", 1),
                          ("lookup_max_occurrences", 1), ("lookup_cache_tokens", 0),
                          ("job_ngram_tokens", 0), ("job_ngram_order", 1)):
        value = getattr(params, name)
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            out.append((name, f"must be an integer, got {type(value).__name__}"))
        elif value < minimum:
            out.append((name, f"must be >= {minimum}, got {value}"))
    for name, minimum in (("depth_decay", None), ("draft_decay", 0.0), ("ngram_weight", 0.0),
                          ("job_ngram_prior", 0.0)):
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
                or not math.isfinite(float(value)):
            out.append((name, f"must be finite, got {value!r}"))
        elif minimum is not None and value < minimum:
            out.append((name, f"must be >= {minimum}, got {value}"))
    factor = params.lookup_depth_factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float, np.number)) \
            or not math.isfinite(float(factor)) or factor <= 0:
        out.append(("lookup_depth_factor", f"must be finite and > 0, got {factor!r}"))
    if isinstance(params.lookup_cache_tokens, (int, np.integer)) and params.lookup_cache_tokens > 2**28:
        out.append(("lookup_cache_tokens", f"must be <= 2**28 (268435456), got {params.lookup_cache_tokens}"))
    if isinstance(params.job_ngram_tokens, (int, np.integer)) and params.job_ngram_tokens > 2**28:
        out.append(("job_ngram_tokens", f"must be <= 2**28 (268435456), got {params.job_ngram_tokens}"))
    if isinstance(params.job_ngram_order, (int, np.integer)) and params.job_ngram_order > 6:
        out.append(("job_ngram_order", f"must be <= 6, got {params.job_ngram_order}"))
    if not isinstance(params.lookup_cache_prompts, (bool, np.bool_)):
        out.append(("lookup_cache_prompts", f"must be true or false, got {params.lookup_cache_prompts!r}"))
    weight, scale = params.coupling_noise_weight, params.coupling_scale
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.number)) or not 0.0 <= float(weight) <= 1.0:
        out.append(("coupling_noise_weight", f"must be in [0, 1] (0 = off), got {weight!r}"))
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.number)) \
            or not math.isfinite(float(scale)) or scale <= 0:
        out.append(("coupling_scale", f"must be finite and > 0, got {scale!r}"))
    depth = params.max_depth
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or depth < 1):
        out.append(("max_depth", f"must be >= 1 or None, got {depth!r}"))
    return out


def ngram_probs(
    scorer: NgramScorer, context: Sequence[int] | np.ndarray, candidates: Sequence[int] | np.ndarray
) -> np.ndarray:
    """The scorer's DART estimate q(t | context) for every candidate t (float32).

    Only the last n - 1 context tokens matter. Exposed for debugging and for the
    pure-Python references in the tests.
    """
    ctx = _token_array(context, "context", None)
    cand = _token_array(candidates, "candidates", None)
    return _core._ngram_probs(scorer, ctx, cand)


# ---------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------


def build_dart_trees(
    topk_ids: np.ndarray | None = None,
    topk_values: np.ndarray | None = None,
    contexts: Sequence[Sequence[int] | np.ndarray] | None = None,
    scorer: NgramScorer | None = None,
    *,
    logits: np.ndarray | None = None,
    params: TreeParams | None = None,
    eos_ids: int | Iterable[int] = (),
    max_depths: Sequence[int] | np.ndarray | None = None,
    vocab_size: int | None = None,
    **overrides,
) -> list[DraftTree]:
    """DART n-gram-guided beam search (arXiv 2601.19278); defaults = the reference code.

    Per draft position l (0-based; node depth l + 1) the best `top_k` candidates get
    p_l = softmax over those k values only. A child t of beam node u scores
        score(u) + (l + 1)**-depth_decay * (draft_decay**l * ln(p_l(t) + 1e-10)
                                           + ngram_weight * ln(q(t | ctx) + 1e-10)),
    where q comes from `scorer` with ctx = the last n - 1 tokens of (committed context +
    path to u, u included). Level 0 has no n-gram term, nor does any level when `scorer` is
    None. Each level keeps `beam_width` children (non-EOS first, then by score); EOS nodes
    are never expanded. The tree holds the best `budget` nodes over all levels - of every
    scored child when `keep_pruned` (as the reference does), else of the beam-kept ones -
    ranked by min(score, parent's rank key) so that the result is always prefix-closed.

    Args:
        topk_ids, topk_values: pre-selected candidates [B, D, K]; values may be logits or
            log-probs (the softmax over the k is the same). Or pass `logits` [B, D, V].
        contexts: B sequences of committed token ids (the root token last); only the last
            n - 1 are read. Required when `scorer` is given, ignored otherwise.
        scorer: an N-gram model (e.g. an `NgramTrie`), or None for draft scores alone.
        params: a `TreeParams` (default: the reference values); keyword `overrides` replace
            its fields (``budget=16``). budget >= 0 nodes per tree (root excluded); top_k >= 1
            candidates per position (clamped to V or K); beam_width >= 1; depth_decay,
            draft_decay, ngram_weight: the weights above (the decay and the n-gram weight must
            be >= 0, so scores never grow along a path beyond rounding); keep_pruned: whether
            children cut from the beam may still enter the tree as leaves; prune: skip children
            that provably cannot enter the tree (their best possible score, with q = 1, is
            below the budget-th best key found so far) - exact, the tree is the same either
            way, and it avoids most N-gram queries (False is for testing). `max_depth` is
            ignored here: per-sequence limits come in `max_depths`.
        eos_ids: token id(s) that end a sequence; such nodes get no children.
        max_depths: optional per-sequence depth limit (<= D is used; 0 = empty tree), e.g.
            the tokens a sequence may still generate. Rows past the limit are not read.
        vocab_size: optional bound for top-k ids and context ids (dense logits imply V).
    """
    values, ids, vocab = _draft_input(logits, topk_ids, topk_values, vocab_size)
    params = params or TreeParams()
    if overrides:
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(TreeParams)})
        if unknown:
            raise TypeError(f"unknown tree parameter(s) {unknown}")
        params = dataclasses.replace(params, **overrides)  # checked as it is built
    batch = values.shape[0]
    ctx_tokens = ctx_offsets = None
    if scorer is not None:
        if contexts is None:
            raise ValueError("contexts are required with a scorer (use [] for an empty context)")
        order = _core._scorer_order(scorer)
        ctx_tokens, ctx_offsets = _pack_contexts(contexts, batch, max(order - 1, 0), vocab)
    elif contexts is not None and len(contexts) != batch:
        raise ValueError(f"got {len(contexts)} contexts for a batch of {batch}")
    out = _core._build_dart(
        values, ids, vocab if vocab is not None else -1, ctx_tokens, ctx_offsets, scorer,
        _eos_array(eos_ids), _max_depths(max_depths, batch), params.to_native(),
    )  # fmt: skip
    return _split(*out)


def build_ddtree_trees(
    topk_ids: np.ndarray | None = None,
    topk_values: np.ndarray | None = None,
    *,
    logits: np.ndarray | None = None,
    values: ValuesKind = "logprobs",
    budget: int = DEFAULT_BUDGET,
    top_k: int | None = None,
    eos_ids: int | Iterable[int] = (),
    max_depths: Sequence[int] | np.ndarray | None = None,
    vocab_size: int | None = None,
) -> list[DraftTree]:
    """DDTree best-first tree (arXiv 2604.12989): the `budget` most likely draft prefixes.

    A path's score is the sum of its per-position log-probabilities: `topk_values` as given
    when values="logprobs" (the default: e.g. ``log_softmax(logits).topk(k)``; they must be
    <= 0, positives up to 1e-4 are taken as rounding noise and clamped), a log-softmax over
    the K values when values="logits", or a log-softmax over the full vocabulary for dense
    `logits`. A heap pops the best frontier node and pushes its next sibling and its first
    child (none for EOS nodes or at the depth limit), which yields exactly the top-`budget`
    prefixes under (score desc, depth asc, candidate ranks along the path asc).

    Args:
        topk_ids, topk_values: pre-selected candidates [B, D, K]. Or pass `logits` [B, D, V].
        values: "logprobs" or "logits": what `topk_values` hold (ignored for dense logits).
        budget: number of nodes per tree (root excluded), >= 0.
        top_k: candidates per position; None = all K, or min(budget, V) for dense logits
            (enough for an exact best-first tree over the whole vocabulary).
        eos_ids: token id(s) whose nodes get no children.
        max_depths: optional per-sequence depth limit (<= D is used; 0 = empty tree).
        vocab_size: optional bound for top-k ids.
    """
    draft_values, ids, vocab = _draft_input(logits, topk_ids, topk_values, vocab_size)
    _check_int("budget", budget, 0)
    if top_k is not None:
        _check_int("top_k", top_k, 1)
    out = _core._build_ddtree(
        draft_values, ids, vocab if vocab is not None else -1, _eos_array(eos_ids),
        _max_depths(max_depths, draft_values.shape[0]), 0 if top_k is None else top_k, budget,
        _values_are_logprobs(values),
    )  # fmt: skip
    return _split(*out)


def build_chain_trees(
    topk_ids: np.ndarray | None = None,
    topk_values: np.ndarray | None = None,
    *,
    logits: np.ndarray | None = None,
    values: ValuesKind = "logits",
    budget: int = DEFAULT_BUDGET,
    eos_ids: int | Iterable[int] = (),
    max_depths: Sequence[int] | np.ndarray | None = None,
    vocab_size: int | None = None,
) -> list[DraftTree]:
    """A chain of the top-1 candidate per position (plain speculative decoding).

    Depth <= min(D, budget, max_depths[b]); the chain stops after an EOS token. Scores are
    cumulative log-probs as in `build_ddtree_trees` (log-softmax over the K given values
    for values="logits", so with K = 1 they are all 0; dense logits pay one O(V) exp pass
    per row for them). The chain itself does not depend on `values`.
    """
    draft_values, ids, vocab = _draft_input(logits, topk_ids, topk_values, vocab_size)
    _check_int("budget", budget, 0)
    out = _core._build_chain(
        draft_values, ids, vocab if vocab is not None else -1, _eos_array(eos_ids),
        _max_depths(max_depths, draft_values.shape[0]), budget, _values_are_logprobs(values),
    )  # fmt: skip
    return _split(*out)


# ---------------------------------------------------------------------------------------
# Input checking and conversion
# ---------------------------------------------------------------------------------------


def _check_int(name: str, value: int, minimum: int) -> None:
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")


def _values_are_logprobs(values: str) -> bool:
    if values not in ("logits", "logprobs"):
        raise ValueError(f'values must be "logits" or "logprobs", got {values!r}')
    return values == "logprobs"


def _float_array(x: object, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "fiu":
        raise ValueError(f"{name} must hold real numbers, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32)


def _document_array(tokens: object, what: str, vocab: int | None) -> np.ndarray:
    """One finished document for a job-level index (`what` names it in errors): 1-D, at least one
    token id, each in [0, vocab) - as contiguous int32."""
    a = np.asarray(tokens)
    if a.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {a.shape}")
    if a.shape[0] == 0:
        raise ValueError(f"a {what} document needs at least one token")
    return _token_array(a, "tokens", vocab)


def _token_array(x: object, name: str, vocab: int | None) -> np.ndarray:
    """Integer ids -> contiguous int32, checking 0 <= id < vocab (or < 2**31)."""
    a = np.asarray(x)
    if a.size == 0:  # np.asarray([]) is float64: any dtype is fine when there are no ids
        return np.zeros(a.shape, dtype=np.int32)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer token ids, got dtype {a.dtype}")
    limit = _INT32_LIMIT if vocab is None else vocab
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds token id {bad} outside [0, {limit})")
    return np.ascontiguousarray(a, dtype=np.int32)


def _draft_input(
    logits: np.ndarray | None,
    topk_ids: np.ndarray | None,
    topk_values: np.ndarray | None,
    vocab_size: int | None,
) -> tuple[np.ndarray, np.ndarray | None, int | None]:
    """Validate either form of draft scores -> (values f32, ids i32 or None, vocab)."""
    if vocab_size is not None:
        _check_int("vocab_size", vocab_size, 1)
    if logits is not None:
        if topk_ids is not None or topk_values is not None:
            raise ValueError("pass either logits or topk_ids + topk_values, not both")
        values = _float_array(logits, "logits")
        if values.ndim != 3:
            raise ValueError(f"logits must be [B, D, V], got shape {values.shape}")
        if vocab_size is not None and vocab_size != values.shape[2]:
            raise ValueError(f"vocab_size {vocab_size} differs from the logits' V = {values.shape[2]}")
        ids = None
        vocab = values.shape[2]
    else:
        if topk_ids is None or topk_values is None:
            raise ValueError("pass logits [B, D, V], or both topk_ids and topk_values [B, D, K]")
        values = _float_array(topk_values, "topk_values")
        if values.ndim != 3:
            raise ValueError(f"topk_values must be [B, D, K], got shape {values.shape}")
        id_shape = np.shape(topk_ids)
        if id_shape != values.shape:
            raise ValueError(f"topk_ids shape {id_shape} differs from topk_values shape {values.shape}")
        ids = _token_array(topk_ids, "topk_ids", vocab_size)
        vocab = vocab_size
    if values.shape[1] < 1:
        raise ValueError(f"need D >= 1 draft positions, got shape {values.shape}")
    if values.shape[2] < 1:
        raise ValueError(f"need at least one candidate per position, got shape {values.shape}")
    return values, ids, vocab


def _pack_contexts(
    contexts: Sequence[Sequence[int] | np.ndarray], batch: int, width: int, vocab: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Cut each context to its last `width` tokens and concatenate -> (tokens, offsets)."""
    if len(contexts) != batch:
        raise ValueError(f"got {len(contexts)} contexts for a batch of {batch}")
    tails = []
    for b, c in enumerate(contexts):
        tail = np.asarray(c[max(len(c) - width, 0) :] if width else c[:0])  # cut before converting
        if tail.ndim != 1:
            raise ValueError(f"contexts[{b}] must be 1-D, got shape {np.shape(c)}")
        tails.append(_token_array(tail, f"contexts[{b}]", vocab))
    offsets = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum([t.shape[0] for t in tails], out=offsets[1:])
    tokens = np.concatenate(tails) if tails else np.zeros(0, dtype=np.int32)
    return tokens, offsets


def _max_depths(max_depths: Sequence[int] | np.ndarray | None, batch: int) -> np.ndarray | None:
    if max_depths is None:
        return None
    a = np.asarray(max_depths)
    if a.shape != (batch,) or (batch and a.dtype.kind not in "iu"):
        raise ValueError(f"max_depths must be {batch} integers, got dtype {a.dtype} shape {a.shape}")
    if batch and a.min() < 0:
        raise ValueError(f"max_depths must be >= 0, got {int(a.min())}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _eos_array(eos_ids: int | Iterable[int] | None) -> np.ndarray:
    if eos_ids is None:
        return np.zeros(0, dtype=np.int32)
    ids = [eos_ids] if isinstance(eos_ids, (int, np.integer)) else list(eos_ids)
    return _token_array(np.asarray(ids, dtype=np.int64), "eos_ids", None)


def _split(
    tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray, scores: np.ndarray, offsets: np.ndarray
) -> list[DraftTree]:
    """Concatenated batch output -> one read-only DraftTree (array views) per sequence."""
    for a in (tokens, parents, depths, scores):
        a.flags.writeable = False
    bounds = offsets.tolist()
    return [DraftTree(tokens[s:e], parents[s:e], depths[s:e], scores[s:e]) for s, e in itertools.pairwise(bounds)]
