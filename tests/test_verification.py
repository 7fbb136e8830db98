"""Tree verification: greedy walk vs brute force; sampling: the same tokens as plain sampling
with the same key, and statistical losslessness.

The statistical tests run a toy target (a fixed random distribution for every context over a
vocabulary of 8) through many independent decoding chains: each round drafts a random tree
(siblings at every depth, depth 3), verifies it with `verify_batch` and commits the accepted
path plus the bonus, until every chain holds two tokens. The first token and the first two
tokens are chi-square tested against the exact target distribution computed independently
with transformers' warpers. Sample sizes are chosen so that moving 0.02 of probability between
the two most likely outcomes is caught with power >= 0.99 (checked analytically and
empirically), and deliberately biased verifiers must fail the same test. Every chain has its own
key; a chain decoded with empty trees (plain sampling) commits exactly the same tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import dart_worker.sampling.verification as verification
from dart_worker.sampling import params as sampling
from dart_worker.sampling.logits_processors import RowControls
from dart_worker.sampling.params import SamplingParams, request_key, warp_logits_to_probs
from dart_worker.sampling.verification import (
    Acceptance,
    VerifyRow,
    verify_batch,
    verify_greedy,
    verify_sampling,
)
from ngram_native.trees import SOURCE_CONTEXT, SOURCE_HEAD
from tests.hypothesis_budget import examples
from tests.test_sampling import transformers_probs
from tests.test_tree_batch import make_tree, random_tree, trees

VOCAB = 8  # of the deterministic tests
CHAINS = 40_000  # per configuration; see test_sample_size_catches_a_two_percent_error
ALPHA = 1e-4  # significance level of every chi-square test
MIN_EXPECTED = 5.0  # cells expected below this are pooled, as chi-square requires

# ------------------------------------------------------------------------ greedy


def verify_requests(trees, logits, params, keys=None, positions=None):
    """`verify_batch` of requests given as parallel lists (tree b with params[b], keys[b] and
    positions[b]; None: greedy requests at position 0)."""
    keys = [None] * len(trees) if keys is None else keys
    positions = [0] * len(trees) if positions is None else positions
    return verify_batch([VerifyRow(tree, RowControls(p), key, position)
                         for tree, p, key, position in zip(trees, params, keys, positions, strict=True)], logits)


def brute_force_greedy(tree, argmax):
    """Reference: the deepest node whose whole path agrees with the argmax table."""
    parents, tokens = tree.parents, tree.tokens
    best, best_depth = -1, 0
    for i in range(len(tokens)):
        node, agrees = i, True
        while node >= 0:
            agrees &= int(tokens[node]) == int(argmax[parents[node] + 1])
            node = int(parents[node])
        if agrees and tree.depths[i] > best_depth:
            best, best_depth = i, int(tree.depths[i])
    path = []
    node = best
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1], int(argmax[best + 1])


@settings(max_examples=examples(300), deadline=None)
@given(trees(vocab=4, max_depth=4, max_children=3), st.data())
def test_greedy_walk_matches_brute_force(tree, data):
    n = len(tree.tokens)
    argmax = data.draw(st.lists(st.integers(0, 3), min_size=n + 1, max_size=n + 1))
    result = verify_greedy(tree, np.array(argmax))
    path, bonus = brute_force_greedy(tree, argmax)
    assert result.accepted.tolist() == path
    assert result.accepted_tokens.tolist() == [int(tree.tokens[i]) for i in path]
    assert result.bonus == bonus
    assert result.tokens.tolist() == [*result.accepted_tokens.tolist(), bonus]
    assert result.committed_rows.tolist() == [0, *(i + 1 for i in path)]
    assert result.bonus_row == (path[-1] + 1 if path else 0)


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(trees(vocab=4, max_depth=4, max_children=3), min_size=1, max_size=5), st.data())
def test_greedy_walk_by_rows_projects_each_row_once_and_equals_full_verification(batch_trees, data):
    width = 1 + max(len(t.tokens) for t in batch_trees)
    # Few distinct values: ties, where the first maximum must win in both.
    values = data.draw(st.lists(st.integers(0, 2), min_size=len(batch_trees) * width * 4,
                                max_size=len(batch_trees) * width * 4))
    logits = torch.tensor(values, dtype=torch.float32).reshape(len(batch_trees), width, 4)
    asked = []

    def row_logits(index, rows):
        asked.append(list(zip(index.tolist(), rows.tolist())))
        return logits[torch.from_numpy(index), torch.from_numpy(rows)]

    # Half the nodes marked as context-lookup proposals: the walk projects ahead through those.
    marked = [dataclasses.replace(t, sources=np.asarray(data.draw(st.lists(
        st.sampled_from([SOURCE_HEAD, SOURCE_CONTEXT]), min_size=len(t.tokens), max_size=len(t.tokens))),
        dtype=np.uint8)) for t in batch_trees]
    lazy = verification.verify_greedy_by_rows(marked, row_logits)
    greedy = SamplingParams(temperature=0.0)
    full = verify_requests(batch_trees, logits, [greedy] * len(batch_trees), [None] * len(batch_trees))
    for a, b in zip(lazy, full):
        assert a.accepted.tolist() == b.accepted.tolist() and a.bonus == b.bonus
    visited = {pair for call in asked for pair in call}
    needed = {(b, int(r)) for b, acc in enumerate(full) for r in acc.committed_rows}
    assert needed <= visited  # the root and each accepted node ...
    assert len(visited) == sum(len(call) for call in asked)  # ... each projected once
    # ... and beyond them only first-child chains: at most one call per branch the walk takes.
    assert len(asked) <= 1 + max(len(acc.accepted) for acc in full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_greedy_uses_argmax_of_logits_next_to_sampled_requests(dtype):
    rng = np.random.default_rng(0)
    batch_trees = [random_tree(rng, vocab=VOCAB, max_depth=3, max_children=3) for _ in range(6)]
    width = 1 + max(len(t.tokens) for t in batch_trees)
    # Peaked logits whose argmax often follows the tree, so paths get long.
    logits = torch.randn(6, width, VOCAB, generator=torch.Generator().manual_seed(1))
    for b, tree in enumerate(batch_trees):
        for i, parent in enumerate(tree.parents):
            if rng.random() < 0.7:
                logits[b, parent + 1, tree.tokens[i]] += 5.0
    logits = logits.to(dtype)
    params = [SamplingParams(temperature=0 if b % 2 == 0 else 1.0) for b in range(6)]
    keys = [None if p.is_greedy else request_key(SamplingParams(seed=b)) for b, p in enumerate(params)]
    results = verify_requests(batch_trees, logits, params, keys, [0] * 6)
    lengths = []
    for b in range(0, 6, 2):
        n = len(batch_trees[b].tokens)
        expected = verify_greedy(batch_trees[b], logits[b, : n + 1].float().argmax(-1).numpy())
        assert results[b].accepted.tolist() == expected.accepted.tolist()
        assert results[b].bonus == expected.bonus
        lengths.append(results[b].num_accepted)
    assert max(lengths) >= 2  # the walk really went down the trees


def test_sampling_with_one_hot_target_is_the_greedy_walk():
    """top_k = 1 makes the target deterministic: coupled sampling must then walk like greedy."""
    rng = np.random.default_rng(3)
    gen = torch.Generator().manual_seed(3)
    key = request_key(SamplingParams(seed=3))
    for position in range(50):
        tree = random_tree(rng, vocab=4, max_depth=3, max_children=3)
        logits = torch.randn(len(tree.tokens) + 1, 4, generator=gen)
        sampled = verify_sampling(tree, logits, SamplingParams(top_k=1), key, position)
        greedy = verify_greedy(tree, logits.argmax(-1).numpy())
        assert sampled.accepted.tolist() == greedy.accepted.tolist()
        assert sampled.bonus == greedy.bonus


# --------------------------------------------------------------------- toy target


class ToyTarget:
    """A 'language model' over a toy vocabulary: fixed random logits for every context (a tuple)."""

    def __init__(self, seed: int, vocab: int, scale: float = 1.5):
        self.seed = seed
        self.vocab = vocab
        self.scale = scale
        self._cache: dict[tuple[int, ...], np.ndarray] = {}

    def logits(self, context: tuple[int, ...]) -> np.ndarray:
        if context not in self._cache:
            rng = np.random.default_rng([self.seed, len(context), *context])
            self._cache[context] = (rng.normal(size=self.vocab) * self.scale).astype(np.float32)
        return self._cache[context]

    def probs(self, context: tuple[int, ...], params: SamplingParams) -> np.ndarray:
        """Exact warped distribution, computed by transformers' warpers (independent of ours)."""
        logits = torch.from_numpy(self.logits(context))[None]
        return transformers_probs(logits, params)[0].double().numpy()


