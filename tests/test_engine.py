"""The decoding engine is lossless: every mode reproduces the target's own decoding.

Greedy: chain, ddtree and dart equal `ar` token for token, and `ar` equals transformers'
greedy generate (fp32 tiny models of every family, B = 1 and B > 1 with ragged prompts,
stops inside accepted paths, the context limit). Sampling: the distribution of the first
spec-decoded tokens equals the target's exact distribution (chi-square, toy vocabulary).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_bench.gpu_acceptance.correctness import first_two_tokens_p_value
from dart_worker.decode_round import RoundRecord
from dart_worker.engine import DecodingEngine
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.head.draft_head import DartDraftHead
from dart_worker.sampling.params import SamplingParams
from dart_worker.sizing.policy import FixedSizing
from dart_worker.target.adapter import TargetAdapter
from ngram_native import NgramTrie, TreeParams, build_trie
from tests.hypothesis_budget import examples
from tests.tiny_models import FAMILIES, tiny_model, tiny_tokenizer

SPEC_MODES = ("chain", "ddtree", "dart")
VOCAB = 32  # small enough that top-25 drafts often contain the target's choice


def greedy(max_new_tokens: int, stop: tuple[int, ...] = ()) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop)


def random_prompts(count: int, seed: int, vocab: int = VOCAB, lengths=(5, 23)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1], (count,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in sizes]


def make_engine(model, mode: str, trie=None, draft_length: int = 4, eos=(), defer_logits=None,
                **tree) -> DecodingEngine:
    target = TargetAdapter(model)
    head = None
    if mode != "ar":
        torch.manual_seed(123)
        head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=draft_length)
    parts = EngineParts(target=target, head=head, trie=trie if mode == "dart" else None, eos_token_ids=tuple(eos))
    return build_engine(parts, mode, TreeParams(**tree), defer_logits=defer_logits)


@pytest.fixture(scope="module")
def models():
    return {family: tiny_model(family, vocab_size=VOCAB) for family in FAMILIES}


@pytest.fixture(scope="module")
def self_trie(models, tmp_path_factory):
    """A trie over the target's own greedy continuations, so that the N-gram term finds the
    target's path and trees accept several tokens per round (exercising compaction)."""
    docs = []
    for model in models.values():
        engine = make_engine(model, "ar")
        for result in engine.generate(random_prompts(12, seed=99), greedy(48)):
            docs.append(np.asarray(result.token_ids, dtype=np.int32))
    path = tmp_path_factory.mktemp("trie") / "self.ngram"
    build_trie(docs, path, order=3, vocab_size=VOCAB, tokenizer_fingerprint="tiny")
    return NgramTrie.open(path, verify=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_ar_equals_transformers_generate(models, family):
    model = models[family]
    prompts = random_prompts(3, seed=1)
    eos = (model.config.eos_token_id,)  # transformers' generate stops there too
    results = make_engine(model, "ar", eos=eos).generate(prompts, greedy(30))
    for prompt, result in zip(prompts, results):
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)
        assert result.token_ids == reference[0, len(prompt) :].tolist()
        assert result.finish_reason == ("stop" if result.token_ids[-1] == 2 else "length")
        assert result.stats.tau == 1.0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", SPEC_MODES)
def test_greedy_speculative_equals_ar_batched_and_alone(models, self_trie, family, mode):
    model = models[family]
    prompts = random_prompts(4, seed=2)
    expected = [r.token_ids for r in make_engine(model, "ar").generate(prompts, greedy(40))]
    engine = make_engine(model, mode, trie=self_trie)
    batched = engine.generate(prompts, greedy(40))
    assert [r.token_ids for r in batched] == expected
    alone = [engine.generate([p], greedy(40))[0].token_ids for p in prompts[:2]]
    assert alone == expected[:2]
    if mode == "dart":  # the self-trie makes multi-token acceptance common: compaction is exercised
        assert max(max(r.stats.accept_lengths, default=0) for r in batched) >= 2


@pytest.mark.parametrize("family", FAMILIES)
def test_deferred_and_full_logits_decode_alike(models, self_trie, family):
    """Greedy rounds that project only the walked rows (deferred) decode as full logits do."""
    model = models[family]
    prompts = random_prompts(3, seed=5)
    deferred = make_engine(model, "dart", trie=self_trie, defer_logits=True)
    full = make_engine(model, "dart", trie=self_trie, defer_logits=False)
    assert [r.token_ids for r in deferred.generate(prompts, greedy(30))] == \
        [r.token_ids for r in full.generate(prompts, greedy(30))]


