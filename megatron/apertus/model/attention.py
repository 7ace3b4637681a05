"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

Flash/memory-efficient kernels on GPU, a fused kernel on CPU, native GQA (no K/V expansion).
Two layouts:

* ``sbhd`` (``[s, b, heads, d]``): causal attention over each sample, or an explicit mask.
* ``thd`` packed documents (``[t, heads, d]`` with ``packed_seq_params.cu_seqlens_q``): each
  segment attends causally to itself only. Segments are processed one SDPA call each, so no
  dense mask is built and a segment's result does not depend on its neighbours.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPAttention(MegatronModule):
    """megatron-core ``core_attention`` slot filled by PyTorch SDPA."""

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
        self.softmax_scale = softmax_scale
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def _sdpa(self, q, k, v, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """q [b, heads, s, d], k/v [b, groups, s, d] -> [b, heads, s, d]."""
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention_bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        seq, batch, heads, dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # megatron-core masks are True where attention is *forbidden*; SDPA's are the opposite.
        mask = None if attention_mask is None else ~attention_mask
        out = self._sdpa(q, k, v, mask)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)

    def _packed(self, query, key, value, params: PackedSeqParams) -> torch.Tensor:
        """[t, heads, d] -> [t, heads * d], attending within each ``cu_seqlens`` segment."""
        if params.qkv_format != "thd":
            raise ValueError(f"SDPAttention packs only the thd format, got {params.qkv_format!r}")
        bounds = params.cu_seqlens_q.tolist()
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            outputs.append(self._sdpa(q, k, v, None).squeeze(0).transpose(0, 1))
        out = torch.cat(outputs)
        return out.reshape(out.shape[0], -1)
