"""Gumbel-max sampling and coupled drafting (issue #48).

The sampler: the noise is a counter-based function of (key, position, stream, token id) whose
int64 torch implementation equals its numpy definition; the partitioned Gumbel-max draw is
distributed exactly as its weights (chi-square on a vocabulary large enough that the singles, the
block level and the inside of a block all decide draws; a biased draw fails the same test).

Coupled drafting: a drafter that knows a sampled request's key and position names the target's
draw; one that reads the wrong position's noise still commits exactly `ar`'s tokens (verification
does not care where a draft came from), only fewer of its drafts are accepted; the head drafters
graft their coupled guesses, marked SOURCE_COUPLED, into their trees.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from scipy import stats

from dart_worker import sampling
from dart_worker.drafters import DrafterSpec, register_drafter, unregister_drafter
from dart_worker.drafters.base import Dice, Drafter
from dart_worker.drafters.head import HeadDrafter, coupled_chain
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.sampling import (
    BLOCK_STREAM,
    GUMBEL_BLOCK,
    SamplingParams,
    coupled_candidates,
    gumbel_noise,
    gumbel_sample,
    noise_bits,
    request_key,
    row_seeds,
    warp_logits_to_probs,
)
from dart_worker.target import TargetAdapter
from ngram_native import TreeParams
from ngram_native.trees import SOURCE_COUPLED, SOURCE_HEAD, DraftTree
from tests.tiny_models import tiny_model

ALPHA = 1e-4
VOCAB = 32


# ---------------------------------------------------------------------------------- the noise


def test_noise_bits_equal_the_numpy_definition_whatever_is_asked_with_them():
    seeds = row_seeds(request_key(SamplingParams(seed=5)), [0, 3, 3, 1000])
    ids = np.asarray([0, 1, 262_143, 7, 99_999])
    got = noise_bits(torch.from_numpy(seeds), torch.from_numpy(ids)).numpy().view(np.uint64)
    # The id-th output of splitmix64 started at the seed: numpy's unsigned arithmetic, wrapping.
    with np.errstate(over="ignore"):
        expected = sampling._splitmix64(seeds.view(np.uint64)[:, None] + ids.astype(np.uint64) * sampling._GOLDEN)
    np.testing.assert_array_equal(got, expected)
    # An element's noise does not depend on the other elements of its call.
    alone = noise_bits(torch.from_numpy(seeds[1:2]), torch.tensor([7])).numpy().view(np.uint64)
    assert alone[0, 0] == expected[1, 3]
    # Streams and positions give unrelated seeds; the same (key, position, stream) the same seed.
    assert len({*row_seeds(1, [0, 1, 2]).tolist(), *row_seeds(1, [0, 1, 2], BLOCK_STREAM).tolist()}) == 6
    np.testing.assert_array_equal(row_seeds(9, [4, 4]), row_seeds(9, [4, 4]))


def test_gumbel_noise_is_standard_gumbel():
    g = gumbel_noise(torch.from_numpy(row_seeds(3, [11])), torch.arange(200_000))[0].numpy()
    assert stats.kstest(g, stats.gumbel_r.cdf).pvalue > ALPHA


# ------------------------------------------------------------------------------ the draw is exact


def _weights(vocab: int, seed: int) -> torch.Tensor:
    """A distribution with a few heavy tokens, a long tail spread over several blocks, and zeros."""
    rng = np.random.default_rng(seed)
    w = rng.exponential(size=vocab) * (rng.random(vocab) < 0.6)
    w[rng.choice(vocab, 5, replace=False)] += 0.05 * w.sum()
    return torch.from_numpy(w / w.sum()).float()


def _draw_many(weights: torch.Tensor, draws: int, singles: int, key: int = 17) -> np.ndarray:
    rows = weights[None].expand(draws, -1)
    positions = np.arange(draws)
    return gumbel_sample(rows, torch.from_numpy(row_seeds(key, positions)),
                         torch.from_numpy(row_seeds(key, positions, BLOCK_STREAM)), singles).numpy()


def _pvalue(drawn: np.ndarray, weights: torch.Tensor) -> float:
    exact = weights.double().numpy()
    exact = exact / exact.sum()
    counts = np.bincount(drawn, minlength=exact.size)
    assert counts[exact == 0].sum() == 0, "a zero-weight token was drawn"
    # Pool into cells expected >= 5: the heavy tokens alone, the tail by id ranges.
    order = np.argsort(-exact)
    expected, observed, acc_e, acc_o = [], [], 0.0, 0
    for i in order[exact[order] > 0]:
        acc_e += exact[i] * drawn.size
        acc_o += counts[i]
        if acc_e >= 5:
            expected.append(acc_e)
            observed.append(acc_o)
            acc_e, acc_o = 0.0, 0
    expected[-1] += acc_e
    observed[-1] += acc_o
    return float(stats.chisquare(observed, np.asarray(expected) * sum(observed) / sum(expected)).pvalue)


@pytest.mark.parametrize("singles", [0, 4, sampling.GUMBEL_SINGLES])
def test_gumbel_sample_is_distributed_as_its_weights(singles):
    weights = _weights(3 * GUMBEL_BLOCK + 200, seed=singles)  # blocks, a partial last block, singles
    drawn = _draw_many(weights, 40_000, singles)
    assert _pvalue(drawn, weights) > ALPHA
    # Each level decides draws: tail tokens and heavy ones both come out.
    heavy = set(weights.topk(5).indices.tolist())
    assert 0.1 < np.isin(drawn, list(heavy)).mean() < 0.9


def test_a_biased_draw_fails_the_same_test(monkeypatch):
    """The negative control: noise at half its scale (a draw at a lower temperature) is caught."""
    real = sampling.gumbel_noise
    monkeypatch.setattr(sampling, "gumbel_noise", lambda seeds, ids: 0.8 * real(seeds, ids))
    weights = _weights(3 * GUMBEL_BLOCK + 200, seed=4)
    assert _pvalue(_draw_many(weights, 40_000, 4), weights) < ALPHA


def test_gumbel_sample_never_draws_zero_weight_tokens_and_follows_one_hot_rows():
    weights = torch.zeros(3, 2 * GUMBEL_BLOCK + 5)
    weights[0, 7] = 1.0
    weights[1, GUMBEL_BLOCK + 3] = 2.0
    weights[2, [1, 2 * GUMBEL_BLOCK + 4]] = 1.0
    for singles in (0, 1, 64):
        for t in range(20):
            drawn = gumbel_sample(weights, torch.from_numpy(row_seeds(1, [t] * 3)),
                                  torch.from_numpy(row_seeds(1, [t] * 3, BLOCK_STREAM)), singles).tolist()
            assert drawn[:2] == [7, GUMBEL_BLOCK + 3] and drawn[2] in (1, 2 * GUMBEL_BLOCK + 4)


def test_a_drafter_with_the_targets_distribution_names_every_draw():
    """Coupling: q = p (mass within the drafter's candidates) and the same noise give the same
    token, every time; at another position's noise, far less often."""
    torch.manual_seed(0)
    logits = torch.randn(400, 5000) * 4
    logits[:, 40:] = -float("inf")  # all mass on 40 tokens: the drafter's top 64 hold it
    p = warp_logits_to_probs(logits, SamplingParams(temperature=1.0))
    key = request_key(SamplingParams(seed=1))
    positions = np.arange(400)
    seeds = torch.from_numpy(row_seeds(key, positions))
    drawn = gumbel_sample(p, seeds, torch.from_numpy(row_seeds(key, positions, BLOCK_STREAM)))
    top_q, top_ids = p.topk(64, dim=-1)
    guess, _ = coupled_candidates(top_q.log(), top_ids, seeds)
    assert torch.equal(guess[:, 0], drawn)
    wrong, _ = coupled_candidates(top_q.log(), top_ids, torch.from_numpy(row_seeds(key, positions + 1)))
    assert (wrong[:, 0] == drawn).float().mean() < 0.6


# ------------------------------------------------------------------------- coupled drafting


class OracleDrafter(Drafter):
    """Knows the target: drafts, per sequence, the chain of the target's own coupled draws (the
    target run on its chain, each depth drawn with the noise of its position). With the right dice
    nearly every node is accepted; `shift` moves the positions it reads (the wrong noise)."""

    name = "oracle"

    def __init__(self, model, depth: int, shift: int = 0):
        self.model, self.depth, self.shift = model, depth, shift
        self.dice: list[Dice | None] = []

    def read_dice(self, dice: Sequence[Dice | None]) -> None:
        self.dice = list(dice)

    @torch.inference_mode()
    def propose(self, tokens, max_depths):
        trees = []
        for seq, cap, dice in zip(tokens, max_depths, self.dice, strict=True):
            depth = min(self.depth, cap)
            chain: list[int] = []
            for d in range(depth):
                logits = self.model(torch.tensor([list(seq) + chain])).logits[:, -1].float()
                probs = warp_logits_to_probs(logits, SamplingParams(temperature=dice.temperature))
                position = [dice.position + d + self.shift]
                chain.append(int(gumbel_sample(probs, torch.from_numpy(row_seeds(dice.key, position)),
                                               torch.from_numpy(row_seeds(dice.key, position, BLOCK_STREAM)))[0]))
            trees.append(DraftTree(np.asarray(chain, np.int32), np.arange(-1, depth - 1, dtype=np.int32),
                                   np.arange(1, depth + 1, dtype=np.int32)))
        return trees


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=VOCAB)


