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
alarms; its state (consecutive counts, running moments, the alarms that fired, the decisions
taken) is a small dictionary that the checkpoint keeps, so a requeued job goes on counting where
it stopped. :class:`GuardedRun` connects it to the training loop: one call per step logs the
alarms, records them, and says when the run must stop or switch layers out of FP8
(:class:`Switch`).

A switch (``bf16-layers``, ``bf16``) is carried out in the running job: the layers leave FP8
(:mod:`megatron.apertus.model.precision`) and the trainer goes back to the run's own last
checkpoint before the alarm, persistent or not (never one of a history a --ckpt-step left). The
decision is written at once to the save directory (:data:`DECISIONS_FILE`; also beside a
non-persistent checkpoint gone back to), then into every later checkpoint: a job that dies
before its next save is requeued onto that same checkpoint (the newest one) with the same layers
out of FP8 (:func:`decisions_at`).

This module imports neither torch nor megatron-core at module level: its configuration is
part of the command line, which must parse without them.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

from megatron.apertus.checkpoint_files import checkpoint_iteration
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help

if TYPE_CHECKING:
    from megatron.apertus.training.metrics import Metrics
    from megatron.apertus.training.step import StepResult

log = logging.getLogger("apertus")

ACTIONS = ("warn", "stop", "bf16-layers", "bf16")
SWITCHES = ("bf16-layers", "bf16")
"""The actions that take layers out of FP8 and go back to the last checkpoint before the alarm."""
CHECKPOINT_KEY = "fp8_guard"
"""The guard's entry in a checkpoint's extra training state."""
DECISIONS_FILE = "fp8_guard_decisions.json"
"""Beside the checkpoints in ``--save``: every switch decision, written when it is taken (and
beside the non-persistent checkpoint it goes back to, when it goes back to one)."""
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
        "what an alarm does: warn (log it, record it in --log-json and TensorBoard; the default), "
        "stop (save a checkpoint and exit 1), bf16-layers (the layers it names continue in bf16 "
        "from the last checkpoint saved before the alarm, in the same job) or bf16 (every layer "
        "does); the last two need --save",
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

    @property
    def switches(self) -> bool:
        """Whether an alarm takes layers out of FP8 (the guard on, a switching action)."""
        return self.fp8_guard and self.fp8_guard_action in SWITCHES

    def check_run(
        self, *, save: str | None, fp8_param_gather: bool, saves_left_out: list[str]
    ) -> None:
        """What a switching action needs of the rest of the run: whole checkpoints to go back
        to (``saves_left_out``: the flags that leave states out of them), and weights that can
        leave FP8."""
        action = f"--fp8-guard-action {self.fp8_guard_action}"
        if self.switches and not save:
            raise ConfigError(
                f"{action} goes back to the last checkpoint before the alarm: it needs --save"
            )
        if self.switches and saves_left_out:
            raise ConfigError(
                f"{action} continues from its own checkpoints as the run itself would: they "
                f"need every state, drop {' and '.join(saves_left_out)}"
            )
        if self.switches and fp8_param_gather:
            raise ConfigError(
                f"{action} needs the weights in --precision: --fp8-param-gather keeps them in "
                "FP8 only"
            )


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
    """The decision: fed each step's figures, returns the alarms raised at that step.

    Layers in bf16 (``exempt``) raise no GEMM-input alarm: FP8 no longer touches their inputs,
    though their statistics are still measured and logged."""

    def __init__(
        self, cfg: Fp8GuardConfig, state: dict | None = None, exempt: Iterable[int] = ()
    ) -> None:
        self.cfg = cfg
        state = state or {}
        self.exempt: set[int] = set()
        self.above: dict[str, int] = dict(state.get("above", {}))
        """Consecutive measurements above its bound, per ``layer/gemm/statistic``."""
        self.loss = RunningMoments(cfg.fp8_guard_window, state.get("loss"))
        self.grad_norm = RunningMoments(cfg.fp8_guard_window, state.get("grad_norm"))
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
        self.fired: list[dict] = list(state.get("fired", []))
        """The alarms raised so far (at most :data:`KEPT_ALARMS`, the latest)."""
        self.stopped_at: int | None = state.get("stopped_at")
        self.decisions: list[dict] = list(state.get("decisions", []))
        """The switches taken (:meth:`Switch.record`), oldest first."""
        self.exempt_layers(exempt)

    def exempt_layers(self, layers: Iterable[int]) -> None:
        """From now on, no GEMM-input alarm for ``layers`` (their counts start over)."""
        self.exempt |= set(layers)
        self.above = {k: n for k, n in self.above.items() if layer_number(k) not in self.exempt}

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
            if layer_number(layer) in self.exempt:
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
            "decisions": list(self.decisions),
        }

    def layers_above_bounds(self) -> set[int]:
        """The layers with a GEMM input above its bound at its latest measurement."""
        return {layer_number(key) for key in self.above}


