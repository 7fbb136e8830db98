"""The DART draft head's shape and hyper-parameters: its checkpoint's config.json, parsed and checked.

Published DART/EAGLE-3 configs omit some keys and name others the transformers-5 way; `from_dict`
fills them as the reference loaders do, keeps keys it does not use (so load -> save round-trips
them), and rejects an inconsistent shape with a `DraftHeadConfigError` naming the field, before
any weight is read. The head (`draft_head.DartDraftHead`) is built from a parsed config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from transformers import LlamaConfig, PretrainedConfig
from transformers.activations import ACT2FN


class DraftHeadConfigError(ValueError):
    """A draft-head config.json that is incomplete or inconsistent."""


# Fields a published config may omit, with the value the reference DART/EAGLE-3 loaders then use.
_DEFAULTS_FROM_REFERENCE = {
    "rope_theta": 10000.0,  # reference: getattr(config, "rope_theta", 10000)
    "rope_scaling": None,
    "hidden_act": "silu",  # LlamaConfig default
}


# Fields a config.json may omit without a reference default (None = "as the reference").
_OPTIONAL_FIELDS = ("tap_layers",)


@dataclass
class DraftHeadConfig:
    """Shape and hyper-parameters of a DART draft head, stored as the checkpoint's config.json.

    `extras` keeps keys of a published config that this code does not use (architectures,
    torch_dtype, ...), so that load -> save round-trips them; it is not part of the architecture.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    draft_length: int
    draft_vocab_size: int
    target_hidden_size: int
    # Target layers whose inputs the head reads (low, mid, high). Published heads omit it: they
    # were trained on the reference taps (`default_tap_layers`), which is what None means.
    tap_layers: list[int] | None = None
    extras: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "draft_length",
                     "draft_vocab_size", "target_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DraftHeadConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise DraftHeadConfigError(f"{name} must be a positive number, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DraftHeadConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise DraftHeadConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise DraftHeadConfigError(
                f"draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size})")
        if self.hidden_act not in ACT2FN:
            raise DraftHeadConfigError(f"unknown hidden_act {self.hidden_act!r}")
        if self.tap_layers is not None:
            taps = self.tap_layers
            if (not isinstance(taps, (list, tuple)) or len(taps) != 3
                    or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in taps)):
                raise DraftHeadConfigError(f"tap_layers must list 3 layer indices >= 0, got {taps!r}")
            self.tap_layers = list(taps)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise DraftHeadConfigError(f"rope_scaling must be null or an object, got {self.rope_scaling!r}")

    @property
    def num_rows(self) -> int:
        """D = draft_length + 1 rows of logits per proposal."""
        return self.draft_length + 1

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftHeadConfig:
        """Parse a config.json object. Unknown keys go to `extras`; a missing required key is an error.

        Optional keys follow the reference loaders: head_dim = hidden_size // num_attention_heads,
        num_key_value_heads = num_attention_heads, target_hidden_size = hidden_size, rope_theta =
        10000, rope_scaling = null, hidden_act = silu. A transformers>=5 style `rope_parameters`
        object is read when `rope_theta` is absent.
        """
        if not isinstance(data, dict):
            raise DraftHeadConfigError(f"config must be a JSON object, got {type(data).__name__}")
        names = [f.name for f in fields(cls) if f.name != "extras"]
        values = {name: data[name] for name in names if name in data}
        values.update({k: v for k, v in _DEFAULTS_FROM_REFERENCE.items() if k not in values})
        rope_parameters = data.get("rope_parameters")
        if "rope_theta" not in data and isinstance(rope_parameters, dict):
            params = dict(rope_parameters)
            values["rope_theta"] = params.pop("rope_theta", _DEFAULTS_FROM_REFERENCE["rope_theta"])
            if "rope_scaling" not in data and params.get("rope_type", "default") != "default":
                values["rope_scaling"] = params
        if "num_attention_heads" in values:
            values.setdefault("num_key_value_heads", values["num_attention_heads"])
            if "hidden_size" in values and "head_dim" not in values:
                heads, hidden = values["num_attention_heads"], values["hidden_size"]
                if isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
                    values["head_dim"] = hidden // heads
        if "hidden_size" in values:
            values.setdefault("target_hidden_size", values["hidden_size"])
        missing = [name for name in names if name not in values and name not in _OPTIONAL_FIELDS]
        if missing:
            raise DraftHeadConfigError(f"config is missing required field(s) {missing}")
        extras = {k: v for k, v in data.items() if k not in names}
        return cls(**values, extras=extras)

    def to_dict(self) -> dict[str, Any]:
        """The config.json object: kept unknown keys first, then every field of the architecture."""
        data = dict(self.extras)
        data.update({k: v for k, v in asdict(self).items()
                     if k != "extras" and not (k in _OPTIONAL_FIELDS and v is None)})
        return data

    def llama_config(self) -> LlamaConfig:
        """A LlamaConfig of the draft layer, so transformers' RoPE variants and MLP apply unchanged."""
        try:
            return LlamaConfig(
                vocab_size=self.vocab_size,
                hidden_size=self.hidden_size,
                intermediate_size=self.intermediate_size,
                num_hidden_layers=1,
                num_attention_heads=self.num_attention_heads,
                num_key_value_heads=self.num_key_value_heads,
                head_dim=self.head_dim,
                hidden_act=self.hidden_act,
                max_position_embeddings=self.max_position_embeddings,
                rms_norm_eps=self.rms_norm_eps,
                rope_theta=float(self.rope_theta),
                rope_scaling=dict(self.rope_scaling) if self.rope_scaling is not None else None,
            )
        except Exception as exc:  # transformers raises several types for a bad rope dict
            raise DraftHeadConfigError(f"transformers rejects this draft config: {exc}") from exc


def target_text_config(target_config: PretrainedConfig) -> PretrainedConfig:
    """The decoder text config of a target (itself for text-only models)."""
    get_text_config = getattr(target_config, "get_text_config", None)
    return get_text_config() if get_text_config is not None else target_config
