"""Alignment data as training reads it: preference pairs (DPO) and rewarded completions (QRPO)
stored as chat datasets by :mod:`megatron.apertus.prep.preferences`.

Each example is one document of the chat dataset ``PREFIX_pref_document`` (+ ``_loss_mask``):
the conversation prompt + completion for every completion (two sequences for DPO, chosen
first), the loss mask on the completion's tokens and its ``<|assistant_end|>`` only (assistant
turns inside the prompt are context, never trained on). ``PREFIX_pref_document_ref_logp``
(float64, one value per sequence) holds the reference log-probabilities a line gave, NaN where
it gave none. QRPO data also has ``PREFIX_pref_document_quantile`` (float64 per example: the
quantile of the reward among the reference policy's rewards and the number of reference rewards
it was estimated from, which the log and normal-icdf transforms clamp by).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.apertus.data.chat import loss_mask_prefix, quantile_prefix, ref_logp_prefix
from megatron.apertus.data.indexed import read_index
from megatron.apertus.errors import ConfigError

SEQUENCES = {"dpo": 2, "qrpo": 1}
"""Sequences (completions) per example."""


class PreferenceDataset:
    """Examples of a preprocessed alignment dataset, each padded to ``seq_length`` + 1.

    Item ``i`` is example ``i``: ``tokens``/``labels``/``loss_mask`` of shape [g, seq_length]
    (g completions: 2 for DPO, chosen first; 1 for QRPO) and, for QRPO, ``quantile`` [1].
    ``mmap``: the files are read through a memory map (``--no-mmap-bin-files``: file reads).
    """

    def __init__(
        self, prefix: str, objective: str, seq_length: int, pad: int, mmap: bool = True
    ) -> None:
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
            read_index("", path)  # refuses a damaged pair, which IndexedDataset reads past
        self.tokens = IndexedDataset(prefix, mmap=mmap)
        self.mask = IndexedDataset(loss_mask_prefix(prefix), mmap=mmap)
        self.quantile = (
            IndexedDataset(quantile_prefix(prefix), mmap=mmap) if objective == "qrpo" else None
        )
        if self.quantile is not None and (self.quantile.sequence_lengths != 2).any():
            raise ConfigError(
                f"{quantile_prefix(prefix)}: one value per example, not the "
                "quantile and its reference-reward count: preprocess the data "
                "again with tools/preprocess_preferences.py"
            )
        self.ref_logps = precomputed_reference(prefix)
        if len(self.tokens) != self.group * len(self):
            raise ConfigError(
                f"{prefix}: {len(self.tokens)} sequences in {len(self)} examples, "
                f"not {self.group} per example (--align-objective {objective})"
            )
        longest = int(self.tokens.sequence_lengths.max())
        if longest > seq_length + 1:
            raise ConfigError(
                f"{prefix}: a sequence of {longest} tokens does not fit --seq-length "
                f"{seq_length}; preprocess with --max-tokens {seq_length + 1}"
            )

    def __len__(self) -> int:
        return len(self.tokens.document_indices) - 1

    def fewest_ref_rewards(self) -> int | None:
        """The smallest number of reference rewards behind any example's quantile (None: not
        QRPO data, or no example); a transform that needs two or more checks it before a step."""
        if self.quantile is None or len(self.quantile) == 0:
            return None
        # Every entry is [quantile, count] (checked on opening), stored back to back.
        values = np.memmap(self.quantile.path_prefix + ".bin", dtype=np.float64, mode="r")
        return int(values[1::2].min())

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
            quantile, count = np.array(self.quantile[i], dtype=np.float64)
            sample["quantile"] = torch.tensor([quantile], dtype=torch.float64)
            sample["ref_count"] = torch.tensor([count], dtype=torch.float64)
        return sample


def stored_reference(prefix: str) -> np.ndarray | None:
    """The stored reference log-probability of every sequence of the dataset at ``prefix``
    (NaN where its line gave none), or None when there is no such file."""
    path = ref_logp_prefix(prefix)
    if not Path(path + ".idx").is_file():
        return None
    dataset = IndexedDataset(path)
    if len(dataset) == 0:
        return None
    return np.concatenate([np.array(dataset[i], dtype=np.float64) for i in range(len(dataset))])


def partial_reference_error(values: np.ndarray) -> str | None:
    """What is wrong when only some sequences carry a reference log-probability, else None."""
    missing = np.isnan(values)
    if not missing.any() or missing.all():
        return None
    return (
        f"{int((~missing).sum())} of {values.size} sequences carry a reference "
        "log-probability; give it on every line or on none"
    )


def precomputed_reference(prefix: str) -> np.ndarray | None:
    """The reference log-probability of every sequence the data carries, or None when it
    carries none; data that carries them for some sequences only is refused."""
    values = stored_reference(prefix)
    if values is None or np.isnan(values).all():
        return None
    error = partial_reference_error(values)
    if error:
        raise ConfigError(f"{ref_logp_prefix(prefix)}: {error}")
    return values