class RecordingPolicy(FixedSizing):
    """The fixed sizing policy, keeping what each call was handed."""

    def __init__(self):
        self.calls: list[tuple[str, RoundRecord]] = []

    def plan(self, record, draft):
        self.calls.append(("plan", record))
        assert not record.trees and not record.acceptances  # planned before anything is verified
        return super().plan(record, draft)

    def learn(self, record):
        self.calls.append(("learn", record))


def test_a_round_plans_its_trees_once_and_hands_its_policy_one_filled_record(models, self_trie):
    """The engine asks its sizing policy two things a round, in order: plan the trees (while
    drafting), then learn from the round's record once it has committed; the record holds what
    the round did: the trees verified, one acceptance and committed rows per live sequence, the
    stage times (the verify forward's among them), the model's run."""
    model = models["llama"]
    prompts = random_prompts(4, seed=8)
    expected = [r.token_ids for r in make_engine(model, "dart", trie=self_trie).generate(prompts, greedy(12),
                                                                                       max_live=3)]
    engine = make_engine(model, "dart", trie=self_trie)
    policy = engine.sizer = RecordingPolicy()
    results = engine.generate(prompts, greedy(12), max_live=3)
    assert [r.token_ids for r in results] == expected  # the recording policy is the fixed one
    learnt = [record for kind, record in policy.calls if kind == "learn"]
    # One record per round: every request was live in len(its rounds) of them.
    assert sum(len(record.live) for record in learnt) == sum(r.stats.rounds for r in results)
    planned = iter(policy.calls)
    for kind, record in planned:  # each plan is followed by the learn of the same round
        if kind == "plan":
            assert next(planned) == ("learn", record)
    drafted = [record for kind, record in policy.calls if kind == "plan"]
    for record in learnt:
        live = len(record.live)
        assert len(record.trees) == len(record.acceptances) == len(record.committed_rows) == len(record.rows) == live
        assert record.batch.batch_size == live and record.out.taps.shape[0] == live
        assert record.verified_seconds >= record.seconds["verify"] > 0
        assert all(rows[0] == 0 and len(rows) == acc.num_accepted + 1
                   for rows, acc in zip(record.committed_rows, record.acceptances))
        assert record.model_ran == (record in drafted) == (record.model_seconds > 0)


def test_a_block_of_unequal_trees_runs_its_real_rows_only(models, self_trie):
    """Exact shapes (a CPU): a round's verify forward runs its trees' roots and nodes, never the
    padding after the smaller trees (a block without padding runs whole, as it is), and the output
    is still `ar`'s, greedy and seeded, in one batch, with logits deferred or not."""
    model = models["llama"]
    prompts = random_prompts(4, seed=6)
    params = [greedy(30), SamplingParams(temperature=0.8, seed=5, max_new_tokens=30)] * 2
    expected = [r.token_ids for r in make_engine(model, "ar").generate(prompts, params)]
    for defer_logits in (False, True):
        engine = make_engine(model, "dart", trie=self_trie, defer_logits=defer_logits)
        assert engine.packs_rows
        blocks = []
        real_verify = engine.target.verify

        def verify(state, tokens, *args, packed=None, real_verify=real_verify, blocks=blocks, **kwargs):
            blocks.append((tokens.numel(), None if packed is None else packed.rows.numel()))
            return real_verify(state, tokens, *args, packed=packed, **kwargs)

        engine.target.verify = verify
        assert [r.token_ids for r in engine.generate(prompts, params)] == expected
        assert all(real is None or real < rows for rows, real in blocks)  # a block without padding runs whole
        assert any(real is not None for rows, real in blocks)
        # Greedy rows alone: the deferred path runs packed too.
        assert [r.token_ids for r in engine.generate(prompts[::2], params[::2])] == expected[::2]


@pytest.mark.parametrize("mode", SPEC_MODES)
def test_trees_have_siblings_and_depth(models, self_trie, mode):
    engine = make_engine(models["llama"], mode, trie=self_trie, budget=24)
    result = engine.generate(random_prompts(1, seed=3), greedy(20))[0]
    assert result.stats.mean_tree_size > (1 if mode == "chain" else 4)


@pytest.mark.parametrize("family", FAMILIES)
def test_stop_token_inside_an_accepted_path(models, self_trie, family):
    model = models[family]
    prompt = random_prompts(1, seed=4)[0]
    free = make_engine(model, "ar").generate([prompt], greedy(40))[0].token_ids
    stop = free[12]
    cut = free.index(stop) + 1
    for mode in ("ar", *SPEC_MODES):
        result = make_engine(model, mode, trie=self_trie).generate([prompt], greedy(40, stop=(stop,)))[0]
        assert result.token_ids == free[:cut], mode
        assert result.finish_reason == "stop"


