"""Turning a user message into the target's prompt text.

A target with a chat template gets its template (one user turn plus the generation prompt).
A base model such as the embedded default Gemma-3-270M has none; it gets a plain
"User:/Assistant:" frame, which base models continue as a reply far more often than a bare
question. The same function serves the pipeline, the benchmarks and draft-head training, so
that the draft head is trained on the prompt distribution it is used with.
"""

from __future__ import annotations

from typing import Any

PLAIN_TEMPLATE = "User: {message}\nAssistant:"


def format_user_prompt(tokenizer: Any, message: str, use_chat_template: bool = True) -> str:
    """The prompt text for one user `message`: the chat template if the tokenizer has one."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
    return PLAIN_TEMPLATE.format(message=message)
