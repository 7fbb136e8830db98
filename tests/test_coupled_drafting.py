"""Coupled drafting (issue #48): drafters that read the sampler's dice.

- the engine and `dart_train.replay` hand every sampled sequence its `Dice` (key, generated index
  of its next root row, temperature) before each proposal, and none for greedy ones;
- a head drafter with a `coupler` (by default `GumbelCoupler` from its tree settings) builds its
  trees from the coupler's logits for the sampled sequences only;
- `dart_worker.drafters.coupling.GumbelCoupler`'s logits rank the head's tokens by log q + a g with
  the noise the engine's Gumbel-max draw uses at each depth's position: where q is the target's p
  (and every token is a cell of its own), its argmax at depth d IS the target's draw at
  position + d - 1, so a coupled chain over such a head is accepted whole;
- a drafter reading the wrong position's dice still commits `ar`'s tokens (only acceptance falls);
- `jobs.bench coupling` with `tau_modes` reports greedy, today's and coupled tau by replay.

Tiny fp32 models; small vocabularies.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from dart_bench.coupling import gumbel_replies
from dart_train.replay import replay, target_references
from dart_worker.drafters.base import Dice, Drafter, empty_tree
from dart_worker.drafters.coupling import GumbelCoupler
from dart_worker.engine_factory import EngineParts, build_drafter
from dart_worker.head.draft_head import DartDraftHead
from dart_worker.sampling.gumbel import ALONE_ABOVE, BLOCK_STREAM, gumbel_sample_threshold, row_seeds
from dart_worker.sampling.params import SamplingParams, request_key
from dart_worker.target.adapter import TargetAdapter
from ngram_native import TreeParams
from tests.test_engine import VOCAB, random_prompts
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def parts() -> EngineParts:
    model = tiny_model("llama", vocab_size=VOCAB)
    torch.manual_seed(5)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4)
    return EngineParts(target=TargetAdapter(model), head=head, eos_token_ids=(2,))


class _DiceRecorder(Drafter):
    """Proposes nothing (one token a round) and records the dice and the tokens of each round."""

    name = "recorder"

    def __init__(self):
        self.rounds: list[tuple[list[Dice], list[int]]] = []
        self.dice: list[Dice] = []

    def read_dice(self, dice):
        self.dice = list(dice)

    def propose(self, tokens, max_depths):
        self.rounds.append((self.dice, [len(t) for t in tokens]))
        self.dice = []
        return [empty_tree() for _ in tokens]


def test_replay_hands_each_sampled_sequence_the_dice_of_its_next_position(parts):
    prompts = random_prompts(3, seed=4)
    replies = [[7, 8, 9, 10, 11, 12], [7, 8, 9], [5, 6, 7, 8, 9]]  # unequal: sequences retire mid-way
    refs = target_references(parts, prompts, 6, replies=replies)
    params = SamplingParams(temperature=0.7, seed=3)
    recorder = _DiceRecorder()
    replay(recorder, refs, 6, dice=params)
    # empty trees: every round commits one token, so in round r the live sequences (replies longer
    # than r + 1) have generated r + 1 tokens, and their next root row draws generated index r + 1
    assert len(recorder.rounds) == max(len(r) for r in replies) - 1
    for r, (dice, lengths) in enumerate(recorder.rounds):
        live = [b for b in range(3) if len(replies[b]) > r + 1]
        assert lengths == [len(prompts[b]) + r + 1 for b in live]
        assert [d.position for d in dice] == [r + 1] * len(live)
        assert {d.key for d in dice} == {request_key(params)} and {d.temperature for d in dice} == {0.7}
    greedy = _DiceRecorder()
    replay(greedy, refs, 6, dice=SamplingParams(temperature=0.0))
    replay(greedy, refs, 6)
    assert all(not dice for dice, _ in greedy.rounds)
    with pytest.raises(ValueError, match="seeded"):
        replay(_DiceRecorder(), refs, 6, dice=SamplingParams(temperature=1.0))


def test_a_head_drafter_builds_from_its_couplers_logits_for_sampled_sequences_only(parts):
    prompts = random_prompts(2, seed=8)
    refs = target_references(parts, prompts, 5, replies=[[4, 5, 6, 7, 8], [9, 10, 11, 12, 13]])
    drafter = build_drafter(parts, "chain", TreeParams(budget=4))
    seen = []

    def coupler(logits, dice):
        """Depth d's favourite: draft id (position + d) mod V, for each sampled sequence."""
        seen.append([None if d is None else d.position for d in dice])
        out = logits.clone()
        for b, d in enumerate(dice):
            if d is not None:
                out[b] = 0.0
                for depth in range(logits.shape[1]):
                    out[b, depth, (d.position + depth + 1) % logits.shape[-1]] = 100.0
        return out

    drafter.coupler = coupler
    drafter.observe(_joined_block(refs))
    tokens = [ref.prompt + ref.reply[:1] for ref in refs]
    drafter.read_dice([Dice(key=1, position=5, temperature=1.0), None])
    sampled, plain = drafter.propose(tokens, [4, 4])
    to_target = parts.head.to_target_ids
    assert sampled.tokens.tolist() == to_target(torch.tensor([6, 7, 8, 9])).tolist()
    expected_plain = to_target(drafter.logits[1].argmax(dim=-1)).tolist()
    assert plain.tokens.tolist() == expected_plain[: plain.size]
    assert seen == [[5, None]]
    drafter.read_dice([None, None])  # nobody samples: the coupler is not asked
    drafter.propose(tokens, [4, 4])
    assert seen == [[5, None]]


