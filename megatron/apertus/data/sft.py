"""Supervised fine-tuning samples: chat datasets packed like pretraining, loss on the assistant.

A chat dataset (``tools/preprocess_chat.py``) is an ordinary Megatron token dataset plus a
uint8 loss-mask dataset with the same document lengths. :class:`ChatGPTDataset` is
megatron-core's ``GPTDataset`` (blends, splits, shuffling, cached sample indices, documents
packed back to back into ``seq_length + 1`` windows) whose samples carry that mask: the loss
of the label at position ``i`` counts iff the mask of token ``i + 1`` is set. Both arrays go
through the one sample-assembly path of ``GPTDataset``: the low-level dataset returns each
token with its mask bit in bit 32 of an int64 (token ids are below 2**31), and the sample is
split back into the two. Attention and positions restart at every ``</s>`` exactly as in
pretraining (``--reset-attention-mask --reset-position-ids``); the loss is the masked per-token
loss of :mod:`megatron.apertus.training.step`, normalised by the number of assistant tokens in
the global batch under ``--calculate-per-token-loss``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.apertus.data.chat import loss_mask_prefix
from megatron.apertus.data.indexed import read_index
from megatron.apertus.errors import ConfigError

MASK_SHIFT = 32


class MaskedIndexedDataset(IndexedDataset):
    """A token dataset read together with its loss mask: ``get`` returns
    ``token | mask << 32`` as int64."""

    def __init__(self, path_prefix: str, mmap: bool = True) -> None:
        super().__init__(path_prefix, multimodal=False, mmap=mmap)
        self.mask = IndexedDataset(loss_mask_prefix(path_prefix), multimodal=False, mmap=mmap)
        if not np.array_equal(self.sequence_lengths, self.mask.sequence_lengths):
            raise ConfigError(
                f"{loss_mask_prefix(path_prefix)}: the loss mask's document lengths differ from "
                f"{path_prefix}'s; preprocess again with tools/preprocess_chat.py"
            )

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        tokens = super().get(idx, offset, length).astype(np.int64)
        return tokens | (self.mask.get(idx, offset, length).astype(np.int64) << MASK_SHIFT)


def check_mask_pair(flag: str, prefix: str) -> None:
    """Refuse a chat prefix whose loss mask files are missing or damaged, naming ``flag``."""
    mask = loss_mask_prefix(prefix)
    for suffix in (".bin", ".idx"):
        if not Path(mask + suffix).is_file():
            raise ConfigError(
                f"{flag}: {mask}{suffix} is missing: --sft reads chat datasets with their loss "
                "mask (tools/preprocess_chat.py writes both)"
            )
    read_index(flag, mask)


class ChatGPTDataset(GPTDataset):
    """``GPTDataset`` samples whose loss mask is the stored assistant mask."""

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        return MaskedIndexedDataset(dataset_path, mmap=config.mmap_bin_files)

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        # The text ids come first (megatron-core 0.19 returns per-document counts as well).
        packed = self._query_document_sample_shuffle_indices(0 if idx is None else idx)[0]
        packed = torch.from_numpy(packed)
        text = packed & ((1 << MASK_SHIFT) - 1)
        tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        loss_mask = (packed[1:] >> MASK_SHIFT).float()
        padding = labels == self._pad_token_id  # GPTDataset pads a short last sample
        loss_mask[padding] = 0.0
        tokens[tokens == self._pad_token_id] = 0
        labels[padding] = 0
        if idx is None:
            loss_mask.zero_()
        return {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": loss_mask,
            "position_ids": torch.arange(tokens.numel(), dtype=torch.int64),
        }
