"""``--fp8-guard``: watch the signs that FP8 training is about to go wrong, and act on them.

FP8 runs of Apertus diverged long after they started: a few activation channels grew into
outliers, the per-tensor FP8 scale followed the outliers, more of the remaining values
underflowed, and only then did the loss rise and the gradient norm spike. The GEMM-input
statistics of ``--log-intermediate-metrics`` (:mod:`.gemm_metrics`) see the first stages; the
loss and the gradient norm see the last. The guard reads both and raises an alarm when

* the kurtosis of a GEMM input stays above a bound for several consecutive measurements;
* the e4m3 underflow or overflow share of a GEMM input does the same;
* the loss or the gradient norm jumps above its running mean by z running standard deviations;
* a step is skipped (non-finite loss or gradient norm), the given number of times in a row.

:class:`Fp8Guard` is the decision, in pure Python: fed one step's figures, it returns the
alarms; its state (consecutive counts, running moments, the alarms that fired) is a small
dictionary that the checkpoint keeps, so a requeued job goes on counting where it stopped.
:class:`GuardedRun` connects it to the training loop: one call per step logs the alarms,
records them, and says when the run must stop.

This module imports neither torch nor megatron-core at module level: its configuration is
part of the command line, which must parse without them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help

if TYPE_CHECKING:
    from megatron.apertus.training.metrics import Metrics
    from megatron.apertus.training.step import StepResult

log = logging.getLogger("apertus")

ACTIONS = ("warn", "stop", "bf16-layers", "bf16")
"""Every action the flag names; :data:`AVAILABLE_ACTIONS` are the ones implemented."""
AVAILABLE_ACTIONS = ("warn", "stop")
CHECKPOINT_KEY = "fp8_guard"
"""The guard's entry in a checkpoint's extra training state."""
GEMM_STATISTICS = ("kurtosis", "underflow", "overflow")
"""The GEMM-input statistics the guard reads; it turns on those the run does not log."""


@dataclass(kw_only=True, frozen=True)
class Fp8GuardConfig:
    """Thresholds and action of the guard; every bound can be switched off with 0. Every flag is
    ours (``ours=True``): neither Megatron-LM nor the Apertus fork has one."""

    fp8_guard: bool = flag_help(
        "watch for signs of FP8 trouble (GEMM-input kurtosis, e4m3 underflow/overflow, loss "
        "and grad-norm spikes, skipped steps) and act (--fp8-guard-action); turns on the "
        "--log-intermediate-metrics statistics it reads (kurtosis underflow overflow); "
        "docs/gpu.md",
        False,
        ours=True,
    )
    fp8_guard_action: str = flag_help(
        "what an alarm does: warn (log it, record it in --log-json and TensorBoard) or stop "
        "(save a checkpoint and exit 1; default warn); bf16-layers and bf16 are not available yet",
        "warn",
        ours=True,
    )
    fp8_guard_kurtosis: float = flag_help(
        "alarm when a GEMM input's kurtosis stays above this for --fp8-guard-intervals "
        "consecutive measurements (default 500: 2.5x the 150-200 of fc2's input in 0.5B runs that "
        "trained; a vector of H values has kurtosis at most about H; 0: off)",
        500.0,
        ours=True,
    )
    fp8_guard_underflow: float = flag_help(
        "alarm when the share of a GEMM input's non-zero values that e4m3 flushes to zero stays "
        "above this for --fp8-guard-intervals measurements (default 0.003: 2x the highest share seen "
        "in a healthy 0.5B run, 0.0016; 0.0004 typical, 0.0014 when FP8 drifted; 0: off)",
        0.003,
        ours=True,
    )
    fp8_guard_overflow: float = flag_help(
        "alarm when the share of a GEMM input's values that saturate e4m3 stays above this for "
        "--fp8-guard-intervals measurements (default 0.0001; 0 under current scaling by "
        "construction; 0: off)",
        0.0001,
        ours=True,
    )
    fp8_guard_intervals: int = flag_help(
        "consecutive intermediate-metric measurements a GEMM-input bound must be exceeded for "
        "(default 3)",
        3,
        ours=True,
    )
    fp8_guard_loss_z: float = flag_help(
        "alarm when the loss exceeds its running mean by this many running standard deviations "
        "(default 6; 0: off)",
        6.0,
        ours=True,
    )
    fp8_guard_grad_norm_z: float = flag_help(
        "alarm when the gradient norm exceeds its running mean by this many running standard "
        "deviations (default 6; 0: off)",
        6.0,
        ours=True,
    )
    fp8_guard_window: int = flag_help(
        "steps over which the running mean and standard deviation of the loss and gradient "
        "norm average (exponentially); no spike alarm before this many steps were seen (default "
        "100)",
        100,
        ours=True,
    )
    fp8_guard_skipped: int = flag_help(
        "alarm after this many consecutive skipped steps (non-finite loss or grad norm; default 1; "
        "0: off)",
        1,
        ours=True,
    )

    def __post_init__(self) -> None:
        """Refuse what cannot be meant, whether the guard is on or not: a typo in a threshold
        should not wait until the day the guard is switched on."""
        if self.fp8_guard_action not in ACTIONS:
            raise ConfigError(
                f"--fp8-guard-action must be one of {', '.join(ACTIONS)}, "
                f"got {self.fp8_guard_action!r}"
            )
        if self.fp8_guard_action not in AVAILABLE_ACTIONS:
            raise ConfigError(
                f"--fp8-guard-action {self.fp8_guard_action} is not available yet; use "
                f"{' or '.join(AVAILABLE_ACTIONS)}"
            )
        for name in ("kurtosis", "underflow", "overflow", "loss_z", "grad_norm_z"):
            value = getattr(self, f"fp8_guard_{name}")
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"--fp8-guard-{name.replace('_', '-')} must be >= 0, got {value}")
        for name in ("underflow", "overflow"):
            value = getattr(self, f"fp8_guard_{name}")
            if value >= 1:
                raise ConfigError(f"--fp8-guard-{name} is a share: it must be < 1, got {value}")
        for name, least in (("intervals", 1), ("window", 2), ("skipped", 0)):
            value = getattr(self, f"fp8_guard_{name}")
            if value < least:
                raise ConfigError(f"--fp8-guard-{name} must be >= {least}, got {value}")


@dataclass(frozen=True)
class Alarm:
    """One exceeded bound: where (``layer`` and ``gemm`` for GEMM inputs), which figure, its
    value and the bound it crossed."""

    iteration: int
    figure: str
    value: float
    threshold: float
    layer: Optional[str] = None
    gemm: Optional[str] = None
    detail: str = ""
    relation: str = ">"

    @property
    def name(self) -> str:
        """The metric name it is recorded under (``fp8_guard/layer002/fc2/kurtosis``)."""
        where = "/".join(part for part in (self.layer, self.gemm) if part)
        return f"fp8_guard/{where + '/' if where else ''}{self.figure}"

    def describe(self) -> str:
        where = f"{self.layer} {self.gemm} " if self.layer else ""
        detail = f" ({self.detail})" if self.detail else ""
        return f"{where}{self.figure} {self.value:.4g} {self.relation} {self.threshold:.4g}{detail}"


class RunningMoments:
    """Exponentially weighted mean and variance over about ``window`` values: a slow drift of
    the loss moves them, a sudden jump stands out."""

    def __init__(self, window: int, state: dict | None = None) -> None:
        self.decay = 1.0 - 2.0 / (window + 1)
        self.window = window
        state = state or {}
        self.count = int(state.get("count", 0))
        self.mean = float(state.get("mean", 0.0))
        self.variance = float(state.get("variance", 0.0))

    def threshold(self, z: float) -> float | None:
        """Mean + z std, or None while fewer than ``window`` values were seen."""
        if self.count < self.window:
            return None
        return self.mean + z * math.sqrt(self.variance)

    def add(self, value: float) -> None:
        if self.count == 0:
            self.mean, self.variance = value, 0.0
        else:
            delta = value - self.mean
            self.mean += (1.0 - self.decay) * delta
            self.variance = self.decay * (self.variance + (1.0 - self.decay) * delta * delta)
        self.count += 1

    def state(self) -> dict:
        return {"count": self.count, "mean": self.mean, "variance": self.variance}


class Fp8Guard:
    """The decision: fed each step's figures, returns the alarms raised at that step."""

    def __init__(self, cfg: Fp8GuardConfig, state: dict | None = None) -> None:
        self.cfg = cfg
        state = state or {}
        self.above: dict[str, int] = dict(state.get("above", {}))
        """Consecutive measurements above its bound, per ``layer/gemm/statistic``."""
        self.loss = RunningMoments(cfg.fp8_guard_window, state.get("loss"))
        self.grad_norm = RunningMoments(cfg.fp8_guard_window, state.get("grad_norm"))
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
        self.fired: list[dict] = list(state.get("fired", []))
        """The alarms raised so far (at most :data:`KEPT_ALARMS`, the latest)."""
        self.stopped_at: int | None = state.get("stopped_at")

    def bound(self, statistic: str) -> float:
        return getattr(self.cfg, f"fp8_guard_{statistic}")

    def observe(
        self,
        iteration: int,
        *,
        loss: float | None,
        grad_norm: float | None,
        skipped: bool,
        gemm_inputs: dict[str, float] | None = None,
    ) -> list[Alarm]:
        """The alarms of one step. ``gemm_inputs``: ``layerNNN/gemm/statistic -> value`` at a
        measured step, empty or None at the others (their counts stay as they are)."""
        alarms = self._gemm_alarms(iteration, gemm_inputs or {})
        alarms += self._skip_alarms(iteration, skipped)
        if not skipped:
            alarms += self._spike(iteration, "loss", self.loss, loss, self.cfg.fp8_guard_loss_z)
            alarms += self._spike(
                iteration, "grad_norm", self.grad_norm, grad_norm, self.cfg.fp8_guard_grad_norm_z
            )
        self.fired = (self.fired + [_alarm_record(a) for a in alarms])[-KEPT_ALARMS:]
        return alarms

    def _gemm_alarms(self, iteration: int, measured: dict[str, float]) -> list[Alarm]:
        """A bound exceeded for ``--fp8-guard-intervals`` measurements in a row raises an alarm
        at each of them from then on; a measurement below it starts the count over."""
        alarms = []
        for key, value in sorted(measured.items()):
            layer, gemm, statistic = key.split("/")
            if statistic not in GEMM_STATISTICS or not self.bound(statistic):
                continue
            bound = self.bound(statistic)
            exceeded = value > bound or math.isnan(value)  # NaN: the tensor itself is broken
            self.above[key] = self.above.get(key, 0) + 1 if exceeded else 0
            if self.above[key] >= self.cfg.fp8_guard_intervals:
                detail = f"{self.above[key]} measurement(s) in a row"
                alarms.append(Alarm(iteration, statistic, value, bound, layer, gemm, detail))
        self.above = {k: n for k, n in self.above.items() if n}
        return alarms

    def _skip_alarms(self, iteration: int, skipped: bool) -> list[Alarm]:
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        limit = self.cfg.fp8_guard_skipped
        if not limit or self.skipped_in_a_row < limit:
            return []
        detail = "non-finite loss or grad norm"
        count = float(self.skipped_in_a_row)
        return [Alarm(iteration, "skipped_steps", count, limit, detail=detail, relation=">=")]

    def _spike(
        self, iteration: int, figure: str, moments: RunningMoments, value: float | None, z: float
    ) -> list[Alarm]:
        """Compare with the moments before this value, then let it into them (a lasting shift
        raises one alarm, and the moments follow it)."""
        if value is None or not math.isfinite(value):
            return []
        threshold = moments.threshold(z) if z else None
        mean = moments.mean
        moments.add(value)
        if threshold is None or value <= threshold:
            return []
        detail = f"running mean {mean:.4g}, {z:g} running std"
        return [Alarm(iteration, f"{figure}_spike", value, threshold, None, None, detail)]

    def state(self) -> dict:
        """What the checkpoint keeps (plain numbers, strings, lists and dicts)."""
        return {
            "above": dict(self.above),
            "loss": self.loss.state(),
            "grad_norm": self.grad_norm.state(),
            "skipped_in_a_row": self.skipped_in_a_row,
            "fired": list(self.fired),
            "stopped_at": self.stopped_at,
        }


