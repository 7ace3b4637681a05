"""megatron-core's ``OptimizerParamScheduler`` built from a :class:`ScheduleConfig`
(:func:`build_scheduler`), as :class:`ParamScheduler`, whose state dict also holds the WSD
cooldown length and shape (megatron-core's omits them, so a resumed run would take them from the
flags silently, whatever ``use_checkpoint_opt_param_scheduler`` says), and which does not refuse
a resume over the length of a constant weight decay, a length that changes nothing.
"""

from __future__ import annotations

from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.apertus.errors import ConfigError
from megatron.apertus.optim.schedule import WSD_DECAY_STYLES, ScheduleConfig


class ParamScheduler(OptimizerParamScheduler):
    """megatron-core's scheduler whose state dict also carries the WSD cooldown.

    Advance it once per iteration, after ``optimizer.step()``, by the samples that iteration
    consumed: ``scheduler.step(increment=global_batch_size)``.
    """

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "wsd_decay_steps": self.wsd_decay_steps,
            "lr_wsd_decay_style": self.lr_wsd_decay_style,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if self.wd_incr_style == state_dict.get("wd_incr_style") == "constant":
            state_dict = {**state_dict, "wd_incr_steps": self.wd_incr_steps}
        # Before the parent's load: it sets the lr of the restored step with these values.
        if "wsd_decay_steps" in state_dict:
            self.wsd_decay_steps = self._check_and_set(
                self.wsd_decay_steps, state_dict["wsd_decay_steps"], "WSD decay steps"
            )
            self.lr_wsd_decay_style = self._check_and_set(
                self.lr_wsd_decay_style, state_dict["lr_wsd_decay_style"], "WSD decay style"
            )
        super().load_state_dict(state_dict)


def build_scheduler(
    optimizer: MegatronOptimizer,
    schedule: ScheduleConfig,
    optimizer_config: OptimizerConfig,
    *,
    global_batch_size: int,
    train_iters: int | None = None,
    train_samples: int | None = None,
) -> ParamScheduler:
    """The scheduler for ``optimizer``, which it immediately gives the step-0 lr and weight decay
    (the scheduled weight decay times ``wd_mult`` per group; ``optimizer_config.weight_decay``
    is the constant style's)."""
    if optimizer_config.min_lr is None:
        raise ValueError(
            "set OptimizerConfig.min_lr: megatron-core copies it into every param group"
        )
    if schedule.lr_warmup_init > optimizer_config.lr:  # megatron-core asserts it
        raise ConfigError(
            f"--lr-warmup-init ({schedule.lr_warmup_init}) exceeds --lr ({optimizer_config.lr}): "
            "the warmup rises from it to the peak"
        )
    steps = schedule.in_samples(
        global_batch_size=global_batch_size, train_iters=train_iters, train_samples=train_samples
    )
    start_wd, end_wd = schedule.weight_decay_range(optimizer_config.weight_decay)
    return ParamScheduler(
        optimizer,
        init_lr=schedule.lr_warmup_init,
        max_lr=optimizer_config.lr,
        min_lr=optimizer_config.min_lr,
        lr_warmup_steps=steps.warmup,
        lr_decay_steps=steps.decay,
        lr_decay_style=schedule.lr_decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=steps.wd_incr,
        wd_incr_style=schedule.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=schedule.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=schedule.override_opt_param_scheduler,
        wsd_decay_steps=steps.wsd_decay,
        lr_wsd_decay_style=WSD_DECAY_STYLES[schedule.lr_wsd_decay_style],
    )
