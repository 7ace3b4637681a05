"""Per-GPU memory of an Apertus layout: model states, activations, loss buffers.

Model states, per parameter held by a rank (megatron-core DDP with ``grad_reduce_in_fp32``, as
``training/step.py`` builds it):

* weights in the training dtype (2 bytes bf16, 4 bytes fp32);
* gradients in DDP's fp32 ``main_grad`` buffer (4 bytes), never sharded;
* optimizer: fp32 master weights (bf16 training only; fp32 training updates the weights
  themselves) and 2 fp32 moments for Adam or 3 for AdEMAMix (``exp_avg``, ``exp_avg_slow``,
  ``exp_avg_sq``); the distributed optimizer shards all of these over data-parallel ranks.

Activations follow the accounting of Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (arXiv 2205.05198): bytes saved for backward per
layer and micro-batch, divided by TP where tensors are split over heads or MLP columns and, with
sequence parallelism, also where they are split over the sequence. Their GPT layer is replaced
by ours, term by term (``layer_activation_bytes``): RMSNorms that save an fp32 copy of their
input, fused QKV with per-head QK-norm, GQA, SDPA attention that keeps the flash-style
log-sum-exp instead of the s x s scores (so there is no ``5as/h`` term, and megatron-core's
selective recomputation of ``core_attn`` only saves the log-sum-exp), no dropout masks, and the
non-gated xIELU MLP (two f-wide tensors). The table was read off the saved-tensor hooks of the
real layer and is tested against them (``tests/launch/test_memory.py``). Transformer Engine's
layers save less (``--transformer-impl transformer_engine``: norms fused into the GEMMs, no
fp32 copies), a table checked against peak GPU memory instead.

Context parallelism (CP ranks share one sequence, Megatron's split into 2 x CP chunks): every
tensor above holds the rank's seq / CP tokens, so activations, RoPE tables and the loss buffers
fall by CP. What CP adds is a working set of one layer at a time (``cp_buffer_bytes``): with
``p2p`` the ring's send/receive buffers, two blocks of keys and values in forward and two of
keys, values and their gradients in backward; with ``a2a`` the query, key, value and output
tensors in their head-split layout while attention runs; with ``a2a+p2p`` (hierarchical sizes
A x P) both: the head-split tensors of the A-rank all-to-all and the ring's four blocks, each
A x the tokens at 1/A of the heads (a per-layer list: the largest of its kinds). Per step, each
GPU sends ``cp_layer_traffic`` per layer and micro-batch. Gradients are reduced, and with the
distributed optimizer its states sharded, over data-parallel x context-parallel ranks.

Pipelining: with 1F1B, pipeline rank r holds min(PP - r, M) micro-batches in flight; with
interleaving, min(2 (PP - r - 1) + (VP - 1) PP + 1, M VP) model chunks (megatron-core's warmup
plus one). Not modelled: transient buffers (an op's temporaries, communication buffers, the CUDA
context, allocator fragmentation); the planner keeps a share of each GPU for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron.apertus.model.config import ApertusConfig, ParallelConfig
from megatron.apertus.ops.sparse_kl import default_chunk_rows

OPTIMIZER_MOMENTS = {"adam": 2, "ademamix": 3}
"""fp32 moment tensors per parameter."""
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = 4


@dataclass(kw_only=True, frozen=True)
class Recompute:
    """Activation recomputation as megatron-core's ``TransformerConfig`` takes it."""

    granularity: str | None = None
    """None, ``selective`` (recompute core attention) or ``full``."""
    method: str | None = None
    """``uniform`` (checkpoint groups of ``num_layers``) or ``block`` (the first ``num_layers``)."""
    num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.granularity not in (None, "selective", "full"):
            raise ValueError(
                f"--recompute-granularity must be selective or full, got {self.granularity!r}"
            )
        if self.granularity == "full" and (
            self.method not in ("uniform", "block") or not self.num_layers
        ):
            raise ValueError(
                "--recompute-granularity full needs --recompute-method uniform|block and "
                "--recompute-num-layers N"
            )


