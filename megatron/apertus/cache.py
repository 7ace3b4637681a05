"""Where the package keeps what it derives from its inputs when no flag names a place.

The tekken vocabulary (:mod:`megatron.apertus.tokenizer`), its Hugging Face conversion
(:mod:`megatron.apertus.convert.hf_tokenizer`), megatron-core's sample indices and the embedded
corpus's token files (:mod:`megatron.apertus.data.datasets`) all go under one directory, so that the
tokenizer and the datasets, which are layers apart, agree on it.
"""

from __future__ import annotations

from pathlib import Path


def default_cache_dir() -> Path:
    """``~/.cache/megatron-apertus``."""
    return Path.home() / ".cache" / "megatron-apertus"
