"""The sampling settings, declared once: every other list of them in the pipeline is derived here.

A setting is a field of `decoding.*` (pipeline/settings/config.py, where its default and meaning are
documented) and, for most, of the engine's SamplingParams. What differs is where else it goes:
whether a row may set its own (`input.settings_columns`, checked by pipeline/settings/row_settings.py),
whether every output row records the value it decoded with (a column of the same name,
pipeline/data/outputs.py), and whether the job summary reports tau per distinct value (pipeline/
summary.py). Those lists were spelled out by hand in seven places; a setting added to one and
not another was silently dropped (tests/test_sampling_settings.py ties them together now).

Import-light (no torch): read tasks and the driver import it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa


@dataclass(frozen=True)
class SamplingSetting:
    """One sampling setting and where it goes besides `decoding.<name>`.

    kind: what a row's value must hold (pipeline/row_settings.checked_setting), None when rows
    cannot set it; column: the Arrow type of the output column recording it, None when rows do not
    record it; in_params: a field of dart_worker.sampling.params.SamplingParams (`n` is not: it is how many
    requests a row becomes); grouped: the summary reports tau per distinct value.
    """

    name: str
    kind: str | None
    column: pa.DataType | None = None
    in_params: bool = True
    grouped: bool = False


# In output-column order: the Parquet schema lists the recorded ones in this order.
SAMPLING_SETTINGS: tuple[SamplingSetting, ...] = (
    SamplingSetting("temperature", "float", pa.float64(), grouped=True),
    SamplingSetting("top_p", "float", pa.float64(), grouped=True),
    SamplingSetting("top_k", "int", pa.int64(), grouped=True),
    SamplingSetting("min_p", "float", pa.float64(), grouped=True),
    SamplingSetting("repetition_penalty", "float", pa.float64(), grouped=True),
    SamplingSetting("presence_penalty", "float", pa.float64(), grouped=True),
    SamplingSetting("frequency_penalty", "float", pa.float64(), grouped=True),
    SamplingSetting("seed", "int", pa.int64()),
    SamplingSetting("max_new_tokens", "int", pa.int64()),
    SamplingSetting("n", "int", pa.int64(), in_params=False),
    # the row's constraint as JSON ({"json": ...}), or null; a row's value is a mapping or its JSON text
    SamplingSetting("structured_output", "structured", pa.string()),
    SamplingSetting("logprobs", "int"),
    SamplingSetting("prompt_logprobs", "int"),
    SamplingSetting("stop", "strings"),
    SamplingSetting("stop_token_ids", None),  # the config's only: token ids are the target's, not a row's
)

# Every setting's name, in the order above.
SETTING_NAMES = tuple(s.name for s in SAMPLING_SETTINGS)
# Settings a row may set, and what each must hold.
ROW_SETTING_KINDS: dict[str, str] = {s.name: s.kind for s in SAMPLING_SETTINGS if s.kind is not None}
# Settings every output row records, with their Arrow types (output columns of the same names).
RECORDED_SETTINGS: dict[str, pa.DataType] = {s.name: s.column for s in SAMPLING_SETTINGS if s.column is not None}
# SamplingParams fields among the settings.
PARAMS_SETTINGS = tuple(s.name for s in SAMPLING_SETTINGS if s.in_params)
# Settings the summary reports tau per distinct value of: speculation pays differently per temperature.
GROUPED_SETTINGS = tuple(s.name for s in SAMPLING_SETTINGS if s.grouped)
