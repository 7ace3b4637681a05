"""A micro-batch's share for one context-parallel (CP) rank.

Every CP rank of a data-parallel replica reads the same micro-batch, whole: Goldfish's drop mask,
document boundaries, SFT loss masks and teacher targets are computed on the whole sequence, then
:func:`shard_batch` keeps this rank's tokens of each tensor, so their meaning cannot depend on
the split.

* Unpacked ``[b, s]``: Megatron-LM's split, ``2N`` chunks of the sequence, rank ``i`` keeps
  chunks ``i`` and ``2N-1-i`` (:func:`~megatron.apertus.ops.cp_attention.sequence_partition`).
* Packed documents (``thd``): each document is padded to a multiple of ``2N`` tokens and cut into
  ``2N`` chunks on its own, as Transformer Engine's THD context parallelism requires
  (:func:`~megatron.apertus.ops.cp_attention.document_partition`). Padding tokens repeat the
  document's last token, carry no loss and come after every real token of their document, so no
  real token attends to them: the loss and the gradients are those of the unpadded batch.
  ``cu_seqlens`` (padded, whole sequence) travel on so attention and RoPE know the layout.

Goldfish's counts (dropped, eligible) describe the whole micro-batch; CP rank 0 reports them, the
others report zero, so the sum over the data- and context-parallel group counts each once.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.apertus.data.batches import Batch
from megatron.apertus.ops.cp_attention import document_partition, sequence_partition


def padded_document_sources(cu_seqlens: torch.Tensor, cp_size: int):
    """(source, real, padded cu_seqlens): for each token of the padded packed sequence, the index
    of the original token it copies, and whether it is a real token (not padding)."""
    multiple = 2 * cp_size
    sources, real, bounds = [], [], [0]
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        padded = -(end - start) // multiple * -multiple
        index = torch.arange(start, start + padded).clamp(max=end - 1)
        sources.append(index)
        real.append(torch.arange(padded) < end - start)
        bounds.append(bounds[-1] + padded)
    return torch.cat(sources), torch.cat(real), torch.tensor(bounds, dtype=torch.int32)


def _take(t: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    """Tokens ``index`` of ``t`` along its sequence dimension (dim 1 of [b, s, ...])."""
    return None if t is None else t[:, index].contiguous()


def _shard_teacher(teacher, index: torch.Tensor):
    if teacher is None:
        return None
    return teacher._replace(ids=_take(teacher.ids, index), probs=_take(teacher.probs, index))


def shard_tokens(t: torch.Tensor, batch: Batch, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This CP rank's tokens of a per-token tensor ``t`` [b, s, ...] laid out as ``batch``'s
    tokens, in the order :func:`shard_batch` keeps them (padding repeats a document's last)."""
    if cp_size == 1:
        return t
    params = batch.packed_seq_params
    if params is None:
        return _take(t, sequence_partition(batch.tokens.shape[1], cp_size)[cp_rank])
    sources, _, cu_padded = padded_document_sources(params.cu_seqlens_q, cp_size)
    return _take(t, sources[document_partition(cu_padded, cp_size)[cp_rank]])


def shard_batch(batch: Batch, cp_rank: int, cp_size: int) -> Batch:
    """This CP rank's tokens of ``batch`` (the batch itself when ``cp_size`` is 1)."""
    if cp_size == 1:
        return batch
    counts = {} if cp_rank == 0 else {"goldfish_dropped": 0, "loss_positions": 0}
    params = batch.packed_seq_params
    if params is None:
        index = sequence_partition(batch.tokens.shape[1], cp_size)[cp_rank]
        return dataclasses.replace(
            batch,
            tokens=_take(batch.tokens, index),
            labels=_take(batch.labels, index),
            loss_mask=_take(batch.loss_mask, index),
            position_ids=_take(batch.position_ids, index),
            teacher=_shard_teacher(batch.teacher, index),
            **counts,
        )
    sources, real, cu_padded = padded_document_sources(params.cu_seqlens_q, cp_size)
    mine = document_partition(cu_padded, cp_size)[cp_rank]
    index = sources[mine]
    starts = torch.repeat_interleave(cu_padded[:-1].long(), (cu_padded[1:] - cu_padded[:-1]).long())
    longest = int((cu_padded[1:] - cu_padded[:-1]).max())
    return dataclasses.replace(
        batch,
        tokens=_take(batch.tokens, index),
        labels=_take(batch.labels, index),
        loss_mask=_take(batch.loss_mask, index) * real[mine].to(batch.loss_mask.dtype),
        position_ids=(mine - starts[mine]).unsqueeze(0),
        teacher=_shard_teacher(batch.teacher, index),
        packed_seq_params=dataclasses.replace(
            params,
            cu_seqlens_q=cu_padded,
            cu_seqlens_kv=cu_padded,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        ),
        **counts,
    )


def gather_tokens(local: torch.Tensor, batch: Batch, cp_rank: int, cp_size: int, group):
    """The inverse of :func:`shard_batch` for a per-token output ``local`` [b, s_local, ...]:
    every CP rank's share gathered into ``batch``'s whole-sequence order [b, s, ...] (padding
    dropped). Every rank of ``group`` (the CP group) must call it."""
    if cp_size == 1:
        return local
    shares = [torch.empty_like(local) for _ in range(cp_size)]
    torch.distributed.all_gather(shares, local.contiguous(), group=group)
    everything = torch.cat(shares, dim=1)
    params = batch.packed_seq_params
    out = local.new_empty((local.shape[0], batch.tokens.shape[1], *local.shape[2:]))
    if params is None:
        out[:, sequence_partition(batch.tokens.shape[1], cp_size).reshape(-1)] = everything
        return out
    sources, real, cu_padded = padded_document_sources(params.cu_seqlens_q, cp_size)
    order = document_partition(cu_padded, cp_size).reshape(-1)
    keep = real[order]
    out[:, sources[order][keep]] = everything[:, keep.to(everything.device)]
    return out