@pytest.fixture
def oracles(model):
    for name, shift in (("oracle", 0), ("oracle_wrong_position", 1)):
        register_drafter(DrafterSpec(name, lambda resources, tree, shift=shift: OracleDrafter(model, 4, shift)))
    yield
    unregister_drafter("oracle")
    unregister_drafter("oracle_wrong_position")


def _prompts(count: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (6, 11, 9)[:count]]


def test_a_drafter_reading_the_wrong_positions_noise_commits_ar_tokens_only_less_is_accepted(model, oracles):
    parts = EngineParts(target=TargetAdapter(model))
    params = [SamplingParams(temperature=t, seed=s, max_new_tokens=24) for t, s in ((1.0, 1), (0.7, 2), (1.0, 3))]
    expected = [r.token_ids for r in build_engine(parts, "ar").generate(_prompts(), params)]
    taus = {}
    for mode in ("oracle", "oracle_wrong_position"):
        results = build_engine(parts, mode, TreeParams(max_depth=4), sizing="fixed").generate(_prompts(), params)
        assert [r.token_ids for r in results] == expected
        taus[mode] = np.mean([r.stats.tau for r in results])
    assert taus["oracle"] > 3.5  # 4-deep chains of the target's own draws: (nearly) all accepted
    assert taus["oracle_wrong_position"] < 2.0


