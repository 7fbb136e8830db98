"""Coupled drafting (issue #48): drafters that read the sampler's dice.

- `dart_train.replay` hands every sampled sequence its `Dice` (key, generated index of its next
  root row, temperature) before each proposal, and none for greedy replies;
- a head drafter with a `coupler` builds its trees from the coupler's logits for the sampled
  sequences only;
- `dart_bench.coupling.GumbelCoupler`'s logits rank the head's tokens by log q + g with the noise
  the target's Gumbel-max draw uses at each depth's position: where q is the target's p (and every
  token is a cell of its own), its argmax at depth d IS the target's draw at position + d - 1;
- `jobs.bench coupling` with `tau_modes` reports greedy, today's and coupled tau by replay.

Tiny fp32 models; small vocabularies.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dart_bench.coupling import GumbelCoupler, gumbel_replies
from dart_bench.gumbel import BLOCK_STREAM, gumbel_sample, row_seeds
from dart_train.replay import replay, target_references
from dart_worker.drafters.base import Dice, Drafter, empty_tree
from dart_worker.engine_factory import EngineParts, build_drafter
from dart_worker.head.draft_head import DartDraftHead
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
    vocab, depth, cases = 32, 4, 60  # 32 tokens: every token a cell of its own in the partitioned draw
    logits = torch.randn(cases, depth, vocab, generator=gen, dtype=torch.float64).float() * 2
    dice = [Dice(key=int(k), position=int(p), temperature=0.8)
            for k, p in zip(torch.randint(0, 2**62, (cases,), generator=gen), torch.randint(0, 500, (cases,),
                                                                                          generator=gen))]
    for scale in (0.5, 2.0):
        coupled = GumbelCoupler(_IdentityHead(), scale)(logits, dice)
        hits = shifted = 0
        for b, d in enumerate(dice):
            p = torch.softmax(logits[b].double() / d.temperature, dim=-1)
            for at, seeds in ((d.position, "right"), (d.position + 1, "wrong")):  # the draw of each depth's row
                positions = at + np.arange(depth)
                drawn = gumbel_sample(p, torch.from_numpy(row_seeds(d.key, positions)),
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
