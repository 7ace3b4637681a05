"""What a run checks and builds before its first step: the refusals of flags a user can get
wrong, megatron-core's micro-batch calculator, and the model as the step trains it.

The refusals come before anything is allocated (an unwritable --save, batch sizes that do not
split into micro-batches) and raise :class:`ConfigError` in one line.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.num_microbatches_calculator import get_current_running_global_batch_size
from megatron.core.transformer.module import Float16Module

from megatron.apertus import checkpoint
from megatron.apertus.errors import ConfigError
from megatron.apertus.mcore_compat import init_num_microbatches_calculator
from megatron.apertus.model.config import ParallelConfig
from megatron.apertus.model.engine import EngineConfig
from megatron.apertus.training import runtime
from megatron.apertus.training.config import RunConfig
from megatron.apertus.training.loop_config import TrainingConfig
from megatron.apertus.training.objectives import describe_output_loss
from megatron.apertus.training.profiling import start_memory_history
from megatron.apertus.training.runtime import Runtime, is_reporting_rank
from megatron.apertus.training.step import wrap_ddp

log = logging.getLogger("apertus")


def check_before_start(cfg: RunConfig) -> None:
    """What the flags get wrong, refused before any process group exists: a --save (or
    non-persistent checkpoint directory) that cannot be written, or a --log-progress without
    --save."""
    if cfg.checkpoint.save:
        checkpoint.check_save_dir(cfg.checkpoint.save)
        frequent = cfg.checkpoint.non_persistent_save_dir()
        if frequent is not None and cfg.checkpoint.non_persistent_global_ckpt_dir:
            checkpoint.check_save_dir(frequent, "--non-persistent-global-ckpt-dir")
    elif cfg.logging.log_progress:
        raise ConfigError(
            "--log-progress writes progress.txt beside the checkpoints: it needs --save"
        )


def _batch_sizes(t: TrainingConfig) -> dict[str, int]:
    """The batch sizes the flags give, by flag (a ramp-up's start and increment too)."""
    sizes = {"--global-batch-size": t.global_batch_size, "--micro-batch-size": t.micro_batch_size}
    if t.rampup_batch_size is not None:
        start, increment, _ = t.rampup_batch_size
        sizes |= {"--rampup-batch-size START": start, "--rampup-batch-size INCREMENT": increment}
    return sizes


def check_batch_sizes(
    t: TrainingConfig, layout: ParallelConfig, dp: int, group: int | None = None
) -> None:
    """Every global batch, each size of a ramp-up too, splits into whole micro-batches on every
    data-parallel rank; said with the flags before megatron-core's calculator asserts. Under
    --decrease-batch-size-if-needed megatron-core rounds each size down to such a multiple, so
    each must only hold one micro-batch per rank."""
    sizes = _batch_sizes(t)
    for flag, size in sizes.items():
        if size < 1:
            raise ConfigError(f"{flag} must be >= 1, got {size}")
    unit = t.micro_batch_size * dp
    for flag, size in sizes.items():
        if flag == "--micro-batch-size" or not size % unit:
            continue
        if t.decrease_batch_size_if_needed and size >= unit:
            continue
        fits = "smaller than" if t.decrease_batch_size_if_needed else "not divisible by"
        raise ConfigError(
            f"{flag} ({size}) is {fits} --micro-batch-size ({t.micro_batch_size}) x "
            f"data-parallel size ({dp} = world size {torch.distributed.get_world_size()} / "
            f"(--tensor-model-parallel-size {layout.tensor_model_parallel_size} x "
            f"--pipeline-model-parallel-size {layout.pipeline_model_parallel_size} x "
            f"--context-parallel-size {layout.context_parallel_size}))"
        )
    _check_interleaved_microbatches(sizes, layout, unit)
    _check_microbatch_group(sizes, layout, unit, group)
    _check_rampup_reaches_the_batch(t)
    _check_eval_batch_sizes(t, layout, dp, group)


def _check_eval_batch_sizes(
    t: TrainingConfig, layout: ParallelConfig, dp: int, group: int | None
) -> None:
    """A validation batch (--eval-global-batch-size, else the step's) splits into whole
    validation micro-batches (--eval-micro-batch-size, else the step's) on every rank, as
    Megatron-LM asserts, and suits the interleaved schedule as a step does."""
    if t.eval_micro_batch_size is None and t.eval_global_batch_size is None:
        return
    micro = t.eval_micro_batch_size or t.micro_batch_size
    if t.eval_global_batch_size is not None:
        sizes = {"--eval-global-batch-size": t.eval_global_batch_size}
    else:
        sizes = {k: v for k, v in _batch_sizes(t).items() if k != "--micro-batch-size"}
    for flag, size in sizes.items():
        if size % (micro * dp):
            raise ConfigError(
                f"{flag} ({size}) is not divisible by the validation micro-batch ({micro}) x "
                f"data-parallel size ({dp})"
            )
    _check_interleaved_microbatches(sizes, layout, micro * dp)
    _check_microbatch_group(sizes, layout, micro * dp, group)


def _check_interleaved_microbatches(
    sizes: dict[str, int], layout: ParallelConfig, unit: int
) -> None:
    """megatron-core's interleaved schedule runs a step's micro-batches in groups of one per
    pipeline stage and raises mid-step on a count that is no multiple of the stages; each
    batch size (a ramp-up's start and increment too) is refused here instead, naming its flag."""
    pp = layout.pipeline_model_parallel_size
    if layout.virtual_pipeline_model_parallel_size is None:
        return
    for flag, size in sizes.items():
        if flag == "--micro-batch-size" or not (size // unit) % pp:
            continue
        raise ConfigError(
            f"{flag} ({size}) gives {size // unit} micro-batches per step, not a multiple of "
            f"--pipeline-model-parallel-size ({pp}) as the interleaved schedule needs"
        )


def _check_microbatch_group(
    sizes: dict[str, int], layout: ParallelConfig, unit: int, group: int | None
) -> None:
    """megatron-core's interleaved schedule runs groups of ``group`` micro-batches per virtual
    stage: at most a step's micro-batches, the last group empty or at least one per stage (else
    it raises mid-step)."""
    if group is None or layout.virtual_pipeline_model_parallel_size is None:
        return
    pp = layout.pipeline_model_parallel_size
    for flag, size in sizes.items():
        count = size // unit
        if flag == "--micro-batch-size" or (group <= count and not 0 < count % group < pp):
            continue
        raise ConfigError(
            f"--microbatch-group-size-per-virtual-pipeline-stage ({group}) does not fit the "
            f"{count} micro-batches per step of {flag} ({size}): at most that many, and the "
            f"last group empty or of at least --pipeline-model-parallel-size ({pp})"
        )


def _check_rampup_reaches_the_batch(t: TrainingConfig) -> None:
    """A ramp-up ends exactly at --global-batch-size."""
    if t.rampup_batch_size is None:
        return
    start, increment, _ = t.rampup_batch_size
    if start > t.global_batch_size or (t.global_batch_size - start) % increment:
        raise ConfigError(
            f"--rampup-batch-size START ({start}) does not reach --global-batch-size "
            f"({t.global_batch_size}) in steps of INCREMENT ({increment})"
        )


def start_microbatches(t: TrainingConfig, dp: int) -> None:
    """megatron-core's calculator of the step's micro-batches (a ramp-up changes them)."""
    init_num_microbatches_calculator(
        torch.distributed.get_rank(),
        t.rampup_batch_size,
        t.global_batch_size,
        t.micro_batch_size,
        dp,
        decrease_batch_size_if_needed=t.decrease_batch_size_if_needed,
    )
    _log_decreased_batch(t, dp)


def _log_decreased_batch(t: TrainingConfig, dp: int) -> None:
    """Say when megatron-core runs a smaller global batch than --global-batch-size."""
    running = get_current_running_global_batch_size()
    if running != t.global_batch_size and is_reporting_rank():
        log.info(
            f"--decrease-batch-size-if-needed: global batch {running} instead of "
            f"{t.global_batch_size} (a multiple of --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp})"
        )


def with_bf16_layers(started: Runtime, layers: set[int]) -> Runtime:
    """``started`` with ``layers`` added to the engine's ``--bf16-layers``."""
    if not layers:
        return started
    engine = started.engine or EngineConfig()
    chosen = sorted(set(engine.bf16_layers or ()) | layers)
    return replace(started, engine=replace(engine, bf16_layers=chosen))


def describe_engine(impl: str, engine: EngineConfig, params: str) -> str:
    """The one log line that says how the layers compute (``params``: --precision)."""
    chosen = "" if engine.transformer_impl else " (default for this machine)"
    precision = f"{params} GEMMs"
    if engine.fp8:
        precision = f"FP8 {engine.fp8_format} GEMMs, {engine.fp8_recipe} scaling"
    if engine.bf16_layers:
        layers = ", ".join(str(n) for n in sorted(engine.bf16_layers))
        where = f"{params} GEMMs" if engine.fp8 else "no FP8 in this run: no change"
        precision += f" (layers {layers}: {where})"
    determinism = ", deterministic kernels" if engine.deterministic_mode else ""
    if determinism and impl == "transformer_engine" and engine.attention_backend == "local":
        determinism += " (core attention: torch flash / varlen, deterministic on this GPU)"
    return f"transformer implementation: {impl}{chosen}; {precision}{determinism}"


def build_model(cfg: RunConfig, started: Runtime) -> list[DistributedDataParallel]:
    """This rank's model chunks as the step trains them: built by the engine the runtime chose,
    in low precision behind megatron-core's fp32-loss wrapper, each wrapped in DDP (with
    --data-parallel-random-init, data-parallel rank 0's weights copied to the others); the
    memory history of --record-memory-history starts before them."""
    start_memory_history(cfg.profiling)
    if is_reporting_rank():
        engine = describe_engine(started.transformer_impl, started.engine, cfg.training.precision)
        log.info(f"{engine}; {describe_output_loss(cfg.training, cfg.align)}")
    chunks = runtime.model_chunks(
        cfg.model,
        cfg.parallel,
        training=cfg.training,
        runtime=started,
        packed_documents=cfg.dataset.reset_attention_mask,
        fused_loss=cfg.training.fused_output_loss,
        quant=cfg.quant,
        transformer_impl=started.transformer_impl,
        engine=started.engine,
        graphs=cfg.cuda_graphs,
        calculate_per_token_loss=cfg.training.calculate_per_token_loss,
        perform_initialization=not cfg.training.no_initialization,
        log_max_attention_logit=cfg.logging.log_max_attention_logit,
        **cfg.training.recompute_overrides(),
        **cfg.communication.transformer_overrides(
            virtual_pipeline=cfg.parallel.virtual_pipeline_model_parallel_size is not None
        ),
    )
    tconfig = chunks[0].config
    if tconfig.bf16 or tconfig.fp16:
        # Low-precision compute, fp32 loss: megatron-core's standard wrapper.
        chunks = [Float16Module(tconfig, chunk) for chunk in chunks]
    wrapped = wrap_ddp(
        chunks,
        tconfig,
        use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        fp8_param_gather=cfg.engine.fp8_param_gather,
        overlap_grad_reduce=cfg.communication.overlap_grad_reduce,
        overlap_param_gather=cfg.communication.overlap_param_gather,
        bucket_size=cfg.communication.ddp_bucket_size,
        num_buckets=cfg.communication.ddp_num_buckets,
        average_in_collective=cfg.communication.ddp_average_in_collective,
        gradient_reduce_div_fusion=cfg.communication.gradient_reduce_div_fusion,
        gradient_accumulation_fusion=cfg.engine.gradient_accumulation_fusion,
        check_for_large_grads=cfg.rerun.check_for_large_grads,
    )
    if cfg.training.data_parallel_random_init:
        # Megatron-LM's way back to equal replicas: data-parallel rank 0's weights everywhere.
        for chunk in wrapped:
            chunk.broadcast_params()
    return wrapped
