"""Chat datasets from JSON lines: one conversation per line, in the Apertus chat format of
:mod:`megatron.apertus.data.chat`, for :func:`megatron.apertus.prep.preprocess.preprocess`
(``tools/preprocess_chat.py``)."""

from __future__ import annotations

import json

import numpy as np

from megatron.apertus.data.chat import (
    ConversationError,
    control_token_ids,
    encode_conversation,
    loss_mask_prefix,
    parse_messages,
)
from megatron.apertus.prep.preprocess import decode_line
from megatron.apertus.tokenizer.tokenizers import Tokenizer


class ChatEncoder:
    """One JSON line -> its conversation's ids and loss mask, for
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
        ids, mask = encode_conversation(self.tokenizer, parse_messages(record))
        if self.max_tokens is not None and ids.size > self.max_tokens:
            raise ConversationError(
                f"over-long ({ids.size} tokens > --max-tokens {self.max_tokens})"
            )
        return {"tokens": ids, "loss_mask": mask}
