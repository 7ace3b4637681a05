"""What a run says about itself: each step's scalars (Megatron-LM's TensorBoard and wandb tags,
the history and ``--log-json``), Megatron-LM's iteration line every ``--log-interval`` steps and
the memory and step-timer lines after it, the diagnostics asked for (parameter norms, memory,
GEMM-input statistics), the loss plot, the metrics kept beside each checkpoint and Megatron-LM's
progress file.

Collectives among these (parameter norms, the GEMM statistics of every pipeline stage, the
timers' gathering) run on every rank at the same steps; only the reporting rank writes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import torch

from megatron.apertus.checkpoint import TrainingState
from megatron.apertus.checkpoint_files import METRICS_FILE, history_file
from megatron.apertus.model.builder import chunk_groups
from megatron.apertus.model.flops import flops_per_token
from megatron.apertus.training.config import RunConfig
from megatron.apertus.training.diagnostics import (
    memory_line,
    memory_stats,
    params_norms,
    peak_memory_gib,
)
from megatron.apertus.training.fp8_guard import gemm_statistics
from megatron.apertus.training.gemm_metrics import GemmInputMonitor
from megatron.apertus.training.metrics import (
    IntervalSummary,
    LogInterval,
    Metrics,
    device_peak_tflops,
    wandb_dir,
)
from megatron.apertus.training.objectives import Objective, metric_name
from megatron.apertus.training.progress import ProgressLog
from megatron.apertus.training.runtime import is_reporting_rank
from megatron.apertus.training.step import StepResult, synced_parameters
from megatron.apertus.training.step_timers import StepTimers

log = logging.getLogger("apertus")
SKIPPED_SAMPLES = "skipped_train_samples"
"""``TrainingState.extra`` key: the samples of the run's --iterations-to-skip so far
(Megatron-LM's ``skipped_train_samples``, kept across resumes as it keeps it)."""
MEGATRON_MEMORY_TAGS = {
    "memory/allocated_bytes": "mem-allocated-bytes",
    "memory/max_allocated_bytes": "mem-max-allocated-bytes",
    "memory/reserved_bytes": "mem-reserved-bytes",
}
"""Megatron-LM's TensorBoard tags of the allocator statistics (a CPU's resident memory has none)."""


class Reporter:
    """The run's metrics and log lines, continued from a resumed checkpoint's history."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        objective: Objective,
        model: list,
        optimizer,
        state: TrainingState,
        resumed_from: Path | None,
        device: torch.device,
        dp: int,
        timers: StepTimers,
    ) -> None:
        """``resumed_from``: the checkpoint ``state`` comes from (None: a fresh start)."""
        self.cfg, self.objective, self.model, self.optimizer = cfg, objective, model, optimizer
        self.device, self.timers = device, timers
        self.metrics = self._metrics(state, resumed_from)
        self.total_iterations = cfg.training.total_iterations(dp)
        self.interval = LogInterval()
        self.logged_once = False
        self.gemm_monitor = self._gemm_monitor()
        self.progress = self._progress_log(state)

    def _metrics(self, state: TrainingState, resumed_from: Path | None) -> Metrics:
        """TensorBoard and wandb on the reporting rank, the history continued from the one the
        resumed checkpoint holds (:func:`history_file`), and the JSON log started from it."""
        cfg, logging_cfg = self.cfg, self.cfg.logging
        metrics = Metrics(
            tensorboard_dir=logging_cfg.tensorboard_dir if is_reporting_rank() else None,
            wandb_project=logging_cfg.wandb_project if is_reporting_rank() else None,
            wandb_exp_name=logging_cfg.wandb_exp_name,
            wandb_entity=logging_cfg.wandb_entity,
            wandb_dir=wandb_dir(logging_cfg.wandb_save_dir, cfg.checkpoint.save),
            config={k: asdict(v) for k, v in vars(cfg).items()},
            tensorboard_queue_size=logging_cfg.tensorboard_queue_size,
        )
        if resumed_from is not None and state.iteration > 0:
            history = history_file(resumed_from, cfg.checkpoint.load)
            if history is not None:
                metrics.restore(history, state.iteration)
        if logging_cfg.log_json and is_reporting_rank():
            metrics.open_json_log(logging_cfg.log_json)
        return metrics

    def _progress_log(self, state: TrainingState) -> ProgressLog | None:
        """Megatron-LM's progress file, written by global rank 0 as Megatron-LM does; its job
        start line now."""
        if not self.cfg.logging.log_progress or torch.distributed.get_rank() != 0:
            return None
        seq = self.cfg.model.seq_length
        progress = ProgressLog(
            self.cfg.checkpoint.save,
            world_size=torch.distributed.get_world_size(),
            flops_per_sample=seq * flops_per_token(self.cfg.model),
            tokens_per_sample=seq,
            consumed_samples=state.consumed_samples,
        )
        progress.start()
        return progress

    def rewind(self, state: TrainingState) -> None:
        """Continue from ``state``, an earlier checkpoint the run went back to: the history
        after it is dropped, but the FP8 guard's records of why are kept."""
        self.metrics.rewind(state.iteration, keep="fp8_guard/")
        self.interval = LogInterval()

    # -- diagnostics -----------------------------------------------------------------------------

    def _gemm_monitor(self) -> GemmInputMonitor | None:
        names = gemm_statistics(self.cfg.logging.log_intermediate_metrics, self.cfg.fp8_guard)
        if not names:
            return None
        delayed = self.cfg.engine.fp8 and self.cfg.engine.fp8_recipe == "delayed"
        return GemmInputMonitor(self.model, names=names, delayed_scaling=delayed)

    def _measures_gemm_inputs(self, iteration: int) -> bool:
        logging_cfg = self.cfg.logging
        interval = logging_cfg.log_intermediate_metrics_interval or self.cfg.training.log_interval
        return self.gemm_monitor is not None and (iteration % interval == 0 or iteration == 1)

    @contextlib.contextmanager
    def gemm_inputs(self, iteration: int) -> Iterator[dict[str, float]]:
        """Around training step ``iteration``: on the steps that measure them, the statistics
        of every GEMM's input, recorded and put into the dict yielded (empty on other steps)
        once the step is done."""
        measured: dict[str, float] = {}
        measure = self._measures_gemm_inputs(iteration)
        if measure:
            self.gemm_monitor.attach()
        yield measured
        if measure:
            measured.update(self.gemm_monitor.detach())
            for name, value in measured.items():
                self.metrics.record(f"intermediate/{name}", iteration, value)

    def _written(self, iteration: int) -> bool:
        """Whether TensorBoard and wandb get the training scalars of ``iteration``."""
        return iteration % self.cfg.logging.tensorboard_log_interval == 0

    def _record_diagnostics(self, it: int, samples: int) -> float | None:
        """Parameter norms (a collective: every rank computes them) and memory use, as asked
        for; returns the total parameter norm when --log-params-norm asks for it."""
        logging_cfg = self.cfg.logging
        written = self._written(it)
        total = None
        if logging_cfg.log_params_norm or logging_cfg.log_params_norm_per_param:
            with synced_parameters(self.model):
                total, each = params_norms(
                    self.model, per_param=logging_cfg.log_params_norm_per_param
                )
            if logging_cfg.log_params_norm:
                self.metrics.record(
                    "train/params_norm",
                    it,
                    total,
                    tag="params-norm",
                    samples=samples,
                    written=written,
                )
            else:
                total = None
            for name, value in each.items():
                self.metrics.record(f"params-norm/{name}", it, value, written=written)
        if logging_cfg.log_memory_to_tensorboard:
            for name, value in memory_stats(self.device).items():
                tag = MEGATRON_MEMORY_TAGS.get(name)
                self.metrics.record(name, it, value, tag=tag, written=written)
        return total

    # -- each step -------------------------------------------------------------------------------

    def step(
        self, result: StepResult, seconds: float, global_batch: int, state: TrainingState
    ) -> None:
        """Record the step's scalars; every --log-interval steps, and at this job's first step,
        print Megatron-LM's iteration line."""
        lr, loss_scale = self._record_step(result, seconds, global_batch, state)
        it = state.iteration
        regular = it % self.cfg.training.log_interval == 0
        if not (regular or not self.logged_once):
            return
        self.logged_once = True
        params_norm = self._record_diagnostics(it, state.consumed_samples)
        summary = self.interval.take(torch.distributed.get_world_size(), reset=regular)
        tflops = summary.tokens_per_second * flops_per_token(self.cfg.model) / 1e12
        self.metrics.record("train/throughput", it, tflops, tag="throughput")
        self.timers.write(it, summary.steps, self.metrics)
        self.metrics.flush()  # on disk before the line says so
        if is_reporting_rank():
            fields = self._iteration_fields(summary, state, lr, global_batch, tflops)
            fields += self._loss_fields(result, summary, loss_scale, params_norm)
            fields += self._our_fields(result, tflops, summary)
            log.info("".join(f"{field} | " for field in fields).rstrip())
        self._after_line(it, summary.steps, reset=regular)

    def _after_line(self, iteration: int, steps: int, *, reset: bool) -> None:
        """What follows the iteration line, in Megatron-LM's order: the memory line at
        --log-memory-interval (each rank of the first data-parallel replica), then the step
        timers (a collective: every rank gathers the times)."""
        interval = self.cfg.logging.log_memory_interval
        if interval and iteration % interval == 0 and chunk_groups(self.model[0]).dp.rank() == 0:
            rank = torch.distributed.get_rank()
            line = memory_line(self.device, self.cfg.logging.log_device_memory_used)
            log.info(f"[Rank {rank}] (after {iteration} iterations) {line}")
        timers = self.timers.lines(steps, reset=reset)
        if timers is not None and is_reporting_rank():
            log.info(timers)

    def _record_step(
        self, result: StepResult, seconds: float, global_batch: int, state: TrainingState
    ) -> tuple[float, float]:
        """The step's scalars, each with its "vs samples" twin where Megatron-LM writes one
        (TensorBoard and wandb get them every --tensorboard-log-interval steps), into the
        interval of the next line; returns the learning rate and the loss scale."""
        it = state.iteration
        record = functools.partial(self.metrics.record, iteration=it, written=self._written(it))
        samples = state.consumed_samples
        if result.loss is not None:
            record("train/loss", value=result.loss, tag=self.objective.loss_name, samples=samples)
        if result.grad_norm is not None and math.isfinite(result.grad_norm):
            record("train/grad_norm", value=result.grad_norm, tag="grad-norm", samples=samples)
        if result.num_zeros_in_grad is not None:
            zeros = result.num_zeros_in_grad
            record("train/num_zeros_in_grad", value=zeros, tag="num-zeros", samples=samples)
        if result.max_attention_logit is not None:
            logit = result.max_attention_logit
            record("train/max_attention_logit", value=logit, tag="max_attention_logit")
        for name, value in result.quantities.items():
            record(f"train/{metric_name(name)}", value=value)
        lr = self.optimizer.param_groups[0]["lr"]
        record("train/lr", value=lr, tag="learning-rate", samples=samples)
        record("train/batch_size", value=global_batch, tag="batch-size", samples=samples)
        if self.cfg.logging.log_world_size_to_tensorboard:
            world = torch.distributed.get_world_size()
            record("train/world_size", value=world, tag="world-size", samples=samples)
        loss_scale = self.optimizer.get_loss_scale().item()
        if self.cfg.logging.log_loss_scale_to_tensorboard:
            record("train/loss_scale", value=loss_scale, tag="loss-scale", samples=samples)
        record("train/step_seconds", value=seconds, tag="iteration-time")
        if state.extra.get(SKIPPED_SAMPLES):
            skipped = state.extra[SKIPPED_SAMPLES]
            record("train/skipped_samples", value=skipped, tag="skipped-train-samples")
        tokens = global_batch * self.cfg.model.seq_length
        self.interval.add(seconds, tokens, loss=result.loss, skipped=result.skipped)
        return lr, loss_scale

    def _iteration_fields(
        self, summary: IntervalSummary, state: TrainingState, lr: float, batch: int, tflops: float
    ) -> list[str]:
        """Megatron-LM's iteration line up to its loss: its fields, names and order (skipped
        samples once --iterations-to-skip skipped some)."""
        skipped = state.extra.get(SKIPPED_SAMPLES, 0)
        return [
            f"iteration {state.iteration:8d}/{self.total_iterations:8d}",
            f"consumed samples: {state.consumed_samples:12d}",
            *([f"skipped samples: {skipped:12d}"] if skipped else []),
            f"elapsed time per iteration (ms): {summary.ms_per_iteration:.1f}",
            f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}",
            f"learning rate: {lr:.6E}",
            f"global batch size: {batch:5d}",
        ]

    def _loss_fields(
        self,
        result: StepResult,
        summary: IntervalSummary,
        loss_scale: float,
        params_norm: float | None,
    ) -> list[str]:
        """The rest of Megatron-LM's line: the loss averaged over the interval's steps that
        updated the weights, and the skipped and NaN steps counted over it."""
        fields = []
        if summary.loss is not None:
            fields.append(f"{self.objective.loss_name}: {summary.loss:.6E}")
        fields.append(f"loss scale: {loss_scale:.1f}")
        if result.grad_norm is not None:
            fields.append(f"grad norm: {result.grad_norm:.3f}")
        if result.num_zeros_in_grad is not None:
            fields.append(f"num zeros: {result.num_zeros_in_grad:.1f}")
        if params_norm is not None:
            fields.append(f"params norm: {params_norm:.3f}")
        return fields + [
            f"number of skipped iterations: {summary.skipped:3d}",
            f"number of nan iterations: {summary.nan:3d}",
        ]

    def _our_fields(self, result: StepResult, tflops: float, summary: IntervalSummary) -> list[str]:
        """What our line adds: tokens per second, MFU (on a known GPU), memory, and the
        objective's own quantities."""
        fields = [f"tokens per second per device: {summary.tokens_per_second:.0f}"]
        peak = device_peak_tflops()
        if peak is not None:
            fields.append(f"MFU: {100 * tflops / peak:.1f}%")
        fields.append(f"memory (GiB): {peak_memory_gib(self.device):.2f}")
        return fields + self.objective.quantity_fields(result.quantities)

    # -- checkpoints and the end -----------------------------------------------------------------

    def plot_path(self) -> str | None:
        """--loss-plot, by default SAVE/loss.png."""
        plot = self.cfg.logging.loss_plot
        if plot is None and self.cfg.checkpoint.save:
            plot = str(Path(self.cfg.checkpoint.save) / "loss.png")
        return plot

    def write_history(self, directory: Path) -> None:
        """The history so far into ``directory``, a checkpoint being saved (every rank calls
        it; the reporting rank, which holds the history, writes)."""
        if is_reporting_rank():
            self.metrics.snapshot(directory / METRICS_FILE)

    def saved(self, path: Path, state: TrainingState, *, background: bool) -> None:
        """After a save of ``state``: the history beside the checkpoints, the plot redrawn, all
        on disk; the progress file's line."""
        if is_reporting_rank():
            self.metrics.snapshot(Path(self.cfg.checkpoint.save) / METRICS_FILE)
            self.metrics.plot(self.plot_path())
            self.metrics.flush()
            if background:
                log.info(f"saving checkpoint {path} in the background")
        if self.progress is not None:
            self.progress.saved(state.iteration, state.consumed_samples, background=background)

    def close(self, *, completed: bool) -> dict:
        """Every sink flushed and closed, the final plot; the history, marked ``completed``."""
        if is_reporting_rank():
            self.metrics.close(self.plot_path())
        self.metrics.history["completed"] = completed
        return self.metrics.history
