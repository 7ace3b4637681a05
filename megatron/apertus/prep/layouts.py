"""TRL's dataset layouts, read into a prompt and its completions for the chat and preference
tools (``tools/preprocess_chat.py``, ``tools/preprocess_preferences.py``).

TRL (Hugging Face's post-training library, "Dataset formats and types") tells a dataset's
*format*, standard (plain text) or conversational (lists of ``{"role", "content"}``
messages), from its *type*, named by its fields: language modelling (``text`` / ``messages``),
prompt-completion (``prompt``, ``completion``) and preference (``prompt``, ``chosen``,
``rejected``, or with an implicit prompt ``chosen`` and ``rejected`` alone, each the whole
sequence: the prompt is what they share at the start).

How each is rendered (docs/post_training.md):

* conversational: in the Apertus chat format (:func:`~megatron.apertus.data.chat.encode_conversation`);
  a completion is one assistant message. A string completion after a message-list prompt is
  that message's content (the layout these tools read before TRL's).
* standard: as plain text, no chat template, as TRL tokenizes it
  (:func:`~megatron.apertus.data.chat.encode_text`).

The loss covers the completion only (prompt-completion and preference); an implicit text
prompt ends where the shared text's last run of whitespace starts, so that each completion
begins at a word (" blue." and " green." after "The sky is").
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from megatron.apertus.data.chat import (
    ConversationError,
    check_messages,
    encode_conversation,
    encode_text,
)
from megatron.apertus.tokenizer.tokenizers import Tokenizer

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Completions:
    """A prompt and its completions, all text or all messages (one assistant message each)."""

    prompt: str | Messages
    completions: tuple[str | Messages, ...]

    def encode(self, tokenizer: Tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, completion-only loss mask) of the prompt followed by each completion."""
        if isinstance(self.prompt, str):
            return [encode_text(tokenizer, self.prompt, c) for c in self.completions]
        return [
            encode_conversation(tokenizer, [*self.prompt, *c], context=len(self.prompt))
            for c in self.completions
        ]


def _value(record: dict, key: str) -> str | list:
    """A field that is a non-empty string or a list (of messages, checked by the caller)."""
    if key not in record:
        raise ConversationError(f"missing {key!r}")
    value = record[key]
    if isinstance(value, str):
        if not value.strip():
            raise ConversationError(f"empty {key!r}")
        return value
    if isinstance(value, list):
        return value
    raise ConversationError(f"{key!r} is {type(value).__name__}, not a string")


def _check_prompt(prompt: object) -> Messages:
    """A message-list prompt: it needs a user turn and must end with one."""
    if prompt == []:
        raise ConversationError("empty prompt (it needs a user turn)")
    if any(not isinstance(m, dict) for m in prompt):
        raise ConversationError("the prompt must be a list of message objects")
    messages = check_messages(prompt, "prompt")
    if not any(m["role"] == "user" for m in messages):
        raise ConversationError("no user turn in the prompt")
    if messages[-1]["role"] != "user":
        raise ConversationError("the prompt must end with a user turn")
    return messages


def _reply(value: str | list, key: str) -> Messages:
    """A completion after a message-list prompt: one assistant message."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    messages = check_messages(value, key)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        roles = ", ".join(m["role"] for m in messages)
        raise ConversationError(f"{key!r} must be one assistant message, not [{roles}]")
    return messages


def explicit(record: dict, keys: tuple[str, ...]) -> Completions:
    """``prompt`` and the completions under ``keys``: text and text, or a message-list prompt
    and one assistant message (or its content) each."""
    prompt = record.get("prompt")
    if prompt is None:
        raise ConversationError("no 'prompt' (text or a list of messages)")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ConversationError("empty prompt")
        values = [_value(record, key) for key in keys]
        for key, value in zip(keys, values):
            if not isinstance(value, str):
                raise ConversationError(f"{key!r} is a list of messages but the prompt is text")
        return Completions(prompt, tuple(values))
    if not isinstance(prompt, list):
        raise ConversationError(f"'prompt' is {type(prompt).__name__}, not text or messages")
    messages = _check_prompt(prompt)
    return Completions(messages, tuple(_reply(_value(record, key), key) for key in keys))


def _shared_text(chosen: str, rejected: str) -> Completions:
    shared = os.path.commonprefix([chosen, rejected])
    cut = len(shared)
    while cut and not shared[cut - 1].isspace():
        cut -= 1
    while cut and shared[cut - 1].isspace():
        cut -= 1
    if not shared[:cut].strip():
        raise ConversationError("chosen and rejected share no prompt (no common first words)")
    return Completions(shared[:cut], (chosen[cut:], rejected[cut:]))


def _shared_messages(chosen: list, rejected: list) -> Completions:
    chosen, rejected = check_messages(chosen, "chosen"), check_messages(rejected, "rejected")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise ConversationError("chosen and rejected share no prompt (their first messages differ)")
    prompt = _check_prompt(chosen[:shared])
    replies = []
    for key, messages in (("chosen", chosen), ("rejected", rejected)):
        if len(messages) == shared:
            raise ConversationError(f"{key!r} has no reply after the prompt both share")
        if len(messages) - shared > 1:
            raise ConversationError(
                "chosen and rejected differ before their last message (the implicit prompt is "
                "what they share)"
            )
        replies.append(_reply(messages[shared:], key))
    return Completions(prompt, tuple(replies))


def implicit(record: dict) -> Completions:
    """TRL's implicit prompt: ``chosen`` and ``rejected`` are whole sequences, both text or
    both conversations, and the prompt is what they share at the start."""
    chosen, rejected = _value(record, "chosen"), _value(record, "rejected")
    if chosen == rejected:
        raise ConversationError("chosen and rejected are identical")
    if isinstance(chosen, str) and isinstance(rejected, str):
        return _shared_text(chosen, rejected)
    if isinstance(chosen, list) and isinstance(rejected, list):
        return _shared_messages(chosen, rejected)
    raise ConversationError("one of chosen and rejected is text, the other a list of messages")


def preference(record: dict, keys: tuple[str, ...]) -> Completions:
    """A preference line (DPO: ``keys`` chosen, rejected) or a rewarded completion (QRPO:
    ``keys`` completion), with an explicit prompt; DPO also with an implicit one."""
    if "prompt" not in record and keys == ("chosen", "rejected"):
        return implicit(record)
    return explicit(record, keys)
