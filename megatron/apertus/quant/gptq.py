"""Post-training quantization baselines: round-to-nearest and GPTQ, for every format.

GPTQ (Frantar et al., 2023) quantizes a weight ``W`` (``[out, in]``) one input column at a
time, in order, and spreads each column's rounding error over the columns not yet quantized
through the inverse Hessian of the layer's reconstruction error, ``H = 2 X^T X / n`` (``X``
the layer's ``n`` calibration inputs, one row per token). With ``U`` the upper Cholesky factor
of ``(H + damp I)^-1``, column ``j`` is rounded to ``q_j`` and the remaining columns ``k > j``
move by ``-(w_j - q_j) U[j, k] / U[j, j]``. Work is done in blocks of columns with the
updates of a finished block applied to the rest at once ("lazy batch" updates). Computed in
float64: layers of the sizes these tools handle fit, and the result does not depend on the
accumulated error of a long fp32 update chain.

The loop is the same for every format; a :class:`ColumnGrid` says what differs: the scales a
group of columns shares, taken from the group's columns as they are when its first column is
reached (which is why blocks are whole groups), and the rounding of one column under them,
done by the fake quantizers' own functions (:mod:`megatron.apertus.quant.formats`):

* ``int*``: a scale (and zero point) per ``group_size`` columns and output row.
* ``fp8``: no groups; the scale (per tensor or per output row) is the fake quantizer's, taken
  from the whole weight before any update.
* ``nvfp4``: the fp32 tensor scale is the fake quantizer's, from the whole weight before any
  update; each 16-column block's e4m3 scale (per output row) is taken when the block's first
  column is reached, ``e4m3(amax_block / (6 s_t))``.

A column updated after its group's scales were set can outgrow them: integer codes may then
reach ``-2**(b-1)``, fp8 and nvfp4 values saturate. e4m3 rounding converts through fp32
(torch's conversion), so a float64 value within ``2**-24`` (relative) of a tie between two e4m3
numbers may round to the farther one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from megatron.apertus.quant.config import QuantConfig
from megatron.apertus.quant.formats import (
    NVFP4_BLOCK,
    fp8_round,
    fp8_scale,
    int_codes,
    int_dequantize,
    int_params,
    int_quantize,
    nvfp4_block_scale,
    nvfp4_tensor_scale,
    nvfp4_values,
)

DEFAULT_DAMP = 0.01
"""Damping, as a fraction of the mean diagonal of ``H`` (GPTQ's default)."""
DEFAULT_BLOCK = 128
"""Columns per lazy-batch block (rounded down to whole groups, at least one group)."""


@dataclass(frozen=True)
class ColumnGrid:
    """A format as GPTQ's column loop sees it.

    ``group`` consecutive columns share the scales ``scales(columns)`` returns, computed from
    those columns (``[out, group]``) as they are when the first of them is reached; 0: no
    groups (every scale was fixed from the whole weight up front, and ``scales`` is not
    called). ``round(column, scales)`` is the nearest grid value of each entry of one column
    (``[out, 1]``) under the current group's scales (None without groups).
    """

    round: Callable[[Tensor, Any], Tensor]
    group: int = 0
    scales: Optional[Callable[[Tensor], Any]] = None


def int_grid(bits: int, group_size: int, columns: int, *, symmetric: bool = True) -> ColumnGrid:
    """Groupwise integers: a scale (and zero point) per ``group_size`` columns (-1: all)."""
    group = columns if group_size <= 0 else group_size
    if columns % group:
        raise ValueError(f"{columns} input columns are not a multiple of group size {group}")
    return ColumnGrid(
        round=lambda column, scale_zero: int_dequantize(
            int_codes(column, *scale_zero, bits), *scale_zero
        ),
        group=group,
        scales=lambda g: int_params(g, bits, symmetric=symmetric),
    )


def fp8_grid(weight: Tensor, *, per_row: bool) -> ColumnGrid:
    """e4m3 under the fake quantizer's scale of ``weight`` (per tensor or per output row)."""
    scale = fp8_scale(weight, per_row=per_row).double()
    return ColumnGrid(round=lambda column, _: fp8_round(column, scale))


def nvfp4_grid(weight: Tensor) -> ColumnGrid:
    """e2m1 under a 16-column block's e4m3 scale and the fake quantizer's tensor scale."""
    if weight.shape[1] % NVFP4_BLOCK:
        raise ValueError(
            f"nvfp4 needs input columns divisible by {NVFP4_BLOCK}, the weight has "
            f"{weight.shape[1]}"
        )
    tensor_scale = nvfp4_tensor_scale(weight).double()

    def round_column(column: Tensor, block_scale: Tensor) -> Tensor:
        return nvfp4_values(column, block_scale, tensor_scale) * block_scale * tensor_scale

    return ColumnGrid(
        round=round_column, group=NVFP4_BLOCK, scales=lambda g: nvfp4_block_scale(g, tensor_scale)
    )


def column_grid(weight: Tensor, quant: QuantConfig) -> ColumnGrid:
    """The :class:`ColumnGrid` of ``weight`` in ``quant``'s format."""
    if quant.int_bits is not None:
        return int_grid(
            quant.int_bits, quant.quant_group_size, weight.shape[1], symmetric=quant.quant_symmetric
        )
    if quant.quant_format == "fp8":
        return fp8_grid(weight, per_row=quant.quant_fp8_scaling == "channel")
    return nvfp4_grid(weight)


def rtn(weight: Tensor, bits: int, group_size: int, *, symmetric: bool = True) -> Tensor:
    """Round-to-nearest: every group quantized with its own max scale, nothing else."""
    codes, scale, zero = int_quantize(weight, bits, group_size, symmetric=symmetric)
    return int_dequantize(codes, scale, zero).reshape(weight.shape).to(weight.dtype)


def hessian(inputs: Tensor) -> Tensor:
    """``2 X^T X / n`` of the rows of ``inputs`` (``[..., in]``), float64."""
    x = inputs.reshape(-1, inputs.shape[-1]).double()
    return 2 * x.T @ x / x.shape[0]


def _inverse_cholesky(h: Tensor, damp: float) -> Tensor:
    """Upper Cholesky factor of ``(H + damp mean(diag H) I)^-1``."""
    h = h + damp * torch.diag(h).mean() * torch.eye(len(h), dtype=h.dtype)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True)


