"""How much memory a worker's KV cache can take: predicted before a job starts, not met as an OOM.

The target's cache (`dart_worker.target.kv_cache.GrowingCache`) keeps one row of buffers per live
sequence (at most `max_live`: finished rows are reused in place by joiners) and, per row, as many
slots as the longest live sequence needs plus its growth room (`kv_cache.buffer_slots`). A
sequence never holds more than its prompt, its new tokens and one verify block; prompts are
bounded by the target's context and by `input.max_prompt_chars` (a token is at least one
character), so

    bound = max_live x buffer_slots(min(context, prompt chars + new tokens) + tree rows)
            x layers x 2 (K and V) x KV heads x head dim x bytes per element

is what the cache can reach in the worst case, whatever the inputs. With bucketed verify shapes
(`dart_worker.target.shape_buckets`, the strategy on CUDA) a forward widens the cached context to its
bucket (up to 1.5x the tokens) and pads the block to its rows bucket, so there the bound is taken
over `context_bucket(min(context, prompt + new tokens)) + rows_bucket(tree rows)` slots. Its
padding sequences (the batch rounded up to its bucket) are capped at `max_live` with the live
ones, so the rows stay `max_live`.
`--dry-run` prints it for the configured target, dtype, device and `max_live`, with the figure at
a typical context beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from dart_worker.target.kv_cache import buffer_slots
from dart_worker.target.shape_buckets import context_bucket, rows_bucket


@dataclass(frozen=True)
class KVBudget:
    bytes_per_token: int  # K and V of every layer, one sequence, one position
    max_live: int
    context_tokens: int  # the most slots a row can hold (prompt + new tokens + verify block, bucketed)
    bound_bytes: int  # max_live rows of buffer_slots(context_tokens) slots
    bucketed: bool = False  # bucketed verify shapes (context and block padded to their buckets)

    def at(self, tokens: int) -> int:
        """Bytes of `max_live` rows at `tokens` tokens each (a typical job's, not the worst case)."""
        slots = context_bucket(tokens) if self.bucketed else tokens
        return self.max_live * buffer_slots(slots) * self.bytes_per_token


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """K and V bytes of one position of one sequence over every decoder layer of `config`."""
    text = config.get_text_config(decoder=True)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return 2 * int(text.num_hidden_layers) * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_budget(config: PretrainedConfig, dtype: torch.dtype, *, max_live: int, max_prompt_tokens: int,
              max_new_tokens: int, tree_rows: int, bucketed: bool = False) -> KVBudget:
    """The worst-case cache of `max_live` sequences (module doc); `bucketed`: the verify forward
    runs bucketed shapes (`dart_worker.hardware.kernels.shapes_for`)."""
    text = config.get_text_config(decoder=True)
    context = int(getattr(text, "max_position_embeddings", None) or 1 << 30)
    tokens = min(context, max_prompt_tokens + max_new_tokens)
    longest = context_bucket(tokens) + rows_bucket(tree_rows + 1) if bucketed else tokens + tree_rows + 1
    per_token = kv_bytes_per_token(config, dtype)
    return KVBudget(per_token, max_live, longest, max_live * buffer_slots(longest) * per_token, bucketed)