@dataclass(kw_only=True, frozen=True)
class Shape:
    """One micro-batch as a rank sees it."""

    seq_length: int
    micro_batch_size: int
    tp: int
    sequence_parallel: bool
    dtype_bytes: int
    """Bytes per activation element (the training dtype)."""
    device: str = "cuda"
    """Where it runs (the fused loss sizes its chunks by device)."""
    context_parallel: int = 1
    """Ranks that share each sequence (``--context-parallel-size``)."""
    cp_comm_type: str | tuple[str, ...] = "p2p"
    """One comm type, or one per transformer layer (Megatron-LM's per-layer list)."""
    a2a_size: int = 1
    """Ranks of the all-to-all level of ``a2a+p2p`` (``--hierarchical-context-parallel-sizes``'s
    first)."""
    transformer_impl: str = "local"
    """``--transformer-impl``: the layers whose saved tensors ``layer_activation_bytes`` counts."""

    @property
    def local_seq_length(self) -> int:
        """Tokens of each sequence on this rank."""
        return self.seq_length // self.context_parallel

    @property
    def tokens(self) -> int:
        return self.local_seq_length * self.micro_batch_size

    @property
    def seq_split(self) -> int:
        """Over how many ranks the tensors outside attention and MLP are split."""
        return self.tp if self.sequence_parallel else 1


# -- parameters ------------------------------------------------------------------------------


