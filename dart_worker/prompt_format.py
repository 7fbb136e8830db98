"""Turning a user message (or a chat) into the target's prompt token ids.

A target with a chat template gets its template plus the generation prompt. A base model such
as the embedded default Gemma-3-270M has none; it gets a plain "User:/Assistant:" frame, which
base models continue as a reply far more often than a bare question. The same functions serve
the pipeline, the benchmarks and draft-head training, so that the draft head is trained on the
prompt distribution it is used with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PLAIN_TEMPLATE = "User: {message}\nAssistant:"
PLAIN_ROLES = {"user": "User", "assistant": "Assistant", "system": "System"}


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def format_user_prompt(tokenizer: Any, message: str, use_chat_template: bool = True) -> str:
    """The prompt text for one user `message`: the chat template if the tokenizer has one."""
    return format_messages(tokenizer, [{"role": "user", "content": message}], use_chat_template)


def format_messages(tokenizer: Any, messages: Sequence[dict], use_chat_template: bool = True) -> str:
    """Prompt text for a chat ending in a user turn, ready for the assistant's reply."""
    if not messages:
        raise ValueError("a chat prompt needs at least one message")
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"message {k} must be an object with a string 'content'")
        if message.get("role") not in PLAIN_ROLES:
            raise ValueError(f"message {k} has role {message.get('role')!r}; expected one of {sorted(PLAIN_ROLES)}")
    if use_chat_template and has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    lines = [f"{PLAIN_ROLES[m['role']]}: {m['content']}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


def encode_prompt(tokenizer: Any, text: str, templated: bool) -> list[int]:
    """Token ids of a formatted prompt; a chat template already carries the BOS token."""
    add_special = not (templated and has_chat_template(tokenizer))
    return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])