def reference_stop_cut(tokenizer, free: list[int], stops: list[str]) -> tuple[list[int], str]:
    """Brute force: the shortest prefix of the free run whose text contains a stop string."""
    for end in range(1, len(free) + 1):
        text = tokenizer.decode(free[:end], skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return free[:end], text[: min(hits)]
    return free, tokenizer.decode(free, skip_special_tokens=True)


@settings(max_examples=examples(12), deadline=None)
@given(start=st.integers(0, 30), span=st.integers(1, 3), partial=st.booleans(), mode=st.sampled_from(("ar",
       *SPEC_MODES)), family=st.sampled_from(FAMILIES))
def test_stop_strings_end_the_text_where_plain_decoding_would(models, self_trie, start, span, partial, mode,
                                                              family):
    tokenizer = tiny_tokenizer(VOCAB)
    model = models[family]
    prompt = random_prompts(1, seed=7)[0]
    free = make_engine(model, "ar").generate([prompt], greedy(40))[0].token_ids
    stop = tokenizer.decode(free[start : start + span], skip_special_tokens=True) or "w"
    if partial:  # a stop string that ends inside a token ("w1" in "w17")
        stop = stop[:-1] or stop
    stops = [stop, "never w0 w0 w0"]
    expected_ids, expected_text = reference_stop_cut(tokenizer, free, stops)
    engine = make_engine(model, mode, trie=self_trie)
    engine.tokenizer = tokenizer
    params = SamplingParams(temperature=0.0, max_new_tokens=40, stop=tuple(stops))
    result = engine.generate([prompt, random_prompts(1, seed=8)[0]], params)[0]
    assert result.token_ids == expected_ids
    assert result.text == expected_text and stop not in result.text
    assert result.finish_reason == ("stop" if len(expected_ids) < 40 or stop in tokenizer.decode(
        free, skip_special_tokens=True) else "length")


def test_stop_strings_need_a_tokenizer_and_non_empty_strings(models):
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(stop=("",))
    with pytest.raises(TypeError, match="sequence of strings"):
        SamplingParams(stop="User:")
    result = make_engine(models["llama"], "ar").generate([[5, 6, 7]], SamplingParams(stop=("x",)))[0]
    assert result.error == "stop strings need a tokenizer"


@pytest.mark.parametrize("max_new", [1, 2, 3, 7])
def test_max_new_tokens_is_never_exceeded(models, self_trie, max_new):
    model = models["qwen3"]
    prompts = random_prompts(3, seed=5)
    expected = [r.token_ids for r in make_engine(model, "ar").generate(prompts, greedy(max_new))]
    assert all(len(t) == max_new for t in expected)
    for mode in SPEC_MODES:
        got = make_engine(model, mode, trie=self_trie).generate(prompts, greedy(max_new))
        assert [r.token_ids for r in got] == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_runs_up_to_the_context_limit(family, tmp_path):
    model = tiny_model(family, vocab_size=VOCAB, max_position_embeddings=48)
    prompts = [p[:30] for p in random_prompts(2, seed=6, lengths=(25, 31))]
    ar = make_engine(model, "ar").generate(prompts, greedy(100))
    for prompt, result in zip(prompts, ar):
        assert result.finish_reason == "context_limit"
        assert len(prompt) + len(result.token_ids) == 48
    for mode in ("chain", "ddtree"):
        got = make_engine(model, mode).generate(prompts, greedy(100))
        assert [r.token_ids for r in got] == [r.token_ids for r in ar]


def test_bad_requests_get_an_error_and_the_rest_still_run(models):
    engine = make_engine(models["llama"], "chain")
    too_long = [5] * 300
    results = engine.generate([[], [4, 5, 6], [VOCAB + 7], too_long], greedy(5))
    assert results[0].error and "empty" in results[0].error
    assert results[1].error is None and len(results[1].token_ids) == 5
    assert "vocabulary" in results[2].error
    assert "context limit" in results[3].error
    assert all(r.finish_reason == "error" for r in (results[0], results[2], results[3]))


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(models, self_trie):
    # The job n-gram is on: what the engine drafts depends on the rows it finished before, and
    # still a seeded request's tokens do not (coupled sampling, dart_worker/sampling/verification.py).
    engine = make_engine(models["gemma3"], "dart", trie=self_trie)
    prompts = random_prompts(3, seed=7)
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=20) for s in (11, 12, 13)]
    together = [r.token_ids for r in engine.generate(prompts, params)]
    alone = engine.generate([prompts[1]], [params[1]])[0].token_ids
    assert together[1] == alone
    assert together == [r.token_ids for r in engine.generate(prompts, params)]
    assert engine.drafter.job_ngram.num_documents == 7


