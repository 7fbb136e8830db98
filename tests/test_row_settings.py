"""Per-row sampling settings: read from optional input columns, checked per row, decoded in one batch.

- the readers carry the setting columns (any names, input.settings_columns) into one JSON column,
  a value JSON cannot hold is that row's error;
- the worker turns them into the row's SamplingParams: a bad value is an error row naming the
  setting, never a failed batch, and the output row records the settings it decoded with;
- rows with different settings share one continuous batch and each gets exactly what decoding it
  alone with `ar` gives (hypothesis over mixed settings, every registered drafter).
"""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_worker.drafters import drafter_names
from dart_worker.sampling.params import SamplingParams
from pipeline.data.inputs import INPUT_SCHEMA, PromptFields, parse_jsonl_record
from pipeline.settings.config import ConfigError, load_config, to_dict
from pipeline.settings.row_settings import (
    SETTING_NAMES,
    SettingError,
    checked_setting,
    decode_settings,
    encode_settings,
    row_sampling_params,
    settings_columns,
)
from pipeline.worker import GenerationWorker, row_seed
from tests.hypothesis_budget import examples
from tests.test_engine import VOCAB, make_engine, random_prompts
from tests.tiny_models import input_row, save_tiny_artifacts, tiny_model, tiny_worker_config

FIELDS = PromptFields(setting_columns=settings_columns({"temperature": "temp"}))
DEFAULTS = SamplingParams(temperature=0.0, max_new_tokens=16, seed=7, stop=("w9",))


def test_jsonl_record_carries_its_setting_columns():
    line = json.dumps({"id": 1, "prompt": "w5 w6", "temp": 0.5, "top_k": 3, "stop": ["w7"], "top_p": None,
                       "temperature": 9.0}).encode()
    row_id, prompt, error, raw = parse_jsonl_record(line, FIELDS)
    assert (row_id, prompt, error) == ("1", "w5 w6", None)
    # the renamed column is read, the default name of a remapped setting is not, nulls are left out
    assert json.loads(raw) == {"temperature": 0.5, "top_k": 3, "stop": ["w7"]}
    assert parse_jsonl_record(b'{"id": 2, "prompt": "w5"}', FIELDS)[2:] == (None, None)


def test_a_setting_json_cannot_hold_is_the_rows_error():
    row_id, prompt, error, raw = parse_jsonl_record(b'{"id": 3, "prompt": "w5", "seed": {"a": 1}}', FIELDS)
    assert (row_id, prompt, raw) == ("3", None, None)
    assert error == "setting 'seed' holds a dict, which no setting accepts"
    # joined after the row's other problems
    error = parse_jsonl_record(b'{"id": 3, "prompt": "", "top_p": [[{}]]}', FIELDS)[2]
    assert error.startswith("empty prompt; setting 'top_p'")


def test_parquet_reader_carries_setting_columns(tmp_path):
    from pipeline.data.inputs import ParquetPromptDatasource

    table = pa.table({"id": ["a", "b", "c"], "prompt": ["w5", "w6", "w7"],
                      "max_new_tokens": pa.array([4.0, None, 2.5]),  # pandas' int column with nulls
                      "temp": pa.array([0.0, 1.0, None]), "stop": pa.array([["w9"], None, []])})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    source = ParquetPromptDatasource.__new__(ParquetPromptDatasource)  # the reader alone, no Ray
    source._fields, source._rows_per_block = FIELDS, 16
    rows = pa.concat_tables(source._read_rows(pq.ParquetFile(io.BytesIO(buffer.getvalue())), "f")).to_pylist()
    assert [decode_settings(r["settings"]) for r in rows] == [
        {"max_new_tokens": 4.0, "temperature": 0.0, "stop": ["w9"]}, {"temperature": 1.0},
        {"max_new_tokens": 2.5, "stop": []}]


def test_config_names_setting_columns_and_refuses_unknown_ones():
    base = ["input.urls=[a.jsonl]", "output.url=out"]
    cfg = load_config(None, [*base, "input.settings_columns.temperature=temp", "input.settings_columns.seed=null"])
    pairs = dict(settings_columns(cfg.input.settings_columns))
    assert pairs["temperature"] == "temp" and "seed" not in pairs and pairs["top_p"] == "top_p"
    with pytest.raises(ConfigError, match=r"input\.settings_columns\.beam: is not a per-row setting"):
        load_config(None, [*base, "input.settings_columns.beam=beam"])
    with pytest.raises(ConfigError, match=r"input\.settings_columns\.stop: must be null or a column other"):
        load_config(None, [*base, "input.settings_columns.stop=prompt"])


@pytest.mark.parametrize(("settings", "message"), [
    ({"temperature": "hot"}, "setting 'temperature' must be a number, got 'hot'"),
    ({"temperature": -1}, "temperature must be finite and >= 0"),
    ({"temperature": float("nan")}, "temperature must be finite"),
    ({"top_p": 2}, "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k must be >= 0"),
    ({"top_k": 1.5}, "setting 'top_k' must be an integer, got 1.5"),
    ({"max_new_tokens": True}, "setting 'max_new_tokens' must be an integer, got True"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"seed": -1}, "setting 'seed' must be in [0, 2**63)"),
    ({"seed": 2**64}, "setting 'seed' must be in [0, 2**63)"),
    ({"stop": ""}, "setting 'stop' must be a non-empty string or a list of them"),
    ({"stop": ["w5", 3]}, "setting 'stop' must be a non-empty string"),
    ({"beam": 3}, "unknown setting 'beam'"),
])
def test_bad_row_settings_raise_a_setting_error_naming_them(settings, message):
    with pytest.raises(SettingError) as raised:
        row_sampling_params(DEFAULTS, settings, lambda base: base)
    assert message in str(raised.value)