def _joined_block(refs):
    from dart_worker.drafters.base import CommittedBlock

    width = max(len(r.prompt) for r in refs)
    taps = torch.zeros(len(refs), width, refs[0].taps.shape[-1], dtype=refs[0].taps.dtype)
    for b, ref in enumerate(refs):
        taps[b, : len(ref.prompt)] = ref.taps[: len(ref.prompt)]
    return CommittedBlock(taps, [range(len(r.prompt)) for r in refs], [r.prompt + r.reply[:1] for r in refs],
                          joined=True)


class _IdentityHead:
    """A head whose vocabulary is the target's (draft id = target id)."""

    @staticmethod
    def to_target_ids(ids):
        return ids


def test_gumbel_couplers_argmax_is_the_targets_draw_when_q_is_p():
    gen = torch.Generator().manual_seed(0)
    vocab, depth, cases = 32, 4, 60
    # Flat enough that every token is above 1/256 of the mass: a cell of its own in the engine's draw.
    logits = torch.randn(cases, depth, vocab, generator=gen, dtype=torch.float64).float() * 0.3
    dice = [Dice(key=int(k), position=int(p), temperature=0.8)
            for k, p in zip(torch.randint(0, 2**62, (cases,), generator=gen), torch.randint(0, 500, (cases,),
                                                                                          generator=gen))]
    for scale in (0.5, 2.0):
        coupled = GumbelCoupler(_IdentityHead(), scale)(logits, dice)
        hits = shifted = 0
        for b, d in enumerate(dice):
            p = torch.softmax(logits[b].double() / d.temperature, dim=-1)
            assert (p > ALONE_ABOVE).all()
            for at, seeds in ((d.position, "right"), (d.position + 1, "wrong")):  # the draw of each depth's row
                positions = at + np.arange(depth)
                drawn = gumbel_sample_threshold(p.float(), torch.from_numpy(row_seeds(d.key, positions)),
                                                torch.from_numpy(row_seeds(d.key, positions, BLOCK_STREAM)))
                agree = int((coupled[b].argmax(dim=-1) == drawn).sum())
                if seeds == "right":
                    hits += agree
                else:
                    shifted += agree
        assert hits == cases * depth
        assert shifted < cases * depth * 0.6  # the neighbouring position's noise: a different draw
        # the scale only calibrates: (log q + g) / s
        again = GumbelCoupler(_IdentityHead(), 1.0)(logits, dice)
        torch.testing.assert_close(coupled * scale, again, rtol=1e-5, atol=1e-4)
    # a noise weight a ranks by log q + a g: a = 0 is q's own ranking (today's trees)
    hedged = GumbelCoupler(_IdentityHead(), 1.0, noise_weight=0.0)(logits, dice)
    for b, d in enumerate(dice):
        torch.testing.assert_close(hedged[b], torch.log_softmax(logits[b].double() / d.temperature, dim=-1).float())
    half = GumbelCoupler(_IdentityHead(), 1.0, noise_weight=0.5)(logits, dice)
    full = GumbelCoupler(_IdentityHead(), 1.0)(logits, dice)
    torch.testing.assert_close(2 * half - hedged, full, rtol=1e-5, atol=1e-4)
    greedy = GumbelCoupler(_IdentityHead(), 1.0)(logits[:2], [None, Dice(1, 0, 0.0)])
    assert torch.equal(greedy, logits[:2])
    with pytest.raises(ValueError, match="scale"):
        GumbelCoupler(_IdentityHead(), 0.0)
    with pytest.raises(ValueError, match="noise_weight"):
        GumbelCoupler(_IdentityHead(), 1.0, noise_weight=1.5)


