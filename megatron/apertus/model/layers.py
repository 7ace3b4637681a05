"""The modules that fill Apertus's slots in megatron-core's transformer layer spec.

* :class:`RMSNorm`: fp32-accumulating RMSNorm (as Hugging Face's Apertus computes it) that
  also supports sequence parallelism, which ``torch.nn.RMSNorm`` via megatron-core's
  ``WrappedTorchNorm`` refuses.
* :class:`XIELU`: the activation module with the per-layer learnable ``alpha_p``/``alpha_n``.
* :class:`SDPAttention`: core attention on ``torch.nn.functional.scaled_dot_product_attention``
  (flash/memory-efficient kernels on GPU, a fused kernel on CPU) with native GQA.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.apertus.ops.xielu import (
    XIELU_ALPHA_N_INIT,
    XIELU_ALPHA_P_INIT,
    inverse_softplus,
    xielu,
)


class RMSNorm(torch.nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, reduced in fp32 and cast back to the input dtype."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
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
    """

    def __init__(self, config: TransformerConfig, beta: float, eps: float) -> None:
        super().__init__(config=config)
        dtype = config.params_dtype
        alpha_p = inverse_softplus(XIELU_ALPHA_P_INIT)
        alpha_n = inverse_softplus(XIELU_ALPHA_N_INIT - beta)
        self.alpha_p = torch.nn.Parameter(torch.full((1,), alpha_p, dtype=dtype))
        self.alpha_n = torch.nn.Parameter(torch.full((1,), alpha_n, dtype=dtype))
        self.beta = float(beta)
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alphas = copy_to_tensor_model_parallel_region(torch.cat([self.alpha_p, self.alpha_n]))
        return xielu(x, alphas[0:1], alphas[1:2], self.beta, self.eps)


class SDPAttention(MegatronModule):
    """Causal (or explicitly masked) attention through PyTorch's SDPA, GQA without expanding K/V."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """[s, b, heads, d] query and [s, b, groups, d] key/value -> [s, b, heads * d]."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention takes neither attention_bias nor packed_seq_params")
        seq, batch, heads, dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # megatron-core masks are True where attention is *forbidden*; SDPA's are the opposite.
        mask = None if attention_mask is None else ~attention_mask
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != heads,
        )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)