def test_row_settings_override_the_config_and_the_seed_is_derived_from_the_rows_own():
    params = row_sampling_params(DEFAULTS, {"temperature": 1, "max_new_tokens": 3.0, "stop": "w4", "seed": 5},
                                 lambda base: row_seed(base, "id:x"))
    assert params == SamplingParams(temperature=1.0, max_new_tokens=3, stop=("w4",), seed=row_seed(5, "id:x"))
    unchanged = row_sampling_params(DEFAULTS, {}, lambda base: row_seed(base, "id:x"))
    assert unchanged.seed == row_seed(7, "id:x") and unchanged.stop == ("w9",)
    assert checked_setting("top_p", 1) == 1.0 and set(SETTING_NAMES) >= {"temperature", "seed", "stop"}
    assert encode_settings({"top_k": None}) == (None, None)


# ------------------------------------------------------------------------------------- the worker


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    artifacts = save_tiny_artifacts(tmp_path_factory.mktemp("row-settings"))
    cfg = tiny_worker_config(artifacts)
    cfg.decoding.max_new_tokens, cfg.resources.max_live = 8, 2
    resolved = {"run_id": "settings", "head_dir": artifacts["head"], "trie_url": artifacts["trie"]}
    return GenerationWorker(to_dict(cfg), resolved)


def test_worker_decodes_each_row_with_its_own_settings_and_bad_ones_are_error_rows(worker):
    rows = [input_row("a", "w5 w6 w7", temperature=1.0, seed=3, max_new_tokens=5),
            input_row("b", "w8 w9", top_p=3.0),
            input_row("c", "w10 w11", max_new_tokens=2),
            input_row("d", "w12", temperature=0.8, top_k=4, seed=9),
            input_row("e", "w13", temperature="warm"),
            input_row("f", "w14 w15 w14", temperature=1.0, min_p=0.1, repetition_penalty=1.3, logprobs=2, seed=1)]
    out = worker(pa.Table.from_pylist(rows, schema=INPUT_SCHEMA)).to_pylist()
    assert [r["row_key"] for r in out] == [r["row_key"] for r in rows]
    assert out[1]["finish_reason"] == "error" and "top_p must be in (0, 1]" in out[1]["error"]
    assert out[1]["temperature"] is None  # no settings were in force for it
    assert out[4]["error"] == "setting 'temperature' must be a number, got 'warm'"
    assert (out[0]["temperature"], out[0]["max_new_tokens"], out[0]["seed"]) == (1.0, 5, row_seed(3, "id:a"))
    assert (out[2]["temperature"], out[2]["max_new_tokens"], out[2]["seed"]) == (0.0, 2, row_seed(0, "id:c"))
    assert out[3]["top_k"] == 4 and len(out[2]["token_ids"]) == 2
    assert (out[5]["min_p"], out[5]["repetition_penalty"], out[5]["frequency_penalty"]) == (0.1, 1.3, 0.0)
    assert out[0]["logprobs"] is None and len(out[5]["logprobs"]) == len(out[5]["token_ids"])
    assert all(len(ids) == 2 for ids in out[5]["top_logprob_ids"])
    # each row alone, with `ar` and the settings written on its output row
    ar = make_engine(worker.engine.target.model, "ar")
    for k in (0, 2, 3, 5):
        params = SamplingParams(temperature=out[k]["temperature"], top_p=out[k]["top_p"], top_k=out[k]["top_k"],
                                min_p=out[k]["min_p"], repetition_penalty=out[k]["repetition_penalty"],
                                seed=out[k]["seed"], max_new_tokens=out[k]["max_new_tokens"],
                                logprobs=2 if k == 5 else 0)
        alone = ar.generate([worker._encode(rows[k])], [params])[0]
        assert out[k]["token_ids"] == alone.token_ids, k
        if k == 5:
            assert out[k]["logprobs"] == pytest.approx(alone.logprobs, abs=1e-5)


# ------------------------------------------------------------------ the engine, mixed settings


ENGINE_MODEL = tiny_model("qwen3", vocab_size=VOCAB)
ENGINES = {mode: make_engine(ENGINE_MODEL, mode) for mode in drafter_names()}
AR = ENGINES["ar"]

row_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.5]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
    top_k=st.sampled_from([0, 1, 5]),
    seed=st.integers(0, 2**32),
    max_new_tokens=st.integers(1, 14),
    stop_token_ids=st.sampled_from([(), (7,), (3, 11)]),
)


@settings(max_examples=examples(25), deadline=None)
@given(mode=st.sampled_from(drafter_names()), params=st.lists(row_params, min_size=1, max_size=6),
       max_live=st.sampled_from([None, 1, 2, 3]), prompt_seed=st.integers(0, 1000))
def test_mixed_settings_in_one_continuous_batch_equal_each_row_alone_with_ar(mode, params, max_live, prompt_seed):
    prompts = random_prompts(len(params), seed=prompt_seed)
    together = ENGINES[mode].generate(prompts, params, max_live=max_live)
    for prompt, p, result in zip(prompts, params, together, strict=True):
        alone = AR.generate([prompt], [p])[0]
        assert result.token_ids == alone.token_ids
        assert result.finish_reason == alone.finish_reason
        assert len(result.token_ids) <= p.max_new_tokens
