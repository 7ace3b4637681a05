"""Fake quantization inside megatron-core's parallel linear layers of the decoder.

The layer spec (``model/spec.py``) fills the ``linear_qkv``, ``linear_proj``, ``linear_fc1`` and
``linear_fc2`` slots of the decoder with :class:`QuantColumnParallelLinear` and
:class:`QuantRowParallelLinear` when a run quantizes: subclasses of megatron-core's parallel
linears whose ``_forward_impl`` fake-quantizes the weight (and, for fp8 and nvfp4, the layer's
input; with ``--quant-activations-only`` the input alone) just before megatron-core's matmul,
after the layer has done its own tensor-parallel communication of the input. Parameters, state-dict keys and checkpoints are
untouched: training keeps full-precision master weights, as QAT does, and a QAD checkpoint
loads into any model. The embedding and the output layer stay unquantized.

Maxima that span tensor-parallel ranks (a whole tensor's; a row of a row-parallel weight; a
token of a row-parallel input) are max-reduced over the layer's tensor-parallel group, so
every layout fake-quantizes the same full tensors.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import Tensor

from megatron.apertus.errors import ConfigError
from megatron.apertus.quant.config import QuantConfig
from megatron.apertus.quant.formats import NVFP4_BLOCK, fake_fp8, fake_int, fake_nvfp4

QUANTIZED_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def decoder_linears(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, module) of the decoder's linear layers that quantization applies to."""
    for name, module in chunk.named_modules():
        if name.split(".")[-1] in QUANTIZED_LINEARS and ".layers." in f".{name}":
            yield name, module


def _tp_max(group) -> Callable[[Tensor], Tensor]:
    """Max over ``group`` (identity on one rank)."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        return lambda t: t

    def reduce(t: Tensor) -> Tensor:
        t = t.contiguous()
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
        return t

    return reduce


def _identity(t: Tensor) -> Tensor:
    return t


class LinearQuantizers:
    """The weight and input quantizers of one layer, with its tensor-parallel reductions."""

    def __init__(self, cfg: QuantConfig, *, row_parallel: bool, tp_group) -> None:
        self.cfg = cfg
        self.tensor_max = _tp_max(tp_group)
        # Rows of a row-parallel weight, and tokens of its input, are split over the ranks.
        self.row_max = self.tensor_max if row_parallel else _identity

    def weight(self, w: Tensor) -> Tensor:
        cfg = self.cfg
        if cfg.quant_activations_only:
            return w  # already quantized by tools/quantize.py
        if cfg.int_bits is not None:
            per_row = cfg.quant_group_size == -1
            return fake_int(
                w,
                cfg.int_bits,
                cfg.quant_group_size,
                symmetric=cfg.quant_symmetric,
                reduce=self.row_max if per_row else _identity,
            )
        if cfg.quant_format == "fp8":
            return self._fp8(w)
        return fake_nvfp4(w, reduce_tensor=self.tensor_max)

    def input(self, x: Tensor) -> Tensor:
        if self.cfg.int_bits is not None:
            return x  # weight-only
        if self.cfg.quant_format == "fp8":
            return self._fp8(x)
        return fake_nvfp4(x, reduce_tensor=self.tensor_max)

    def _fp8(self, t: Tensor) -> Tensor:
        per_row = self.cfg.quant_fp8_scaling == "channel"
        return fake_fp8(t, per_row=per_row, reduce=self.row_max if per_row else self.tensor_max)


def check_divisible(name: str, features: int, cfg: QuantConfig) -> None:
    """Refuse a format that cannot split the ``features`` inputs (per tensor-parallel rank) of
    linear ``name`` into its groups or blocks."""
    if cfg.int_bits is not None and cfg.quant_group_size > 0:
        if features % cfg.quant_group_size:
            raise ConfigError(
                f"--quant-group-size {cfg.quant_group_size} does not divide the {features} "
                f"input features of {name} (per tensor-parallel rank)"
            )
    if cfg.quant_format == "nvfp4" and features % NVFP4_BLOCK:
        raise ConfigError(
            f"--quant-format nvfp4 needs input features divisible by {NVFP4_BLOCK}; {name} has "
            f"{features} per tensor-parallel rank"
        )


class QuantColumnParallelLinear(ColumnParallelLinear):
    """megatron-core's column-parallel linear on fake-quantized weight and input (``linear_qkv``,
    ``linear_fc1``); the spec has checked that the format splits its inputs."""

    def __init__(self, *args, quant: QuantConfig, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.quantizers = LinearQuantizers(quant, row_parallel=False, tp_group=self.tp_group)

    def _forward_impl(self, input, weight, *args, **kwargs):
        # Gradient-accumulation fusion writes into ``weight.main_grad``, which the quantized copy
        # has not: the gradient goes to ``param.grad`` and megatron-core's DDP hook accumulates it.
        kwargs["gradient_accumulation_fusion"] = False
        q = self.quantizers
        return super()._forward_impl(q.input(input), q.weight(weight), *args, **kwargs)


class QuantRowParallelLinear(RowParallelLinear):
    """megatron-core's row-parallel linear on fake-quantized weight and input (``linear_proj``,
    ``linear_fc2``); maxima over rows and tokens reduce over its tensor-parallel group."""

    def __init__(self, *args, quant: QuantConfig, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.quantizers = LinearQuantizers(quant, row_parallel=True, tp_group=self.tp_group)

    def _forward_impl(self, input, weight, *args, **kwargs):
        # Gradient-accumulation fusion writes into ``weight.main_grad``, which the quantized copy
        # has not: the gradient goes to ``param.grad`` and megatron-core's DDP hook accumulates it.
        kwargs["gradient_accumulation_fusion"] = False
        q = self.quantizers
        return super()._forward_impl(q.input(input), q.weight(weight), *args, **kwargs)
