"""Flags of quantization-aware training (``pretrain_gpt.py --quant-format FORMAT``).

The format names live here, not in :mod:`~megatron.apertus.quant.formats` (which re-exports
them): the flags serve ``--help``, which must not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help, switch

INT_BITS = {"int2": 2, "int3": 3, "int4": 4, "int6": 6}
ACTIVATION_FORMATS = ("fp8", "nvfp4")
"""Formats that quantize the layer inputs as well as the weights."""
FORMATS = (*INT_BITS, *ACTIVATION_FORMATS)

FP8_SCALINGS = ("tensor", "channel")


@dataclass(kw_only=True, frozen=True)
class QuantConfig:
    quant_format: Optional[str] = flag_help(
        f"fake-quantize the decoder's linear layers on every forward pass "
        f"(straight-through gradient): {', '.join(FORMATS)}; int* are weight-only, fp8 and "
        "nvfp4 quantize weights and activations",
        None,
        ours=True,
    )
    quant_group_size: int = flag_help(
        "int* formats: elements per scale along the input dimension; -1: one "
        "scale per output channel",
        128,
        ours=True,
    )
    quant_symmetric: bool = flag_help(
        "int* formats: symmetric (no zero point); --no-quant-symmetric adds "
        "a zero point per group",
        True,
        ours=True,
    )
    quant_fp8_scaling: str = flag_help(
        "fp8: one scale per tensor, or per channel (weights: per output "
        "channel, activations: per token)",
        "tensor",
        ours=True,
    )
    quant_activations_only: bool = switch(
        "fp8 and nvfp4: fake-quantize the layer inputs only and use the weights as "
        "loaded, for a checkpoint whose weights tools/quantize.py already quantized (GPTQ's "
        "values lie on the grid of the original weights' scales, which quantizing them "
        "again would recompute)",
        ours=True,
    )

    def __post_init__(self) -> None:
        if self.quant_format is not None and self.quant_format not in FORMATS:
            raise ConfigError(
                f"--quant-format must be one of {', '.join(FORMATS)}, got {self.quant_format!r}"
            )
        if self.quant_group_size == 0 or self.quant_group_size < -1:
            raise ConfigError(
                f"--quant-group-size must be positive or -1, got {self.quant_group_size}"
            )
        if self.quant_fp8_scaling not in FP8_SCALINGS:
            raise ConfigError(
                f"--quant-fp8-scaling must be one of {', '.join(FP8_SCALINGS)}, "
                f"got {self.quant_fp8_scaling!r}"
            )
        if self.quant_activations_only and self.quant_format not in ACTIVATION_FORMATS:
            raise ConfigError(
                "--quant-activations-only needs --quant-format fp8 or nvfp4 (the int* formats "
                f"quantize weights only), got {self.quant_format or 'no --quant-format'}"
            )

    @property
    def enabled(self) -> bool:
        return self.quant_format is not None

    @property
    def int_bits(self) -> Optional[int]:
        """Bits of an integer format; None for fp8 and nvfp4."""
        return INT_BITS.get(self.quant_format)