def test_gumbel_replies_are_the_draws_of_one_forward_over_the_whole_reply(parts):
    from dart_bench.coupling import redrawn

    params = SamplingParams(temperature=1.0, seed=21)
    prompts = random_prompts(3, seed=6)
    replies = gumbel_replies(parts, prompts, params, 10, group=2)
    assert all(1 <= len(r) <= 10 for r in replies)
    assert all(r[-1] == 2 or len(r) == 10 for r in replies) and all(2 not in r[:-1] for r in replies)
    refs = target_references(parts, prompts, 10, replies=replies)
    same, total = redrawn(parts, refs, params)
    assert total == sum(len(r) for r in replies) and same == total
    other = gumbel_replies(parts, prompts, SamplingParams(temperature=1.0, seed=22), 10)
    assert other != replies


def test_bench_coupling_reports_greedy_todays_and_coupled_tau(tiny_artifacts, tmp_path):
    from jobs.bench import main as jobs_bench_main

    assert jobs_bench_main(["coupling", f"target={tiny_artifacts['target']}", f"head={tiny_artifacts['head']}",
                            f"trie={tiny_artifacts['trie']}", "agreement=false", "tau_modes=[dart]",
                            "tau_budgets=[6]", "coupling_scales=[1.0]", "num_prompts=2", "check_prompts=0",
                            "max_new_tokens=8", "temperatures=[1.0]", f"output_dir={tmp_path}"]) == 0
    report = json.loads((tmp_path / "coupling.json").read_text())
    kinds = {(r["temperature"], r["scale"]) for r in report["taus"]}
    assert kinds == {(0.0, None), (1.0, None), (1.0, 1.0)}
    assert all(r["tau"] >= 1.0 and len(r["per_prompt_tau"]) == 2 for r in report["taus"])
    sampled = [r for r in report["taus"] if r["temperature"] == 1.0]
    assert all(r["replies_redrawn"][0] == r["replies_redrawn"][1] > 0 for r in sampled)
    assert "| dart | 6 | 1 |" in (tmp_path / "coupling.md").read_text()


# ------------------------------------------------------------------------ coupled drafting in the engine


@pytest.mark.parametrize("mode", ["chain", "ddtree", "dart", "dart_lookup"])
def test_head_drafters_couple_by_default_and_the_tree_setting_turns_it_off(parts, mode):
    def head_part(drafter):
        return drafter.inner if mode.endswith("_lookup") else drafter

    coupler = head_part(build_drafter(parts, mode, TreeParams())).coupler
    assert isinstance(coupler, GumbelCoupler)
    assert (coupler.scale, coupler.noise_weight) == (TreeParams().coupling_scale, TreeParams().coupling_noise_weight)
    tuned = head_part(build_drafter(parts, mode, TreeParams(coupling_scale=2.0, coupling_noise_weight=1.0))).coupler
    assert (tuned.scale, tuned.noise_weight) == (2.0, 1.0)
    assert head_part(build_drafter(parts, mode, TreeParams(coupling_noise_weight=0.0))).coupler is None


class _TargetHead(_IdentityHead):
    """The head of `_fixed_chain`: its vocabulary is the target's, on the CPU."""

    device = torch.device("cpu")


def _chain_rounds(logits: torch.Tensor, dice: list[Dice | None], tree: TreeParams, shift: int = 0):
    """Propose one chain per sequence from head logits [B, D, V] whose depth d is also the target's
    distribution at that depth (a context-free target: row d of every path), and verify them at
    T=1 with each sequence's key; the drafter reads dice shifted by `shift` positions. Returns the
    acceptances."""
    from dart_worker.drafters.head import ChainDrafter
    from dart_worker.sampling.logits_processors import RowControls
    from dart_worker.sampling.verification import VerifyRow, verify_batch

    drafter = ChainDrafter(_TargetHead(), tree, eos_token_ids=())
    drafter.logits = logits
    depth = logits.shape[1]
    drafter.read_dice([None if d is None else Dice(d.key, d.position + shift, d.temperature) for d in dice])
    trees = drafter.propose([[1, 2, 3]] * len(dice), [depth] * len(dice))
    # the target's rows: the root predicts depth 1 (logits[:, 0]), a node at depth d predicts d + 1
    target = torch.cat([logits, logits[:, -1:]], dim=1)
    rows = [VerifyRow(t, RowControls(SamplingParams(temperature=1.0 if d else 0.0)), d and d.key,
                      d.position if d else 0) for t, d in zip(trees, dice, strict=True)]
    return trees, verify_batch(rows, target)


