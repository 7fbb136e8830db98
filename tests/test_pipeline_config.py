"""The pipeline config: schema errors and value errors surface before any work, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from pipeline.settings.config import ConfigError, from_dict, load_config, to_dict

MINIMAL = "input:\n  urls: [prompts.jsonl]\noutput:\n  url: out/\n"


@pytest.fixture
def minimal(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(MINIMAL)
    return path


def test_defaults_and_overrides(minimal):
    cfg = load_config(minimal, ["decoding.mode=chain", "resources.batch_size=8", "decoding.stop_token_ids=[5,6]"])
    assert cfg.decoding.mode == "chain" and cfg.resources.batch_size == 8
    assert cfg.decoding.stop_token_ids == [5, 6]
    assert cfg.model.target == "default" and cfg.decoding.tree.budget == 60
    assert from_dict(to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["decoding.modee=ar"], "decoding.modee"),
        (["decoding.temperature=hot"], "decoding.temperature"),
        (["decoding.mode=beam"], "decoding.mode: must be one of"),
        (["decoding.temperature=-1"], "decoding.temperature: must be >= 0"),
        (["decoding.top_p=0"], "decoding.top_p"),
        (["input.format=csv"], "input.format"),
        (["input.messages_column=messages"], "set exactly one of input.prompt_column"),
        (["resources.min_workers=2"], "set both min_workers and max_workers"),
        (["resources.min_workers=3", "resources.max_workers=2"], "min_workers <= max_workers"),
        (["model.draft_head=null"], "needs a draft head"),
        (["model.trie=null"], "needs an N-gram trie"),
        (["run.run_id=a/b"], "run.run_id"),
        (["model.tap_layers=[1,2]"], "model.tap_layers"),
        (["decoding.stop=['User:','']"], "decoding.stop: stop strings must not be empty"),
    ],
)
def test_bad_values_are_clear_errors(minimal, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(minimal, overrides)


def test_missing_required_values(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("input:\n  urls: [a.jsonl]\n")
    with pytest.raises(ConfigError, match=r"output\.url"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_unparsable_yaml_is_a_config_error(tmp_path, minimal):
    """YAML that cannot parse (syntax, an escaped lone surrogate, bytes that are not UTF-8) is a ConfigError too."""
    cases = {"syntax.yaml": b"input: {urls: [a]\noutput: {url: o}\n",
             "surrogate.yaml": MINIMAL.encode() + b'decoding: {stop: ["x\\udcff"]}\n',
             "latin1.yaml": MINIMAL.encode() + b"run: {run_id: caf\xe9}\n"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match=rf"invalid config: cannot parse {tmp_path / name}: "):
            load_config(tmp_path / name)
    with pytest.raises(ConfigError, match=r"invalid config: cannot parse an override: .*invalid Unicode"):
        load_config(minimal, ['decoding.stop=["a\\udcffb"]'])


def test_several_problems_are_reported_together(minimal):
    with pytest.raises(ConfigError) as err:
        load_config(minimal, ["decoding.top_k=-1", "resources.batch_size=0"])
    assert "decoding.top_k" in str(err.value) and "resources.batch_size" in str(err.value)


def test_ar_needs_neither_head_nor_trie(minimal):
    cfg = load_config(minimal, ["decoding.mode=ar", "model.draft_head=null", "model.trie=null"])
    assert cfg.model.draft_head is None


def test_shipped_configs_validate():
    configs = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    # Pipeline configs are the ones whose `input` is a section (other jobs use other schemas).
    pipeline_configs = [c for c in configs if isinstance(OmegaConf.load(c).get("input"), DictConfig)]
    assert pipeline_configs
    for path in pipeline_configs:
        load_config(path)


def test_max_live_is_null_or_within_the_batch(minimal):
    assert load_config(minimal, ["resources.batch_size=8", "resources.max_live=3"]).resources.max_live == 3
    assert load_config(minimal, []).resources.max_live is None
    for bad in ("0", "9"):
        with pytest.raises(ConfigError, match=r"resources.max_live: must be null \(= batch_size\) or between 1"):
            load_config(minimal, ["resources.batch_size=8", f"resources.max_live={bad}"])
