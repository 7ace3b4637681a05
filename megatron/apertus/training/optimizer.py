"""The optimizer (megatron-core's Adam, or AdEMAMix) and its learning-rate schedule.

The schedule is megatron-core's ``OptimizerParamScheduler`` stepped in samples, so iteration-
and sample-based settings and a batch-size ramp-up all mean the same thing: iteration counts
are converted with the (final) global batch size, as Megatron-LM does. ``WSD`` with the
``1-sqrt`` cooldown is megatron-core's ``minus_sqrt``.
"""

from __future__ import annotations

from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.apertus.model.config import dtype_from_name
from megatron.apertus.training.config import OptimizerSettings, TrainingConfig
from megatron.apertus.training.step import install_schedule_hooks

WSD_STYLES = {
    "1-sqrt": "minus_sqrt",
    "linear": "linear",
    "cosine": "cosine",
    "exponential": "exponential",
}


def megatron_optimizer_config(settings: OptimizerSettings, precision: str) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=dtype_from_name(precision),
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )


def _build_optimizer(model, settings: OptimizerSettings, precision: str) -> MegatronOptimizer:
    config = megatron_optimizer_config(settings, precision)
    if settings.optimizer == "adam":
        return get_megatron_optimizer(config, model)
    from megatron.apertus.optim.builder import get_ademamix_optimizer

    return get_ademamix_optimizer(config, model, settings)


def _samples(iters: int | None, samples: int | None, global_batch: int) -> int:
    return samples if samples else (iters or 0) * global_batch


def build_scheduler(
    optimizer: MegatronOptimizer, settings: OptimizerSettings, training: TrainingConfig
) -> OptimizerParamScheduler:
    gbs = training.global_batch_size
    total = training.train_samples or training.train_iters * gbs
    # megatron-core wants a positive horizon even for a run of 0 steps (an initial checkpoint).
    decay = max(_samples(settings.lr_decay_iters, settings.lr_decay_samples, gbs) or total, 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=_samples(settings.lr_warmup_iters, settings.lr_warmup_samples, gbs),
        lr_decay_steps=decay,
        lr_decay_style=settings.lr_decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=not settings.override_opt_param_scheduler,
        override_opt_param_scheduler=settings.override_opt_param_scheduler,
        wsd_decay_steps=_samples(settings.lr_wsd_decay_iters, settings.lr_wsd_decay_samples, gbs),
        lr_wsd_decay_style=WSD_STYLES[settings.lr_wsd_decay_style],
    )


def build_optimizer_and_scheduler(
    model, settings: OptimizerSettings, training: TrainingConfig, *, precision: str
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    optimizer = install_schedule_hooks(model, _build_optimizer(model, settings, precision))
    return optimizer, build_scheduler(optimizer, settings, training)
