"""The Apertus model as a megatron-core ``GPTModel`` built from our layer spec.

The builder (megatron-core, torch) loads on first use of its names: the configs and presets
serve ``--help`` and argument errors, which must not pay for it.
"""

from megatron.apertus.model.config import (
    PRESETS,
    ApertusConfig,
    ParallelConfig,
    preset,
    validate_layout,
)

_BUILDER_NAMES = ("build_model_chunk", "transformer_config")

__all__ = [
    "ApertusConfig",
    "PRESETS",
    "ParallelConfig",
    "build_model_chunk",
    "preset",
    "transformer_config",
    "validate_layout",
]


def __getattr__(name: str):
    if name in _BUILDER_NAMES:
        from megatron.apertus.model import builder

        return getattr(builder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