def layer_parameters(model: ApertusConfig, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank (norms and xIELU scalars replicated)."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.kv_channels
    qkv = h * d * (model.num_attention_heads + 2 * model.num_query_groups)
    projection = model.num_attention_heads * d * h
    sharded = qkv + projection + 2 * h * f
    replicated = 2 * h + (2 * d if model.qk_layernorm else 0) + 2  # norms, QK-norms, alphas
    return sharded // tp + replicated


def stage_parameters(model: ApertusConfig, parallel: ParallelConfig, pipeline_rank: int) -> int:
    """Parameters held by one rank of pipeline stage ``pipeline_rank`` (all its model chunks).

    The first stage holds the embedding, the last the final norm and the output layer; with tied
    embeddings and PP > 1 the last stage keeps its own copy of the embedding as output weight.
    """
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    vocab = model.vocab_size * model.hidden_size // tp
    count = model.num_layers // pp * layer_parameters(model, tp)
    if pipeline_rank == 0:
        count += vocab
    if pipeline_rank == pp - 1:
        count += model.hidden_size
        if model.untie_embeddings_and_output_weights or pp > 1:
            count += vocab
    return count


# -- activations -----------------------------------------------------------------------------


def fp8_weight_cache_bytes(model: ApertusConfig) -> float:
    """What FP8 adds to a bf16 plan at most: TE keeps each GEMM weight of the blocks as e4m3 and
    its transpose (one byte each) between the forward and the backward. Not part of
    :func:`stage_memory`: recorded FP8 peaks lie between the bf16 estimate and it plus these
    copies, since FP8 also saves some activations in one byte (``tests/launch/test_memory.py``)."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.kv_channels
    qkv = h * d * (model.num_attention_heads + 2 * model.num_query_groups)
    gemm_weights = qkv + model.num_attention_heads * d * h + 2 * h * f
    return 2 * model.num_layers * gemm_weights


def layer_activation_bytes(model: ApertusConfig, shape: Shape, *, selective: bool = False) -> float:
    """Bytes one transformer layer saves for backward for one micro-batch (no recomputation).

    ``selective``: megatron-core's selective recomputation of core attention, which drops
    SDPA's log-sum-exp (its inputs and output stay saved).
    """
    per_token = (
        _te_layer_bytes_per_token(model, shape, selective)
        if shape.transformer_impl == "transformer_engine"
        else _local_layer_bytes_per_token(model, shape, selective)
    )
    rope_tables = 4 * shape.local_seq_length * model.kv_channels * shape.dtype_bytes  # q, k cos/sin
    xielu_alphas = 2 * shape.dtype_bytes
    return per_token * shape.tokens + rope_tables + xielu_alphas


def _layer_dims(model: ApertusConfig, shape: Shape) -> tuple[int, ...]:
    """Hidden, FFN and key/value widths, heads, query groups, bytes per element, TP and the
    sequence split: the letters of the activation tables."""
    kv = model.kv_channels * model.num_query_groups
    return (
        model.hidden_size,
        model.ffn_hidden_size,
        kv,
        model.num_attention_heads,
        model.num_query_groups,
        shape.dtype_bytes,
        shape.tp,
        shape.seq_split,
    )


def _local_layer_bytes_per_token(model: ApertusConfig, shape: Shape, selective: bool) -> float:
    """The local layers: RMSNorms that save an fp32 copy of their input, separate linears."""
    h, f, kv, nh, ng, p, t, r = _layer_dims(model, shape)
    norm = (FP32 * h + p * h + FP32) / r  # fp32 copy of the input, normalised x, 1/rms
    # q is copied out of the fused QKV output when a rank holds several query groups; in fp32
    # .float() returns that copy (or, for k and for one group, the QKV output's view) itself.
    q_copy = FP32 * h if p < FP32 or ng > t else 0
    k_copy = FP32 * kv if p < FP32 else 0
    return (
        2 * norm  # input and pre-MLP RMSNorm
        + 2 * p * h / r  # inputs of linear_qkv and linear_fc1 (gathered again in backward)
        + p * (h + 2 * kv) / t  # QKV output (its views k and v are saved)
        + (q_copy + p * h + FP32 * nh) / t  # q-norm: input, normed q, 1/rms
        + (k_copy + p * kv + FP32 * ng) / t  # k-norm
        + p * (h + kv) / t  # SDPA's q and k after RoPE
        + p * h / t  # SDPA output = linear_proj input
        + (0 if selective else FP32 * nh / t)  # SDPA log-sum-exp
        + 2 * p * f / t  # xIELU input (fc1 output) and fc2 input
    )


def _te_layer_bytes_per_token(model: ApertusConfig, shape: Shape, selective: bool) -> float:
    """Transformer Engine's layers: RMSNorm fused into the QKV and fc1 GEMMs, which keep the
    input and the normalised input in the training dtype (sequence-split, gathered again in
    backward) and an fp32 1/rms, and TE's QK-norm, which keeps only 1/rms beside its input (the
    QKV output). Checked against the 1.5B's peak memory on an H200 (docs/long_context.md)."""
    h, f, kv, nh, ng, p, t, r = _layer_dims(model, shape)
    return (
        2 * (2 * p * h + FP32) / r  # fused norm + linear (QKV, fc1): input, normalised, 1/rms
        + p * (h + 2 * kv) / t  # QKV output: q and k as QK-norm's inputs, v as attention's
        + FP32 * (nh + ng) / t  # QK-norm's 1/rms per head
        + p * (h + kv) / t  # q and k after RoPE
        + p * h / t  # attention output = linear_proj input
        + (0 if selective else FP32 * nh / t)  # softmax statistics
        + 2 * p * f / t  # xIELU input (fc1 output) and fc2 input
    )


def kv_block_bytes(model: ApertusConfig, shape: Shape) -> float:
    """Keys and values of this rank's tokens in one layer (what the CP ring passes on)."""
    kv = model.kv_channels * model.num_query_groups
    return 2 * shape.dtype_bytes * kv / shape.tp * shape.tokens


