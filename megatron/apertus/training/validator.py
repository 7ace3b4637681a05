"""Validation passes: the mean loss per token over ``--eval-iters`` global batches of the
objective's validation data, through its validation forward pass, and the means of its own
quantities (alignment); recorded and logged as Megatron-LM does.

A pass stops at its next batch once ``--exit-duration-in-mins`` is reached and reports nothing,
as Megatron-LM does; the loop then saves and exits.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from megatron.core.num_microbatches_calculator import get_current_running_global_batch_size
from megatron.core.pipeline_parallel.utils import is_pp_last_stage

from megatron.apertus.checkpoint import TrainingState
from megatron.apertus.model.builder import chunk_groups
from megatron.apertus.training.diagnostics import ManualGC
from megatron.apertus.training.loop_config import TrainingConfig
from megatron.apertus.training.metrics import Metrics, perplexity
from megatron.apertus.training.objectives import Objective, metric_name
from megatron.apertus.training.runtime import is_reporting_rank
from megatron.apertus.training.signals import past_duration
from megatron.apertus.training.step import (
    chunk_iterators,
    empty_unused_memory,
    reduce_quantities,
    run_microbatches,
    synced_parameters,
)

log = logging.getLogger("apertus")


class Validator:
    """The run's validation passes over ``model`` (every rank takes part), communicating over
    the groups the model was built with."""

    def __init__(
        self,
        objective: Objective,
        model: list,
        training: TrainingConfig,
        *,
        metrics: Metrics,
        gc: ManualGC,
        device: torch.device,
        perplexity: bool = False,
    ) -> None:
        """``perplexity``: record exp(loss) beside the loss (--log-validation-ppl-to-tensorboard)."""
        self.objective, self.model, self.training = objective, model, training
        self.metrics, self.gc, self.device = metrics, gc, device
        self.perplexity = perplexity
        self.groups = chunk_groups(model[0])

    def due(self, iteration: int) -> bool:
        """Whether --eval-interval validates after ``iteration`` (from --start-eval-at-iter on)."""
        interval, start = self.training.eval_interval, self.training.start_eval_at_iter
        return bool(interval and iteration % interval == 0 and iteration >= (start or 0))

    def validate(self, state: TrainingState, *, split: str = "") -> None:
        """One pass over each validation set at ``state``, recorded and logged (between
        collections under --manual-gc); ``split`` names the data in the log line, as
        Megatron-LM's pass after training does. Once --exit-duration-in-mins is reached, no
        further set is validated."""
        self.gc.eval_boundary()
        for valid_set, suffix in enumerate(self.objective.valid_suffixes):
            if valid_set and past_duration(self.training.exit_duration_in_mins, self.device):
                break
            evaluated = self.evaluate(state.iteration, valid_set, suffix)
            if evaluated is not None:
                self._report(state, split, suffix, *evaluated)
        self.gc.eval_boundary()
        self.metrics.flush()

    def _report(
        self,
        state: TrainingState,
        split: str,
        suffix: str,
        loss: float,
        quantities: dict[str, float],
    ) -> None:
        """Record and log one validation set's result; ``suffix`` is the set's
        (``-NAME`` under --multiple-validation-sets, else empty)."""
        tag = f"{self.objective.valid_loss_name} validation{suffix}"
        self.metrics.record(
            f"valid/loss{suffix}", state.iteration, loss, tag=tag, samples=state.consumed_samples
        )
        if self.perplexity:
            self.metrics.record(
                f"valid/ppl{suffix}",
                state.iteration,
                perplexity(loss),
                tag=f"{tag} ppl",
                samples=state.consumed_samples,
            )
        if is_reporting_rank():
            at = f"iteration {state.iteration}" + (f" on {split}" if split else "")
            log.info(self.objective.validation_line(at, loss, quantities, suffix))

    def evaluate(
        self, iteration: int, valid_set: int = 0, suffix: str = ""
    ) -> tuple[float, dict[str, float]] | None:
        """Mean validation loss per token of set ``valid_set`` and the means of the objective's
        own quantities (last pipeline stage; elsewhere None, as without validation data or when
        time ran out)."""
        passes = self.training.eval_iters or self.training.full_validation
        if not passes or self.objective.valid_data is None:
            return None
        with self._evaluating():
            reported, timed_out = self._run_batches(valid_set)
        if timed_out:  # as Megatron-LM: no partial result; the loop saves and exits next
            if is_reporting_rank():
                log.info("--exit-duration-in-mins reached during validation: stopping it")
            return None
        if not is_pp_last_stage(self.groups.pp):
            return None
        total = torch.stack([entry["lm loss"] for entry in reported]).double().sum(0)
        torch.distributed.all_reduce(total, group=self.groups.dp_cp)
        quantities = reduce_quantities(reported, self.groups)
        for name, value in quantities.items():
            self.metrics.record(f"valid/{metric_name(name)}{suffix}", iteration, value)
        return (total[0] / total[1]).item(), quantities

    @contextlib.contextmanager
    def _evaluating(self) -> Iterator[None]:
        """The chunks in eval mode, back in training mode after the pass."""
        for chunk in self.model:
            chunk.eval()
        yield
        if self.groups.pp.size() > 1:
            # The interleaved schedule's forward-only pass with overlapped p2p returns on an
            # earlier stage before its last sends are delivered; a stage that then exits (the
            # run's final validation, no save after it) closes the pipe its next stage reads.
            torch.distributed.barrier(group=self.groups.pp)
        for chunk in self.model:
            chunk.train()

    def _run_batches(self, valid_set: int) -> tuple[list[dict], bool]:
        """The reported losses of up to --eval-iters global batches of validation set
        ``valid_set`` (--full-validation: as many as hold the whole set), and whether the pass
        stopped early at --exit-duration-in-mins."""
        reported = []
        global_batch = self.training.eval_global_batch_size or (
            get_current_running_global_batch_size()
        )
        whole = self.objective.whole_valid_set(valid_set)
        batches_in_pass = self.training.eval_iters if whole is None else -(-whole // global_batch)
        with torch.no_grad(), synced_parameters(self.model):
            for i in range(batches_in_pass):
                batches = self.objective.valid_batches(i * global_batch, global_batch, valid_set)
                reported += run_microbatches(
                    self.model,
                    chunk_iterators(self.model, batches),
                    self.objective.valid_shape(len(batches)),
                    forward_only=True,
                    forward=self.objective.valid_forward,
                )
                empty_unused_memory(self.training.empty_unused_memory_level, at_least=1)
                if past_duration(self.training.exit_duration_in_mins, self.device):
                    return reported, True
        return reported, False