@pytest.mark.parametrize(("mode", "states"), [("ar", set()), ("ddtree", set()), ("dart", {"job_ngram"}),
                                             ("lookup", {"job_cache"}), ("dart_lookup", {"job_cache", "job_ngram"})])
def test_job_state_reports_what_the_drafter_learnt_from_finished_rows(models, self_trie, mode, states):
    engine = make_engine(models["qwen3"], mode, trie=self_trie if mode.startswith("dart") else None)
    if mode == "dart_lookup":  # make_engine hands the trie to `dart` only
        engine = build_engine(EngineParts(target=engine.target, head=engine.drafter.inner.head, trie=self_trie),
                              mode, TreeParams())
    assert set(engine.job_state()) == states
    results = engine.generate(random_prompts(3, seed=4), greedy(12))
    generated = sum(len(r.token_ids) for r in results)
    for tokens, nbytes in engine.job_state().values():
        assert tokens == generated and nbytes > 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", [*SPEC_MODES, "lookup", "dart_lookup"])
def test_seeded_sampling_commits_the_tokens_of_plain_sampling(models, self_trie, family, mode):
    """For a given seed every drafter commits exactly what `ar` samples (fp32), batched or not:
    drafts decide how many tokens a round settles, never which."""
    model = models[family]
    prompts = random_prompts(4, seed=3)
    params = [SamplingParams(temperature=t, top_p=p, seed=s, max_new_tokens=30)
              for t, p, s in ((1.0, 1.0, 1), (0.7, 0.9, 2), (1.3, 1.0, 3), (1.0, 0.8, 4))]
    expected = [r.token_ids for r in make_engine(model, "ar").generate(prompts, params)]
    engine = make_engine(model, mode, trie=self_trie)
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == expected
    assert engine.generate([prompts[2]], [params[2]])[0].token_ids == expected[2]
    if mode == "dart":  # drafts were accepted, so the coupling was exercised across rounds
        assert max(max(r.stats.accept_lengths, default=0) for r in results) >= 2


def assert_first_two_tokens_follow_the_target(model, prompt, params, results) -> None:
    """Chi-square of the sampled (y1, y2) cells against the exact warped target distribution
    (the acceptance run's check, dart_bench.gpu_acceptance.correctness; cross-checked with scipy there)."""
    p_value = first_two_tokens_p_value(model, prompt, params, [r.token_ids for r in results])
    assert p_value > 1e-3, p_value


@pytest.mark.parametrize("mode", ["dart", "ddtree"])
@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
def test_sampled_tokens_follow_the_target_distribution(mode, warp, tmp_path):
    """The first two tokens: y1 comes from prefill, y2 from the first verified tree.

    4000 draws over the 64 cells of (y1, y2) catch a 2% shift of a likely cell's probability.
    """
    vocab = 8
    model = tiny_model("llama", vocab_size=vocab, initializer_range=0.1)
    prompt = [3, 5, 1, 6]
    draws = 4000
    params = [SamplingParams(**warp, seed=i, max_new_tokens=3) for i in range(draws)]
    engine = make_engine(model, mode, top_k=vocab, budget=12, beam_width=4)
    results = engine.generate([prompt] * draws, params)
    assert_first_two_tokens_follow_the_target(model, prompt, params[0], results)
    assert np.mean([r.stats.accept_lengths[0] for r in results]) > 0.3  # trees were really used


def test_sampled_tokens_follow_the_target_distribution_with_context_nodes():
    """As above, with the hybrid drafter: lookup nodes from the repeating prompt are grafted into
    the DART tree (min match 1, so every y1 seen in the prompt has a continuation to propose)."""
    vocab = 8
    model = tiny_model("llama", vocab_size=vocab, initializer_range=0.1)
    prompt = [3, 5, 1, 6, 3, 5, 1, 6, 2, 4, 7, 0, 2]
    draws = 4000
    params = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=3) for i in range(draws)]
    engine = make_engine(model, "dart_lookup", top_k=vocab, budget=12, beam_width=4, lookup_min_match=1)
    results = engine.generate([prompt] * draws, params)
    assert_first_two_tokens_follow_the_target(model, prompt, params[0], results)
    assert sum(r.stats.accepted_by_source["context"] for r in results) > 100  # context nodes were accepted
