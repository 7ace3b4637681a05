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

The weight decay follows megatron-core's schedule too (Megatron-LM's ``--weight-decay-incr-style``):
constant at ``--weight-decay``, or from ``--start-weight-decay`` up to ``--end-weight-decay``
over the whole run (not ``lr_decay_*``: Megatron-LM's ``wd_incr_steps`` is the run's length),
linearly or along half a cosine; each param group applies it times its ``wd_mult``.

Resume semantics are megatron-core's: the step count always comes from the checkpoint; with
``override_opt_param_scheduler`` every other value comes from the new config; with
``use_checkpoint_opt_param_scheduler`` from the checkpoint; with neither they must agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from megatron.apertus.flags import flag_help, require

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

    warmup: float
    """A whole number unless given as a fraction of ``decay`` (Megatron-LM's, unrounded)."""
    decay: int
    wsd_decay: int
    wd_incr: int
    """The weight decay's schedule: the run."""


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
    lr_warmup_fraction: Optional[float] = flag_help(
        "warmup as a fraction of the schedule's length (--lr-decay-iters/-samples, default the "
        "run), instead of --lr-warmup-iters/-samples",
        None,
    )
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
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = flag_help(
        "weight decay over the run: constant (--weight-decay) or rising from "
        "--start-weight-decay to --end-weight-decay, linear or cosine",
        "constant",
    )
    start_weight_decay: Optional[float] = flag_help(
        "weight decay at the start (linear, cosine; constant: --weight-decay)", None
    )
    end_weight_decay: Optional[float] = flag_help(
        "weight decay at the end of the run (linear, cosine; constant: --weight-decay)", None
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
        init = self.lr_warmup_init
        require(math.isfinite(init) and init >= 0, "--lr-warmup-init", init, "a finite number >= 0")
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
        self._check_warmup_fraction()
        self._check_weight_decay()

    def _check_warmup_fraction(self) -> None:
        """Megatron-LM's rule: a fraction, or a warmup in iterations or samples, not both."""
        fraction = self.lr_warmup_fraction
        if fraction is None:
            return
        if self.lr_warmup_iters or self.lr_warmup_samples:
            given = "iters" if self.lr_warmup_iters else "samples"
            raise ValueError(f"give --lr-warmup-fraction or --lr-warmup-{given}, not both")
        require(0 <= fraction < 1, "--lr-warmup-fraction", fraction, "in [0, 1)")

    def _check_weight_decay(self) -> None:
        """Megatron-LM's rules: a constant weight decay is --weight-decay alone, a rising one
        needs both ends; megatron-core's: the ends are >= 0 and it never falls."""
        start, end = self.start_weight_decay, self.end_weight_decay
        if self.weight_decay_incr_style == "constant":
            for flag, value in (("--start-weight-decay", start), ("--end-weight-decay", end)):
                if value is not None:
                    raise ValueError(
                        f"{flag} needs --weight-decay-incr-style linear or cosine (constant: "
                        "--weight-decay)"
                    )
            return
        if start is None or end is None:
            raise ValueError(
                f"--weight-decay-incr-style {self.weight_decay_incr_style} needs "
                "--start-weight-decay and --end-weight-decay"
            )
        require(math.isfinite(start) and start >= 0, "--start-weight-decay", start, ">= 0")
        require(
            math.isfinite(end) and end >= start,
            "--end-weight-decay",
            end,
            f">= --start-weight-decay {start} (the weight decay only rises)",
        )

    def weight_decay_range(self, weight_decay: float) -> tuple[float, float]:
        """The weight decay at the start and at the end of the run; ``weight_decay``:
        ``--weight-decay``, the constant style's."""
        if self.weight_decay_incr_style == "constant":
            return weight_decay, weight_decay
        return self.start_weight_decay, self.end_weight_decay

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

        decay = samples(self.lr_decay_iters, self.lr_decay_samples) or total
        steps = ScheduleSteps(
            warmup=self._warmup(decay, samples(self.lr_warmup_iters, self.lr_warmup_samples)),
            decay=decay,
            wsd_decay=samples(self.lr_wsd_decay_iters, self.lr_wsd_decay_samples),
            wd_incr=total,
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

    def _warmup(self, decay: int, given: int) -> float:
        """The warmup in samples: ``lr_warmup_fraction`` of ``decay`` (Megatron-LM's product,
        not rounded), else ``given``."""
        if self.lr_warmup_fraction is None:
            return given
        return self.lr_warmup_fraction * decay

    def _given(self, what: str, samples: float) -> str:
        """A length as its flag gave it, e.g. ``--lr-warmup-iters 10 (40 samples)``."""
        if what == "warmup" and self.lr_warmup_fraction is not None:
            return f"--lr-warmup-fraction {self.lr_warmup_fraction} ({samples:g} samples)"
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
