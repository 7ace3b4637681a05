"""The Apertus model as a megatron-core ``GPTModel`` built from our layer spec."""

from megatron.apertus.model.builder import build_model_chunk, transformer_config
from megatron.apertus.model.config import ApertusConfig, ParallelConfig, validate_layout
from megatron.apertus.model.presets import PRESETS, preset

__all__ = [
    "ApertusConfig",
    "PRESETS",
    "ParallelConfig",
    "build_model_chunk",
    "preset",
    "transformer_config",
    "validate_layout",
]
