"""The Apertus chat format: conversations -> token ids and an assistant-only loss mask.

The format (Apertus tech report, arXiv 2509.14233, section 4.2.1; specification in
github swiss-ai/apertus-format, ``docs/format.md``; the plain-text path of the chat template of
``swiss-ai/Apertus-8B-Instruct-2509``) wraps every message in start and end control tokens and
adds a *developer* message that states the model's capabilities::

    <s><|system_start|>SYSTEM<|system_end|>
    <|developer_start|>Deliberation: disabled\\nTool Capabilities: disabled<|developer_end|>
    <|user_start|>USER<|user_end|><|assistant_start|>ASSISTANT<|assistant_end|> ...

(no newlines between the blocks; they are drawn here for reading). The twelve control tokens
have ids 61..72 in the Apertus tokenizer; the Mistral tekken vocabulary that Apertus derives from
(the one bundled with mistral-common) keeps exactly these ids as unused reserved slots
``<SPECIAL_61>`` .. ``<SPECIAL_72>``, so the ids are the same in both.

Two deliberate differences from the released template, both so that the same data always
gives the same tokens: a conversation without a system message gets no system block (the
released template inserts a default one that contains the current date), and every
conversation ends with ``</s>``, the end-of-document token pretraining uses, so that packed
conversations never attend to each other. ``</s>`` is outside the loss mask.

The loss mask is 1 exactly on the tokens the model must learn to produce: the content of every
assistant message and its ``<|assistant_end|>``. ``<|assistant_start|>`` is not in it: at
inference it is given (the generation prompt).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron.apertus.tokenizer.tokenizers import Tokenizer

CONTROL_TOKENS = {
    "<|system_start|>": 61,
    "<|system_end|>": 62,
    "<|developer_start|>": 63,
    "<|developer_end|>": 64,
    "<|user_start|>": 65,
    "<|user_end|>": 66,
    "<|assistant_start|>": 67,
    "<|assistant_end|>": 68,
    "<|inner_prefix|>": 69,
    "<|inner_suffix|>": 70,
    "<|tools_prefix|>": 71,
    "<|tools_suffix|>": 72,
}
"""Apertus control tokens and their ids (the Apertus tokenizer's ``added_tokens``)."""
ROLES = ("system", "user", "assistant")
DEVELOPER_MESSAGE = "Deliberation: disabled\nTool Capabilities: disabled"
"""What the released template states for a plain conversation (no reasoning, no tools)."""

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- '<|system_start|>' + messages[0]['content'] + '<|system_end|>' -}}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{{- '<|developer_start|>" + DEVELOPER_MESSAGE.replace("\n", "\\n") + "<|developer_end|>' -}}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '<|user_start|>' + message['content'] + '<|user_end|>' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|assistant_start|>' + message['content'] + '<|assistant_end|>' -}}"
    "{%- else -%}{{- raise_exception('unknown role: ' + message['role']) -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant_start|>' -}}{%- endif -%}"
)
"""The same format as a Hugging Face (Jinja) chat template, for exported tokenizers.
``apply_chat_template`` gives the ids of :func:`encode_conversation` without the final ``</s>``."""


class ConversationError(ValueError):
    """A conversation that cannot be rendered; the message says why."""