def _split_kv_block_bytes(model: ApertusConfig, shape: Shape, ranks: int) -> float:
    """:func:`kv_block_bytes` after an all-to-all over ``ranks``: the same bytes, unless the
    query groups of a TP rank do not divide over them and K/V are repeated per query head first
    (local layers; Transformer Engine refuses such a split)."""
    groups = max(1, model.num_query_groups // shape.tp)
    repeat = model.num_attention_heads // model.num_query_groups if groups % ranks else 1
    return repeat * kv_block_bytes(model, shape)


def _head_split_bytes(model: ApertusConfig, shape: Shape, ranks: int) -> float:
    """Queries, keys, values and output of one layer in an all-to-all's head-split layout."""
    queries_out = shape.dtype_bytes * 2 * model.hidden_size / shape.tp * shape.tokens
    return queries_out + _split_kv_block_bytes(model, shape, ranks)


def _comm_types(shape: Shape) -> tuple[str, ...]:
    kinds = shape.cp_comm_type
    return tuple(dict.fromkeys(kinds)) if isinstance(kinds, tuple) else (kinds,)


def cp_buffer_bytes(model: ApertusConfig, shape: Shape) -> float:
    """Working set context parallelism adds while one layer's attention runs (0 without CP).

    ``p2p``: double-buffered ring transfers, peaking in backward where the keys and values and
    their gradients both travel (4 key/value blocks). ``a2a``: queries, keys, values and the
    output in the all-to-all's other layout (same bytes as the local tensors). ``a2a+p2p``:
    the all-to-all's tensors and the ring's 4 blocks of the gathered, head-split keys and
    values. A per-layer list: its largest.
    """
    if shape.context_parallel == 1:
        return 0.0
    return max(_layer_cp_buffer_bytes(model, shape, kind) for kind in _comm_types(shape))


def _layer_cp_buffer_bytes(model: ApertusConfig, shape: Shape, kind: str) -> float:
    if kind == "p2p":
        return 4 * kv_block_bytes(model, shape)
    if kind == "a2a":
        return _head_split_bytes(model, shape, shape.context_parallel)
    ranks = shape.a2a_size
    return _head_split_bytes(model, shape, ranks) + 4 * _split_kv_block_bytes(model, shape, ranks)


def cp_layer_traffic(model: ApertusConfig, shape: Shape, kind: str) -> tuple[float, float]:
    """(forward, backward) bytes one GPU sends for one layer's attention of one micro-batch.

    ``p2p``: the forward passes the rank's key/value block CP - 1 steps around the ring; the
    backward passes the blocks again with their gradients (2 x). ``a2a``: the forward's three
    all-to-alls (queries, keys, values to head-split) and the output's back, each sending
    (CP - 1) / CP of its tensor; the backward the same four. ``a2a+p2p`` over A x P: the
    all-to-alls within the A ranks ((A - 1) / A of each tensor), then the ring over the P
    groups with the gathered, head-split key/value blocks (the same bytes as a local block;
    P - 1 steps forward, twice that backward): fewer ring steps than p2p's CP - 1, and each
    all-to-all within A ranks (a node's NVLink, say) instead of CP.
    """
    cp = shape.context_parallel
    if cp == 1:
        return 0.0, 0.0
    if kind == "p2p":
        ring = (cp - 1) * kv_block_bytes(model, shape)
        return ring, 2 * ring
    if kind == "a2a":
        exchange = _head_split_bytes(model, shape, cp) * (cp - 1) / cp
        return exchange, exchange
    exchange, ring = hierarchical_layer_traffic(model, shape)
    return exchange + ring, exchange + 2 * ring


def cp_layer_inter_node_traffic(
    model: ApertusConfig, shape: Shape, kind: str, cp_per_node: int
) -> float:
    """Of :func:`cp_layer_traffic` (forward + backward), the bytes whose transfers wait on a
    link between nodes, when ``cp_per_node`` consecutive CP ranks share a node (megatron-core
    places CP ranks next to each other after TP). A ring that leaves the node waits on that link
    at every step: all its bytes count. An all-to-all over ``n`` ranks sends (n - c) / n of each
    tensor off its node of ``c`` of them."""
    cp = shape.context_parallel
    if cp == 1 or cp <= cp_per_node:
        return 0.0
    if kind == "p2p":
        return sum(cp_layer_traffic(model, shape, kind))
    if kind == "a2a":
        return 2 * _head_split_bytes(model, shape, cp) * (cp - cp_per_node) / cp
    a2a = shape.a2a_size
    exchange = 2 * _head_split_bytes(model, shape, a2a) * max(0, a2a - cp_per_node) / a2a
    return exchange + 3 * hierarchical_layer_traffic(model, shape)[1]


def hierarchical_layer_traffic(model: ApertusConfig, shape: Shape) -> tuple[float, float]:
    """``a2a+p2p``'s forward bytes for one layer and micro-batch: (all-to-all within the A
    ranks, ring over the P groups); the backward sends the same all-to-alls and twice the ring."""
    a2a, ring_size = shape.a2a_size, shape.context_parallel // shape.a2a_size
    exchange = _head_split_bytes(model, shape, a2a) * (a2a - 1) / a2a
    return exchange, (ring_size - 1) * _split_kv_block_bytes(model, shape, a2a)


def layer_input_bytes(model: ApertusConfig, shape: Shape) -> float:
    """What a fully recomputed layer (or group of layers) keeps: its input."""
    return shape.dtype_bytes * model.hidden_size * shape.tokens / shape.seq_split


def in_flight_chunks(parallel: ParallelConfig, pipeline_rank: int, microbatches: int) -> int:
    """Model-chunk forward passes whose activations pipeline rank ``pipeline_rank`` holds at peak."""
    pp = parallel.pipeline_model_parallel_size
    vp = parallel.virtual_pipeline_model_parallel_size or 1
    if pp == 1:
        return 1
    if vp == 1:
        return min(pp - pipeline_rank, microbatches)
    return min(2 * (pp - pipeline_rank - 1) + (vp - 1) * pp + 1, microbatches * vp)


def chunk_activation_bytes(
    model: ApertusConfig, shape: Shape, layers: int, recompute: Recompute
) -> tuple[float, float]:
    """(bytes a model chunk of ``layers`` layers keeps per in-flight micro-batch, extra working
    set while one chunk's recomputed layers run their backward)."""
    full = layer_activation_bytes(model, shape, selective=recompute.granularity == "selective")
    if recompute.granularity != "full":
        return layers * full, 0.0
    n = min(recompute.num_layers, layers)
    saved_input = layer_input_bytes(model, shape)
    if recompute.method == "uniform":
        return math.ceil(layers / n) * saved_input, n * full
    return n * saved_input + (layers - n) * full, full  # block: the first n layers recomputed


def loss_buffer_bytes(model: ApertusConfig, shape: Shape) -> float:
    """Peak of the fused output layer + loss (``ops/sparse_kl.py``) in its forward, which
    computes dX and dW there and keeps them for backward: dX, dW (accumulated in fp32 when the
    tokens take several chunks, then cast), and one chunk of logits."""
    p, h, vocab_local = shape.dtype_bytes, model.hidden_size, model.vocab_size // shape.tp
    dtype = torch.float32 if p == FP32 else torch.bfloat16
    rows = default_chunk_rows(shape.tokens, vocab_local, dtype, torch.device(shape.device))
    one_chunk = shape.tokens <= rows
    grad_weight = vocab_local * h * (p if one_chunk else FP32 + (p if p < FP32 else 0))
    return p * shape.tokens * h + grad_weight + p * min(rows, shape.tokens) * vocab_local


def unfused_loss_bytes(model: ApertusConfig, shape: Shape) -> float:
    """Peak of the unfused output layer + loss (megatron-core's vocab-parallel cross-entropy):
    the logits in the training dtype and the fp32 softmax it keeps for the backward."""
    return (shape.dtype_bytes + FP32) * shape.tokens * model.vocab_size / shape.tp


@dataclass(kw_only=True, frozen=True)
class StageMemory:
    """Bytes on one GPU of pipeline stage ``pipeline_rank``."""

    pipeline_rank: int
    parameters: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    loss_buffers: float
    cp_buffers: float = 0.0
    """Context parallelism's communication working set (``cp_buffer_bytes``)."""

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.activations
            + self.loss_buffers
            + self.cp_buffers
        )


