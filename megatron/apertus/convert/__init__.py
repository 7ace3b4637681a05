"""Conversions between our checkpoints and other formats (Hugging Face ``ApertusForCausalLM``).

:mod:`~megatron.apertus.convert.hf` holds the pure tensor/config mappings;
:mod:`~megatron.apertus.convert.hf_io` the file-level export and import that
``tools/checkpoint/export_hf.py`` and ``import_hf.py`` call. This package is not imported
by training, so it may depend on ``safetensors`` and ``transformers``.
"""

from megatron.apertus.convert.hf import (
    ConversionError,
    apertus_config_from_hf,
    from_hf_state_dict,
    fuse_qkv,
    hf_config,
    split_qkv,
    to_hf_state_dict,
)

__all__ = [
    "ConversionError",
    "apertus_config_from_hf",
    "from_hf_state_dict",
    "fuse_qkv",
    "hf_config",
    "split_qkv",
    "to_hf_state_dict",
]
