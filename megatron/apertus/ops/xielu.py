"""xIELU activation (Huang & Schlag 2024, arXiv 2411.13010).

    alpha_p = softplus(a_p)          alpha_n = beta + softplus(a_n)
    y = alpha_p * x^2 + beta * x                          for x > 0
    y = alpha_n * (expm1(min(x, eps)) - x) + beta * x     for x <= 0

``a_p`` and ``a_n`` are learnable raw scalars of shape [1] (the same parametrisation and names,
``alpha_p``/``alpha_n``, as Hugging Face's ``XIELUActivation``). ``beta`` and ``eps`` are fixed
Python floats: keeping them as device tensors costs a host sync per call in some backends.
``min(x, eps)`` keeps the unused branch finite so that gradients never see ``inf * 0``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

XIELU_BETA = 0.5
XIELU_EPS = -1e-6
XIELU_ALPHA_P_INIT = 0.8
XIELU_ALPHA_N_INIT = 0.8


def inverse_softplus(y: float) -> float:
    """The raw parameter value whose softplus is ``y``."""
    return math.log(math.expm1(y))


def xielu_reference(
    x: torch.Tensor,
    alpha_p: torch.Tensor,
    alpha_n: torch.Tensor,
    beta: float = XIELU_BETA,
    eps: float = XIELU_EPS,
) -> torch.Tensor:
    """Eager PyTorch xIELU; autograd gives dx and the two raw-parameter gradients.

    Computes in at least fp32 (fp64 stays fp64, for gradcheck) and returns ``x.dtype``.
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    a_p = F.softplus(alpha_p.to(compute))
    a_n = beta + F.softplus(alpha_n.to(compute))
    xf = x.to(compute)
    positive = a_p * xf * xf + beta * xf
    negative = a_n * (torch.expm1(torch.clamp(xf, max=eps)) - xf) + beta * xf
    return torch.where(xf > 0, positive, negative).to(x.dtype)


def xielu(
    x: torch.Tensor,
    alpha_p: torch.Tensor,
    alpha_n: torch.Tensor,
    beta: float = XIELU_BETA,
    eps: float = XIELU_EPS,
) -> torch.Tensor:
    """Public entry point; dispatches to the fastest available implementation."""
    return xielu_reference(x, alpha_p, alpha_n, beta, eps)