def test_a_coupled_chain_over_a_head_equal_to_the_target_is_accepted_whole():
    """With q = p and every token a cell of its own, argmax(log q + g) at depth d is the target's
    draw there: the coupled chain (a = 1) is accepted to its end, every round; the head's top-1
    chain is not, nor is a coupled chain that read the neighbouring position's noise - and every
    way commits the same tokens (the draw does not look at the tree)."""
    gen = torch.Generator().manual_seed(3)
    rows, depth, vocab = 40, 4, 24
    logits = torch.randn(rows, depth, vocab, generator=gen) * 0.3  # every token above 1/256
    assert (logits.softmax(dim=-1) > ALONE_ABOVE).all()
    dice = [Dice(key=request_key(SamplingParams(seed=s)), position=int(s % 7), temperature=1.0) for s in range(rows)]
    budget = TreeParams(budget=depth)
    coupled_trees, coupled = _chain_rounds(logits, dice, replace_tree(budget, coupling_noise_weight=1.0))
    assert all(t.size == depth for t in coupled_trees)
    assert [a.num_accepted for a in coupled] == [depth] * rows
    _, plain = _chain_rounds(logits, dice, replace_tree(budget, coupling_noise_weight=0.0))
    _, wrong = _chain_rounds(logits, dice, replace_tree(budget, coupling_noise_weight=1.0), shift=1)
    for worse in (plain, wrong):
        assert sum(a.num_accepted for a in worse) < 0.5 * rows * depth
        for a, full in zip(worse, coupled, strict=True):  # the same text, fewer tokens a round
            assert a.tokens.tolist() == full.tokens.tolist()[: a.num_accepted + 1]
    # greedy sequences are never coupled: their chains are the head's argmax
    greedy_trees, _ = _chain_rounds(logits[:2], [None, None], replace_tree(budget, coupling_noise_weight=1.0))
    assert [t.tokens.tolist() for t in greedy_trees] == logits[:2].argmax(dim=-1).tolist()


def replace_tree(tree: TreeParams, **changes) -> TreeParams:
    import dataclasses

    return dataclasses.replace(tree, **changes)


@pytest.mark.parametrize("mode", ["chain", "ddtree", "dart_lookup"])
def test_a_drafter_reading_the_wrong_positions_dice_still_commits_ars_tokens(parts, mode, monkeypatch):
    """The engine hands each sampled sequence its dice before every proposal; a drafter told the
    neighbouring position's noise (an off-by-one in the engine) proposes other trees, and every
    seeded row still commits exactly `ar`'s tokens (fp32)."""
    import dart_worker.engine as engine_module
    from dart_worker.engine_factory import build_engine

    prompts = random_prompts(4, seed=11)
    params = [SamplingParams(temperature=t, top_p=p, seed=s, max_new_tokens=16)
              for t, p, s in ((1.0, 1.0, 1), (0.7, 0.9, 2), (0.0, 1.0, 3), (1.0, 0.8, 4))]
    expected = [r.token_ids for r in build_engine(parts, "ar").generate(prompts, params)]
    engine = build_engine(parts, mode, TreeParams(budget=8), sizing="fixed")
    assert [r.token_ids for r in engine.generate(prompts, params)] == expected
    real_dice, real_call, read = engine_module._dice, GumbelCoupler.__call__, []

    def wrong_dice(live):
        return [None if d is None else Dice(d.key, d.position + 1, d.temperature) for d in real_dice(live)]

    def counted(self, logits, dice):
        read.append([None if d is None else d.position for d in dice])
        return real_call(self, logits, dice)

    monkeypatch.setattr(engine_module, "_dice", wrong_dice)
    monkeypatch.setattr(GumbelCoupler, "__call__", counted)
    assert [r.token_ids for r in engine.generate(prompts, params)] == expected
    assert read and all(any(p is not None for p in positions) for positions in read)  # the coupler drafted
    assert all(positions[2] is None for positions in read if len(positions) == 4)  # the greedy row: no dice


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("coupling_noise_weight", 1.5, "coupling_noise_weight must be in [0, 1] (0 = off), got 1.5"),
    ("coupling_noise_weight", True, "coupling_noise_weight must be in [0, 1] (0 = off), got True"),
    ("coupling_scale", 0.0, "coupling_scale must be finite and > 0, got 0.0"),
    ("coupling_scale", float("inf"), "coupling_scale must be finite and > 0, got inf"),
])
def test_a_bad_coupling_setting_is_a_clear_error(setting, value, message):
    from ngram_native.builders import InvalidTreeParams

    with pytest.raises(InvalidTreeParams, match=re.escape(message)):
        TreeParams(**{setting: value})
