"""Megatron-LM's step-timer flags (``--help``'s "timers" group): which phases of a training step
are timed, how the times of the ranks are summarised, and whether TensorBoard gets them.

What each level costs (the timers themselves: :mod:`megatron.apertus.training.step_timers`):

- 0 (default): no timer runs; megatron-core's schedules, gradient finalisation and optimizer
  find no timers and skip them. No synchronisation, nothing measured, nothing printed.
- 1: the phases that run about once a step (forward-backward, the gradient all-reduce, each
  optimizer phase). Each start and stop waits for the device (``torch.cuda.synchronize``) and,
  unless --no-barrier-with-level-1-timing, each start is a barrier of all ranks: a few syncs per
  step, and ranks wait for the slowest at each phase.
- 2: also the phases that run once per micro-batch (batch generation, each micro-batch's
  forward and backward compute, every pipeline send and receive), each synchronised: the
  device's queue drains many times a step, which costs most where micro-batches are many and
  small.

At every --log-interval line (levels 1 and 2) all ranks exchange their times in one all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.apertus.flags import flag_help, switch


@dataclass(kw_only=True, frozen=True)
class TimingConfig:
    timing_log_level: Literal[0, 1, 2] = flag_help(
        "which step phases are timed and logged under the --log-interval line: 0 none (no "
        "cost), 1 the once-a-step phases (forward-backward, gradient all-reduce, optimizer "
        "phases; a device sync and a barrier each), 2 also the per-micro-batch ones "
        "(batch-generator, forward-compute, backward-compute, pipeline sends and receives; a "
        "device sync each)",
        0,
    )
    timing_log_option: Literal["max", "minmax", "all"] = flag_help(
        "how the ranks' times are printed: max, minmax (the slowest and fastest rank) or all "
        "(every rank's)",
        "minmax",
    )
    log_timers_to_tensorboard: bool = switch(
        "also write each timer's slowest-rank seconds per iteration to TensorBoard and wandb "
        "as '<name>-time' at every --log-interval line"
    )
    barrier_with_level_1_timing: bool = flag_help(
        "start each level-1 timer with a barrier of all ranks, so a phase's time excludes "
        "waiting for slower ranks; --no-barrier-with-level-1-timing: no barrier (the times "
        "then include that wait). Megatron-LM has only the --no- form; the positive form is ours",
        True,
        ours=True,
    )