@dataclass(frozen=True)
class Case:
    params: SamplingParams
    vocab: int = 8
    horizon: int = 2  # committed tokens per chain that are tested (the first 1..horizon)
    repeated_siblings: bool = False  # the drafter may propose the same token twice


CASES = {
    "plain": Case(SamplingParams(temperature=1.0)),
    "temperature+top_k": Case(SamplingParams(temperature=0.6, top_k=4)),
    "temperature+top_p": Case(SamplingParams(temperature=1.3, top_p=0.8)),
    "all_warps": Case(SamplingParams(temperature=0.8, top_k=6, top_p=0.9)),
    # Three tokens deep (rows at depth 2 decide too) on a smaller vocabulary, with repeats.
    "deep+repeats": Case(SamplingParams(temperature=1.0, top_p=0.95), vocab=4, horizon=3, repeated_siblings=True),
}


def draft_tree(target: ToyTarget, context: tuple[int, ...], case: Case, seed: int):
    """A random draft tree of depth 3 with siblings at every depth; proposals lean towards likely
    tokens (like a real drafter) but also propose filtered-out (probability 0) tokens."""
    rng = np.random.default_rng([seed, len(context), *context])
    tokens: list[int] = []
    parents: list[int] = []
    paths: dict[int, tuple[int, ...]] = {-1: ()}
    frontier = [-1]
    for depth in range(3):
        next_frontier = []
        for j, parent in enumerate(frontier):
            low = 2 if j == 0 else 0  # the first parent of each level always has siblings below it
            count = int(rng.integers(low, 4 if depth == 0 else 3))
            p = target.probs(context + paths[parent], case.params)
            proposal = 0.6 * p + 0.4 / target.vocab
            proposal /= proposal.sum()
            for token in rng.choice(target.vocab, size=count, replace=case.repeated_siblings, p=proposal):
                tokens.append(int(token))
                parents.append(parent)
                paths[len(tokens) - 1] = paths[parent] + (int(token),)
                next_frontier.append(len(tokens) - 1)
        frontier = next_frontier
    return make_tree(tokens, parents), paths


