"""Chat datasets from JSON lines, for :func:`megatron.apertus.prep.preprocess.preprocess`
(``tools/preprocess_chat.py``): one example per line in any of TRL's SFT layouts
(:mod:`megatron.apertus.prep.layouts`), checked in this order:

* ``{"messages": [...]}``: a conversation in the Apertus chat format of
  :mod:`megatron.apertus.data.chat`, every assistant turn learned;
* ``{"prompt": P, "completion": C}``: a message-list prompt and one assistant message (or its
  text), or both text (plain text, no chat template); the completion alone is learned;
* ``{"text": "..."}``: plain text, all of it learned (language modelling).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import numpy as np

from megatron.apertus.data.chat import (
    ConversationError,
    control_token_ids,
    encode_conversation,
    encode_text,
    loss_mask_prefix,
    parse_messages,
)
from megatron.apertus.flags import flag_help, require
from megatron.apertus.prep.layouts import explicit
from megatron.apertus.prep.preprocess import decode_line
from megatron.apertus.tokenizer.tokenizers import Tokenizer


@dataclass(kw_only=True, frozen=True)
class ChatOptions:
    """``tools/preprocess_chat.py``'s flag beyond the corpus's: :class:`ChatEncoder`'s limit."""

    max_tokens: Optional[int] = flag_help(
        "skip conversations longer than this many tokens (e.g. --seq-length)", None, ours=True
    )

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            require(self.max_tokens >= 2, "--max-tokens", self.max_tokens, ">= 2")


def encode_sft(tokenizer: Tokenizer, record: object) -> tuple[np.ndarray, np.ndarray]:
    """(ids, loss mask) of one SFT line in the first layout whose field it has."""
    if not isinstance(record, dict):
        raise ConversationError(f"not a JSON object but {type(record).__name__}")
    if "messages" in record:
        return encode_conversation(tokenizer, parse_messages(record))
    if "prompt" in record:
        (pair,) = explicit(record, ("completion",)).encode(tokenizer)
        return pair
    if "text" in record:
        text = record["text"]
        if not isinstance(text, str) or not text.strip():
            raise ConversationError("'text' is not a non-empty string")
        return encode_text(tokenizer, "", text)
    raise ConversationError("no 'messages', 'prompt' or 'text' field")


class ChatEncoder:
    """One JSON line -> its example's ids and loss mask, for
    :func:`~megatron.apertus.prep.preprocess.preprocess`.

    Writes ``PREFIX_chat_document.bin/.idx`` (token ids, an ordinary Megatron dataset) and
    ``PREFIX_chat_document_loss_mask.bin/.idx`` (uint8, one value per token).
    """

    def __init__(self, tokenizer: Tokenizer, max_tokens: int | None = None) -> None:
        control_token_ids(tokenizer)
        self.tokenizer, self.max_tokens = tokenizer, max_tokens

    def outputs(self, prefix: str) -> dict[str, tuple[str, type]]:
        tokens = f"{prefix}_chat_document"
        return {"tokens": (tokens, np.int32), "loss_mask": (loss_mask_prefix(tokens), np.uint8)}

    def __call__(self, raw: bytes) -> dict[str, np.ndarray]:
        try:
            record = json.loads(decode_line(raw))
        except json.JSONDecodeError as err:
            raise ConversationError(f"invalid JSON ({err.msg} at column {err.colno})") from None
        ids, mask = encode_sft(self.tokenizer, record)
        if self.max_tokens is not None and ids.size > self.max_tokens:
            raise ConversationError(
                f"over-long ({ids.size} tokens > --max-tokens {self.max_tokens})"
            )
        return {"tokens": ids, "loss_mask": mask}
