"""Alignment data: preference pairs (DPO) and rewarded completions (QRPO) as chat datasets.

One JSON line per example, the prompt in the chat format of :mod:`megatron.apertus.data.chat`:

* DPO: ``{"prompt": [messages...], "chosen": "...", "rejected": "..."}``
* QRPO: ``{"prompt": [...], "completion": "...", "reward": r, "ref_rewards": [r1, r2, ...]}``
  where ``ref_rewards`` score the reference policy's own completions of the prompt; they
  define the quantile of ``reward`` (:func:`megatron.apertus.align.losses.quantile_rewards`),
  which is computed here, once.

Each example is one document of the chat dataset ``PREFIX_pref_document`` (+ ``_loss_mask``):
the conversation prompt + completion for every completion (two sequences for DPO, chosen
first), the loss mask on the completion's tokens and ``<|assistant_end|>``. QRPO also writes
``PREFIX_pref_document_quantile`` (float64, one value per example).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.apertus.data.chat import (
    ConversationError,
    control_token_ids,
    encode_conversation,
    loss_mask_prefix,
    parse_messages,
)
from megatron.apertus.data.preprocess import decode_line
from megatron.apertus.data.tokenizer import Tokenizer
from megatron.apertus.errors import ConfigError

SEQUENCES = {"dpo": 2, "qrpo": 1}
"""Sequences (completions) per example."""


def quantile_prefix(prefix: str) -> str:
    return f"{prefix}_quantile"


def _completion(record: dict, key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ConversationError(f"empty or missing {key!r}")
    return value


def _reward(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConversationError(f"{what} is not a finite number")
    return float(value)


class PreferenceEncoder:
    """One JSON line -> its example's sequences, loss masks (and quantile), for preprocess."""

    def __init__(self, tokenizer: Tokenizer, objective: str, max_tokens: int | None = None):
        control_token_ids(tokenizer)
        self.tokenizer, self.objective, self.max_tokens = tokenizer, objective, max_tokens

    def outputs(self, prefix: str) -> dict[str, tuple[str, type]]:
        tokens = f"{prefix}_pref_document"
        outputs = {"tokens": (tokens, np.int32), "loss_mask": (loss_mask_prefix(tokens), np.uint8)}
        if self.objective == "qrpo":
            outputs["quantile"] = (quantile_prefix(tokens), np.float64)
        return outputs

    def _conversation(self, prompt: list[dict], completion: str) -> tuple[np.ndarray, np.ndarray]:
        messages = parse_messages(
            {"messages": [*prompt, {"role": "assistant", "content": completion}]}
        )
        ids, mask = encode_conversation(self.tokenizer, messages)
        if self.max_tokens is not None and ids.size > self.max_tokens:
            raise ConversationError(
                f"over-long ({ids.size} tokens > --max-tokens {self.max_tokens})"
            )
        return ids, mask

    def __call__(self, raw: bytes) -> dict[str, list[np.ndarray]]:
        try:
            record = json.loads(decode_line(raw))
        except json.JSONDecodeError as err:
            raise ConversationError(f"invalid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), list):
            raise ConversationError("no 'prompt' list of messages")
        prompt = record["prompt"]
        if any(not isinstance(m, dict) or m.get("role") == "assistant" and i == len(prompt) - 1
               for i, m in enumerate(prompt)):  # fmt: skip
            raise ConversationError("the prompt must be messages ending with a user turn")
        if self.objective == "dpo":
            keys = ("chosen", "rejected")
            pairs = [self._conversation(prompt, _completion(record, key)) for key in keys]
            return {"tokens": [p[0] for p in pairs], "loss_mask": [p[1] for p in pairs]}
        ids, mask = self._conversation(prompt, _completion(record, "completion"))
        reward = _reward(record.get("reward"), "'reward'")
        references = record.get("ref_rewards")
        if not isinstance(references, list) or not references:
            raise ConversationError("no 'ref_rewards' list (the reference policy's rewards)")
        ref = np.array([_reward(r, "a 'ref_rewards' entry") for r in references])
        quantile = float(np.mean(ref <= reward))
        return {"tokens": [ids], "loss_mask": [mask], "quantile": [np.array([quantile])]}


class PreferenceDataset:
    """Examples of a preprocessed alignment dataset, each padded to ``seq_length`` + 1.

    Item ``i`` is example ``i``: ``tokens``/``labels``/``loss_mask`` of shape [g, seq_length]
    (g completions: 2 for DPO, chosen first; 1 for QRPO) and, for QRPO, ``quantile`` [1].
    """

    def __init__(self, prefix: str, objective: str, seq_length: int, pad: int) -> None:
        self.prefix, self.objective, self.seq_length, self.pad = prefix, objective, seq_length, pad
        self.group = SEQUENCES[objective]
        for path in (prefix, loss_mask_prefix(prefix)) + (
            (quantile_prefix(prefix),) if objective == "qrpo" else ()
        ):
            for suffix in (".bin", ".idx"):
                if not Path(path + suffix).is_file():
                    raise ConfigError(
                        f"{path}{suffix} is missing: --align-objective {objective} reads "
                        "datasets written by tools/preprocess_preferences.py --objective "
                        f"{objective}"
                    )
        self.tokens = IndexedDataset(prefix)
        self.mask = IndexedDataset(loss_mask_prefix(prefix))
        self.quantile = IndexedDataset(quantile_prefix(prefix)) if objective == "qrpo" else None
        if len(self.tokens) != self.group * len(self):
            raise ConfigError(f"{prefix}: {len(self.tokens)} sequences in {len(self)} examples, "
                              f"not {self.group} per example (--align-objective {objective})")  # fmt: skip
        longest = int(self.tokens.sequence_lengths.max())
        if longest > seq_length + 1:
            raise ConfigError(f"{prefix}: a sequence of {longest} tokens does not fit --seq-length "
                              f"{seq_length}; preprocess with --max-tokens {seq_length + 1}")  # fmt: skip

    def __len__(self) -> int:
        return len(self.tokens.document_indices) - 1

    def sequence(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and loss mask of sequence ``index`` (unpadded)."""
        return np.array(self.tokens[index], dtype=np.int64), np.array(self.mask[index])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        width = self.seq_length + 1
        ids = np.full((self.group, width), self.pad, dtype=np.int64)
        mask = np.zeros((self.group, width), dtype=np.float32)
        for j in range(self.group):
            tokens, loss_mask = self.sequence(self.group * i + j)
            ids[j, : tokens.size], mask[j, : tokens.size] = tokens, loss_mask
        ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
        sample = {"tokens": ids_t[:, :-1], "labels": ids_t[:, 1:], "loss_mask": mask_t[:, 1:]}
        if self.quantile is not None:
            sample["quantile"] = torch.from_numpy(np.array(self.quantile[i], dtype=np.float64))
        return sample
