"""Learning-rate schedule: megatron-core's ``OptimizerParamScheduler``, configured and persisted.

megatron-core 0.16.1 already implements WSD (Hägele et al. 2024): linear warmup from
``lr_warmup_init``, the peak lr, then over the last ``wsd_decay_steps`` of ``lr_decay_steps``
``lr = min + (max - min) c(r)`` with c = ``1 - sqrt(r)`` ("minus_sqrt"), ``1 - r``,
``(1 + cos(pi r)) / 2`` or ``2 * 0.5^r - 1``, and lr = min after. Its steps are in whatever unit
the caller advances it by; like Megatron-LM we always count **samples** (``step(increment=
global batch of this iteration)``), converting iteration settings with the global batch size, so
iteration- and sample-based flags mean the same schedule and a batch-size ramp-up moves along it
by the samples it actually consumed.

What this module adds: :class:`ScheduleConfig` (Megatron's flag names, validated, ``1-sqrt`` as the
Apertus fork spells it), without megatron-core, so that ``--help`` need not import it. The
scheduler built from it is in :mod:`megatron.apertus.optim.param_scheduler`.

Resume semantics are megatron-core's: the step count always comes from the checkpoint; with
``override_opt_param_scheduler`` every other value comes from the new config; with
``use_checkpoint_opt_param_scheduler`` from the checkpoint; with neither they must agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.apertus.flags import flag_help

WSD_DECAY_STYLES = {
    "1-sqrt": "minus_sqrt",
    "minus_sqrt": "minus_sqrt",
    "linear": "linear",
    "cosine": "cosine",
    "exponential": "exponential",
}
"""Our names (the Apertus fork's and Megatron-LM's) -> megatron-core's ``lr_wsd_decay_style``."""

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


@dataclass(kw_only=True, frozen=True)
class ScheduleSteps:
    """A schedule's lengths in samples, as megatron-core's scheduler takes them."""

    warmup: int
    decay: int
    wsd_decay: int


@dataclass(kw_only=True, frozen=True)
class ScheduleConfig:
    """How the learning rate moves; peak and minimum are OptimizerConfig's ``lr`` and ``min_lr``
    (megatron-core copies them into every param group, where the scheduler reads them).

    Each length is given in iterations or in samples, not both.
    """

    lr_decay_style: str = flag_help(
        "constant, linear, cosine, inverse-square-root or WSD", "constant"
    )
    lr_wsd_decay_style: str = flag_help(
        "WSD cooldown shape: 1-sqrt, linear, cosine or exponential", "1-sqrt"
    )
    lr_warmup_iters: int = flag_help("iterations of linear warmup", 0)
    lr_warmup_samples: int = flag_help("samples of linear warmup (instead of iterations)", 0)
    lr_warmup_init: float = flag_help("learning rate at the start of the warmup", 0.0)
    lr_decay_iters: Optional[int] = flag_help(
        "iterations of the whole schedule (default: the run)", None
    )
    lr_decay_samples: Optional[int] = flag_help(
        "samples of the whole schedule (instead of iterations)", None
    )
    lr_wsd_decay_iters: Optional[int] = flag_help(
        "WSD: iterations of the cooldown at the end", None
    )
    lr_wsd_decay_samples: Optional[int] = flag_help(
        "WSD: samples of the cooldown (instead of iterations)", None
    )
    override_opt_param_scheduler: bool = flag_help(
        "on resume take the schedule from this config, not the checkpoint (keeps the step count)",
        False,
    )
    use_checkpoint_opt_param_scheduler: bool = flag_help(
        "on resume take the schedule from the checkpoint, ignoring this config", False
    )

    def __post_init__(self) -> None:
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(
                f"--lr-decay-style must be one of {DECAY_STYLES}, got {self.lr_decay_style!r}"
            )
        if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(
                f"--lr-wsd-decay-style must be one of {sorted(WSD_DECAY_STYLES)}, "
                f"got {self.lr_wsd_decay_style!r}"
            )
        for what in ("warmup", "decay", "wsd_decay"):
            iters, samples = getattr(self, f"lr_{what}_iters"), getattr(self, f"lr_{what}_samples")
            if iters and samples:
                raise ValueError(
                    f"give --lr-{_dash(what)}-iters or --lr-{_dash(what)}-samples, not both"
                )
            if (iters or 0) < 0 or (samples or 0) < 0:
                raise ValueError(f"--lr-{_dash(what)}-iters/-samples must be >= 0")
        # 0 is a length (Megatron-LM's: no cooldown, the peak lr to the end); only None is none.
        no_length = self.lr_wsd_decay_iters is None and self.lr_wsd_decay_samples is None
        if self.lr_decay_style == "WSD" and no_length:
            raise ValueError(
                "--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples"
            )
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError(
                "give --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler, "
                "not both"
            )

    def in_samples(
        self,
        *,
        global_batch_size: int,
        train_iters: int | None = None,
        train_samples: int | None = None,
    ) -> ScheduleSteps:
        """Lengths in samples; iterations count ``global_batch_size`` samples each (the final
        global batch under a ramp-up, as in Megatron-LM). The schedule spans the run unless
        ``lr_decay_*`` says otherwise."""
        if (train_iters is None) == (train_samples is None):
            raise ValueError("give exactly one of train_iters and train_samples")
        total = train_samples if train_samples is not None else train_iters * global_batch_size

        def samples(iters: int | None, count: int | None) -> int:
            return count if count else (iters or 0) * global_batch_size

        steps = ScheduleSteps(
            warmup=samples(self.lr_warmup_iters, self.lr_warmup_samples),
            decay=samples(self.lr_decay_iters, self.lr_decay_samples) or total,
            wsd_decay=samples(self.lr_wsd_decay_iters, self.lr_wsd_decay_samples),
        )
        if steps.warmup >= steps.decay:
            raise ValueError(
                f"{self._given('warmup', steps.warmup)} must be shorter than the schedule, "
                f"{self._schedule_given(steps.decay, train_iters, train_samples)}"
            )
        if self.lr_decay_style == "WSD" and steps.warmup + steps.wsd_decay > steps.decay:
            raise ValueError(
                f"{self._given('warmup', steps.warmup)} plus "
                f"{self._given('wsd_decay', steps.wsd_decay)} exceed the schedule, "
                f"{self._schedule_given(steps.decay, train_iters, train_samples)}"
            )
        return steps

    def _given(self, what: str, samples: int) -> str:
        """A length as its flag gave it, e.g. ``--lr-warmup-iters 10 (40 samples)``."""
        iters = getattr(self, f"lr_{what}_iters")
        if iters:
            return f"--lr-{_dash(what)}-iters {iters} ({samples} samples)"
        return f"--lr-{_dash(what)}-samples {samples}"

    def _schedule_given(
        self, samples: int, train_iters: int | None, train_samples: int | None
    ) -> str:
        """The schedule's length as the flags gave it: --lr-decay-* or, by default, the run."""
        if self.lr_decay_iters or self.lr_decay_samples:
            return self._given("decay", samples)
        if train_samples is not None:
            return f"the run's --train-samples {train_samples}"
        return f"the run's --train-iters {train_iters} ({samples} samples)"


def _dash(name: str) -> str:
    return name.replace("_", "-")
