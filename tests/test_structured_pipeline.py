"""Structured output through the job: the config's constraint, a row's own, bad ones, the output columns.

- `decoding.structured_output` is checked at start-up: an invalid schema, regex or grammar, or a
  mapping without exactly one kind, is refused with one line naming it;
- a row's `structured_output` setting (a mapping or its JSON text) overrides the config's; an invalid
  one is that row's error row, naming the problem, and its neighbours decode as usual;
- every output row records its constraint (`structured_output`), whether its text is complete
  under it (`structured_complete`) and what the grammar drafted (`accepted_grammar`), and its
  tokens are those `ar` with the same constraint commits for the row alone.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.sampling.params import SamplingParams
from dart_worker.target.adapter import TargetAdapter
from pipeline.data.inputs import INPUT_SCHEMA, PromptFields, parse_jsonl_record
from pipeline.data.outputs import OUTPUT_SCHEMA
from pipeline.settings.config import ConfigError, load_config, to_dict
from pipeline.settings.row_settings import SettingError, checked_setting, encode_settings, settings_columns
from pipeline.worker import GenerationWorker
from tests.tiny_models import input_row, save_tiny_artifacts, tiny_worker_config

CONFIG_CHOICE = {"choice": ["w5w6", "w7", "w8w9w10"]}


@pytest.mark.parametrize("value, words", [
    ('{regex: "[a-"}', "decoding.structured_output: structured_output.regex: Regex parsing error"),
    ("{json: {type: objectx}}", 'decoding.structured_output: structured_output.json: Unsupported type "objectx"'),
    ("{choice: []}", "decoding.structured_output: structured_output.choice must be a non-empty list"),
    ("{jsonschema: {}}", "decoding.structured_output: structured_output: unknown key 'jsonschema'"),
])
def test_the_config_refuses_an_invalid_constraint_in_one_line(value, words):
    with pytest.raises(ConfigError) as info:
        load_config("configs/local.yaml", [f"decoding.structured_output={value}"])
    assert words in str(info.value)


def test_the_shipped_structured_config_loads():
    cfg = load_config("configs/structured.yaml")
    assert set(cfg.decoding.structured_output) == {"json"}
    assert cfg.input.settings_columns["structured_output"] == "structured_output"


def test_a_row_carries_its_constraint_as_a_mapping_or_json_text():
    fields = PromptFields(setting_columns=settings_columns(None))
    line = json.dumps({"id": 1, "prompt": "w5", "structured_output": {"regex": "w[5-7]+"}}).encode()
    assert json.loads(parse_jsonl_record(line, fields)[3]) == {"structured_output": {"regex": "w[5-7]+"}}
    as_text = '{"choice": ["a"]}'
    assert json.loads(encode_settings({"structured_output": as_text})[0]) == {"structured_output": as_text}
    # a mapping is refused for every other setting
    assert "holds a dict" in encode_settings({"seed": {"a": 1}})[1]
    assert checked_setting("structured_output", '{"choice": ["a"]}').kind == "choice"
    with pytest.raises(SettingError, match=r"structured_output\.regex: Regex parsing error"):
        checked_setting("structured_output", {"regex": "(("})


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    artifacts = save_tiny_artifacts(tmp_path_factory.mktemp("structured"))
    cfg = tiny_worker_config(artifacts)
    cfg.decoding.max_new_tokens, cfg.resources.max_live = 12, 3
    cfg.decoding.structured_output = CONFIG_CHOICE
    resolved = {"run_id": "structured", "head_dir": artifacts["head"], "trie_url": artifacts["trie"]}
    return GenerationWorker(to_dict(cfg), resolved)


def test_worker_rows_decode_under_their_own_constraint_and_bad_ones_are_error_rows(worker):
    rows = [input_row("a", "w5 w6 w7"),
            input_row("b", "w8 w9", structured_output={"regex": "(w[5-7]){2,3}"}),
            input_row("c", "w10 w11", structured_output='{"regex": "(w1[0-2]){1,5}"}', temperature=0.9, seed=4),
            input_row("d", "w12", structured_output={"regex": "[a-"}),
            input_row("e", "w13", structured_output={"choice": ["w5", "w6"], "json": {}}),
            input_row("f", "w14", structured_output={"regex": "(w5){3}"}, max_new_tokens=2)]
    out = worker(pa.Table.from_pylist(rows, schema=INPUT_SCHEMA)).to_pylist()
    assert [r["row_key"] for r in out] == [r["row_key"] for r in rows]
    assert {"structured_complete", "structured_output", "accepted_grammar", "grammar_s"} <= set(OUTPUT_SCHEMA.names)
    assert out[3]["finish_reason"] == "error"
    assert out[3]["error"].startswith("setting 'structured_output': structured_output.regex: Regex parsing error")
    assert out[4]["finish_reason"] == "error" and "exactly one of" in out[4]["error"]
    assert out[3]["structured_complete"] is None and out[3]["text"] is None
    assert json.loads(out[0]["structured_output"]) == CONFIG_CHOICE
    assert json.loads(out[1]["structured_output"]) == {"regex": "(w[5-7]){2,3}"}
    for k in (0, 1, 2):
        assert out[k]["structured_complete"] is True and out[k]["finish_reason"] == "stop", out[k]
    assert out[5]["finish_reason"] == "length" and out[5]["structured_complete"] is False
    assert len(out[5]["token_ids"]) == 2
    # each row alone, with `ar` and the constraint written on its output row
    engine = worker.engine
    ar = build_engine(EngineParts(target=TargetAdapter(engine.target.model), eos_token_ids=tuple(engine.eos_token_ids),
                                  tokenizer=engine.tokenizer), "ar")
    for k in (0, 1, 2, 5):
        params = SamplingParams(temperature=out[k]["temperature"], seed=out[k]["seed"],
                                max_new_tokens=out[k]["max_new_tokens"], structured_output=out[k]["structured_output"])
        alone = ar.generate([worker._encode(rows[k])], [params])[0]
        assert out[k]["token_ids"] == alone.token_ids, k
