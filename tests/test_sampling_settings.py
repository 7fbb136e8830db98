"""The sampling settings are declared once (pipeline/settings/sampling_settings.py) and every list of them
is derived: these tests fail when a setting is added to the engine or the config and not declared,
or when a derived place stops carrying one."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from dart_worker.sampling.params import SamplingParams
from pipeline.data import outputs, summary
from pipeline.data.openai_batch import FIELD_SETTINGS
from pipeline.settings import row_settings
from pipeline.settings.config import DecodingConfig, PipelineConfig
from pipeline.settings.sampling_settings import (
    GROUPED_SETTINGS,
    PARAMS_SETTINGS,
    RECORDED_SETTINGS,
    ROW_SETTING_KINDS,
    SAMPLING_SETTINGS,
    SETTING_NAMES,
)
from pipeline.worker import GenerationWorker

# A value for each setting that is no default, so that a place that drops one is seen.
NOT_DEFAULTS = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
                "presence_penalty": 0.3, "frequency_penalty": 0.4, "seed": 7, "max_new_tokens": 9, "n": 2,
                "structured_output": {"choice": ["yes", "no"]}, "logprobs": 2, "prompt_logprobs": 1,
                "stop": ["###"], "stop_token_ids": [3]}


def test_every_engine_setting_and_config_field_is_declared():
    assert len(set(SETTING_NAMES)) == len(SAMPLING_SETTINGS)
    assert set(PARAMS_SETTINGS) == {f.name for f in dataclasses.fields(SamplingParams)}
    config_fields = {f.name for f in dataclasses.fields(DecodingConfig)}
    assert set(SETTING_NAMES) <= config_fields
    assert set(NOT_DEFAULTS) == set(SETTING_NAMES)
    for name, value in NOT_DEFAULTS.items():
        assert getattr(DecodingConfig(), name) != value, name


def test_the_config_reaches_the_engine_with_every_setting():
    decoding = DecodingConfig(**{k: v for k, v in NOT_DEFAULTS.items() if k != "structured_output"})
    decoding.structured_output = NOT_DEFAULTS["structured_output"]
    worker = SimpleNamespace(cfg=PipelineConfig(decoding=decoding))
    params = GenerationWorker._config_params(worker)
    for name in PARAMS_SETTINGS:
        got, want = getattr(params, name), NOT_DEFAULTS[name]
        if name == "structured_output":
            assert got.to_dict() == want
        else:
            assert got == (tuple(want) if isinstance(want, list) else want), name


def test_a_row_may_set_each_declared_row_setting_and_the_engine_gets_it():
    assert row_settings.SETTING_KINDS == ROW_SETTING_KINDS and set(row_settings.SETTING_NAMES) == set(ROW_SETTING_KINDS)
    defaults = SamplingParams(temperature=1.0, seed=0)
    settings = {k: v for k, v in NOT_DEFAULTS.items() if k in ROW_SETTING_KINDS and k != "n"}
    params = row_settings.row_sampling_params(defaults, settings, seed_of=lambda base: base)
    for name, want in settings.items():
        got = getattr(params, name)
        assert (got.to_dict() if name == "structured_output" else got) == \
            (tuple(want) if isinstance(want, list) else want), name
    assert row_settings.row_sample_count(1, {"n": 2}, params) == 2
    assert set(FIELD_SETTINGS.values()) <= set(ROW_SETTING_KINDS)  # OpenAI batch fields map onto row settings


def test_recorded_settings_are_output_columns_and_grouped_ones_reach_the_summary():
    schema = outputs.OUTPUT_SCHEMA
    for name, arrow_type in RECORDED_SETTINGS.items():
        assert schema.field(name).type == arrow_type, name
    assert set(GROUPED_SETTINGS) <= set(RECORDED_SETTINGS)  # the summary groups rows by their columns
    assert set(GROUPED_SETTINGS) <= set(summary.STAT_COLUMNS)  # ... which the write tasks hand back
    config = {"decoding": dict(NOT_DEFAULTS)}
    assert summary.sampling_in_force(config) == NOT_DEFAULTS
