"""n completions per prompt (issue #29): one shared prefill, each completion its own seed.

- every completion of `generate_samples` equals decoding its prompt alone with `ar` and the
  completion's own params (`for_sample`), for every registered drafter, ragged and continuous;
- the target forwards each prompt once however many completions it has (prefill calls and
  prompt tokens counted), and once per chunk of `max_live` when n is larger;
- sample 0 is the request itself (n = 1 decodes as before), other samples have seeds of their own.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_worker.drafters import drafter_names
from dart_worker.sampling.params import SamplingParams, for_sample, sample_seed
from pipeline.data.inputs import INPUT_SCHEMA
from pipeline.data.outputs import OUTPUT_SCHEMA, sample_key, split_sample_key
from pipeline.settings.config import ConfigError, load_config, to_dict
from pipeline.worker import GenerationWorker, row_seed
from tests.hypothesis_budget import examples
from tests.test_engine import VOCAB, make_engine, random_prompts
from tests.tiny_models import input_row, save_tiny_artifacts, tiny_model, tiny_worker_config

MODEL = tiny_model("qwen3", vocab_size=VOCAB)
ENGINES = {mode: make_engine(MODEL, mode) for mode in drafter_names()}
AR = ENGINES["ar"]


class PrefillCounter:
    """Wraps a target's `prefill` to count calls and the prompt tokens forwarded."""

    def __init__(self, target):
        self.target, self.original = target, target.prefill
        self.calls, self.tokens = 0, 0

    def __enter__(self):
        def counted(state, prompts, **kwargs):
            self.calls += 1
            self.tokens += sum(len(p) for p in prompts)
            return self.original(state, prompts, **kwargs)

        self.target.prefill = counted
        return self

    def __exit__(self, *exc):
        del self.target.prefill  # back to the class's method


def test_sample_seeds_keep_sample_zero_and_differ_otherwise():
    assert sample_seed(7, 0) == 7 and sample_seed(None, 3) is None
    seeds = {sample_seed(7, i) for i in range(1, 50)} | {sample_seed(8, 1)}
    assert len(seeds) == 50 and 7 not in seeds and all(0 <= s < 2**63 for s in seeds)
    params = SamplingParams(seed=7)
    assert for_sample(params, 0) is params and for_sample(params, 2).seed == sample_seed(7, 2)
    with pytest.raises(ValueError, match="sample index"):
        sample_seed(7, -1)


@pytest.mark.parametrize("mode", drafter_names())
def test_each_completion_equals_its_prompt_alone_with_ar_and_the_prefill_runs_once(mode):
    prompts = random_prompts(3, seed=11)
    base = [SamplingParams(temperature=1.0, top_k=8, min_p=0.05, repetition_penalty=1.2, seed=s, max_new_tokens=12,
                           logprobs=2 if s == 2 else 0) for s in (1, 2, 3)]
    counts = (4, 1, 3)
    samples = [[for_sample(p, j) for j in range(n)] for p, n in zip(base, counts)]
    engine = ENGINES[mode]
    with PrefillCounter(engine.target) as counter:
        results = engine.generate_samples(prompts, samples, max_live=4)
    # one prompt per prefill: 3 forwards of the prompts' own tokens, not 8
    assert counter.tokens == sum(len(p) for p in prompts)
    assert counter.calls <= 3  # max_live 4: a prompt's completions join together (here 4, then 1 + 3)
    for prompt, per_sample, got in zip(prompts, samples, results, strict=True):
        assert len(got) == len(per_sample)
        for params, result in zip(per_sample, got, strict=True):
            alone = AR.generate([prompt], [params])[0]
            assert result.error is None
            assert result.token_ids == alone.token_ids
            assert result.finish_reason == alone.finish_reason
            if params.logprobs:
                assert result.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
                assert result.top_logprob_ids == alone.top_logprob_ids
    # seeded completions of one prompt are different samples (4 x 12 tokens over a 32-token vocabulary)
    assert len({tuple(r.token_ids) for r in results[0]}) > 1