KEPT_ALARMS = 100
"""Alarms the checkpointed state keeps, the latest: enough to say what happened."""


def layer_number(name: str) -> int:
    """``layer002`` (or ``layer002/fc2/kurtosis``) -> 2."""
    return int(name.split("/")[0].removeprefix("layer"))


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


def _layers_text(layers: Iterable[int]) -> str:
    listed = sorted(layers)
    return f"layer{'s' if len(listed) > 1 else ''} {', '.join(str(n) for n in listed)}"


@dataclass(frozen=True)
class Switch:
    """A decision to take ``layers`` out of FP8 after the alarm at ``iteration`` (``why``) and
    continue from the checkpoint of iteration ``resumed_from``, the last one saved before it."""

    action: str
    layers: tuple[int, ...]
    iteration: int
    why: str
    resumed_from: int | None = None

    def record(self) -> dict:
        """As the checkpoint and :data:`DECISIONS_FILE` keep it (plain JSON)."""
        return {**asdict(self), "layers": list(self.layers)}

    def describe(self) -> str:
        return (
            f"FP8 guard: {self.action} at iteration {self.iteration} ({self.why}): "
            f"{_layers_text(self.layers)} continue in bf16 from the checkpoint of iteration "
            f"{self.resumed_from}"
        )

    def no_checkpoint_line(self, save: str) -> str:
        """Why the run stops instead: nothing in ``save`` to go back to."""
        flags = " ".join(str(n) for n in self.layers)
        return (
            f"the FP8 guard's {self.action} at iteration {self.iteration} ({self.why}) goes back "
            f"to the last checkpoint saved before the alarm, and {save} holds none yet; restart "
            f"the run with --bf16-layers {flags} (and a --save-interval that saves before the "
            "trouble starts)"
        )


def write_decision(save_dir: str | Path, switch: Switch) -> None:
    """Append ``switch`` to ``save_dir``'s :data:`DECISIONS_FILE` (atomically; one writer)."""
    path = Path(save_dir) / DECISIONS_FILE
    decisions = read_decisions(Path(save_dir)) + [switch.record()]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(decisions, indent=2) + "\n")
    tmp.replace(path)


def read_decisions(save_dir: Path) -> list[dict]:
    """The decisions written to ``save_dir`` (none when it holds no :data:`DECISIONS_FILE`)."""
    path = save_dir / DECISIONS_FILE
    return json.loads(path.read_text()) if path.is_file() else []


def decisions_at(checkpoint_dir: Path | None) -> list[dict]:
    """The decisions that hold for a run continuing from ``checkpoint_dir`` (an ``iter_*``
    directory, persistent or not): those its guard state carries, and those the
    :data:`DECISIONS_FILE` of its directory names it for (taken after it was saved; a job that
    ended before its next save left them nowhere else)."""
    if checkpoint_dir is None:
        return []
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_common_state_dict(str(checkpoint_dir)).get("training_state", {})
    decisions = list(((saved.get("extra") or {}).get(CHECKPOINT_KEY) or {}).get("decisions", []))
    for record in read_decisions(checkpoint_dir.parent):
        if record["resumed_from"] == saved.get("iteration") and record not in decisions:
            decisions.append(record)
    return decisions


def decided_layers(cfg: Fp8GuardConfig, decisions: list[dict], *, reporting: bool) -> set[int]:
    """The layers ``decisions`` keep out of FP8, each said in the log; none while the guard is
    off, which is how a run takes them back into FP8 (said too)."""
    layers = {n for record in decisions for n in record["layers"]}
    if reporting:
        for record in decisions:
            switch = Switch(**{**record, "layers": tuple(record["layers"])})
            log.info(
                switch.describe() + ("" if cfg.fp8_guard else ": not applied, --fp8-guard off")
            )
    return layers if cfg.fp8_guard else set()