class _Recording:
    """Wraps a drafter's propose to keep the trees it returned."""

    def __init__(self, drafter):
        self.trees: list[DraftTree] = []
        real = drafter.propose

        def propose(tokens, max_depths):
            out = real(tokens, max_depths)
            self.trees.extend(out)
            return out

        drafter.propose = propose


@pytest.mark.parametrize("mode", ["chain", "ddtree", "dart_lookup"])
def test_head_drafters_graft_coupled_guesses_for_sampled_rows_and_commit_ar_tokens(model, mode, monkeypatch):
    from dart_worker.draft_head import DartDraftHead

    torch.manual_seed(123)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4)
    parts = EngineParts(target=TargetAdapter(model), head=head)
    params = [SamplingParams(temperature=1.0, seed=7, max_new_tokens=20), SamplingParams(temperature=0.0,
                                                                                         max_new_tokens=20)]
    expected = [r.token_ids for r in build_engine(parts, "ar").generate(_prompts(2), params)]
    read = []
    real_read = HeadDrafter.read_dice

    def read_dice(self, dice):
        read.append(list(dice))
        real_read(self, dice)

    monkeypatch.setattr(HeadDrafter, "read_dice", read_dice)
    engine = build_engine(parts, mode, TreeParams(budget=8), sizing="fixed")
    recording = _Recording(engine.drafter)
    assert [r.token_ids for r in engine.generate(_prompts(2), params)] == expected
    # The sampled row's dice name its key and its position; the greedy row has none.
    assert read and all(d[-1] is None for d in read if len(d) == 2)
    first = read[0][0]
    assert first.key == request_key(params[0]) and first.position == 1 and first.temperature == 1.0
    coupled = [t for t in recording.trees if t.sources is not None and (t.sources & SOURCE_COUPLED).any()]
    assert coupled and all((((t.sources & SOURCE_COUPLED) == 0) | (t.sources & SOURCE_HEAD > 0)).all() for t in coupled)


def test_coupled_chain_is_scored_as_the_trees_best_path_at_each_depth():
    tree = DraftTree(np.asarray([5, 6, 7], np.int32), np.asarray([-1, -1, 0], np.int32),
                     np.asarray([1, 1, 2], np.int32), np.asarray([-0.5, -1.0, -2.0]))
    chain = coupled_chain(tree, np.asarray([9, 8, 4]), np.asarray([-3.0, -0.25, -0.5]))
    assert chain.tokens.tolist() == [9, 8, 4] and chain.parents.tolist() == [-1, 0, 1]
    np.testing.assert_allclose(chain.scores, [-0.5, -2.0, -2.5])  # below the tree: its own log q
    assert (chain.sources == SOURCE_HEAD | SOURCE_COUPLED).all()
