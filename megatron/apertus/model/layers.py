"""The modules that fill Apertus's slots in megatron-core's transformer layer spec.

* :class:`RMSNorm`: fp32-accumulating RMSNorm (as Hugging Face's Apertus computes it) that
  also supports sequence parallelism, which ``torch.nn.RMSNorm`` via megatron-core's
  ``WrappedTorchNorm`` refuses.
* :class:`XIELU`: the activation module with the per-layer learnable ``alpha_p``/``alpha_n``.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.apertus.ops.xielu import (
    XIELU_ALPHA_N_INIT,
    XIELU_ALPHA_P_INIT,
    XIELU_IMPLS,
    inverse_softplus,
    xielu,
)


def _param_device(config: TransformerConfig) -> torch.device | int:
    """Where megatron-core puts parameters: CPU for CPU initialisation, else the current GPU."""
    return torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()


class RMSNorm(torch.nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, reduced in fp32 and cast back to the input dtype."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=_param_device(config))
        )
        # Under sequence parallelism each TP rank normalises a different slice of the sequence,
        # so megatron-core's finalize_model_grads must sum this weight's gradient over TP.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class XIELU(MegatronModule):
    """xIELU with learnable raw ``alpha_p``, ``alpha_n`` (shape [1]) and fixed ``beta``, ``eps``.

    The parameters are replicated on every rank and never sharded. Their gradient is a sum
    over every activation element; under tensor parallelism each rank sees only its slice of
    the MLP's columns, so the parameters enter through ``copy_to_tensor_model_parallel_region``
    (identity forward, all-reduce over TP backward), which makes the gradient whole on every
    rank whatever driver runs the model. A ``MegatronModule`` because megatron-core's MLP asks
    each child for its ``sharded_state_dict`` (replicated tensors, one copy per checkpoint).
    ``impl`` picks the kernel (``auto``, ``cuda``, ``cpu``, ``torch``; see ``ops/xielu.py``).
    """

    def __init__(
        self, config: TransformerConfig, beta: float, eps: float, impl: str = "auto"
    ) -> None:
        super().__init__(config=config)
        if impl not in XIELU_IMPLS:
            raise ValueError(f"xielu impl must be one of {XIELU_IMPLS}, got {impl!r}")
        like = dict(dtype=config.params_dtype, device=_param_device(config))
        alpha_p = inverse_softplus(XIELU_ALPHA_P_INIT)
        alpha_n = inverse_softplus(XIELU_ALPHA_N_INIT - beta)
        self.alpha_p = torch.nn.Parameter(torch.full((1,), alpha_p, **like))
        self.alpha_n = torch.nn.Parameter(torch.full((1,), alpha_n, **like))
        self.beta = float(beta)
        self.eps = float(eps)
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alphas = copy_to_tensor_model_parallel_region(torch.cat([self.alpha_p, self.alpha_n]))
        return xielu(x, alphas[0:1], alphas[1:2], self.beta, self.eps, impl=self.impl)
