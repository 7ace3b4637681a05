"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

Flash/memory-efficient kernels on GPU, a fused kernel on CPU, native GQA (no K/V expansion).
Two layouts:

* ``sbhd`` (``[s, b, heads, d]``): causal attention over each sample, or an explicit mask.
* ``thd`` packed documents (``[t, heads, d]`` with ``packed_seq_params.cu_seqlens_q``): each
  segment attends causally to itself only. On CUDA in bf16/fp16 all segments go through one
  varlen flash-attention call (``torch.nn.attention.varlen.varlen_attn``); elsewhere (CPU,
  fp32) through one SDPA call per segment, the exact reference. Neither builds a dense mask,
  and a segment's result does not depend on its neighbours.

Under context parallelism (``--context-parallel-size`` > 1) each rank holds chunks ``i`` and
``2N-1-i`` of the sequence (of every document when packed) and attends through
:mod:`megatron.apertus.ops.cp_attention` (ring ``p2p``, ``a2a`` or hierarchical ``a2a+p2p``
over megatron-core's hierarchical CP groups; the layer's ``cp_comm_type``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.apertus.ops.cp_attention import (
    context_parallel_attention,
    document_partition,
    document_starts,
    sequence_partition,
)


@functools.cache
def _varlen_attn() -> Callable | None:
    """torch's varlen flash attention (torch >= 2.10, CUDA builds), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _varlen_takes_gqa() -> bool:
    """Whether varlen_attn takes ``enable_gqa`` (newer torch). Without it the key/value heads
    are repeated: torch 2.11's kernel accepted fewer of them, but its result with them is
    untested, so the verified path is kept."""
    return "enable_gqa" in inspect.signature(_varlen_attn()).parameters


def uses_varlen(query: torch.Tensor) -> bool:
    """Whether packed documents of ``query`` go through the varlen flash kernel."""
    return (
        query.is_cuda
        and query.dtype in (torch.bfloat16, torch.float16)
        and _varlen_attn() is not None
    )


def _hierarchical_groups(pg_collection, cp_group) -> tuple:
    """megatron-core's (all-to-all, ring) hierarchical CP groups of this rank
    (``pg_collection.hcp``; a collection without them, as megatron-core's Attention builds when
    given none, gets megatron-core's default), checked to be laid out as the attention assumes:
    CP rank ``a + A p`` is rank ``a`` of the all-to-all and ``p`` of the ring."""
    if getattr(pg_collection, "hcp", None) is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["hcp"])
    groups = pg_collection.hcp
    if groups is None or len(groups) != 2:
        raise ValueError(
            "cp_comm_type a2a+p2p needs two hierarchical context-parallel groups "
            "(--hierarchical-context-parallel-sizes A P)"
        )
    a2a, ring = groups
    if a2a.size() * ring.size() != cp_group.size() or cp_group.rank() != (
        a2a.rank() + a2a.size() * ring.rank()
    ):
        raise ValueError("the hierarchical CP groups are not laid out as levels of the CP group")
    return a2a, ring


def _end_aligned_causal(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """SDPA's boolean mask (True: may attend) letting query ``i`` of the last ``queries`` of
    ``keys`` tokens see keys ``0 .. keys - queries + i``."""
    allowed = torch.ones(queries, keys, dtype=torch.bool, device=device)
    return allowed.tril(diagonal=keys - queries)


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
        self.cp_group = None
        if config.context_parallel_size > 1:
            if pg_collection is None:  # built outside megatron-core's Attention, which passes one
                pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["cp"])
            self.cp_group = pg_collection.cp
            if config.attention_dropout > 0 or (attention_dropout or 0) > 0:
                raise ValueError("context-parallel attention has no attention dropout")
        self.cp_comm_type = cp_comm_type or config.cp_comm_type or "p2p"
        self.cp_levels = None
        if self.cp_group is not None and self.cp_comm_type == "a2a+p2p":
            self.cp_levels = _hierarchical_groups(pg_collection, self.cp_group)
        self.softmax_scale = softmax_scale
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.current_max_attn_logits: Optional[torch.Tensor] = None

    def _sdpa(self, q, k, v, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """q [b, heads, s_q, d], k/v [b, groups, s_k, d] -> [b, heads, s_q, d].

        Without a mask attention is causal, aligned to the end: under megatron-core's KV cache
        (inference) the queries are the last ``s_q`` of ``s_k`` tokens, and SDPA's own
        ``is_causal`` would align them to the start instead (a decoded token would see only
        the first key)."""
        if mask is None and q.shape[2] != k.shape[2]:
            mask = _end_aligned_causal(q.shape[2], k.shape[2], q.device)
        if self.config.log_max_attention_logit and self.training:
            self._record_max_logit(q, k, mask)
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

    def _record_max_logit(self, q, k, mask: Optional[torch.Tensor]) -> None:
        """QK-clip's statistic (--log-max-attention-logit): each head's largest pre-softmax
        logit ``q . k * scale`` over the keys its queries attend to, the maximum over a step's
        training passes kept in ``current_max_attn_logits`` (the name and shape, [heads], of
        megatron-core's TE attention, which reads it from TE's kernel)."""
        with torch.no_grad():
            keys = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).float()
            scale = self.softmax_scale or q.shape[-1] ** -0.5
            logits = q.float() @ keys.transpose(-1, -2) * scale
            if mask is None:
                mask = _end_aligned_causal(q.shape[2], k.shape[2], q.device)
            heads = logits.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))
        previous = self.current_max_attn_logits
        self.current_max_attn_logits = heads if previous is None else torch.max(previous, heads)

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
        if self.cp_group is not None:
            return self._context_parallel(query, key, value, attention_mask, packed_seq_params)
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        seq, batch, heads, dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # megatron-core masks are True where attention is *forbidden*; SDPA's are the opposite.
        mask = None if attention_mask is None else ~attention_mask
        out = self._sdpa(q, k, v, mask)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)

    def _context_parallel(self, query, key, value, mask, params: PackedSeqParams | None):
        """This rank's chunks attending to the whole sequence of the CP group."""
        if mask is not None:
            raise ValueError("context-parallel attention takes no explicit attention mask")
        cp = self.cp_group.size()
        if params is not None:  # thd [t, heads, d]: one packed row
            cu = params.cu_seqlens_q.cpu()
            index, doc_start = document_partition(cu, cp), document_starts(cu)
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        else:  # sbhd: one causal sequence per sample
            total = query.shape[0] * cp
            index, doc_start = sequence_partition(total, cp), torch.zeros(total, dtype=torch.long)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        index, doc_start = index.to(query.device), doc_start.to(query.device)
        out = context_parallel_attention(
            q,
            k,
            v,
            index=index,
            doc_start=doc_start,
            group=self.cp_group,
            comm_type=self.cp_comm_type,
            scale=self.softmax_scale,
            levels=self.cp_levels,
        )
        if params is not None:
            return out.squeeze(0).transpose(0, 1).reshape(query.shape[0], -1)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _packed(self, query, key, value, params: PackedSeqParams) -> torch.Tensor:
        """[t, heads, d] -> [t, heads * d], attending within each ``cu_seqlens`` segment."""
        if params.qkv_format != "thd":
            raise ValueError(f"SDPAttention packs only the thd format, got {params.qkv_format!r}")
        dropout_active = self.training and self.dropout_p > 0
        # Neither dropout nor the logits' maximum has a varlen kernel.
        if uses_varlen(query) and not dropout_active and not self.config.log_max_attention_logit:
            return self._varlen(query, key, value, params)
        return self._per_segment(query, key, value, params)

    def _varlen(self, query, key, value, params: PackedSeqParams) -> torch.Tensor:
        """All segments in one flash-attention call; ``window_size=(-1, 0)`` is causal."""
        gqa = {}
        if key.shape[1] != query.shape[1]:
            if _varlen_takes_gqa():
                gqa["enable_gqa"] = True
            else:
                repeat = query.shape[1] // key.shape[1]
                key, value = (t.repeat_interleave(repeat, dim=1) for t in (key, value))
        cu = params.cu_seqlens_q.to(device=query.device, dtype=torch.int32)
        longest = int(params.max_seqlen_q)
        out = _varlen_attn()(
            query,
            key,
            value,
            cu,
            cu,
            longest,
            longest,
            scale=self.softmax_scale,
            window_size=(-1, 0),
            **gqa,
        )
        return out.reshape(out.shape[0], -1)

    def _per_segment(self, query, key, value, params: PackedSeqParams) -> torch.Tensor:
        """One SDPA call per segment: the exact reference (CPU, fp32, attention dropout)."""
        bounds = params.cu_seqlens_q.tolist()
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            outputs.append(self._sdpa(q, k, v, None).squeeze(0).transpose(0, 1))
        out = torch.cat(outputs)
        return out.reshape(out.shape[0], -1)
