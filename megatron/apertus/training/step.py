"""One optimizer step on megatron-core: DDP-wrapped chunks, its optimizer and schedules.

A micro-batch's loss goes to megatron-core's schedule as its sum over the loss tokens with
their count. By default (Megatron-LM's) the schedule divides it by that count and by the number
of micro-batches and DDP divides the gradients by the data- and context-parallel size: the step
optimises the mean of the micro-batches' means, which weighs a token of a micro-batch with few
loss tokens (SFT masks, Goldfish, ``--eod-mask-loss``) more than one of a full micro-batch.
``--calculate-per-token-loss`` (``TransformerConfig.calculate_per_token_loss``, read by DDP when
it is built) leaves the sums as they are and megatron-core divides the gradients by the loss
tokens of the *whole* global batch, so micro-batching, data parallelism and masked positions
all give the gradient one big batch would. Context-parallel ranks each compute the loss sum of
their share of the tokens (:func:`shard_batch`). Either way the logged loss is the global
batch's sum over its count: the sums and counts are reduced over the data- and
context-parallel group, as megatron-core reduces the gradients.

The process groups are the ones the model chunks were built with (:func:`chunk_groups`), so
a step communicates over exactly the groups its model does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer.grad_scaler import DynamicGradScaler
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.utils import is_pp_last_stage
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_model_config

from megatron.apertus.data.batches import QUANTITY_PREFIX, Batch
from megatron.apertus.data.context_parallel import shard_batch
from megatron.apertus.model.builder import chunk_groups
from megatron.apertus.model.engine import fuse_te_wgrad_accumulation
from megatron.apertus.training.diagnostics import max_attention_logit
from megatron.apertus.training.step_timers import timed

log = logging.getLogger("apertus")


@dataclass(kw_only=True, frozen=True)
class StepShape:
    """What megatron-core's schedules need to know about one step's micro-batches."""

    num_microbatches: int
    seq_length: int
    micro_batch_size: int


@dataclass(kw_only=True)
class StepResult:
    loss: float | None
    """Mean loss per token over the global batch; None on ranks that do not hold the last stage."""
    num_tokens: int | None
    grad_norm: float | None
    skipped: bool
    overflow: bool = False
    """fp16's dynamic loss scaler found the scaled gradients overflowing (the loss finite),
    refused the update and backed its scale off: a skipped step of mixed precision's normal
    course (Megatron-LM's skipped iteration), no fault."""
    num_zeros_in_grad: int | None = None
    """Zero entries of the gradients the step applied (--log-num-zeros-in-grad; None without
    it and on a skipped step), counted over every rank's shard, the same on all ranks."""
    max_attention_logit: float | None = None
    """The largest pre-softmax attention logit of the step (--log-max-attention-logit)."""
    quantities: dict[str, float] = field(default_factory=dict)
    """The objective's own quantities (alignment: reward margin, ...; Goldfish: the share of
    loss positions dropped), means over the global batch; empty on ranks that do not hold the
    last stage."""


def wrap_ddp(
    chunks: list[GPTModel],
    config: TransformerConfig,
    *,
    use_distributed_optimizer: bool,
    fp8_param_gather: bool = False,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    bucket_size: int | None = None,
    num_buckets: int | None = None,
    average_in_collective: bool = False,
    gradient_reduce_div_fusion: bool = True,
    gradient_accumulation_fusion: bool = False,
    check_for_large_grads: bool = False,
) -> list[DistributedDataParallel]:
    """Wrap each model chunk in megatron-core DDP (gradients go to ``param.main_grad``).

    ``num_buckets`` (Megatron-LM's --ddp-num-buckets) sets the bucket size to this rank's
    parameters (all chunks) over ``num_buckets``, as Megatron-LM does before building DDP: the
    megatron-core of our default line has no such field.
    With ``overlap_param_gather`` several chunks (virtual pipeline stages) gather their
    parameters in the order the schedule first runs them (``align_param_gather``). With
    ``gradient_accumulation_fusion`` Transformer Engine's linears accumulate their weight
    gradients into ``main_grad`` themselves (:func:`fuse_te_wgrad_accumulation`).
    ``check_for_large_grads``: Megatron-LM's, each bucket's gradient norm validated by
    megatron-core's rerun state machine before the reduction."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        align_param_gather=overlap_param_gather and len(chunks) > 1,
        bucket_size=bucket_size if num_buckets is None else bucket_size_of(chunks, num_buckets),
        average_in_collective=average_in_collective,
        gradient_reduce_div_fusion=gradient_reduce_div_fusion,
        use_distributed_optimizer=use_distributed_optimizer,
        fp8_param_gather=fp8_param_gather,
        check_for_large_grads=check_for_large_grads,
    )
    wrapped = [
        DistributedDataParallel(
            config, ddp_config, chunk, disable_bucketing=i > 0, pg_collection=chunk_groups(chunk)
        )
        for i, chunk in enumerate(chunks)
    ]
    if gradient_accumulation_fusion:
        fused = [fuse_te_wgrad_accumulation(chunk) for chunk in wrapped]
        fused_linears, linears = (sum(counts) for counts in zip(*fused))
        if fused_linears < linears:
            log.info(
                "gradient accumulation fusion: %d of %d Transformer Engine linears (the rest "
                "have a main_grad off a 16-byte boundary; --use-distributed-optimizer aligns "
                "every parameter)",
                fused_linears,
                linears,
            )
    return wrapped


def bucket_size_of(chunks: list[GPTModel], num_buckets: int) -> int:
    """Gradient elements per bucket for ``num_buckets`` buckets over the chunks' parameters."""
    return sum(p.numel() for chunk in chunks for p in chunk.parameters()) // num_buckets


def install_schedule_hooks(
    model: list[DistributedDataParallel], optimizer: MegatronOptimizer
) -> MegatronOptimizer:
    """The hooks megatron-core's schedules call: grad finalisation, loss scaling, no_sync."""
    config = model[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    no_sync = [chunk.no_sync for chunk in model]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    ddp_config = model[0].ddp_config
    if ddp_config.overlap_grad_reduce and chunk_groups(model[0]).pp.size() > 1:
        # Pipeline stages start each chunk's reduction when its last backward is done.
        config.grad_sync_func = [chunk.start_grad_sync for chunk in model]
        if len(model) == 1:
            config.grad_sync_func = config.grad_sync_func[0]
    if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        config.param_sync_func = [chunk.start_param_sync for chunk in model]
        if len(model) == 1:
            config.param_sync_func = config.param_sync_func[0]
    return optimizer


@contextlib.contextmanager
def synced_parameters(model: list[DistributedDataParallel]) -> Iterator[None]:
    """Context for reading the weights outside a training step (validation, checkpoints).

    Under --overlap-param-gather the weights an optimizer step updated reach each rank only in
    the next forward pass; this gathers them now, and keeps the gather hooks off meanwhile."""
    chunks = [chunk for chunk in model if chunk.use_forward_hook]
    for chunk in chunks:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in chunks:
            chunk.enable_forward_pre_hook()


LossFunction = Callable[
    [Batch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict]
]
"""``f(batch, loss_mask, output) -> (loss, count, reported)``: an objective's reduction of one
micro-batch's model output. The schedule divides the summed loss by the micro-batch's count
(default) or the summed count of the global batch (``calculate_per_token_loss``); an objective
whose loss is no sum over tokens returns megatron-core's two-value form ``(mean, reported)``
instead (alignment). ``reported`` holds the ``lm loss`` (sum, count) pair, and entries named
``QUANTITY_PREFIX + name`` (sum, count) the step averages over the global batch and logs as the
objective's own quantities."""

ForwardPass = Callable[[Batch, GPTModel], tuple[torch.Tensor, Callable]]
"""``f(batch, model) -> (output, reduce)``: an objective's forward pass over (this context-parallel
rank's share of) one micro-batch, its targets passed to the model as arguments, and ``reduce``,
its :data:`LossFunction` bound to the batch, which megatron-core's schedule calls on the output
(last stage)."""


def token_loss(batch: Batch, loss_mask: torch.Tensor, output: torch.Tensor):
    """(loss sum, loss tokens, reported values) of a micro-batch: the masked per-token loss.

    ``output`` is the model's per-token losses, or (fused output layer) their masked sum.
    """
    mask = loss_mask.reshape(-1).float()
    loss_sum = output.float() if output.dim() == 0 else (output.reshape(-1).float() * mask).sum()
    reported = {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}
    return loss_sum, mask.sum().to(torch.int), reported


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters live: where a micro-batch must go."""
    return next(model.parameters()).device


def language_model_output(
    model: GPTModel, batch: Batch, **targets
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's output on ``batch`` (per-token losses, or under the fused output-layer loss
    their masked sum) and the loss mask on the model's device; ``targets`` reach the model's
    loss as arguments (distillation: ``teacher``)."""
    device = model_device(model)
    loss_mask = to_device(batch.loss_mask, device)
    packed = packed_seq_params_to(batch.packed_seq_params, device, chunk_groups(model).cp)
    output = model(
        to_device(batch.tokens, device),
        to_device(batch.position_ids, device),
        None,
        labels=to_device(batch.labels, device),
        loss_mask=loss_mask,
        packed_seq_params=packed,
        **targets,
    )
    return output, loss_mask


def token_forward(batch: Batch, model: GPTModel, loss: LossFunction = token_loss):
    """The :data:`ForwardPass` of a language-model loss over the labels: ``loss`` reduces the
    model's output (default: the masked per-token cross-entropy)."""
    output, loss_mask = language_model_output(model, batch)
    return output, partial(loss, batch, loss_mask)


def forward_step(
    forward: ForwardPass,
    cp_group: torch.distributed.ProcessGroup,
    config: TransformerConfig,
    data_iterator: Iterator[Batch],
    model: GPTModel,
):
    """megatron-core forward step (``forward``, the context-parallel group and the model's
    config, whose timers time the micro-batch's reading, bound first): the objective's forward
    pass over this context-parallel rank's share of the next micro-batch."""
    with timed(config, "batch-generator", 2):
        batch = shard_batch(next(data_iterator), cp_group.rank(), cp_group.size())
    return forward(batch, model)


def chunk_iterators(model: list, batches: list[Batch]) -> list[Iterator[Batch]]:
    """One iterator per model chunk over a step's micro-batches (interleaved pipeline schedules
    run the chunks' micro-batches in their own orders)."""
    return [iter(batches) for _ in model]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; a host tensor bound for a GPU goes through pinned memory and an
    asynchronous copy. torch's blocking copy waits for the GPU's whole queue: with several per
    micro-batch the GPU of an 8B-shaped step sat idle 15-21% of the time, waiting for the host
    to queue work again (docs/gpu.md)."""
    if device.type != "cuda" or tensor.device.type == "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def packed_seq_params_to(
    params: PackedSeqParams | None, device: torch.device, cp_group: torch.distributed.ProcessGroup
) -> PackedSeqParams | None:
    """A micro-batch's document boundaries on ``device``, for attention over ``cp_group``."""
    if params is None:
        return None
    cu = to_device(params.cu_seqlens_q, device)
    return dataclasses.replace(
        params,
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cp_group=cp_group,
    )


def _reduce(losses: list[dict], key: str, groups: ProcessGroupCollection) -> torch.Tensor | None:
    """Sum a reported pair over micro-batches and data- and context-parallel ranks, on the last
    stage."""
    if not is_pp_last_stage(groups.pp):
        return None
    total = torch.stack([entry[key] for entry in losses]).sum(0)
    torch.distributed.all_reduce(total, group=groups.dp_cp)
    return total


def reduce_quantities(losses: list[dict], groups: ProcessGroupCollection) -> dict[str, float]:
    """The means over micro-batches and data-parallel ranks of the reported (sum, count) pairs
    named ``QUANTITY_PREFIX + name``, by name (last stage only: elsewhere empty). A quantity
    counted nowhere in the global batch (Goldfish on a batch without loss positions) has no
    mean and is left out. ``groups``: the model's (megatron-core's ``dp_cp`` holds the ranks
    whose sums make up the global batch's)."""
    if not losses or not is_pp_last_stage(groups.pp):
        return {}
    means = {}
    for key in (k for k in losses[0] if k.startswith(QUANTITY_PREFIX)):
        total = _reduce(losses, key, groups)
        if total[1] > 0:
            means[key[len(QUANTITY_PREFIX) :]] = (total[0] / total[1]).item()
    return means


def _all_finite(loss: torch.Tensor | None, device: torch.device) -> bool:
    """Whether the loss (known on the last stage only) is finite, agreed by every rank."""
    bad = torch.zeros(1, device=device)
    if loss is not None and not torch.isfinite(loss).all():
        bad += 1
    torch.distributed.all_reduce(bad)
    return bad.item() == 0


def _parts(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _clip(optimizer: MegatronOptimizer, max_norm: float, total_norm: float) -> None:
    for part in _parts(optimizer):
        params = part.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, max_norm, total_norm)


def _room_to_back_off(optimizer: MegatronOptimizer) -> list[torch.Tensor]:
    """Whether each dynamic loss scaler (fp16 without --loss-scale) is above its minimum, as
    tensors read only when needed (no wait for the device otherwise); empty without one."""
    scalers = [getattr(part, "grad_scaler", None) for part in _parts(optimizer)]
    return [s.scale > s.min_scale for s in scalers if isinstance(s, DynamicGradScaler)]


def empty_unused_memory(level: int, *, at_least: int) -> None:
    """--empty-unused-memory-level: the CUDA caching allocator's unused blocks go back to the
    device when ``level`` is at least ``at_least`` (less fragmentation for other allocations,
    at the price of allocating anew). A CPU has no such cache: nothing happens."""
    if level >= at_least and torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(kw_only=True, frozen=True)
class Update:
    """What :func:`optimizer_step` did."""

    updated: bool
    grad_norm: float | None
    """None when a loss scaler found the unscaled gradients non-finite (megatron-core's step
    computes no norm then)."""
    zeros: int | None = None
    """Zeros in the gradients, when the optimizer's config counts them."""
    overflow: bool = False
    """The dynamic loss scaler refused the update of a step with a finite loss."""


def optimizer_step(optimizer: MegatronOptimizer, loss_finite: bool) -> Update:
    """megatron-core's step, except that a non-finite loss or gradient norm skips the update too.

    A loss scaler's check of the unscaled gradients comes first, as in megatron-core's step:
    the dynamic scaler has then already backed off its scale. Its refusal with a finite loss is
    an ``overflow``; under a constant --loss-scale, with a non-finite loss, or at the scaler's
    --min-loss-scale (where it cannot back off: gradients that are not finite at any scale) it
    is a fault.
    The gradient norm is all-reduced over the model-parallel group, so every rank takes the
    same decision. A skipped step leaves weights and optimizer state untouched. The zeros are
    counted after clipping, where megatron-core's own step counts them.
    """
    config = optimizer.config
    room = _room_to_back_off(optimizer)
    if optimizer.prepare_grads():
        overflow = loss_finite and bool(room) and all(bool(r.item()) for r in room)
        return Update(updated=False, grad_norm=None, overflow=overflow)
    with timed(config, "optimizer-clip-main-grad", 1):
        grad_norm = optimizer.get_grad_norm()
        finite = loss_finite and math.isfinite(grad_norm)
        if finite and config.clip_grad > 0:
            _clip(optimizer, config.clip_grad, grad_norm)
    if not finite:
        return Update(updated=False, grad_norm=grad_norm)
    with timed(config, "optimizer-count-zeros", 1):
        zeros = int(optimizer.count_zeros()) if config.log_num_zeros_in_grad else None
    return Update(updated=optimizer.step_with_ready_grads(), grad_norm=grad_norm, zeros=zeros)


def schedule(model: list[torch.nn.Module]) -> Callable[..., list]:
    """megatron-core's forward-backward function for ``model``'s pipeline layout (one chunk per
    virtual stage), bound to the chunks' process groups: its stage-to-stage messages, loss-token
    count and gradient finalisation use them rather than parallel_state's."""
    groups = chunk_groups(model[0])
    virtual_stages = len(model) if len(model) > 1 else None
    return partial(
        get_forward_backward_func(pp_size=groups.pp.size(), vp_size=virtual_stages),
        p2p_communicator=P2PCommunicator(pp_group=groups.pp, config=get_model_config(model[0])),
        pg_collection=groups,
    )


def run_microbatches(
    model: list[DistributedDataParallel],
    data_iterators: list[Iterator[Batch]],
    shape: StepShape,
    *,
    forward_only: bool,
    forward: ForwardPass = token_forward,
) -> list[dict]:
    """megatron-core's schedule over one global batch; the reported losses (last stage only)."""
    return schedule(model)(
        forward_step_func=partial(
            forward_step, forward, chunk_groups(model[0]).cp, get_model_config(model[0])
        ),
        data_iterator=data_iterators[0] if len(model) == 1 else data_iterators,
        model=model,
        num_microbatches=shape.num_microbatches,
        seq_length=shape.seq_length,
        micro_batch_size=shape.micro_batch_size,
        forward_only=forward_only,
    )


def train_step(
    model: list[DistributedDataParallel],
    optimizer: MegatronOptimizer,
    batches: list[Batch],
    shape: StepShape,
    forward: ForwardPass = token_forward,
    *,
    empty_unused_memory_level: int = 0,
) -> StepResult:
    """Forward and backward over ``num_microbatches``, then one optimizer step.

    ``batches``: the step's micro-batches, each model chunk iterating them afresh
    (:func:`chunk_iterators`); ``forward`` is the objective's forward pass over each
    micro-batch. megatron-core's rerun state machine
    (:mod:`~megatron.apertus.training.rerun`) runs the passes again when it rejected a result of
    theirs; off, or with nothing rejected, they run once. ``empty_unused_memory_level``:
    Megatron-LM's, the CUDA allocator's cache emptied before the update (1) and after it (2).
    """
    machine = get_rerun_state_machine()
    while machine.should_run_forward_backward(None):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        iterators = chunk_iterators(model, batches)
        losses = run_microbatches(model, iterators, shape, forward_only=False, forward=forward)
    _, should_exit, exit_code = machine.should_checkpoint_and_exit()
    if should_exit:  # a fatal check's verdict (none of ours is): megatron-core's exit code
        raise SystemExit(exit_code)
    groups = chunk_groups(model[0])
    loss = _reduce(losses, "lm loss", groups)
    finite = _all_finite(loss, model_device(model[0]))
    empty_unused_memory(empty_unused_memory_level, at_least=1)
    with timed(optimizer.config, "optimizer", 1):
        update = optimizer_step(optimizer, finite)
    empty_unused_memory(empty_unused_memory_level, at_least=2)
    logit = None
    if get_model_config(model[0]).log_max_attention_logit:
        logit = max_attention_logit(model)
    outcome = {
        "max_attention_logit": logit,
        "grad_norm": update.grad_norm,
        "skipped": not update.updated,
        "overflow": update.overflow,
        "num_zeros_in_grad": update.zeros,
    }
    if loss is None:
        return StepResult(loss=None, num_tokens=None, **outcome)
    return StepResult(
        loss=(loss[0] / loss[1].clamp(min=1)).item(),
        num_tokens=int(loss[1].item()),
        **outcome,
        quantities=reduce_quantities(losses, groups),
    )
