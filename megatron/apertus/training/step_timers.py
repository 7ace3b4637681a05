"""Megatron-LM's per-phase step timers (``--timing-log-level``), kept by megatron-core's own
:class:`~megatron.core.timers.Timers`.

megatron-core times the phases it runs whenever its configs hold timers: its schedules
(forward-backward; per micro-batch forward-compute, backward-compute and the pipeline's sends
and receives), the gradient finalisation (all-grads-sync, embedding-grads-all-reduce, ...) and
the optimizer (optimizer-copy-to-main-grad, optimizer-inner-step, ...). :class:`StepTimers` puts
one ``Timers`` into the model's and the optimizer's configs at levels 1 and 2; at level 0 it puts
none, and megatron-core then skips every timer: the step runs exactly as without the flags.
:func:`timed` times the phases our own step runs under Megatron-LM's names and levels:
batch-generator (2), optimizer (1, the whole update), optimizer-clip-main-grad (1, the gradient
norm and the clipping) and optimizer-count-zeros (1).

Invariants: every rank reports the same fixed list of names (Megatron-LM's for the level), since
the report is a collective; a timer no rank ran is left out of the lines. Times are per
iteration: the sum since the last line over the steps since then. Validation runs the same
schedules, so its forward passes count into forward-backward and forward-compute, as in
Megatron-LM.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import megatron.core.timers as core_timers
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.timers import Timers
from megatron.core.utils import get_model_config

from megatron.apertus.training.metrics import Metrics
from megatron.apertus.training.timing_config import TimingConfig

LEVEL_1 = (
    "forward-backward",
    "layernorm-grads-all-reduce",
    "non-tensor-parallel-grads-all-reduce",
    "embedding-grads-all-reduce",
    "all-grads-sync",
    "params-all-gather",
    "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad",
    "optimizer-count-zeros",
    "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
    "optimizer",
)
"""Megatron-LM's level-1 names, in its order; megatron-core now names the layer-norm
all-reduce non-tensor-parallel-grads-all-reduce, which is listed too."""
LEVEL_2 = (
    "batch-generator",
    "forward-compute",
    "backward-compute",
    "forward-recv",
    "forward-send",
    "backward-recv",
    "backward-send",
    "forward-send-forward-recv",
    "forward-send-backward-recv",
    "backward-send-forward-recv",
    "backward-send-backward-recv",
    "forward-backward-send-forward-backward-recv",
)
"""Megatron-LM's level-2 names (logged with level 1's), in its order."""


UNTIMED = contextlib.nullcontext()
"""What :func:`timed` returns without timers: reusable, and cheaper than a generator."""


def timed(config, name: str, level: int) -> contextlib.AbstractContextManager:
    """Time phase ``name`` with the timers of ``config`` (a megatron-core model or optimizer
    config) as megatron-core times its own: a level-1 timer starts with a barrier unless the
    config's ``barrier_with_L1_time`` is off. Without timers (level 0) nothing happens."""
    if config.timers is None:
        return UNTIMED
    return _timing(config, name, level)


@contextlib.contextmanager
def _timing(config, name: str, level: int) -> Iterator[None]:
    timer = config.timers(name, log_level=level)
    timer.start(barrier=level == 1 and config.barrier_with_L1_time)
    yield
    timer.stop()


@contextlib.contextmanager
def _gathering() -> Iterator[None]:
    """Around megatron-core's gathering of the ranks' times: it calls
    ``all_gather_into_tensor``, which recent torch says is deprecated, a notice on every rank's
    console that no user of these flags can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*all_gather_into_tensor. is deprecated", category=FutureWarning
        )
        yield


def _optimizer_configs(optimizer: MegatronOptimizer) -> list:
    return [part.config for part in getattr(optimizer, "chained_optimizers", [optimizer])]


class StepTimers:
    """The run's timers: given to megatron-core's configs, reported at each iteration line."""

    def __init__(self, config: TimingConfig, model: list, optimizer: MegatronOptimizer) -> None:
        self.config = config
        level = config.timing_log_level
        self.names = (LEVEL_1 if level >= 1 else ()) + (LEVEL_2 if level >= 2 else ())
        self.model_config = get_model_config(model[0])
        self.timers = Timers(level, config.timing_log_option) if level else None
        for target in [get_model_config(chunk) for chunk in model] + _optimizer_configs(optimizer):
            target.timers = self.timers
            target.barrier_with_L1_time = config.barrier_with_level_1_timing

    def phase(self, name: str, level: int) -> contextlib.AbstractContextManager:
        """:func:`timed` with the model's config (phases outside megatron-core's)."""
        return timed(self.model_config, name, level)

    def write(self, iteration: int, steps: int, metrics: Metrics) -> None:
        """With --log-timers-to-tensorboard, at an iteration line, on every rank (it gathers
        all ranks' times): the slowest rank's seconds per iteration over the ``steps`` since
        the last line, to TensorBoard and wandb as ``<name>-time`` (each rank its own writers:
        the reporting rank's). The times are kept for :meth:`lines`."""
        if self.timers is None or not self.config.log_timers_to_tensorboard:
            return
        wandb = core_timers.wandb if metrics.wandb is not None else None
        for writer in (metrics.tensorboard, wandb):
            with _gathering():
                self.timers.write(self.names, writer, iteration, normalizer=steps, reset=False)

    def lines(self, steps: int, *, reset: bool) -> str | None:
        """At an iteration line, on every rank (it gathers all ranks' times): Megatron-LM's
        timer lines, milliseconds per iteration over the ``steps`` since the last line, for
        the reporting rank to print (None at level 0, or when no timer ran). ``reset`` starts
        the next interval (not at the extra line of a job's first iteration, as Megatron-LM)."""
        if self.timers is None:
            return None
        with _gathering():
            return self.timers.get_all_timers_string(self.names, normalizer=steps, reset=reset)
