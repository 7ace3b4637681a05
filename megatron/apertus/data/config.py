"""The tokenizer and the data loader's flags (``--help``'s "data" group); the datasets
themselves are :class:`megatron.apertus.data.datasets.DatasetConfig`. The tokenizer's flags are
:class:`megatron.apertus.tokenizer.config.TokenizerConfig`, which the preparation tools share.

A tokenizer other than the default is loaded when the flags are read, so that ``--dry-run``
and the tools refuse a wrong file before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help
from megatron.apertus.tokenizer.config import TokenizerConfig
from megatron.apertus.tokenizer.tokenizers import checked_tokenizer

MOST_WORKERS = 1024
"""More loader processes than any node has cores: the loader would fork until the system
refuses, which looks like a hang, so such a count is refused instead."""


@dataclass(kw_only=True, frozen=True)
class DataConfig(TokenizerConfig):
    goldfish_loss: bool = flag_help(
        "drop a deterministic 1/k of label positions from the loss", False
    )
    null_tokenizer_eod_id: int | None = flag_help(
        "--tokenizer-type NullTokenizer: the end-of-document id (default: --vocab-size - 1)", None
    )
    null_tokenizer_pad_id: int = flag_help(
        "--tokenizer-type NullTokenizer: the padding id (-1: none)", -1
    )
    num_workers: int = flag_help(
        "data loader worker processes that read and collate the next step's micro-batches while "
        "this one computes (0: read in the training process; Megatron-LM's default is 2); the "
        "batches are the same for any number",
        0,
    )

    def __post_init__(self) -> None:
        if not 0 <= self.num_workers <= MOST_WORKERS:
            raise ConfigError(
                f"--num-workers must be in [0, {MOST_WORKERS}], got {self.num_workers}"
            )
        if self.tokenizer_type == "NullTokenizer":
            return  # ids only: training checks them against --vocab-size
        if self.null_tokenizer_eod_id is not None or self.null_tokenizer_pad_id != -1:
            raise ConfigError(
                "--null-tokenizer-eod-id and --null-tokenizer-pad-id are the ids of "
                f"--tokenizer-type NullTokenizer; {self.tokenizer_type} has its own"
            )
        if self.tokenizer_model is not None or self.tokenizer_type != "TekkenTokenizer":
            # Read now, not at the first batch: --dry-run and the tools refuse a wrong file too.
            checked_tokenizer(self.tokenizer_type, self.tokenizer_model)
