"""Megatron-LM's result validation (``--check-for-spiky-loss``, ``--check-for-large-grads``,
:mod:`~megatron.apertus.training.rerun_config`) on megatron-core's rerun state machine.

The machine is megatron-core's, used as Megatron-LM uses it: :func:`start` makes it (with the
model-parallel RNG tracker's states among what a rerun restores), :func:`checking_spiky_loss`
validates each training micro-batch's loss sum as Megatron-LM's loss function does, DDP
validates each bucket's gradient norm itself (``check_for_large_grads`` in its config,
:func:`~megatron.apertus.training.step.wrap_ddp`), and
:func:`~megatron.apertus.training.step.train_step` runs its forward and backward passes for as
long as the machine asks. A step's micro-batches are a list in memory, so a rerun iterates them
afresh: no data iterator needs rewinding.

What a rejected result does (validate_results): megatron-core logs ``Unexpected result ...
(message='Spiky loss')`` and the step runs again from the same RNG states; a rerun that differs
is logged as a possible transient error, one that reproduces as such; both checks are non-fatal,
so the run goes on with the rerun's gradients either way. The first iteration is never validated
and the first 100 values of each check only set its scale (megatron-core's sampling), so a
spike is found from about 100 micro-batches into the run.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import tensor_parallel
from megatron.core.rerun_state_machine import (
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    destroy_rerun_state_machine,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
)

from megatron.apertus.training.rerun_config import RerunConfig
from megatron.apertus.training.step import ForwardPass

SPIKY_LOSS_FACTOR = 10
"""A loss sum this many times the largest of the sampled ones is a spike (Megatron-LM's)."""


def start(config: RerunConfig, iteration: int) -> None:
    """megatron-core's machine for this process, continuing at ``iteration``: in the flags' mode
    when a check is on, else off (no result to validate: no all-reduce per step)."""
    destroy_rerun_state_machine()
    tracker = tensor_parallel.get_cuda_rng_tracker
    initialize_rerun_state_machine(
        state_save_func=lambda: {"rng_tracker_states": tracker().get_states()},
        state_restore_func=lambda saved: tracker().set_states(saved["rng_tracker_states"]),
        mode=RerunMode(config.mode) if config.checks else RerunMode.DISABLED,
        error_injector=RerunErrorInjector(
            error_injection_rate=config.error_injection_rate,
            error_injection_type=RerunDiagnostic(config.error_injection_type),
        ),
        result_rejected_tracker_filename=config.result_rejected_tracker_filename,
    )
    get_rerun_state_machine().current_iteration = iteration


def stop() -> None:
    destroy_rerun_state_machine()


def _validate_loss(result: tuple) -> tuple:
    """Megatron-LM's spiky-loss check of a reduced micro-batch (its first value: the loss sum)."""
    machine = get_rerun_state_machine()
    machine.validate_result(
        result=result[0].detach().clone(),  # the schedule scales the loss in place
        rejection_func=partial(
            machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"
        ),
        message="Spiky loss",
        tolerance=0.0,  # the forward pass is deterministic
        fatal=False,
    )
    return result


def checking_spiky_loss(forward: ForwardPass) -> ForwardPass:
    """``forward`` whose loss reduction validates each micro-batch's loss sum."""

    def checked(batch, model) -> tuple[torch.Tensor, object]:
        output, reduce = forward(batch, model)
        return output, lambda output_tensor: _validate_loss(reduce(output_tensor))

    return checked