def gptq_grid(
    weight: Tensor,
    h: Tensor,
    grid: ColumnGrid,
    *,
    damp: float = DEFAULT_DAMP,
    block_size: int = DEFAULT_BLOCK,
) -> Tensor:
    """GPTQ-quantized ``weight`` on ``grid`` (values in ``weight``'s dtype); ``h`` its layer's
    Hessian. Input channels that never saw a non-zero input (``H[j, j] = 0``) are zeroed."""
    w = weight.detach().double().clone()
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    u = _inverse_cholesky(h, damp)
    columns = w.shape[1]
    group = grid.group
    block = block_size if group == 0 else max(group, block_size // group * group)
    out = torch.zeros_like(w)
    scales = None
    for start in range(0, columns, block):
        stop = min(start + block, columns)
        wb, errors = w[:, start:stop].clone(), torch.zeros_like(w[:, start:stop])
        ub = u[start:stop, start:stop]
        for i in range(stop - start):
            if group and (start + i) % group == 0:
                scales = grid.scales(wb[:, i : i + group])
            column = wb[:, i : i + 1]
            q = grid.round(column, scales)
            out[:, start + i] = q[:, 0]
            error = (column - q) / ub[i, i]
            wb[:, i:] -= error @ ub[i : i + 1, i:]
            errors[:, i : i + 1] = error
        w[:, stop:] -= errors @ u[start:stop, stop:]
    return out.to(weight.dtype)


def gptq(
    weight: Tensor,
    h: Tensor,
    bits: int,
    group_size: int,
    *,
    symmetric: bool = True,
    damp: float = DEFAULT_DAMP,
    block_size: int = DEFAULT_BLOCK,
) -> Tensor:
    """GPTQ of ``weight`` to ``bits``-bit integers in groups of ``group_size`` columns."""
    grid = int_grid(bits, group_size, weight.shape[1], symmetric=symmetric)
    return gptq_grid(weight, h, grid, damp=damp, block_size=block_size)
