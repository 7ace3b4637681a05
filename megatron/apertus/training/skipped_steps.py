"""Steps skipped for a non-finite loss or gradient norm (``training/step.py: optimizer_step``
leaves the weights untouched): each is logged, too many in a row stop the run, and a run none
of whose steps trained saves nothing.

fp16's dynamic loss scaler refusing the update of a step with a finite loss (its scaled
gradients overflowed; it backs its scale off) is no fault: as in Megatron-LM the step is
skipped and the iteration line counts it, but it counts toward neither ``--max-skipped-steps``
nor the stop of a run none of whose steps trained, until the run ends: a run starting from
Megatron-LM's initial scale of 2^32 overflows a dozen times or more before its first update.
A non-finite loss under fp16, and an overflow under a constant --loss-scale or at
--min-loss-scale (no scale left to back off to), stay faults."""

from __future__ import annotations

import logging

from megatron.apertus.training.runtime import is_reporting_rank
from megatron.apertus.training.step import StepResult

log = logging.getLogger("apertus")


class SkippedSteps:
    """The count of this job's steps, of those that updated the weights, of the loss scaler's
    overflows and of the faults in a row; ``--max-skipped-steps`` of them in a row end the
    run."""

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.steps = self.updated = self.overflows = 0

    def count(self, result: StepResult, iteration: int) -> bool:
        """Count step ``iteration``; whether it made too many skipped steps in a row. An
        overflow neither adds to the faults in a row nor ends them."""
        self.steps += 1
        if not result.skipped:
            self.in_a_row = 0
            self.updated += 1
            return False
        if result.overflow:
            self.overflows += 1
            if is_reporting_rank():
                log.info(
                    f"iteration {iteration}: the fp16 gradients overflowed at this loss scale; "
                    "step skipped, the dynamic loss scale backs off"
                )
            return False
        self.in_a_row += 1
        if is_reporting_rank():
            log.warning(
                f"iteration {iteration}: non-finite loss or gradient norm "
                f"({result.loss}, {result.grad_norm}); step skipped "
                f"({self.in_a_row} in a row)"
            )
        return self.in_a_row >= self.max_in_a_row

    def too_many(self, iteration: int, save: str | None) -> str:
        """The line that stops the run after too many skipped steps in a row."""
        return (
            f"{self.in_a_row} consecutive steps had a non-finite loss or gradient norm "
            f"(--max-skipped-steps {self.max_in_a_row}); stopped at iteration "
            f"{iteration} with the last good weights saved" + (f" to {save}" if save else "")
        )

    def scaling_down(self) -> bool:
        """Whether no step has trained yet and every one so far was a loss-scale overflow: fp16's
        dynamic scale is still coming down from its start, and a save may wait for the first
        update rather than stop the run."""
        return self.steps > 0 and self.overflows == self.steps

    def nothing_trained(self, iteration: int) -> str | None:
        """The line that stops the run, saving nothing, when every step of this job so far was
        skipped: a checkpoint would hold the starting weights as if trained, and a resumed job
        would then find the run finished. A loss that is never finite comes from the data or
        the configuration; a loss scale that never stops overflowing, from one too high for
        the run's length. None when a step trained (or none ran)."""
        if not self.steps or self.updated:
            return None
        if self.scaling_down():
            return (
                f"every step of this run ({self.steps}, up to iteration {iteration}) overflowed "
                "fp16's dynamic loss scale and was skipped; nothing trained, nothing saved: "
                "train longer or start from a lower --initial-loss-scale"
            )
        return (
            f"every step of this run ({self.steps}, up to iteration {iteration}) "
            "had a non-finite loss or gradient norm and was skipped; nothing trained, nothing "
            "saved: check the training data and the loss settings"
        )