class GuardedRun:
    """The guard inside the training loop: one :meth:`after_step` per step.

    Decisions are taken on the reporting rank, the one that holds the loss and, gathered from
    every pipeline stage, every layer's statistics; with ``stop``, ``bf16-layers`` or ``bf16``
    the decision is shared with every rank (an all-reduce per step, and the decision itself once
    one is taken), so that all of them save and exit, or go back, together.
    """

    def __init__(
        self,
        cfg: Fp8GuardConfig,
        *,
        reporting: bool,
        metrics: Metrics,
        save_dir: str | None,
        num_layers: int,
        state: dict | None = None,
        decisions: Iterable[dict] = (),
        bf16_layers: Iterable[int] = (),
    ) -> None:
        """``state``: the guard's state in the checkpoint the run continues; ``decisions``: the
        switches that hold for it (:func:`decisions_at`); ``bf16_layers``: the layers out of FP8
        (``--bf16-layers`` and those decisions)."""
        self.cfg = cfg
        self.reporting = reporting
        self.metrics = metrics
        self.save_dir = save_dir
        self.num_layers = num_layers
        self.guard = Fp8Guard(cfg, state, exempt=bf16_layers)
        self.guard.decisions = list(decisions)
        if cfg.fp8_guard and reporting and self.guard.stopped_at is not None:
            log.info(
                f"FP8 guard: this run was stopped by it at iteration {self.guard.stopped_at}; "
                "its counts carry on from the checkpoint"
            )

    @property
    def bf16_layers(self) -> set[int]:
        """The layers out of FP8: ``--bf16-layers`` and the switches taken."""
        return set(self.guard.exempt)

    def after_step(
        self, iteration: int, result: StepResult, gemm_inputs: dict | None
    ) -> str | Switch | None:
        """Log and record this step's alarms; under ``stop``, the line that stops the run, under
        ``bf16-layers`` and ``bf16`` the :class:`Switch` to carry out (both on every rank), else
        None."""
        if not self.cfg.fp8_guard:
            return None
        alarms: list[Alarm] = []
        if self.reporting:
            alarms = self.guard.observe(
                iteration,
                loss=result.loss,
                grad_norm=result.grad_norm,
                skipped=result.skipped and not result.overflow,
                gemm_inputs=gemm_inputs,
            )
            for alarm in alarms:
                self._report(alarm)
        action = self.cfg.fp8_guard_action
        if action == "warn" or not self._anywhere(bool(alarms)):
            return None
        if action == "stop":
            self.guard.stopped_at = iteration
            return stop_line(alarms, iteration, self.save_dir)
        return self._from_reporting_rank(
            self._switch(alarms, iteration) if self.reporting else None
        )

    def _switch(self, alarms: list[Alarm], iteration: int) -> Switch | None:
        """The layers to take out of FP8: under ``bf16`` every layer; under ``bf16-layers``
        those the alarms name, else (a loss or gradient-norm spike, skipped steps: no layer
        named) those with a GEMM input above its bound, else every layer; less those in bf16
        already. None when none is left in FP8 (the alarm is only warned)."""
        every = set(range(1, self.num_layers + 1))
        named = {layer_number(alarm.layer) for alarm in alarms if alarm.layer}
        layers = every
        if self.cfg.fp8_guard_action == "bf16-layers":
            layers = named or self.guard.layers_above_bounds() or every
        layers -= self.guard.exempt
        why = "; ".join(alarm.describe() for alarm in alarms)
        if not layers:
            log.warning(f"FP8 guard: iteration {iteration}: every layer is in bf16 already ({why})")
            return None
        return Switch(self.cfg.fp8_guard_action, tuple(sorted(layers)), iteration, why)

    def commit(self, switch: Switch, checkpoint_dir: Path) -> Switch:
        """Take ``switch`` (every rank), going back to the checkpoint ``checkpoint_dir``: its
        layers count as bf16 from now on, it is said in the log and the metrics, written (by
        global rank 0) to --save's :data:`DECISIONS_FILE` and, for a non-persistent checkpoint,
        to the one beside it (where :func:`decisions_at` looks when a job is requeued onto it),
        and kept in the guard's state for every later checkpoint."""
        import torch

        resumed_from = checkpoint_iteration(checkpoint_dir)
        switch = Switch(**{**asdict(switch), "resumed_from": resumed_from})
        self.guard.decisions.append(switch.record())
        self.guard.exempt_layers(switch.layers)
        if self.reporting:
            log.warning(switch.describe())
            name = f"fp8_guard/{switch.action}"
            self.metrics.record(f"{name}/layers", switch.iteration, len(switch.layers))
            self.metrics.record(f"{name}/resumed_from", switch.iteration, resumed_from)
            self.metrics.flush()
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            for directory in dict.fromkeys([Path(self.save_dir), checkpoint_dir.parent]):
                write_decision(directory, switch)
        return switch

    def resumed(self, state: dict | None) -> None:
        """The run went back to a checkpoint that saved the guard state ``state``: counts and
        running moments continue from there; the alarms and decisions since are kept."""
        current = self.guard
        self.guard = Fp8Guard(self.cfg, state, exempt=current.exempt)
        self.guard.fired, self.guard.decisions = current.fired, current.decisions

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

    def _from_reporting_rank(self, value):
        """The reporting rank's ``value``, on every rank (a collective)."""
        import torch

        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return value
        gathered: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, (self.reporting, value))
        return next(theirs for reporting, theirs in gathered if reporting)

    def save_into(self, extra: dict) -> None:
        """Put the guard's state into a checkpoint's extra state (a collective when the guard
        is on: every rank saves)."""
        if self.cfg.fp8_guard:
            extra[CHECKPOINT_KEY] = self.state()

    def state(self) -> dict:
        """The reporting rank's guard state, on every rank (a collective: call it where every
        rank saves), for the checkpoint."""
        return self._from_reporting_rank(self.guard.state())
