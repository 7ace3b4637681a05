"""The tokenizer's flags, ``--tokenizer-type`` and ``--tokenizer-model`` as in Megatron-LM: one
group that the trainer (:class:`megatron.apertus.data.config.DataConfig` extends it) and the
offline preparation tools share.

The help is the fields' docstrings, so this module needs nothing of :mod:`megatron.apertus.flags`
(a unit of the same layer); it only declares. Loading and checking the tokenizer is left to the
user of the group: training loads it when the flags are read, the tools before any work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

TokenizerType = Literal[
    "TekkenTokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "NullTokenizer"
]
"""The tokenizer families of :mod:`megatron.apertus.tokenizer.tokenizers`; the flag takes no
other value. ``NullTokenizer`` (Megatron-LM's) has ids and no vocabulary: training on
``--mock-data`` only; the tools that read or write text refuse it."""


@dataclass(kw_only=True, frozen=True)
class TokenizerConfig:
    tokenizer_type: TokenizerType = "TekkenTokenizer"
    """the tokenizer's family (NullTokenizer: --vocab-size synthetic ids, the last one the end of
    document, no text; for --mock-data runs)"""
    tokenizer_model: Optional[str] = None
    """tokenizer file or directory (TekkenTokenizer: default the one bundled with mistral-common)"""