def control_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The control-token ids of ``tokenizer``; refuses one whose ids 61..72 are other tokens.

    Accepted: a vocabulary that names these ids with the Apertus names, or leaves them as the
    reserved ``<SPECIAL_n>`` slots of the Mistral tekken family.
    """
    for name, token_id in CONTROL_TOKENS.items():
        piece = tokenizer.special_piece(token_id)
        if piece not in (name, f"<SPECIAL_{token_id}>"):
            raise ValueError(
                f"the tokenizer's id {token_id} is {piece!r}, not the Apertus control token "
                f"{name} (nor a reserved <SPECIAL_{token_id}> slot): not an Apertus-family "
                "tokenizer"
            )
    return dict(CONTROL_TOKENS)


def check_messages(messages: object, what: str = "messages") -> list[dict[str, str]]:
    """A list of messages (``what`` names it in the error), checked: known roles, non-empty
    string contents, a system message only first; :class:`ConversationError` says why not."""
    if not isinstance(messages, list) or not messages:
        raise ConversationError(f"no {what!r} list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConversationError(f"message {i} is not an object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ConversationError(f"unknown role {role!r} in message {i}")
        if role == "system" and i > 0:
            raise ConversationError(f"system message at position {i} (only the first may be)")
        if not isinstance(content, str):
            raise ConversationError(
                f"content of message {i} ({role}) is " f"{type(content).__name__}, not a string"
            )
        if not content.strip():
            raise ConversationError(f"empty content in message {i} ({role})")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def parse_messages(record: object) -> list[dict[str, str]]:
    """The ``messages`` of one JSON record, checked; :class:`ConversationError` says why not."""
    if not isinstance(record, dict):
        raise ConversationError(f"not a JSON object but {type(record).__name__}")
    messages = check_messages(record.get("messages"))
    if not any(m["role"] == "assistant" for m in messages):
        raise ConversationError("no assistant message (nothing to learn)")
    return messages


def encode_conversation(
    tokenizer: Tokenizer, messages: Sequence[dict[str, str]], *, context: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int32, loss mask uint8) of one conversation, ending with ``</s>``.

    ``context``: the first ``context`` messages are a prompt whose assistant turns are given,
    not learned (prompt-completion data learns the completion only).
    Message contents are tokenized as text: a literal ``<|user_end|>`` in a message stays
    characters and can never close a turn.
    """
    ids, mask = [tokenizer.bos], [0]

    def add(tokens: list[int], learn: bool) -> None:
        ids.extend(tokens)
        mask.extend([int(learn)] * len(tokens))

    c = CONTROL_TOKENS
    first = 0
    if messages and messages[0]["role"] == "system":
        add(
            [c["<|system_start|>"], *tokenizer.encode(messages[0]["content"]), c["<|system_end|>"]],
            False,
        )
        first = 1
    add(
        [c["<|developer_start|>"], *tokenizer.encode(DEVELOPER_MESSAGE), c["<|developer_end|>"]],
        False,
    )
    for position, message in enumerate(messages[first:], start=first):
        role = message["role"]
        if role == "user":
            add(
                [c["<|user_start|>"], *tokenizer.encode(message["content"]), c["<|user_end|>"]],
                False,
            )
        elif role == "assistant":
            add([c["<|assistant_start|>"]], False)
            learned = [*tokenizer.encode(message["content"]), c["<|assistant_end|>"]]
            add(learned, position >= context)
        else:
            raise ConversationError(f"unknown role {role!r}")
    add([tokenizer.eod], False)
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)


def encode_text(
    tokenizer: Tokenizer, prompt: str, completion: str
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int32, loss mask uint8) of plain text, no chat template:
    ``<s> prompt completion </s>``, the prompt and the completion tokenized apart (so every
    completion of a prompt starts from the same prompt tokens). The completion and ``</s>`` are
    learned: without control tokens, ``</s>`` is how a text model learns to stop."""
    given = [tokenizer.bos, *(tokenizer.encode(prompt) if prompt else [])]
    learned = [*tokenizer.encode(completion), tokenizer.eod]
    mask = [0] * len(given) + [1] * len(learned)
    return np.asarray(given + learned, dtype=np.int32), np.asarray(mask, dtype=np.uint8)


def loss_mask_prefix(prefix: str) -> str:
    """Where the loss mask of the chat dataset at ``prefix`` lives (same document lengths)."""
    return f"{prefix}_loss_mask"


def quantile_prefix(prefix: str) -> str:
    """Where the reward quantiles of the alignment dataset at ``prefix`` live (QRPO)."""
    return f"{prefix}_quantile"


def ref_logp_prefix(prefix: str) -> str:
    """Where precomputed reference log-probabilities of the dataset at ``prefix`` live."""
    return f"{prefix}_ref_logp"