KEPT_ALARMS = 100
"""Alarms the checkpointed state keeps, the latest: enough to say what happened."""


def _alarm_record(alarm: Alarm) -> dict:
    return {
        "iteration": alarm.iteration,
        "name": alarm.name,
        "value": alarm.value,
        "threshold": alarm.threshold,
    }


def gemm_statistics(logged: list[str] | None, cfg: Fp8GuardConfig) -> list[str] | None:
    """The statistics to measure: those logged, plus those the guard reads when it is on."""
    if not cfg.fp8_guard:
        return logged
    return list(dict.fromkeys([*(logged or ()), *GEMM_STATISTICS]))


def stop_line(alarms: list[Alarm], iteration: int, save: str | None) -> str:
    """Why the run stopped and how to go on, in one line."""
    why = "; ".join(a.describe() for a in alarms) or "an alarm on the reporting rank"
    saved = f"saved to {save}; resume with --load {save}" if save else "nothing saved (no --save)"
    return (
        f"the FP8 guard stopped the run at iteration {iteration}: {why}; {saved} once the cause "
        "is dealt with (e.g. without --fp8), or go on as is with --fp8-guard-action warn or "
        "--no-fp8-guard"
    )


class GuardedRun:
    """The guard inside the training loop: one :meth:`after_step` per step.

    Decisions are taken on the reporting rank, the one that holds the loss and, gathered
    from every pipeline stage, every layer's statistics; with ``stop`` the decision is shared
    with every rank (an all-reduce per step), so that all of them save and exit together.
    """

    def __init__(
        self,
        cfg: Fp8GuardConfig,
        *,
        reporting: bool,
        metrics: Metrics,
        save_dir: str | None,
        state: dict | None = None,
    ) -> None:
        self.cfg = cfg
        self.reporting = reporting
        self.metrics = metrics
        self.save_dir = save_dir
        self.guard = Fp8Guard(cfg, state)
        if cfg.fp8_guard and reporting and self.guard.stopped_at is not None:
            log.info(
                f"FP8 guard: this run was stopped by it at iteration {self.guard.stopped_at}; "
                "its counts carry on from the checkpoint"
            )

    def after_step(
        self, iteration: int, result: StepResult, gemm_inputs: dict | None
    ) -> str | None:
        """Log and record this step's alarms; under ``stop``, the line that stops the run (on
        every rank), else None."""
        if not self.cfg.fp8_guard:
            return None
        alarms: list[Alarm] = []
        if self.reporting:
            alarms = self.guard.observe(
                iteration,
                loss=result.loss,
                grad_norm=result.grad_norm,
                skipped=result.skipped,
                gemm_inputs=gemm_inputs,
            )
            for alarm in alarms:
                self._report(alarm)
        if self.cfg.fp8_guard_action != "stop" or not self._anywhere(bool(alarms)):
            return None
        self.guard.stopped_at = iteration
        return stop_line(alarms, iteration, self.save_dir)

    def _report(self, alarm: Alarm) -> None:
        """One log line; the figure and its bound as scalars (history, --log-json, TensorBoard,
        wandb), the line as TensorBoard text; on disk at once."""
        line = f"FP8 guard: iteration {alarm.iteration}: {alarm.describe()}"
        log.warning(line)
        self.metrics.record(alarm.name, alarm.iteration, alarm.value)
        self.metrics.record(f"{alarm.name}_threshold", alarm.iteration, alarm.threshold)
        if self.metrics.tensorboard is not None:
            self.metrics.tensorboard.add_text("fp8_guard", line, alarm.iteration)
        self.metrics.flush()

    def _anywhere(self, fired: bool) -> bool:
        """Whether the reporting rank raised an alarm: the same answer on every rank."""
        import torch

        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return fired
        flag = torch.tensor([int(fired)], dtype=torch.int32)
        if torch.distributed.get_backend() == "nccl":
            flag = flag.cuda()
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def save_into(self, extra: dict) -> None:
        """Put the guard's state into a checkpoint's extra state (a collective when the guard
        is on: every rank saves)."""
        if self.cfg.fp8_guard:
            extra[CHECKPOINT_KEY] = self.state()

    def state(self) -> dict:
        """The reporting rank's guard state, on every rank (a collective: call it where every
        rank saves), for the checkpoint."""
        import torch

        mine = (self.reporting, self.guard.state())
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return mine[1]
        gathered: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        return next(state for reporting, state in gathered if reporting)
