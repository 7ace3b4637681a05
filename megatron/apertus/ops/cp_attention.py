"""Exact causal attention over a sequence split across context-parallel (CP) ranks.

Layout (Megatron-LM's and Transformer Engine's): a sequence of ``S`` tokens is cut into ``2N``
equal chunks for ``N`` CP ranks and rank ``i`` keeps chunks ``i`` and ``2N-1-i``, so every rank
holds as much of the causal triangle as any other. Packed documents (THD) are cut the same way
one document at a time (each document's length a multiple of ``2N``): rank ``i`` holds chunks
``i`` and ``2N-1-i`` of every document, in document order. :func:`sequence_partition` and
:func:`document_partition` give each rank's global token indices; ``doc_start[t]`` is the
global index of the first token of ``t``'s document, and query ``q`` may see key ``k`` iff
``doc_start[q] <= k <= q``. With that rule documents never see each other, whatever rank they
land on.

Two ways to attend, both exact (the same softmax as one process, to fp32 round-off), forward
and backward, over any ``torch.distributed`` backend (gloo on CPU, NCCL on CUDA):

* ``p2p`` (ring): K/V blocks travel around the CP ring; each rank attends its queries to every
  block in tiles (query piece, key piece; each a piece of one chunk of at most ``TILE`` tokens),
  skips the tiles that the mask empties, and merges the partial results
  with their log-sum-exp. The backward pass recomputes the tiles from the saved log-sum-exp and
  sends each block's K/V gradient around the ring with the block until it is home.
* ``a2a`` (all-to-all, "Ulysses"): an all-to-all turns [local tokens, all heads] into [all
  tokens, ``1/N`` of the heads], each rank puts the tokens back in sequence order and attends over
  each document for its heads with the same causal SDPA calls one process makes, and the inverse
  all-to-all brings the result back. Needs heads divisible by ``N``; key/value heads that
  are not are repeated per query head first (their gradients summed back by autograd).
* ``a2a+p2p`` (hierarchical, Megatron-LM's ``--hierarchical-context-parallel-sizes A P``): the CP
  ranks form P groups of A (megatron-core's level groups: CP rank ``a + A p`` is rank ``a`` of
  the all-to-all group and rank ``p`` of the ring). An all-to-all within the A ranks turns
  [local tokens, all heads] into [their A x local tokens, ``1/A`` of the heads], the ring over
  the P groups attends those tokens to every group's (each ring member holds the union of its
  A ranks' chunks, so the ring's blocks are A x larger and travel P - 1 steps instead of
  CP - 1), and the inverse all-to-all brings the result back. Heads (and the key/value heads
  the ring passes, else repeated per query head first) divisible by A.

Shapes: ``q`` [b, heads, s_local, d]; ``k``, ``v`` [b, groups, s_local, d] (GQA: ``heads`` a
multiple of ``groups``). Scores, softmax statistics and accumulators are fp32.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

COMM_TYPES = ("p2p", "a2a", "a2a+p2p")


# -- partitions ------------------------------------------------------------------------------------


def sequence_partition(seq_length: int, cp_size: int) -> torch.Tensor:
    """[cp_size, seq_length / cp_size] global token indices of each rank: chunks i and 2N-1-i."""
    if seq_length % (2 * cp_size):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x CP ({cp_size})")
    chunks = torch.arange(seq_length).view(2 * cp_size, -1)
    return torch.stack(
        [torch.cat([chunks[r], chunks[2 * cp_size - 1 - r]]) for r in range(cp_size)]
    )


def document_partition(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """[cp_size, total / cp_size] global token indices of each rank when every document of the
    packed sequence (boundaries ``cu_seqlens``) is cut into 2N chunks on its own (TE's THD CP)."""
    bounds = cu_seqlens.tolist()
    parts = [
        sequence_partition(end - start, cp_size) + start
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(parts, dim=1)


def document_starts(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[total] global index of the first token of each token's document."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)


def allowed(q_index: torch.Tensor, k_index: torch.Tensor, doc_start: torch.Tensor) -> torch.Tensor:
    """[s_q, s_k] True where the query may attend to the key: same document, not in the future."""
    q, k = q_index[:, None], k_index[None, :]
    return (k <= q) & (k >= doc_start[q_index][:, None])


# -- reference -------------------------------------------------------------------------------------


def reference_attention(q, k, v, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked softmax attention on one process (``mask`` [s_q, s_k], True = attend)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


# -- ring (p2p) ------------------------------------------------------------------------------------


def _accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 and narrower inputs, fp64 for fp64 (gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def _grouped(q: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, heads, s, d] -> [b, groups, heads/groups, s, d] (GQA: each group shares one K/V head)."""
    b, h, s, d = q.shape
    return q.reshape(b, groups, h // groups, s, d)


def _tile_forward(q, k, v, mask, scale):
    """Partial attention of a query tile to a key tile: (out, lse), fp32; lse -inf where a query
    row sees no key of the tile."""
    scores = torch.einsum("bgrqd,bgkd->bgrqk", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return torch.einsum("bgrqk,bgkd->bgrqd", probs, v), lse


def _merge(out, lse, tile_out, tile_lse):
    """Combine two softmax-normalised partial results by their log-sum-exp."""
    total = torch.logaddexp(lse, tile_lse)
    finite = torch.isfinite(total)
    w_old = torch.where(finite, torch.exp(lse - total), 0.0)[..., None]
    w_new = torch.where(finite, torch.exp(tile_lse - total), 0.0)[..., None]
    return out * w_old + tile_out * w_new, total


def _tile_backward(q, k, v, mask, scale, lse, d_out, delta):
    """Gradients of one tile given the final lse and ``delta = rowsum(d_out * out)``."""
    scores = torch.einsum("bgrqd,bgkd->bgrqk", q, k) * scale
    probs = torch.exp(scores - lse[..., None]).masked_fill(~mask, 0.0)
    dv = torch.einsum("bgrqk,bgrqd->bgkd", probs, d_out)
    dp = torch.einsum("bgrqd,bgkd->bgrqk", d_out, v)
    ds = probs * (dp - delta[..., None])
    dq = torch.einsum("bgrqk,bgkd->bgrqd", ds, k) * scale
    dk = torch.einsum("bgrqk,bgrqd->bgkd", ds, q) * scale
    return dq, dk, dv


TILE = 1024
"""Largest query or key extent of a tile: bounds the fp32 scores a tile materialises
(heads x TILE x TILE) however long the sequence."""


def _pieces(length: int) -> list[slice]:
    """A rank's two chunks (one half each: the tiles whose mask may be empty or full), each cut
    into pieces of at most :data:`TILE` tokens."""
    half = length // 2
    halves = [(0, half), (half, length)] if half else [(0, length)]
    return [
        slice(start, min(start + TILE, end))
        for begin, end in halves
        for start in range(begin, end, TILE)
    ]


def _tiles(q_index, k_index, doc_start):
    """(query slice, key slice, mask) of every tile of a block that has something to attend."""
    for qs in _pieces(len(q_index)):
        for ks in _pieces(len(k_index)):
            mask = allowed(q_index[qs], k_index[ks], doc_start)
            if mask.any():
                yield qs, ks, mask


class _Ring:
    """Point-to-point exchange with the CP neighbours: send to rank+1, receive from rank-1."""

    def __init__(self, group) -> None:
        self.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.size, self.rank = size, rank
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def source(self, step: int) -> int:
        """CP rank whose block this rank holds after ``step`` shifts."""
        return (self.rank - step) % self.size

    def start_shift(self, tensor: torch.Tensor):
        """Send ``tensor`` on and start receiving the previous rank's; returns (buffer, waits)."""
        if self.size == 1:
            return tensor, []
        buffer = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group),
            dist.P2POp(dist.irecv, buffer, self.prev, self.group),
        ]
        return buffer, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(requests) -> None:
        for request in requests:
            request.wait()


class RingAttention(torch.autograd.Function):
    """p2p context-parallel attention; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, index, doc_start, scale, group):
        ring = _Ring(group)
        acc = _accumulation_dtype(q)
        qg = _grouped(q.to(acc), k.shape[1])
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        my_index = index[ring.rank]
        for step in range(ring.size):
            pending = ring.start_shift(kv) if step + 1 < ring.size else None
            k_index = index[ring.source(step)]
            kf, vf = kv[0].to(acc), kv[1].to(acc)
            for qs, ks, mask in _tiles(my_index, k_index, doc_start):
                tile = _tile_forward(qg[..., qs, :], kf[..., ks, :], vf[..., ks, :], mask, scale)
                out[..., qs, :], lse[..., qs] = _merge(out[..., qs, :], lse[..., qs], *tile)
            if pending is not None:
                kv, requests = pending
                ring.finish(requests)
        ctx.save_for_backward(q, k, v, out, lse, index, doc_start)
        ctx.scale, ctx.group = scale, group
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, index, doc_start = ctx.saved_tensors
        ring, scale = _Ring(ctx.group), ctx.scale
        acc = _accumulation_dtype(q)
        qg = _grouped(q.to(acc), k.shape[1])
        dog = _grouped(d_out.to(acc), k.shape[1])
        delta = (dog * out).sum(-1)
        dq = torch.zeros_like(qg)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=acc, device=k.device)
        my_index = index[ring.rank]
        for step in range(ring.size):
            pending = ring.start_shift(kv) if step + 1 < ring.size else None
            k_index = index[ring.source(step)]
            kf, vf = kv[0].to(acc), kv[1].to(acc)
            for qs, ks, mask in _tiles(my_index, k_index, doc_start):
                grads = _tile_backward(
                    qg[..., qs, :],
                    kf[..., ks, :],
                    vf[..., ks, :],
                    mask,
                    scale,
                    lse[..., qs],
                    dog[..., qs, :],
                    delta[..., qs],
                )
                dq[..., qs, :] += grads[0]
                dkv[0][..., ks, :] += grads[1]
                dkv[1][..., ks, :] += grads[2]
            # The block's gradient travels with it and is home after one more shift than K/V.
            dkv, grad_requests = ring.start_shift(dkv)
            ring.finish(grad_requests)
            if pending is not None:
                kv, requests = pending
                ring.finish(requests)
        dq = dq.reshape(q.shape).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


# -- all-to-all (a2a) ------------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` over the group's ranks, concatenate what arrives along
    ``gather_dim`` (in rank order)."""
    size = dist.get_world_size(group)
    inputs = [t.contiguous() for t in x.chunk(size, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _HeadsToSequence(torch.autograd.Function):
    """[b, heads, s_local, d] -> [b, heads/N, s, d]; the backward pass is the inverse exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, scatter_dim=1, gather_dim=2, group=group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, scatter_dim=2, gather_dim=1, group=ctx.group), None


class _SequenceToHeads(torch.autograd.Function):
    """[b, heads/N, s, d] -> [b, heads, s_local, d]; the inverse of :class:`_HeadsToSequence`."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, scatter_dim=2, gather_dim=1, group=group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, scatter_dim=1, gather_dim=2, group=ctx.group), None


def _heads_split(q, k, v, size: int, what: str):
    """``k`` and ``v`` ready to split their heads over ``size`` ranks like ``q``'s: repeated per
    query head when their heads do not divide (their gradients summed back by autograd)."""
    if q.shape[1] % size:
        raise ValueError(
            f"{what} context parallelism needs attention heads ({q.shape[1]}) divisible by "
            f"{size}, the ranks of its all-to-all"
        )
    if k.shape[1] % size:  # fewer key/value heads than ranks: give each query head its own
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return k, v


def all_to_all_attention(q, k, v, index, doc_start, scale, group) -> torch.Tensor:
    """a2a context-parallel attention; see the module docstring."""
    k, v = _heads_split(q, k, v, dist.get_world_size(group), "a2a")
    order = index.reshape(-1)  # the gathered tokens: rank 0's, then rank 1's, ...
    to_global = torch.argsort(order)
    qs, ks, vs = (_HeadsToSequence.apply(t, group)[:, :, to_global] for t in (q, k, v))
    out = causal_per_document(qs, ks, vs, doc_start, scale)
    return _SequenceToHeads.apply(out[:, :, order], group)


def causal_per_document(q, k, v, doc_start: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal SDPA over each document of a whole sequence in its own order: the very calls one
    process makes (so a2a gives the bytes of CP=1 where the kernel does)."""
    gqa = k.shape[1] != q.shape[1]
    starts = torch.unique_consecutive(doc_start).tolist() + [doc_start.numel()]
    outputs = [
        F.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scale, enable_gqa=gqa
        )
        for a, b in zip(starts[:-1], starts[1:])
    ]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


# -- hierarchical (a2a+p2p) ------------------------------------------------------------------------


def hierarchical_index(index: torch.Tensor, a2a_size: int) -> torch.Tensor:
    """[P, A x s_local] the global token indices each ring member holds after the all-to-all:
    CP rank ``a + A p``'s tokens are the ``a``-th part of ring member ``p``'s (megatron-core's
    level groups; the all-to-all gathers in rank order)."""
    cp, local = index.shape
    if cp % a2a_size:
        raise ValueError(f"CP size {cp} is not divisible by the all-to-all level's {a2a_size}")
    return index.reshape(cp // a2a_size, a2a_size * local)


def hierarchical_attention(q, k, v, index, doc_start, scale, a2a_group, ring_group):
    """a2a+p2p context-parallel attention; see the module docstring."""
    a2a_size = dist.get_world_size(a2a_group)
    k, v = _heads_split(q, k, v, a2a_size, "a2a+p2p")
    qs, ks, vs = (_HeadsToSequence.apply(t, a2a_group) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ring_index = hierarchical_index(index, a2a_size)
    out = RingAttention.apply(qs, ks, vs, ring_index, doc_start, scale, ring_group)
    return _SequenceToHeads.apply(out, a2a_group)


# -- dispatch --------------------------------------------------------------------------------------


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    index: torch.Tensor,
    doc_start: torch.Tensor,
    group,
    comm_type: str = "p2p",
    scale: float | None = None,
    levels: tuple | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries ``q`` to the whole sequence held by ``group``.

    ``index`` [N, s_local]: every CP rank's global token indices (:func:`sequence_partition`,
    :func:`document_partition`); ``doc_start`` [S]: first token of each token's document.
    ``levels``: for ``a2a+p2p``, the (all-to-all, ring) groups of this rank, whose sizes
    multiply to ``group``'s.
    """
    if comm_type == "a2a+p2p":
        if levels is None or len(levels) != 2:
            raise ValueError("cp_comm_type a2a+p2p needs the two hierarchical CP groups")
        return hierarchical_attention(q, k, v, index, doc_start, scale, *levels)
    if comm_type == "p2p":
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        return RingAttention.apply(q, k, v, index, doc_start, scale, group)
    if comm_type == "a2a":
        return all_to_all_attention(q, k, v, index, doc_start, scale, group)
    raise ValueError(f"cp_comm_type must be one of {', '.join(COMM_TYPES)}, got {comm_type!r}")