def run_chains(target: ToyTarget, case: Case, chains: int, seed: int, horizon: int,
               empty_trees: bool = False) -> np.ndarray:
    """Decode `chains` independent sequences (chain c with the key of seed (seed, c)) until each
    has `horizon` tokens; [chains, horizon]. `empty_trees`: plain sampling, one token per round."""
    keys = [request_key(SamplingParams(seed=seed * 1_000_003 + c)) for c in range(chains)]
    committed: list[list[int]] = [[] for _ in range(chains)]
    active = list(range(chains))
    empty = make_tree([], [])
    while active:
        contexts: dict[tuple[int, ...], int] = {}
        drafted = []
        for c in active:
            context = tuple(committed[c])
            if context not in contexts:
                contexts[context] = len(drafted)
                tree, paths = (empty, {-1: ()}) if empty_trees else draft_tree(target, context, case, seed)
                rows = [target.logits(context + paths[i]) for i in range(-1, len(tree.tokens))]
                drafted.append((tree, np.stack(rows)))
        width = 1 + max(len(tree.tokens) for tree, _ in drafted)
        table = torch.zeros(len(drafted), width, target.vocab)
        for k, (_, rows) in enumerate(drafted):
            table[k, : len(rows)] = torch.from_numpy(rows)
        which = [contexts[tuple(committed[c])] for c in active]
        results = verify_requests(
            [drafted[k][0] for k in which],
            table[torch.tensor(which)],
            [case.params] * len(active),
            [keys[c] for c in active],
            [len(committed[c]) for c in active],
        )
        for c, result in zip(active, results, strict=True):
            committed[c].extend(result.tokens.tolist())
        active = [c for c in active if len(committed[c]) < horizon]
    return np.array([c[:horizon] for c in committed])