def test_sample_zero_is_the_request_alone():
    prompt = random_prompts(1, seed=5)[0]
    params = SamplingParams(temperature=1.0, seed=42, max_new_tokens=10)
    first = AR.generate_samples([prompt], [[for_sample(params, j) for j in range(3)]])[0][0]
    assert first.token_ids == AR.generate([prompt], [params])[0].token_ids


def test_more_completions_than_max_live_prefill_once_per_chunk():
    prompt = random_prompts(1, seed=9)[0]
    params = SamplingParams(temperature=0.9, seed=4, max_new_tokens=6)
    engine = ENGINES["dart_lookup"]
    with PrefillCounter(engine.target) as counter:
        results = engine.generate_samples([prompt], [[for_sample(params, j) for j in range(5)]], max_live=2)
    assert counter.calls == 3 and counter.tokens == 3 * len(prompt)  # chunks of 2, 2, 1
    for j, result in enumerate(results[0]):
        assert result.token_ids == AR.generate([prompt], [for_sample(params, j)])[0].token_ids


def test_a_prompt_the_engine_refuses_is_an_error_for_each_completion_and_its_neighbours_decode():
    good = random_prompts(1, seed=3)[0]
    params = SamplingParams(temperature=1.0, seed=1, max_new_tokens=4)
    results = AR.generate_samples([[], good], [[params, for_sample(params, 1)], [params, for_sample(params, 1)]])
    assert [r.error for r in results[0]] == ["empty prompt", "empty prompt"]
    assert all(r.error is None and len(r.token_ids) == 4 for r in results[1])


@settings(max_examples=examples(12), deadline=None)
@given(mode=st.sampled_from(drafter_names()), counts=st.lists(st.integers(1, 4), min_size=1, max_size=4),
       max_live=st.sampled_from([None, 2, 3, 5]), temperature=st.sampled_from([0.7, 1.0]),
       prompt_seed=st.integers(0, 1000), new_tokens=st.integers(1, 10))
def test_mixed_counts_in_one_continuous_batch_equal_each_completion_alone(mode, counts, max_live, temperature,
                                                                          prompt_seed, new_tokens):
    prompts = random_prompts(len(counts), seed=prompt_seed)
    samples = [[for_sample(SamplingParams(temperature=temperature, seed=prompt_seed + i, max_new_tokens=new_tokens),
                           j) for j in range(n)] for i, n in enumerate(counts)]
    results = ENGINES[mode].generate_samples(prompts, samples, max_live=max_live)
    for prompt, per_sample, got in zip(prompts, samples, results, strict=True):
        for params, result in zip(per_sample, got, strict=True):
            assert result.token_ids == AR.generate([prompt], [params])[0].token_ids


# ------------------------------------------------------------------------------------- the worker


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    artifacts = save_tiny_artifacts(tmp_path_factory.mktemp("samples"))
    cfg = tiny_worker_config(artifacts)
    cfg.decoding.max_new_tokens, cfg.decoding.temperature, cfg.decoding.n, cfg.decoding.seed = 6, 0.9, 3, 5
    resolved = {"run_id": "samples", "head_dir": artifacts["head"], "trie_url": artifacts["trie"],
                "written_samples": {"id:b": (3, (0, 2))}}  # a resumed run: row b has samples 0 and 2 of 3
    return GenerationWorker(to_dict(cfg), resolved)


