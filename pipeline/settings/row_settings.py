"""Per-row sampling settings: optional input columns that override `decoding.*` for their row.

A dataset-generation input often carries its own limits and sampling settings per prompt (a long
answer here, a low temperature there, a row's own seed or stop strings). `input.settings_columns`
maps each setting to the input column that holds it (by default the column of the same name; null
ignores the setting). A row whose column is absent or null uses the config's value.

The readers (pipeline/data/inputs.py) only collect the raw values into the row's `settings` column, as
one JSON object (`encode_settings`), so the dataflow carries one string column whatever the input
format. The worker turns them into the row's `SamplingParams` (`row_sampling_params`), where every
value is checked: a bad value (a string temperature, top_p 2, a negative seed, a fractional
max_new_tokens) makes that row an error row naming the setting and the value, never a failed job,
and its neighbours in the batch decode as usual - rows with different settings share one
continuous batch (the engine warps each request with its own parameters).

The row's `seed` replaces `decoding.seed` in the per-row derivation (`pipeline.worker.row_seed`),
so the seed written to the output row reproduces it alone with the engine. The row's `n` (completions
of its prompt, `row_sample_count`) is checked here too; each completion's seed derives from the
row's (`dart_worker.sampling.params.sample_seed`), so sample 0 has the row's seed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dart_worker.sampling.structured_output import StructuredOutputError, check_syntax, parse_structured_output
from pipeline.settings.sampling_settings import PARAMS_SETTINGS, ROW_SETTING_KINDS

if TYPE_CHECKING:  # dart_worker.sampling.params imports torch; read tasks import this module (tests/test_layering.py)
    from dart_worker.sampling.params import SamplingParams

# Setting -> what it must hold (pipeline/settings/sampling_settings.py declares them). int settings accept
# integral floats (a Parquet writer that went through pandas stores an int column with nulls as
# float64), never bools or fractions; "structured" is a mapping with one of json / json_object /
# regex / choice / grammar, or its JSON text (dart_worker/sampling/structured_output.py), an invalid schema,
# regex or grammar being the row's error; `n` is the row's number of completions (row_sample_count).
SETTING_KINDS: dict[str, str] = ROW_SETTING_KINDS
SETTING_NAMES = tuple(SETTING_KINDS)
# Most completions one row may ask for: a row's n is input data, and n sequences (and output rows)
# per row are the worker's memory, so a hostile n must be an error row, not an out-of-memory worker.
MAX_SAMPLES = 1024


class SettingError(ValueError):
    """A row's setting cannot be used (the row becomes an error row with this message)."""


def default_settings_columns() -> dict[str, str | None]:
    """Each setting from the input column of its own name, when the input has it."""
    return {name: name for name in SETTING_NAMES}


def settings_columns(mapping: Mapping[str, str | None] | None) -> tuple[tuple[str, str], ...]:
    """(setting, column) pairs that are read, from `input.settings_columns` (None: the defaults)."""
    merged = default_settings_columns()
    merged.update(mapping or {})
    unknown = sorted(set(merged) - set(SETTING_NAMES))
    if unknown:
        raise ValueError(f"unknown per-row settings {unknown}; known: {list(SETTING_NAMES)}")
    return tuple((name, column) for name, column in merged.items() if column)


def encode_settings(values: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(JSON object of the non-null values, None) or (None, error) for a value JSON cannot hold.

    Called by the readers with {setting: raw value} for the setting columns present in the record.
    """
    present = {name: value for name, value in values.items() if value is not None}
    if not present:
        return None, None
    for name, value in present.items():
        if not _json_plain(value, mappings=SETTING_KINDS.get(name) == "structured"):
            return None, f"setting {name!r} holds a {type(value).__name__}, which no setting accepts"
    return json.dumps(present, ensure_ascii=False, allow_nan=True), None


def _json_plain(value: Any, mappings: bool = False) -> bool:
    """Can JSON hold `value` as it is? Mappings (with string keys) only where the setting takes one."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_json_plain(v, mappings) for v in value)
    if mappings and isinstance(value, Mapping):
        return all(isinstance(k, str) and _json_plain(v, mappings) for k, v in value.items())
    return False


def decode_settings(text: str | None) -> dict[str, Any]:
    """The row's settings column back as a dict ({} for a row without settings)."""
    if not text:
        return {}
    values = json.loads(text)
    if not isinstance(values, dict):
        raise SettingError(f"settings must be a JSON object, got {type(values).__name__}")
    return values


def checked_setting(name: str, value: Any) -> Any:
    """`value` as the type of setting `name`, or a SettingError naming both."""
    kind = SETTING_KINDS.get(name)
    if kind is None:
        raise SettingError(f"unknown setting {name!r}")
    if kind == "int":
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingError(f"setting {name!r} must be an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SettingError(f"setting {name!r} must be a number, got {value!r}")
        return float(value)
    if kind == "structured":
        try:
            constraint = parse_structured_output(value)
            check_syntax(constraint)
        except StructuredOutputError as exc:
            raise SettingError(f"setting {name!r}: {exc}") from None
        return constraint
    # strings: one stop string or a list of them
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise SettingError(f"setting {name!r} must be a non-empty string or a list of them, got {value!r}")
    return tuple(value)


def row_sampling_params(defaults: SamplingParams, settings: Mapping[str, Any], seed_of) -> SamplingParams:
    """The row's SamplingParams: `defaults` (the config's, seed = decoding.seed) with the row's
    settings applied; `seed_of(base_seed)` derives the request seed from the base seed in force
    (the row's or the config's). A bad value raises SettingError naming the setting."""
    values = {name: checked_setting(name, value) for name, value in settings.items()}
    values.pop("n", None)  # row_sample_count's
    base_seed = values.pop("seed", defaults.seed)
    if base_seed is not None and not 0 <= base_seed < 2**63:
        raise SettingError(f"setting 'seed' must be in [0, 2**63), got {base_seed}")
    fields = {name: getattr(defaults, name) for name in PARAMS_SETTINGS if name != "seed"}
    fields.update(values)
    try:
        return type(defaults)(seed=seed_of(base_seed), **fields)
    except (TypeError, ValueError) as exc:
        raise SettingError(f"row setting: {exc}") from None


def row_sample_count(default_n: int, settings: Mapping[str, Any], params: SamplingParams) -> int:
    """How many completions the row asks for: its `n` setting, else `default_n` (decoding.n).

    n > 1 with a greedy row is refused (a SettingError: the row becomes one error row): greedy
    decoding is deterministic, so its n samples would be n copies of one reply, which a user asking
    for n samples (rejection sampling, preference pairs) never wants written as n rows."""
    n = checked_setting("n", settings["n"]) if "n" in settings else default_n
    if not 1 <= n <= MAX_SAMPLES:
        raise SettingError(f"setting 'n' must be in [1, {MAX_SAMPLES}], got {n}")
    if n > 1 and params.is_greedy:
        raise SettingError(f"n={n} completions at temperature 0 would be {n} identical copies of the greedy "
                           "reply: give the row a temperature > 0 or n = 1")
    return n
