"""Post-training quantization baselines of the integer formats: round-to-nearest and GPTQ.

GPTQ (Frantar et al., 2023) quantizes a weight ``W`` (``[out, in]``) one input column at a
time, in order, and spreads each column's rounding error over the columns not yet quantized
through the inverse Hessian of the layer's reconstruction error, ``H = 2 X^T X / n`` (``X``
the layer's ``n`` calibration inputs, one row per token). With ``U`` the upper Cholesky factor
of ``(H + damp I)^-1``, column ``j`` is rounded to ``q_j`` and the remaining columns ``k > j``
move by ``-(w_j - q_j) U[j, k] / U[j, j]``. Work is done in blocks of columns with the
updates of a finished block applied to the rest at once ("lazy batch" updates); a group's
scale is taken from the group's columns as they are when its first column is reached, which
is why blocks are whole groups. Computed in float64: layers of the sizes these tools handle
fit, and the result does not depend on the accumulated error of a long fp32 update chain.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron.apertus.quant.formats import int_codes, int_dequantize, int_params, int_quantize

DEFAULT_DAMP = 0.01
"""Damping, as a fraction of the mean diagonal of ``H`` (GPTQ's default)."""


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


def gptq(
    weight: Tensor,
    h: Tensor,
    bits: int,
    group_size: int,
    *,
    symmetric: bool = True,
    damp: float = DEFAULT_DAMP,
    block_size: int = 128,
) -> Tensor:
    """GPTQ-quantized ``weight`` (dequantized values in ``weight``'s dtype); ``h`` its layer's
    Hessian. Input channels that never saw a non-zero input (``H[j, j] = 0``) are zeroed."""
    w = weight.detach().double().clone()
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    u = _inverse_cholesky(h, damp)
    columns = w.shape[1]
    group = columns if group_size <= 0 else group_size
    block = max(group, block_size // group * group)
    out = torch.zeros_like(w)
    scale = zero = None
    for start in range(0, columns, block):
        stop = min(start + block, columns)
        wb, errors = w[:, start:stop].clone(), torch.zeros_like(w[:, start:stop])
        ub = u[start:stop, start:stop]
        for i in range(stop - start):
            if (start + i) % group == 0:
                scale, zero = int_params(wb[:, i : i + group], bits, symmetric=symmetric)
            column = wb[:, i : i + 1]
            q = int_dequantize(int_codes(column, scale, zero, bits), scale, zero)
            out[:, start + i] = q[:, 0]
            error = (column - q) / ub[i, i]
            wb[:, i:] -= error @ ub[i : i + 1, i:]
            errors[:, i : i + 1] = error
        w[:, stop:] -= errors @ u[start:stop, stop:]
    return out.to(weight.dtype)