def test_worker_writes_a_row_per_sample_skips_written_ones_and_refuses_greedy_copies(worker):
    rows = [input_row("a", "w5 w6 w7"), input_row("b", "w8 w9"), input_row("c", "w10", n=2, temperature=1.0),
            input_row("d", "w11", temperature=0.0), input_row("e", "w12", n=0), input_row("f", "w13", n=1,
                                                                                              temperature=0.0)]
    out = worker(pa.Table.from_pylist(rows, schema=INPUT_SCHEMA)).to_pylist()
    keys = [(r["row_key"], r["sample_index"], r["n"]) for r in out]
    assert keys == [("id:a", 0, 3), ("sample:1:id:a", 1, 3), ("sample:2:id:a", 2, 3),
                    ("sample:1:id:b", 1, 3),  # only the sample not written yet
                    ("id:c", 0, 2), ("sample:1:id:c", 1, 2),
                    ("id:d", 0, 1), ("id:e", 0, 1), ("id:f", 0, 1)]
    errors = {r["row_key"]: r["error"] for r in out if r["error"]}
    assert errors == {"id:d": "n=3 completions at temperature 0 would be 3 identical copies of the greedy reply: "
                              "give the row a temperature > 0 or n = 1",
                      "id:e": "setting 'n' must be in [1, 1024], got 0"}
    assert out[-1]["error"] is None and out[-1]["temperature"] == 0.0  # n 1 may be greedy
    # each sample alone with `ar`, from the seed written on its row: (seed, row key, sample index)
    assert out[1]["seed"] == sample_seed(row_seed(5, "id:a"), 1) and out[0]["seed"] == row_seed(5, "id:a")
    ar = make_engine(worker.engine.target.model, "ar", eos=worker.engine.eos_token_ids)  # the worker's stop rule
    for r, row in zip(out[:6], [rows[0]] * 3 + [rows[1]] + [rows[2]] * 2):
        params = SamplingParams(temperature=r["temperature"], seed=r["seed"], max_new_tokens=6)
        assert r["token_ids"] == ar.generate([worker._encode(row)], [params])[0].token_ids, r["row_key"]
    assert len({tuple(r["token_ids"]) for r in out[:3]}) > 1


def test_sample_keys_round_trip_and_never_collide_with_input_keys():
    for key in ("id:x", "row:s3://b/f.jsonl#ab12~2", "dup:9f:id:sample:1:x", "id:sample:3:id:x"):
        assert split_sample_key(sample_key(key, 0)) == (key, 0)
        assert split_sample_key(sample_key(key, 7)) == (key, 7)
        assert sample_key(key, 7) != key


def test_config_refuses_greedy_samples_and_bounds_n():
    base = ["input.urls=[a.jsonl]", "output.url=out"]
    assert load_config(None, [*base, "decoding.n=4", "decoding.temperature=0.8"]).decoding.n == 4
    with pytest.raises(ConfigError, match=r"decoding\.n: n=4 completions at temperature 0"):
        load_config(None, [*base, "decoding.n=4"])
    with pytest.raises(ConfigError, match=r"decoding\.n: must be in \[1, 1024\]"):
        load_config(None, [*base, "decoding.n=0", "decoding.temperature=1"])


def test_sft_messages_hold_the_prompt_and_the_reply_next_to_the_plain_columns(worker):
    worker.cfg.output.messages = True
    try:
        chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "w5 w6"}]
        rows = [input_row("m", "w7 w8", n=1, temperature=1.0),
                {**input_row("chat", json.dumps(chat), n=2, temperature=1.0), "prompt_kind": "messages"},
                input_row("bad", "w9", temperature="x")]
        out = worker(pa.Table.from_pylist(rows, schema=INPUT_SCHEMA))
    finally:
        worker.cfg.output.messages = False
    assert out.schema.field("messages").type == OUTPUT_SCHEMA.field("messages").type
    got = out.to_pylist()
    reply = {"role": "assistant", "content": got[0]["text"]}
    assert got[0]["messages"] == [{"role": "user", "content": "w7 w8"}, reply]
    for r in got[1:3]:
        assert r["messages"] == [*chat, {"role": "assistant", "content": r["text"]}]
    assert got[3]["error"] and got[3]["messages"] is None
    assert worker(pa.Table.from_pylist(rows[:1], schema=INPUT_SCHEMA)).to_pylist()[0]["messages"] is None  # off
