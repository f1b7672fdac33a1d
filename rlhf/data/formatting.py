"""Turning a row's columns into prompt and response text, as OpenRLHF's SFT and reward datasets do.

With `--apply_chat_template` the tokenizer's chat template (or `--tokenizer_chat_template`) renders
message lists: the prompt is the conversation before the answer with a generation prompt, the response
is what rendering the answer appends after it. A column holding a plain string becomes one user turn
(prompt) or one assistant turn (response). Without it the prompt is the raw text passed through
`--input_template` and the response is the raw text. This module knows nothing of tokens or masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class ChatTemplate:
    """Renders message lists to text with `tokenizer`'s chat template, or `template` when given
    (`--tokenizer_chat_template`; the tokenizer itself is left unchanged)."""

    tokenizer: Any
    template: str | None = None

    def render(self, messages: Messages, *, add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  chat_template=self.template)


def make_chat_template(tokenizer, apply_chat_template: bool,
                       tokenizer_chat_template: str | None) -> ChatTemplate | None:
    """The renderer for `--apply_chat_template` (None without it); a ValueError when the tokenizer has no
    chat template and none is given."""
    if not apply_chat_template:
        return None
    if not tokenizer_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("--apply_chat_template: the tokenizer has no chat template; pass one with "
                         "--tokenizer_chat_template or drop --apply_chat_template")
    return ChatTemplate(tokenizer, tokenizer_chat_template or None)


def check_input_template(input_template: str | None) -> None:
    """`--input_template` must have one `{}` where the input text goes."""
    if input_template is not None and "{}" not in input_template:
        raise ValueError(f"--input_template {input_template!r} has no {{}} where the input text goes; add one "
                         "(e.g. 'User: {}\\nAssistant: ')")


def as_text(value: Any, where: str, key: str, flag: str) -> str:
    """`value` when it is a string, else a ValueError naming the row and column."""
    if not isinstance(value, str):
        raise ValueError(f"{where}: column {key!r} ({flag}) holds {type(value).__name__}, not text; "
                         "use --apply_chat_template for message lists")
    return value


def as_messages(value: Any, role: str, where: str, key: str) -> Messages:
    """A message list: `value` itself when it is one, or a single `role` turn when it is a string."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        return list(value)
    raise ValueError(f"{where}: column {key!r} holds {type(value).__name__}; with --apply_chat_template it must be "
                     "text or a list of messages ({'role': ..., 'content': ...})")


def _continuation(chat: ChatTemplate, prefix: str, messages: Messages, where: str) -> str:
    """The text rendering `messages` adds after `prefix` (the rendering of their start)."""
    full = chat.render(messages)
    if not full.startswith(prefix):
        raise ValueError(f"{where}: the chat template renders the conversation so that it does not start with the "
                         f"rendered prompt (it ends {prefix[-40:]!r}, the conversation has "
                         f"{full[max(0, len(prefix) - 40):len(prefix)]!r} there); the "
                         "response cannot be cut out; fix the template (--tokenizer_chat_template)")
    return full[len(prefix):]


def prompt_text(value: Any, *, input_template: str | None, chat: ChatTemplate | None, where: str, key: str,
                flag: str) -> str:
    """The prompt: with `chat`, the messages rendered with a generation prompt; else the text through
    `input_template`."""
    if chat is not None:
        return chat.render(as_messages(value, "user", where, key), add_generation_prompt=True)
    text = as_text(value, where, key, flag)
    return input_template.format(text) if input_template else text


def response_text(prompt_value: Any, prompt: str, value: Any, *, chat: ChatTemplate | None, where: str,
                  key: str, flag: str) -> str:
    """The response after `prompt` (made by `prompt_text` from `prompt_value`): with `chat`, what the
    answer's turns add to the rendered conversation; else the raw text."""
    if chat is None:
        return as_text(value, where, key, flag)
    messages = as_messages(prompt_value, "user", where, key) + as_messages(value, "assistant", where, key)
    return _continuation(chat, prompt, messages, where)


def conversation_text(value: Any, *, chat: ChatTemplate | None, where: str, key: str, flag: str) -> str:
    """A whole conversation as one text (reward data without a prompt column): rendered with `chat`,
    else the raw text."""
    if chat is None:
        return as_text(value, where, key, flag)
    return chat.render(as_messages(value, "assistant", where, key))


def split_last_turn(messages: Messages, chat: ChatTemplate, where: str) -> tuple[str, str]:
    """(prompt, response) of a conversation: all turns but the last rendered with a generation prompt,
    and what the last turn adds."""
    prompt = chat.render(messages[:-1], add_generation_prompt=True)
    return prompt, _continuation(chat, prompt, messages, where)


def assistant_turns(messages: Messages, chat: ChatTemplate, where: str) -> list[tuple[str, str]]:
    """(text before, text of) each assistant turn: the conversation up to it rendered with a generation
    prompt, and what the turn adds (OpenRLHF's `--multiturn` response ranges)."""
    turns = []
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            before = chat.render(messages[:i], add_generation_prompt=True)
            turns.append((before, _continuation(chat, before, messages[:i + 1], where)))
    return turns