def exact_distribution(target: ToyTarget, params: SamplingParams, length: int) -> np.ndarray:
    """P(first `length` tokens) over vocab**length outcomes (row-major codes)."""
    shape = (target.vocab,)
    dist = np.ones(1)
    for step in range(length):
        rows = [
            target.probs(tuple(int(t) for t in np.unravel_index(code, shape * step)), params)
            for code in range(target.vocab**step)
        ]
        dist = (dist[:, None] * np.stack(rows)).reshape(-1)
    return dist


def pooled(observed: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pool cells with expected count < MIN_EXPECTED into one cell (if it is not empty)."""
    small = expected < MIN_EXPECTED
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return obs[keep], exp[keep]


def chi_square_pvalue(samples: np.ndarray, exact: np.ndarray) -> float:
    """p-value of 'samples (codes) are drawn from exact'; outcomes of probability 0 must never occur."""
    counts = np.bincount(samples, minlength=exact.size)
    impossible = counts[exact == 0].sum()
    assert impossible == 0, f"{impossible} draws of outcomes the target gives probability 0"
    obs, exp = pooled(counts.astype(float), exact * samples.size)
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def codes(samples: np.ndarray, length: int, vocab: int) -> np.ndarray:
    return np.ravel_multi_index(tuple(samples[:, :length].T), (vocab,) * length)


@pytest.mark.parametrize("name", list(CASES))
def test_drafted_chains_commit_exactly_the_tokens_of_plain_sampling(name):
    """The coupling: with the same keys, verifying draft trees commits token for token what
    plain sampling (empty trees) commits - the drafts change how many tokens a round settles,
    never which. (The toy target's logits are the same whatever the tree, so this is exact.)"""
    case = CASES[name]
    target = ToyTarget(seed=11, vocab=case.vocab)
    drafted = run_chains(target, case, 2_000, seed=9, horizon=5)
    plain = run_chains(target, case, 2_000, seed=9, horizon=5, empty_trees=True)
    np.testing.assert_array_equal(drafted, plain)
    assert len({tuple(r) for r in plain.tolist()}) > 100  # it really samples


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_sampling_verification_is_lossless(name):
    case = CASES[name]
    target = ToyTarget(seed=11, vocab=case.vocab)
    samples = run_chains(target, case, CHAINS, seed=5, horizon=case.horizon)
    for length in range(1, case.horizon + 1):
        exact = exact_distribution(target, case.params, length)
        pvalue = chi_square_pvalue(codes(samples, length, case.vocab), exact)
        assert pvalue > ALPHA, f"{name}: first {length} token(s) deviate from the target (p = {pvalue:.2e})"


def test_sample_size_catches_a_two_percent_error():
    """Moving 0.02 of probability between the two likeliest outcomes (the hardest case for the
    test: chi-square's noncentrality n * d^2 * (1/p_a + 1/p_b) is smallest there) is detected,
    analytically with power >= 0.99 and empirically on one draw, for every tested distribution."""
    rng = np.random.default_rng(0)
    for name, case in CASES.items():
        target = ToyTarget(seed=11, vocab=case.vocab)
        for length in range(1, case.horizon + 1):
            exact = exact_distribution(target, case.params, length)
            a, b = np.argsort(exact)[::-1][:2]
            shifted = exact.copy()
            shifted[a] -= 0.02
            shifted[b] += 0.02
            shifted /= shifted.sum()  # float dust, so numpy accepts it as a distribution
            _, exp_true = pooled(np.zeros_like(exact), exact * CHAINS)
            _, exp_shift = pooled(np.zeros_like(exact), shifted * CHAINS)
            noncentrality = float(((exp_shift - exp_true) ** 2 / exp_true).sum())
            df = exp_true.size - 1
            power = stats.ncx2.sf(stats.chi2.isf(ALPHA, df), df, noncentrality)
            assert power >= 0.99, f"{name}, {length} token(s): power {power:.3f} with {CHAINS} draws"
            drawn = rng.choice(exact.size, size=CHAINS, p=shifted)
            assert chi_square_pvalue(drawn, exact) < ALPHA


def _child_row_reuses_its_parents_noise(position, depths, nodes):
    # an off-by-one in the row's position: a node's row draws with its parent's noise
    row_depth = np.where(nodes < 0, 0, depths[np.maximum(nodes, 0)] - 1) if depths.size else np.zeros(len(nodes), int)
    return position + row_depth


def _draws_ignore_temperature(logits, params):
    return sampling.warp_logits_to_probs(logits, dataclasses.replace(params, temperature=1.0))


@pytest.mark.slow
@pytest.mark.parametrize("bias", ["child_row_reuses_its_parents_noise", "draws_ignore_temperature"])
def test_biased_verifiers_fail_the_same_test(bias, monkeypatch):
    """Negative controls: the statistical test must be able to fail, on the real pipeline."""
    if bias == "child_row_reuses_its_parents_noise":
        monkeypatch.setattr(verification, "_row_positions", _child_row_reuses_its_parents_noise)
        name, length = "plain", 2  # the two tokens of an accepted (parent, child) pair correlate
    else:
        monkeypatch.setattr(verification, "warp_logits_to_probs", _draws_ignore_temperature)
        name, length = "temperature+top_k", 1  # same support, flatter distribution
    case = CASES[name]
    target = ToyTarget(seed=11, vocab=case.vocab)
    samples = run_chains(target, case, CHAINS, seed=5, horizon=length)
    pvalue = chi_square_pvalue(codes(samples, length, case.vocab), exact_distribution(target, case.params, length))
    assert pvalue < ALPHA, f"biased verifier ({bias}) passed: p = {pvalue:.3f}"


# ------------------------------------------------------------------ determinism


def _request(seed: int, rng: np.random.Generator):
    tree = random_tree(rng, vocab=VOCAB, max_depth=3, max_children=3, min_children=1)
    logits = torch.from_numpy(rng.normal(size=(len(tree.tokens) + 1, VOCAB)).astype(np.float32) * 2)
    return tree, logits


def test_seeded_request_is_independent_of_its_batch():
    rng = np.random.default_rng(7)
    tree, rows = _request(0, rng)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    others = [_request(i, rng) for i in range(3)]
    other_params = [SamplingParams(temperature=0), SamplingParams(top_k=3, seed=1), SamplingParams(seed=2)]

    def run(alone: bool) -> list[list[int]]:
        key = request_key(params)
        other_keys = [request_key(p) if not p.is_greedy else None for p in other_params]
        outputs = []
        for position in range(0, 60, 3):  # several rounds at later and later positions
            if alone:
                outputs.append(verify_requests([tree], rows[None], [params], [key], [position])[0].tokens.tolist())
                continue
            batch_trees = [others[0][0], tree, others[1][0], others[2][0]]
            width = 1 + max(len(t.tokens) for t in batch_trees)
            logits = torch.zeros(4, width, VOCAB)
            for b, r in enumerate([others[0][1], rows, others[1][1], others[2][1]]):
                logits[b, : len(r)] = r
            batch_params = [other_params[0], params, other_params[1], other_params[2]]
            batch_keys = [other_keys[0], key, other_keys[1], other_keys[2]]
            outputs.append(verify_requests(batch_trees, logits, batch_params, batch_keys, [5, position, 0, 9])[1]
                           .tokens.tolist())
        return outputs

    alone, batched = run(alone=True), run(alone=False)
    assert alone == batched
    assert len({tuple(o) for o in alone}) > 1  # it really samples


# ---------------------------------------------------------------------- numerics


def test_repeated_sibling_token_takes_the_first_sibling():
    tree = make_tree([2, 2, 3], [-1, -1, -1])
    logits = torch.log(torch.tensor([[0.1, 0.1, 0.5, 0.3], [0.25] * 4, [0.25] * 4, [0.25] * 4]))
    key = request_key(SamplingParams(seed=0))
    accepted = [verify_sampling(tree, logits, SamplingParams(), key, t).accepted.tolist() for t in range(300)]
    assert [1] not in accepted and [0] in accepted and [2] in accepted


def test_bonus_rewarp_of_one_row_equals_the_batched_warp():
    """Rows with children are warped in chunks; a leaf row that ends a walk, alone, and the
    prefill's first token alone too. All must agree (same support, same numbers up to float32
    rounding), or the coupled draw of a row would depend on what it was warped with - also when
    other rows of the chunk change the warp's strategy (a flat row grows the top-p candidates, a
    tie at the k-th score forces the dense path)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(17, 4096, generator=gen) * torch.linspace(0.05, 6.0, 17)[:, None]
    logits[3, :30] = 9.0  # a row with a 30-way tie at the top
    for case in CASES.values():
        for params in (case.params, SamplingParams(temperature=0.9, top_k=20, top_p=0.9)):
            full = warp_logits_to_probs(logits, params)
            for row in range(17):
                alone = warp_logits_to_probs(logits[row : row + 1], params)[0]
                assert torch.equal(full[row] > 0, alone > 0)
                torch.testing.assert_close(full[row], alone, rtol=1e-6, atol=1e-7)


def test_empty_trees_commit_one_token():
    empty = make_tree([], [])
    logits = torch.tensor([[[0.0, 5.0, 0.0]], [[-1.0, 0.0, 3.0]]])
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1)]
    results = verify_requests([empty, empty], logits, params, [None, request_key(SamplingParams(seed=0))], [0, 3])
    assert [r.tokens.tolist() for r in results] == [[1], [2]]
    assert all(r.committed_rows.tolist() == [0] for r in results)


# ------------------------------------------------------------------------ errors


def test_errors_name_what_differs():
    tree = make_tree([1, 2], [-1, 0])
    key = request_key(SamplingParams(seed=0))
    sample = SamplingParams()
    with pytest.raises(ValueError, match="argmax_tokens has 2 entries, tree needs N \\+ 1 = 3"):
        verify_greedy(tree, np.array([1, 2]))
    with pytest.raises(ValueError, match="logits must be"):
        verify_requests([tree], torch.zeros(3, 4), [sample], [key], [0])
    with pytest.raises(ValueError, match="batch sizes differ: 1 trees, logits batch 2"):
        verify_requests([tree], torch.zeros(2, 3, 4), [sample], [key], [0])
    with pytest.raises(ValueError, match="only 2 rows"):
        verify_requests([tree], torch.zeros(1, 2, 4), [sample], [key], [0])
    # Tree contents (token ids within the vocabulary, ...) are checked once, where trees enter the
    # engine: TreeBatch.from_trees (tests/test_tree_batch.py), not again here.
    with pytest.raises(ValueError, match=r"request 0 samples .* but has no key"):
        verify_requests([tree], torch.zeros(1, 3, 4), [sample], [None], [0])
    with pytest.raises(ValueError, match="request 0: position -1 < 0"):
        verify_requests([tree], torch.zeros(1, 3, 4), [sample], [key], [-1])
    bad = torch.zeros(1, 3, 4)
    bad[0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="request 0: warped probabilities of row 1 sum to nan"):
        verify_requests([tree], bad, [sample], [key], [0])
    # the culprit is named in a mixed batch too (greedy, and two different warps) ...
    mixed = [SamplingParams(temperature=0), SamplingParams(top_k=2), sample]
    batch = torch.zeros(3, 3, 4)
    batch[2, 0, 1] = float("inf")
    with pytest.raises(ValueError, match="request 2: warped probabilities of row 0 sum to nan"):
        verify_requests([tree] * 3, batch, mixed, [None, key, key], [0, 0, 0])
    # ... and when the broken row is a leaf that becomes the bonus row (node 0 is certain)
    leaf = make_tree([1], [-1])
    batch = torch.zeros(3, 2, 4)
    batch[:, 0, 1] = 100.0
    batch[2, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="request 2: warped probabilities of row 1 sum to nan"):
        verify_requests([leaf] * 3, batch, mixed, [None, key, key], [0, 0, 0])


def test_acceptance_of_empty_path():
    result = Acceptance(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 5)
    assert result.tokens.tolist() == [5]
    assert result.committed_rows.tolist() == [0]
    assert result.bonus_row == 0
    assert result.num_accepted == 0
