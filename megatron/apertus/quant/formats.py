"""Fake quantization of the formats of quantization-aware distillation (Apertus family
expansion, section 3).

Every function returns ``dequantize(quantize(x))`` in ``x``'s dtype, computed in fp32, with the
straight-through estimator: the forward value is the quantized one, the gradient with respect
to ``x`` is the identity (``x + (q - x).detach()``). Scales come from the tensor itself on every
call (dynamic max scaling) and are constants for autograd. No value is clipped by these scales,
so the identity is also the gradient of the unclipped rounding function almost everywhere.

Formats (docs/quantization.md has the tables):

* ``int{2,3,4,6}``: groups of ``group_size`` consecutive elements of the last dimension share a
  scale. Symmetric: ``s = amax / (2**(b-1) - 1)``, ``q = round(x / s)`` in ``[-(2**(b-1) - 1),
  2**(b-1) - 1]``, ``x' = q s`` (the group's largest magnitude is exactly representable; the
  code ``-2**(b-1)`` stays unused, so INT2 is ternary; the other convention, ``amax /
  ((2**b - 1) / 2)``, puts the largest magnitude on a rounding tie). Asymmetric:
  ``s = (max - min) / (2**b - 1)`` over the group's range extended to include 0, zero point
  ``z = round(-min / s)``, ``q = clamp(round(x / s) + z, 0, 2**b - 1)``, ``x' = (q - z) s``.
* ``fp8``: e4m3 (``float8_e4m3fn``: 4 exponent bits, bias 7, 3 mantissa bits, max 448, no
  infinities), ``s = amax / 448`` per tensor or per row, ``x' = e4m3(x / s) s``.
* ``nvfp4``: e2m1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6) in blocks of 16 along the last dimension;
  each block's scale is an e4m3 number, ``s_b = e4m3(amax_block / (6 s_t))``, under one fp32
  tensor scale ``s_t = amax_tensor / (6 * 448)``; ``x' = e2m1(x / (s_b s_t)) s_b s_t``.

Rounding is to nearest, ties to even, everywhere; values beyond a format's range saturate.
The ``amax`` callbacks let a tensor-parallel layer reduce its maxima over the ranks that hold
the rest of a row or tensor, so that every layout quantizes the same full-model tensors.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from megatron.apertus.quant.config import ACTIVATION_FORMATS, FORMATS, INT_BITS  # noqa: F401

E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16

Reduce = Callable[[Tensor], Tensor]
"""Max-reduction of a local amax over the tensor-parallel ranks sharing it (identity on one)."""


def _same(t: Tensor) -> Tensor:
    return t


def straight_through(x: Tensor, quantized: Tensor) -> Tensor:
    """``quantized`` in the forward pass, identity gradient to ``x`` in the backward pass."""
    return x + (quantized.to(x.dtype) - x).detach()


def round_e4m3(x: Tensor) -> Tensor:
    """Nearest e4m3 (``float8_e4m3fn``) value, ties to even, saturating at +-448."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def round_e2m1(x: Tensor) -> Tensor:
    """Nearest e2m1 value, ties to even, saturating at +-6.

    The e2m1 values are evenly spaced within each binade: steps of 0.5 below 2, of 1 below 4,
    of 2 up to 6; rounding ``|x| / step`` half-to-even picks the even mantissa at ties.
    """
    a = x.abs().clamp(max=E2M1_MAX)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(a.dtype)
    return (torch.round(a / step) * step).copysign(x)


