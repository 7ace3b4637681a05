"""The teacher's top-k instead of its logits: a GPTModel whose last stage returns
``(ids, log-probabilities)`` ``[b, s, k]`` over the full vocabulary, never holding the
[tokens, vocabulary] logits.

The top-k is global over the tensor-parallel vocabulary shards: every shard's own top-k (a
superset of its part of the global top-k) is gathered and reduced once more; the
log-probabilities use the all-reduced log-sum-exp of the full vocabulary. Logits are computed
through the output layer's weight for a chunk of tokens at a time (about 256 MiB of them); each
chunk's logits are bitwise the unchunked output layer's rows (docs/teacher_logits.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megatron.apertus.ops.sparse_kl import row_max_and_sum_exp

TOPK_CHUNK_BYTES = 256 * 2**20
"""Default size of one chunk's logits on the last stage."""


def global_topk(
    logits: torch.Tensor, k: int, *, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` ids (int32) and log-probabilities (fp32) over the full vocabulary from this
    rank's vocabulary shard ``logits [..., V_local]`` (collectives over the tensor-parallel
    ``group``)."""
    vocab_local = logits.shape[-1]
    vocab_start = group.rank() * vocab_local
    row_max, sum_exp = row_max_and_sum_exp(logits.reshape(-1, vocab_local))
    row_max, sum_exp = row_max.view(*logits.shape[:-1], 1), sum_exp.view(*logits.shape[:-1], 1)
    if group.size() > 1:
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        sum_exp = sum_exp * torch.exp(row_max - global_max)
        dist.all_reduce(sum_exp, group=group)
        row_max = global_max
    lse = row_max + sum_exp.log()
    # The logits' own dtype: they were computed in it, so ranking them in fp32 adds nothing.
    values, ids = logits.topk(min(k, vocab_local), dim=-1)
    values, ids = values.float(), ids + vocab_start
    if group.size() > 1:
        values, ids = _gather_candidates(values, ids, group)
        values, pick = values.topk(k, dim=-1)
        ids = ids.gather(-1, pick)
    return ids.int(), values - lse


def global_samples(
    logits: torch.Tensor, uniforms: torch.Tensor, *, group: dist.ProcessGroup
) -> torch.Tensor:
    """Ids (int32 [rows, N]) drawn from softmax(logits) over the full vocabulary by inverse
    CDF at ``uniforms`` (float64 [rows, N] in [0, 1)), from this rank's vocabulary shard
    ``logits [rows, V_local]`` (collectives over the tensor-parallel ``group``).

    The CDF runs in float64 over exp(z - global max): every rank holds the same shard totals, so
    the shards' intervals partition [0, total) exactly and each draw lands on one rank; the
    draws depend on the tensor-parallel size only through float64 rounding of the shard sums."""
    vocab_local = logits.shape[-1]
    rank = group.rank()
    row_max = logits.amax(-1, keepdim=True).double()
    if group.size() > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    # In place: each pass over [rows, V_local] float64 would otherwise fault in a fresh buffer
    # (on CPU that took as long as the arithmetic); the values are the same bits.
    cdf = logits.to(torch.float64, copy=True).sub_(row_max).exp_().cumsum_(-1)
    totals = cdf[:, -1:].contiguous()
    if group.size() > 1:
        gathered = [torch.empty_like(totals) for _ in range(group.size())]
        dist.all_gather(gathered, totals, group=group)
        totals = torch.cat(gathered, -1)
    bounds = torch.nn.functional.pad(totals.cumsum(-1), (1, 0))  # [rows, tp + 1], bounds[:, 0] = 0
    point = uniforms.to(bounds) * bounds[:, -1:]
    last = rank == group.size() - 1
    mine = (point >= bounds[:, rank : rank + 1]) & (last | (point < bounds[:, rank + 1 : rank + 2]))
    column = torch.searchsorted(cdf, (point - bounds[:, rank : rank + 1]).contiguous(), right=True)
    ids = torch.where(mine, column.clamp_max(vocab_local - 1) + rank * vocab_local, -1)
    if group.size() > 1:
        dist.all_reduce(ids, op=dist.ReduceOp.MAX, group=group)
    return ids.int()


def _gather_candidates(values, ids, group):
    """Every shard's top-k side by side: [..., tp * k]."""
    size = group.size()
    all_values = [torch.empty_like(values) for _ in range(size)]
    all_ids = [torch.empty_like(ids) for _ in range(size)]
    dist.all_gather(all_values, values.contiguous(), group=group)
    dist.all_gather(all_ids, ids.contiguous(), group=group)
    return torch.cat(all_values, -1), torch.cat(all_ids, -1)


# -- the output layer in chunks of tokens -----------------------------------------------------------


def default_topk_chunk_rows(vocab_local: int, dtype: torch.dtype) -> int:
    """Rows whose logits [rows, V_local] fill about TOPK_CHUNK_BYTES: a multiple of 64, at least
    64. Depends only on shapes, so all tensor-parallel ranks agree (each chunk has collectives)."""
    rows = TOPK_CHUNK_BYTES // (vocab_local * torch.empty((), dtype=dtype).element_size())
    return max(64, rows // 64 * 64)


def row_chunks(num_rows: int, chunk_rows: int) -> list[slice]:
    """``[0, num_rows)`` in slices of ``chunk_rows``; the remainder joins the last slice.

    Why: a product of few rows can take another GEMM kernel, whose rows differ from the
    unchunked product's in the last bit (on CPU, MKL does so below 4 rows); a short last chunk
    would be such a product. Measured in docs/teacher_logits.md.
    """
    starts = range(0, max(num_rows - chunk_rows, 0) + 1, chunk_rows)
    bounds = [*starts, num_rows]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def output_weight(model: GPTModel) -> torch.Tensor:
    """The output layer's weight [V_local, h]: the word embeddings' when they are tied."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def chunked_topk(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    chunk_rows: int,
    *,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`global_topk` of the logits ``hidden_states [s, b, h] @ weight.T``, ``[b, s, k]``,
    holding one chunk's logits at a time.

    Each chunk is the product megatron-core's output layer computes (``torch.matmul`` in the
    model's dtype), on rows in its token order [s, b]; the results are reordered to [b, s].
    """
    s, b, h = hidden_states.shape
    rows = hidden_states.reshape(s * b, h)
    chunks = row_chunks(s * b, chunk_rows)
    logits = _chunk_logits(rows, weight, max(c.stop - c.start for c in chunks))
    parts = [global_topk(logits(rows[c]), k, group=group) for c in chunks]
    ids, logprobs = (torch.cat(p).view(s, b, -1).transpose(0, 1) for p in zip(*parts))
    return ids, logprobs


def _chunk_logits(rows: torch.Tensor, weight: torch.Tensor, most_rows: int):
    """``chunk -> torch.matmul(chunk, weight.t())`` for chunks of at most ``most_rows`` rows.

    On CPU every chunk's logits go to one buffer: a fresh [rows, V_local] buffer (hundreds of
    MiB) per chunk would be mapped, faulted in page by page and unmapped each time (the same
    measurement as in ``ops/sparse_kl.py``). The product is the same call, so the same bits.
    CUDA's caching allocator already reuses its blocks.
    """
    if rows.is_cuda:
        return lambda chunk: torch.matmul(chunk, weight.t())
    buffer = torch.empty(most_rows * weight.shape[0], dtype=rows.dtype, device=rows.device)

    def logits(chunk: torch.Tensor) -> torch.Tensor:
        out = buffer[: chunk.shape[0] * weight.shape[0]].view(chunk.shape[0], weight.shape[0])
        return torch.matmul(chunk, weight.t(), out=out)

    return logits


def chunked_samples(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    uniforms: torch.Tensor,
    chunk_rows: int,
    *,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """:func:`global_samples` of the logits ``hidden_states [s, b, h] @ weight.T`` at
    ``uniforms [b, s, N]``: the drawn ids ``[b, s, N]``, one chunk's logits at a time."""
    s, b, h = hidden_states.shape
    rows = hidden_states.reshape(s * b, h)
    u = uniforms.to(rows.device).transpose(0, 1).reshape(s * b, -1)
    chunks = row_chunks(s * b, chunk_rows)
    logits = _chunk_logits(rows, weight, max(c.stop - c.start for c in chunks))
    parts = [global_samples(logits(rows[c]), u[c], group=group) for c in chunks]
    return torch.cat(parts).view(s, b, -1).transpose(0, 1)


class TopKGPTModel(GPTModel):
    """megatron-core's GPTModel whose last stage returns the top-``topk`` ids and
    log-probabilities, computed by :func:`chunked_topk` from its final hidden states (after the
    final norm), ``chunk_rows`` tokens at a time (None: about TOPK_CHUNK_BYTES of logits).

    ``_postprocess`` (output layer, logits) is the one behaviour megatron-core's GPTModel offers
    no hook for: here it hands the final hidden states back to :meth:`forward`. Multi-token
    prediction, which that method also runs, is not used by Apertus.
    """

    def __init__(self, *args, topk: int, chunk_rows: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.topk, self.chunk_rows = topk, chunk_rows

    def forward(self, *args, uniforms: torch.Tensor | None = None, **kwargs):
        """GPTModel.forward; the last stage returns ``(ids, log-probabilities)`` [b, s, k], or
        with ``uniforms`` (float64 [b, s, N] in [0, 1), in the layout of the call's tokens: a
        sampled store) ``(ids,)``, ids [b, s, N] drawn from the teacher at them."""
        hidden_states = super().forward(*args, **kwargs)
        if not self.post_process:
            return hidden_states
        weight = output_weight(self)
        rows = self.chunk_rows or default_topk_chunk_rows(weight.shape[0], weight.dtype)
        tp = self.pg_collection.tp
        if uniforms is not None:
            return (chunked_samples(hidden_states, weight, uniforms, rows, group=tp),)
        return chunked_topk(hidden_states, weight, self.topk, rows, group=tp)

    def _postprocess(self, hidden_states: torch.Tensor, *args, **kwargs):
        """The final hidden states of all tokens (the output layer's own sequence-parallel
        gather), whose top-k :meth:`forward` takes."""
        if not self.post_process:
            return super()._postprocess(hidden_states, *args, **kwargs)
        if self.config.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, group=self.pg_collection.tp
            )
        return hidden_states
