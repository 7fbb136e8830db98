"""How much memory a worker's KV cache can take: predicted before a job starts, not met as an OOM.

The target's cache (`dart_worker.kv_cache.GrowingCache`) keeps one row of buffers per live
sequence (at most `max_live`: finished rows are reused in place by joiners) and, per row, as many
slots as the longest live sequence needs plus its growth room (`kv_cache.buffer_slots`). A
sequence never holds more than its prompt, its new tokens and one verify block; prompts are
bounded by the target's context and by `input.max_prompt_chars` (a token is at least one
character), so

    bound = max_live x buffer_slots(min(context, prompt chars + new tokens) + tree rows)
            x layers x 2 (K and V) x KV heads x head dim x bytes per element

is what the cache can reach in the worst case, whatever the inputs. `--dry-run` prints it for the
configured target, dtype and `max_live`, with the figure at a typical context beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from dart_worker.kv_cache import buffer_slots


@dataclass(frozen=True)
class KVBudget:
    bytes_per_token: int  # K and V of every layer, one sequence, one position
    max_live: int
    context_tokens: int  # the longest sequence a row can hold (prompt + new tokens + verify block)
    bound_bytes: int  # max_live rows of buffer_slots(context_tokens) slots

    def at(self, tokens: int) -> int:
        """Bytes of `max_live` rows at `tokens` tokens each (a typical job's, not the worst case)."""
        return self.max_live * buffer_slots(tokens) * self.bytes_per_token


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """K and V bytes of one position of one sequence over every decoder layer of `config`."""
    text = config.get_text_config(decoder=True)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return 2 * int(text.num_hidden_layers) * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_budget(config: PretrainedConfig, dtype: torch.dtype, *, max_live: int, max_prompt_tokens: int,
              max_new_tokens: int, tree_rows: int) -> KVBudget:
    """The worst-case cache of `max_live` sequences (module doc)."""
    text = config.get_text_config(decoder=True)
    context = int(getattr(text, "max_position_embeddings", None) or 1 << 30)
    longest = min(context, max_prompt_tokens + max_new_tokens) + tree_rows + 1
    per_token = kv_bytes_per_token(config, dtype)
    return KVBudget(per_token, max_live, longest, max_live * buffer_slots(longest) * per_token)
