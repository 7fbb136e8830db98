"""Turning a user message (or a chat) into the target's prompt token ids.

A target with a chat template gets its template plus the generation prompt. A base model such
as the embedded default Gemma-3-270M has none; it gets a plain "User:/Assistant:" frame, which
base models continue as a reply far more often than a bare question. The same functions serve
the pipeline, the benchmarks and draft-head training, so that the draft head is trained on the
prompt distribution it is used with.

`PromptEncoder` is how the pipeline encodes input rows: text that comes from a row (a prompt, a
message's content) stays text even where it spells a special token such as `<start_of_turn>` or
`<eos>`, while the chat template's own markers stay control tokens. A tokenizer called on the
rendered prompt would parse every special-token string wherever it appears, so scraped or user
text holding one would end the prompt early, fake a turn or inject instructions (issue #32).
`parse_special_tokens=True` restores that parsing for prompts formatted for the target already.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
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


# A character no special-token string holds and no template trims (str.strip keeps it): it stands in
# for the special-token strings of the row's text while finding where the template's own markers are.
_FILL = "\x01"


class PromptEncoder:
    """Token ids of input rows' prompts, with the rows' text tokenized as text.

    Rows whose text holds no special-token string get exactly the ids `encode_prompt` gives (one
    tokenizer call on the rendered prompt). For the others, the prompt is rendered twice: as is,
    and with each special-token string of the text replaced by as many `_FILL` characters. The
    special tokens the tokenizer finds in the second rendering are the template's markers; the
    prompt is cut at them and every piece between is tokenized with special-token parsing off
    (`split_special_tokens`), so only the markers become control tokens. A template that renders
    the two differently except at those characters (it rewrites the content) leaves no safe cut:
    that row is refused with a ValueError (its error row says why) rather than encoded unsafely.
    """

    def __init__(self, tokenizer: Any, use_chat_template: bool = True, parse_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template
        self.parse_special_tokens = parse_special_tokens
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_ids = frozenset(i for i, t in decoder.items() if getattr(t, "special", False))
        self.special_ids |= frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        # id -> the text that spells it: a special id whose span in the text says something else
        # (the unknown token standing for a word the vocabulary lacks) is not a special-token string
        self._spelling = {i: str(getattr(decoder.get(i), "content", None) or tokenizer.convert_ids_to_tokens(i))
                          for i in self.special_ids}
        self._pattern: re.Pattern | None = None

    def encode_text(self, prompt: str) -> list[int]:
        """One user message (the chat template, or the plain frame if the target has none); with
        `use_chat_template` off, the prompt as it is."""
        if self.use_chat_template:
            return self._encode([prompt], lambda c: format_user_prompt(self.tokenizer, c[0]), templated=True)
        return self._encode([prompt], lambda c: c[0], templated=False)

    def encode_messages(self, messages: Sequence[dict]) -> list[int]:
        """A chat ending in a user turn (format_messages), ready for the assistant's reply."""
        format_messages(self.tokenizer, messages, self.use_chat_template)  # validates roles and contents

        def render(contents: list[str]) -> str:
            chat = [{**m, "content": c} for m, c in zip(messages, contents)]
            return format_messages(self.tokenizer, chat, self.use_chat_template)

        return self._encode([m["content"] for m in messages], render, templated=True)

    # ------------------------------------------------------------------------------ internals

    def _encode(self, contents: list[str], render: Callable[[list[str]], str], templated: bool) -> list[int]:
        text = render(contents)
        spans = [] if self.parse_special_tokens else [self.special_spans(c) for c in contents]
        if not any(spans):
            return encode_prompt(self.tokenizer, text, templated)
        masked = render([_masked(c, s) for c, s in zip(contents, spans)])
        if len(masked) != len(text) or any(a != b and b != _FILL for a, b in zip(text, masked)):
            raise ValueError("the chat template rewrites message text that holds special-token strings, so "
                             "that text cannot be kept apart from the template's markers; remove them from the "
                             "row, or set input.parse_special_tokens=true to read them as control tokens")
        add_special = not (templated and has_chat_template(self.tokenizer))
        markers = self.special_spans(masked)  # the template's own: the row's text is masked there
        if not markers:
            return self._as_text(text, add_special)
        if add_special:  # a prompt with template markers carries its own BOS; never both
            raise ValueError("internal: a formatted prompt with template markers and added special tokens")
        ids: list[int] = []
        position = 0
        for start, end, token_id in markers:
            ids += self._as_text(text[position:start], False)
            ids.append(token_id)
            position = end
        return ids + self._as_text(text[position:], False)

    def _as_text(self, text: str, add_special: bool) -> list[int]:
        if not text and not add_special:
            return []
        return list(self.tokenizer(text, add_special_tokens=add_special, split_special_tokens=True)["input_ids"])

    def special_spans(self, text: str) -> list[tuple[int, int, int]]:
        """(start, end, token id) of every special-token string the tokenizer finds in `text`."""
        if not self.special_ids or not text:
            return []
        if getattr(self.tokenizer, "is_fast", False):
            encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            return [(start, end, token_id) for token_id, (start, end)
                    in zip(encoded["input_ids"], encoded["offset_mapping"])
                    if token_id in self.special_ids and text[start:end] == self._spelling[token_id]]
        if self._pattern is None:  # a Python tokenizer has no offsets: find the strings themselves
            strings = sorted(set(self._spelling.values()), key=len, reverse=True)
            self._pattern = re.compile("|".join(re.escape(s) for s in strings if s))
        ids = {spelling: i for i, spelling in self._spelling.items()}
        return [(m.start(), m.end(), ids[m.group()]) for m in self._pattern.finditer(text)]


def _masked(text: str, spans: list[tuple[int, int, int]]) -> str:
    """`text` with each span replaced by as many _FILL characters."""
    if not spans:
        return text
    pieces, position = [], 0
    for start, end, _ in spans:
        pieces += [text[position:start], _FILL * (end - start)]
        position = end
    return "".join([*pieces, text[position:]])