@dataclass(kw_only=True, frozen=True)
class Workload:
    """The parts of a run's settings that decide its memory."""

    precision: str = "bf16"
    optimizer: str = "ademamix"
    distributed_optimizer: bool = True
    data_parallel: int = 1
    """Ranks the distributed optimizer shards its states over (data-parallel x context-parallel,
    as megatron-core's ``dp_cp`` group)."""
    microbatches: int = 1
    recompute: Recompute = Recompute()
    forward_only: bool = False
    """Inference (teacher logits): weights and one layer's working set, no states."""
    fused_loss: bool = True
    """The fused output layer + loss (``--fused-output-loss``); unfused, the whole logits exist."""


def model_state_bytes(parameters: int, run: Workload) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes for ``parameters`` held by a rank."""
    weights = DTYPE_BYTES[run.precision] * parameters
    if run.forward_only:
        return weights, 0.0, 0.0
    master = FP32 if run.precision != "fp32" else 0
    optimizer = (master + FP32 * OPTIMIZER_MOMENTS[run.optimizer]) * parameters
    if run.distributed_optimizer:
        optimizer /= run.data_parallel
    return weights, FP32 * parameters, optimizer


def stage_memory(
    model: ApertusConfig, parallel: ParallelConfig, shape: Shape, run: Workload, pipeline_rank: int
) -> StageMemory:
    """Memory of one GPU of pipeline stage ``pipeline_rank``."""
    pp = parallel.pipeline_model_parallel_size
    vp = parallel.virtual_pipeline_model_parallel_size or 1
    parameters = stage_parameters(model, parallel, pipeline_rank)
    weights, gradients, optimizer = model_state_bytes(parameters, run)
    layers = model.num_layers // (pp * vp)
    last = pipeline_rank == pp - 1
    if run.forward_only:
        # One layer's tensors at a time, and (an upper bound: tools may chunk) fp32 logits.
        activations = layer_activation_bytes(model, shape)
        loss = FP32 * shape.tokens * model.vocab_size / shape.tp if last else 0.0
        return StageMemory(
            pipeline_rank=pipeline_rank,
            parameters=parameters,
            weights=weights,
            gradients=0.0,
            optimizer=0.0,
            activations=activations,
            loss_buffers=loss,
        )
    chunks = in_flight_chunks(parallel, pipeline_rank, run.microbatches)
    kept, working = chunk_activation_bytes(model, shape, layers, run.recompute)
    activations = chunks * kept + working
    if (
        shape.dtype_bytes < FP32
        and run.recompute.granularity != "full"
        and shape.transformer_impl != "transformer_engine"
    ):
        # The schedule keeps the input it received for each chunk in flight (in fp32 the first
        # RMSNorm saves that very tensor, as TE's fused norm + linear does in any dtype); on the
        # first stage, about 1/VP of them are embeddings.
        received = chunks if pipeline_rank > 0 else chunks * (vp - 1) / vp
        activations += received * layer_input_bytes(model, shape)
    loss = 0.0
    if last:
        h = model.hidden_size
        activations += (FP32 * h + shape.dtype_bytes * h + FP32) * shape.tokens / shape.seq_split
        fused = run.fused_loss
        loss = loss_buffer_bytes(model, shape) if fused else unfused_loss_bytes(model, shape)
    return StageMemory(
        pipeline_rank=pipeline_rank,
        parameters=parameters,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=activations,
        loss_buffers=loss,
        cp_buffers=cp_buffer_bytes(model, shape),
    )
