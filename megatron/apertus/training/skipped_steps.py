"""Steps skipped for a non-finite loss or gradient norm (``training/step.py: optimizer_step``
leaves the weights untouched): each is logged, too many in a row stop the run, and a run none
of whose steps trained saves nothing."""

from __future__ import annotations

import logging

from megatron.apertus.training.runtime import is_reporting_rank
from megatron.apertus.training.step import StepResult

log = logging.getLogger("apertus")


class SkippedSteps:
    """The count of this job's steps, of those that updated the weights, and of the skips in a
    row; ``--max-skipped-steps`` of them in a row end the run."""

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.steps = self.updated = 0

    def count(self, result: StepResult, iteration: int) -> bool:
        """Count step ``iteration``; whether it made too many skipped steps in a row."""
        self.steps += 1
        if not result.skipped:
            self.in_a_row = 0
            self.updated += 1
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

    def nothing_trained(self, iteration: int) -> str | None:
        """The line that stops the run, saving nothing, when every step of this job so far was
        skipped: a checkpoint would hold the starting weights as if trained, and a resumed job
        would then find the run finished. A loss that is never finite comes from the data or
        the configuration. None when a step trained (or none ran)."""
        if not self.steps or self.updated:
            return None
        return (
            f"every step of this run ({self.steps}, up to iteration {iteration}) "
            "had a non-finite loss or gradient norm and was skipped; nothing trained, nothing "
            "saved: check the training data and the loss settings"
        )
