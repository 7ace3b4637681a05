"""The optimizer (megatron-core's Adam, or AdEMAMix wrapped the same way) and its schedule.

The schedule is megatron-core's ``OptimizerParamScheduler`` (``optim.schedule``), stepped in
samples, so iteration- and sample-based settings and a batch-size ramp-up mean the same thing.
"""

from __future__ import annotations

from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.apertus.model.config import dtype_from_name
from megatron.apertus.optim import (
    AdEMAMixSettings,
    ScheduleConfig,
    build_scheduler,
    get_apertus_optimizer,
)
from megatron.apertus.optim.builder import OptimizerSettings
from megatron.apertus.training.loop_config import TrainingConfig
from megatron.apertus.training.step import install_schedule_hooks


def megatron_optimizer_config(
    settings: OptimizerSettings, precision: str, *, log_num_zeros_in_grad: bool = False
) -> OptimizerConfig:
    """megatron-core's optimizer config; ``log_num_zeros_in_grad``: each step counts the zeros
    of the gradients (--log-num-zeros-in-grad)."""
    return OptimizerConfig(
        optimizer=settings.optimizer,
        lr=settings.lr,
        min_lr=settings.min_lr,
        decoupled_lr=settings.decoupled_lr,
        decoupled_min_lr=settings.decoupled_min_lr,
        weight_decay=settings.weight_decay,
        apply_wd_to_qk_layernorm=settings.decays_qk_layernorm,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=dtype_from_name(precision),
        use_distributed_optimizer=settings.use_distributed_optimizer,
        log_num_zeros_in_grad=log_num_zeros_in_grad,
        loss_scale=settings.loss_scale,
        initial_loss_scale=settings.initial_loss_scale,
        min_loss_scale=settings.min_loss_scale,
        loss_scale_window=settings.loss_scale_window,
        hysteresis=settings.hysteresis,
    )


def build_optimizer_and_scheduler(
    model,
    settings: OptimizerSettings,
    schedule: ScheduleConfig,
    ademamix: AdEMAMixSettings,
    training: TrainingConfig,
    *,
    precision: str,
    log_num_zeros_in_grad: bool = False,
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    config = megatron_optimizer_config(
        settings, precision, log_num_zeros_in_grad=log_num_zeros_in_grad
    )
    extra = ademamix if settings.optimizer == "ademamix" else None
    optimizer = install_schedule_hooks(model, get_apertus_optimizer(config, model, extra))
    scheduler = build_scheduler(optimizer, schedule, config, **_schedule_run(training))
    return optimizer, scheduler


def _schedule_run(training: TrainingConfig) -> dict:
    """The run the schedule spans, as ``ScheduleConfig.in_samples`` takes it."""
    return {
        "global_batch_size": training.global_batch_size,
        # A run of 0 steps (an initial checkpoint) still needs a schedule of positive length.
        "train_iters": None if training.train_iters is None else max(training.train_iters, 1),
        "train_samples": training.train_samples,
    }


def check_schedule(schedule: ScheduleConfig, training: TrainingConfig) -> None:
    """Raise ValueError, naming the flags, when the schedule does not fit the run (a warmup
    not shorter than the decay, or a WSD cooldown beyond it); entry points call it while parsing,
    so the error is one line before anything is built."""
    schedule.in_samples(**_schedule_run(training))