def _safe(scale: Tensor) -> Tensor:
    """An all-zero group keeps scale 1 (its values quantize to 0 either way)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _groups(x: Tensor, group_size: int) -> Tensor:
    """``x`` as ``[..., groups, group_size]`` along the last dimension (-1: one group per row)."""
    size = x.shape[-1] if group_size <= 0 else group_size
    if x.shape[-1] % size:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of group size {size}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def int_params(
    g: Tensor, bits: int, *, symmetric: bool = True, reduce: Reduce = _same
) -> tuple[Tensor, Optional[Tensor]]:
    """Scale and (asymmetric) zero point of each group (last dimension) of fp32 ``g``."""
    if symmetric:
        amax = reduce(g.abs().amax(-1, keepdim=True))
        return _safe(amax / (2 ** (bits - 1) - 1)), None
    high = reduce(g.amax(-1, keepdim=True).clamp(min=0))
    low = -reduce(-g.amin(-1, keepdim=True).clamp(max=0))
    scale = _safe((high - low) / (2**bits - 1))
    return scale, torch.round(-low / scale)


def int_codes(g: Tensor, scale: Tensor, zero: Optional[Tensor], bits: int) -> Tensor:
    """Integer codes of ``g`` under ``scale`` and ``zero`` (None: symmetric), saturating."""
    if zero is None:
        return torch.clamp(torch.round(g / scale), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return torch.clamp(torch.round(g / scale) + zero, 0, 2**bits - 1)


def int_dequantize(codes: Tensor, scale: Tensor, zero: Optional[Tensor]) -> Tensor:
    return (codes if zero is None else codes - zero) * scale


def int_quantize(
    x: Tensor, bits: int, group_size: int, *, symmetric: bool = True, reduce: Reduce = _same
) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """Integer codes, scales and (asymmetric) zero points of ``x``, groupwise along the last
    dimension: ``codes`` has ``x``'s shape split into groups, ``scale`` one entry per group."""
    g = _groups(x.detach().float(), group_size)
    scale, zero = int_params(g, bits, symmetric=symmetric, reduce=reduce)
    return int_codes(g, scale, zero, bits), scale, zero


def fake_int(
    x: Tensor, bits: int, group_size: int, *, symmetric: bool = True, reduce: Reduce = _same
) -> Tensor:
    """Groupwise integer fake quantization (see the module docstring), straight-through."""
    codes, scale, zero = int_quantize(x, bits, group_size, symmetric=symmetric, reduce=reduce)
    return straight_through(x, int_dequantize(codes, scale, zero).reshape(x.shape))


def fp8_scale(x: Tensor, *, per_row: bool, reduce: Reduce = _same) -> Tensor:
    """``amax / 448`` of the whole tensor or of each row (last dimension), fp32."""
    a = x.detach().float().abs()
    amax = a.amax(-1, keepdim=True) if per_row else a.amax().reshape([1] * x.dim())
    return _safe(reduce(amax) / E4M3_MAX)


def fp8_round(x: Tensor, scale: Tensor) -> Tensor:
    """The nearest values of the e4m3 grid scaled by ``scale``: ``e4m3(x / s) s``."""
    return round_e4m3(x / scale) * scale


def fake_fp8(x: Tensor, *, per_row: bool, reduce: Reduce = _same) -> Tensor:
    """e4m3 fake quantization with a per-tensor or per-row scale, straight-through."""
    scale = fp8_scale(x, per_row=per_row, reduce=reduce)
    return straight_through(x, fp8_round(x.detach().float(), scale))


def nvfp4_tensor_scale(x: Tensor, *, reduce: Reduce = _same) -> Tensor:
    """The fp32 tensor scale ``amax_tensor / (6 * 448)`` of ``x``, shape ``[1]``."""
    amax = x.detach().float().abs().amax().reshape(1)
    return _safe(reduce(amax) / (E2M1_MAX * E4M3_MAX))


def nvfp4_block_scale(block: Tensor, tensor_scale: Tensor) -> Tensor:
    """The e4m3 scale ``e4m3(amax_block / (6 s_t))`` of each block (last dimension)."""
    return round_e4m3(block.abs().amax(-1, keepdim=True) / (E2M1_MAX * tensor_scale))


def nvfp4_values(x: Tensor, block_scale: Tensor, tensor_scale: Tensor) -> Tensor:
    """The e2m1 values of ``x`` under ``block_scale * tensor_scale`` (0 where that is 0)."""
    scale = block_scale * tensor_scale
    return torch.where(scale > 0, round_e2m1(x / _safe(scale)), torch.zeros_like(x))


def nvfp4_quantize(x: Tensor, *, reduce_tensor: Reduce = _same) -> tuple[Tensor, Tensor, Tensor]:
    """e2m1 values, e4m3 block scales (one per 16 elements of the last dimension) and the fp32
    tensor scale of ``x``: ``x' = values * block_scale * tensor_scale``."""
    g = _groups(x.detach().float(), NVFP4_BLOCK)
    tensor_scale = nvfp4_tensor_scale(g, reduce=reduce_tensor)
    block_scale = nvfp4_block_scale(g, tensor_scale)
    return nvfp4_values(g, block_scale, tensor_scale), block_scale, tensor_scale


def fake_nvfp4(x: Tensor, *, reduce_tensor: Reduce = _same) -> Tensor:
    """NVFP4 fake quantization, straight-through."""
    values, block_scale, tensor_scale = nvfp4_quantize(x, reduce_tensor=reduce_tensor)
    return straight_through(x, (values * block_scale * tensor_scale).reshape(x.shape))
