"""The training loop: build, resume, step, log, validate, save, stop. Reads like torchtitan's.

One :class:`Trainer` per process. Every decision that changes what ranks do next (skip a step,
save, stop) is taken from values all ranks share (all-reduced flags, the replicated grad norm),
so ranks never diverge.

Start-up checks what a user can get wrong before anything is allocated (an unwritable --save,
batch sizes that do not split into micro-batches, a --load that is no checkpoint) and raises
:class:`ConfigError` in one line; a --load that holds no checkpoint yet starts from scratch and
says so, as Megatron-LM does.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    get_current_running_global_batch_size,
    get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.transformer.module import Float16Module

from megatron.apertus import checkpoint, parallel
from megatron.apertus.checkpoint import TrainingState
from megatron.apertus.checkpoint_files import METRICS_FILE, read_run_info
from megatron.apertus.errors import ConfigError
from megatron.apertus.mcore_compat import init_num_microbatches_calculator
from megatron.apertus.model.config import ParallelConfig
from megatron.apertus.model.engine import EngineConfig
from megatron.apertus.model.flops import flops_per_token
from megatron.apertus.training import runtime
from megatron.apertus.training.config import OptimizerSettings, RunConfig, TrainingConfig
from megatron.apertus.training.diagnostics import (
    ManualGC,
    memory_stats,
    params_norms,
    peak_memory_gib,
)
from megatron.apertus.training.fp8_guard import CHECKPOINT_KEY, GuardedRun, gemm_statistics
from megatron.apertus.training.gemm_metrics import GemmInputMonitor
from megatron.apertus.training.metrics import (
    IntervalSummary,
    LogInterval,
    Metrics,
    device_peak_tflops,
)
from megatron.apertus.training.objectives import build_objective, metric_name
from megatron.apertus.training.optimizer import build_optimizer_and_scheduler
from megatron.apertus.training.progress import ProgressLog
from megatron.apertus.training.runtime import is_reporting_rank
from megatron.apertus.training.signals import StopRequests, past_duration
from megatron.apertus.training.step import (
    StepResult,
    StepShape,
    data_and_context_parallel_group,
    reduce_quantities,
    run_microbatches,
    synced_parameters,
    train_step,
    wrap_ddp,
)

log = logging.getLogger("apertus")
MEGATRON_MEMORY_TAGS = {
    "memory/allocated_bytes": "mem-allocated-bytes",
    "memory/max_allocated_bytes": "mem-max-allocated-bytes",
    "memory/reserved_bytes": "mem-reserved-bytes",
}
"""Megatron-LM's TensorBoard tags of the allocator statistics (a CPU's resident memory has none)."""


def _describe_engine(impl: str, engine: EngineConfig, params: str) -> str:
    """The one log line that says how the layers compute (``params``: --precision)."""
    chosen = "" if engine.transformer_impl else " (default for this machine)"
    precision = f"{params} GEMMs"
    if engine.fp8:
        precision = f"FP8 {engine.fp8_format} GEMMs, {engine.fp8_recipe} scaling"
    determinism = ", deterministic kernels" if engine.deterministic_mode else ""
    if determinism and impl == "transformer_engine" and engine.attention_backend == "local":
        determinism += " (core attention: torch flash / varlen, deterministic on this GPU)"
    return f"transformer implementation: {impl}{chosen}; {precision}{determinism}"


def _source_commit() -> str | None:
    """The git commit of this source tree, when it is a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _package_version() -> str | None:
    """The installed megatron-apertus version; None when the code runs from a checkout that was
    never installed (the commit then identifies it)."""
    try:
        return importlib.metadata.version("megatron-apertus")
    except importlib.metadata.PackageNotFoundError:
        return None


class TrainingStopped(RuntimeError):
    """The run stopped itself (too many consecutive non-finite steps, or the FP8 guard); the
    last good state was saved."""


def _check_resumable(settings: OptimizerSettings) -> None:
    """megatron-core 0.16.1 cannot load its distributed Adam without TE or Apex (fused Adam)."""
    if settings.optimizer != "adam" or not settings.use_distributed_optimizer:
        return
    if importlib.util.find_spec("transformer_engine") or importlib.util.find_spec("apex"):
        return
    raise ConfigError(
        "--load with --optimizer adam and --use-distributed-optimizer needs Transformer Engine or "
        "Apex (megatron-core 0.16.1 restores the distributed Adam state only through their fused "
        "Adam; see docs/megatron_core_changes.md); use --optimizer ademamix, or drop "
        "--use-distributed-optimizer"
    )


def _check_batch_sizes(t: TrainingConfig, layout: ParallelConfig, dp: int) -> None:
    """Every global batch, each size of a ramp-up too, splits into whole micro-batches on every
    data-parallel rank; said with the flags before megatron-core's calculator asserts. Under
    --decrease-batch-size-if-needed megatron-core rounds each size down to such a multiple, so
    each must only hold one micro-batch per rank."""
    sizes = {"--global-batch-size": t.global_batch_size, "--micro-batch-size": t.micro_batch_size}
    if t.rampup_batch_size is not None:
        start, increment, _ = t.rampup_batch_size
        sizes |= {"--rampup-batch-size START": start, "--rampup-batch-size INCREMENT": increment}
    for flag, size in sizes.items():
        if size < 1:
            raise ConfigError(f"{flag} must be >= 1, got {size}")
    unit = t.micro_batch_size * dp
    for flag, size in sizes.items():
        if flag == "--micro-batch-size" or not size % unit:
            continue
        if t.decrease_batch_size_if_needed and size >= unit:
            continue
        fits = "smaller than" if t.decrease_batch_size_if_needed else "not divisible by"
        raise ConfigError(
            f"{flag} ({size}) is {fits} --micro-batch-size ({t.micro_batch_size}) x "
            f"data-parallel size ({dp} = world size {torch.distributed.get_world_size()} / "
            f"(--tensor-model-parallel-size {layout.tensor_model_parallel_size} x "
            f"--pipeline-model-parallel-size {layout.pipeline_model_parallel_size} x "
            f"--context-parallel-size {layout.context_parallel_size}))"
        )
    if t.rampup_batch_size is not None and (
        start > t.global_batch_size or (t.global_batch_size - start) % increment
    ):
        raise ConfigError(
            f"--rampup-batch-size START ({start}) does not reach --global-batch-size "
            f"({t.global_batch_size}) in steps of INCREMENT ({increment})"
        )


def _check_before_start(cfg: RunConfig) -> None:
    """What the flags get wrong, refused before any process group exists: a --save that cannot
    be written (or a --log-progress without one)."""
    if cfg.checkpoint.save:
        checkpoint.check_save_dir(cfg.checkpoint.save)
    elif cfg.logging.log_progress:
        raise ConfigError(
            "--log-progress writes progress.txt beside the checkpoints: it needs --save"
        )


class Trainer:
    """One process's run: its objective, model chunks, optimizer and the state it continues."""

    def __init__(self, cfg: RunConfig) -> None:
        """Build in the order a run needs: refusals of the flags first, then the process
        groups, the batch-size calculator, the objective with its data, the model, the
        optimizer, the state to continue from, and what reports on the run."""
        self.cfg = cfg
        _check_before_start(cfg)
        self.runtime = runtime.start(
            cfg.parallel,
            model=cfg.model,
            training=cfg.training,
            engine=cfg.engine,
            packed_documents=cfg.dataset.reset_attention_mask,
        )
        self.device, self.dp = self.runtime.device, self.runtime.dp
        _check_batch_sizes(cfg.training, cfg.parallel, self.dp)
        self.resume_from = self._find_checkpoint()
        self._start_microbatches()
        self.objective = build_objective(
            cfg, tokenizer=runtime.tokenizer(cfg.data, cfg.model), dp=self.dp
        )
        self.model = self._build_model()
        self.gemm_monitor = self._gemm_monitor()
        self.optimizer, self.scheduler = build_optimizer_and_scheduler(
            self.model,
            cfg.optimizer,
            cfg.schedule,
            cfg.ademamix,
            cfg.training,
            precision=cfg.training.precision,
        )
        self.state = self._resume()
        self.objective.prepare(self.model, state=self.state, resume_from=self.resume_from)
        self._start_reporting()

    # -- setup -----------------------------------------------------------------------------------

    def _start_microbatches(self) -> None:
        """megatron-core's calculator of the step's micro-batches (a ramp-up changes them)."""
        t = self.cfg.training
        init_num_microbatches_calculator(
            torch.distributed.get_rank(),
            t.rampup_batch_size,
            t.global_batch_size,
            t.micro_batch_size,
            self.dp,
            decrease_batch_size_if_needed=t.decrease_batch_size_if_needed,
        )
        self._log_decreased_batch()

    def _start_reporting(self) -> None:
        """Stop requests, metrics (continued from a resumed checkpoint's), the JSON log, the
        iteration line's interval, the garbage collector, saving and the progress file."""
        cfg, t = self.cfg, self.cfg.training
        self.stop = StopRequests(
            handle_signals=t.exit_signal_handler,
            trigger_path=t.trigger_path,
            exit_duration_in_mins=t.exit_duration_in_mins,
        )
        self.metrics = Metrics(
            tensorboard_dir=cfg.logging.tensorboard_dir if is_reporting_rank() else None,
            wandb_project=cfg.logging.wandb_project if is_reporting_rank() else None,
            wandb_exp_name=cfg.logging.wandb_exp_name,
            config={k: asdict(v) for k, v in vars(cfg).items()},
        )
        if cfg.checkpoint.load and self.state.iteration > 0:
            self.metrics.restore(Path(cfg.checkpoint.load) / METRICS_FILE, self.state.iteration)
        if cfg.logging.log_json and is_reporting_rank():
            self.metrics.open_json_log(cfg.logging.log_json)
        self.total_iterations = t.total_iterations(self.dp)
        self.interval = LogInterval()
        self.logged_once = False
        self.skipped_in_a_row = 0
        self.steps_run = self.steps_updated = 0
        self.gc = ManualGC(t.manual_gc, t.manual_gc_interval, around_eval=t.manual_gc_eval)
        self.save_options = self._save_options()
        self.progress = self._progress_log()
        self.fp8_guard = GuardedRun(
            cfg.fp8_guard,
            reporting=is_reporting_rank(),
            metrics=self.metrics,
            save_dir=cfg.checkpoint.save,
            state=self.state.extra.get(CHECKPOINT_KEY),
        )

    def _log_decreased_batch(self) -> None:
        """Say when megatron-core runs a smaller global batch than --global-batch-size."""
        running = get_current_running_global_batch_size()
        if running != self.cfg.training.global_batch_size and is_reporting_rank():
            t = self.cfg.training
            log.info(
                f"--decrease-batch-size-if-needed: global batch {running} instead of "
                f"{t.global_batch_size} (a multiple of --micro-batch-size "
                f"{t.micro_batch_size} x data-parallel size {self.dp})"
            )

    def _build_model(self):
        cfg = self.cfg
        if is_reporting_rank():
            impl = self.runtime.transformer_impl
            log.info(_describe_engine(impl, self.runtime.engine, cfg.training.precision))
        chunks = runtime.model_chunks(
            cfg.model,
            cfg.parallel,
            training=cfg.training,
            runtime=self.runtime,
            packed_documents=cfg.dataset.reset_attention_mask,
            fused_loss=cfg.training.fused_output_loss,
            quant=cfg.quant,
            transformer_impl=self.runtime.transformer_impl,
            engine=self.runtime.engine,
            **cfg.training.recompute_overrides(),
            **cfg.communication.transformer_overrides(
                virtual_pipeline=cfg.parallel.virtual_pipeline_model_parallel_size is not None
            ),
        )
        tconfig = chunks[0].config
        if tconfig.bf16 or tconfig.fp16:
            # Low-precision compute, fp32 loss: megatron-core's standard wrapper.
            chunks = [Float16Module(tconfig, chunk) for chunk in chunks]
        return wrap_ddp(
            chunks,
            tconfig,
            use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
            fp8_param_gather=cfg.engine.fp8_param_gather,
            overlap_grad_reduce=cfg.communication.overlap_grad_reduce,
            overlap_param_gather=cfg.communication.overlap_param_gather,
            bucket_size=cfg.communication.ddp_bucket_size,
            gradient_accumulation_fusion=cfg.engine.gradient_accumulation_fusion,
        )

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

    def _chunks(self):
        return [ddp.module for ddp in self.model]

    def _find_checkpoint(self) -> Path | None:
        """The checkpoint --load names, looked up before anything is built."""
        source = self.cfg.checkpoint.load
        if not source:
            return None
        found = _checked_checkpoint(source)
        if found is None:
            self._log_fresh_start(source)
        return found

    def _resume(self) -> TrainingState:
        """Continue from the checkpoint --load names, or start fresh."""
        found = self.resume_from
        if found is None:
            return TrainingState()
        ck = self.cfg.checkpoint
        optimizer = self.optimizer if ck.loads_optimizer() else None
        if optimizer is not None and checkpoint.has_optimizer_states(found):
            _check_resumable(self.cfg.optimizer)
        state, full = checkpoint.load(
            found,
            self._chunks(),
            optimizer=optimizer,
            scheduler=self.scheduler if optimizer else None,
            model=self.cfg.model,
            rng=ck.loads_rng(),
            fully_parallel=ck.ckpt_fully_parallel_load,
        )
        if not full:  # weights only: the optimizer's fp32 main params must follow the new weights
            self.optimizer.reload_model_params()
        if ck.finetune:
            state = TrainingState()
        update_num_microbatches(state.consumed_samples, consistency_check=False)
        if is_reporting_rank():
            log.info(self._describe_resume(found, state))
        return state

    def _describe_resume(self, found: Path, state: TrainingState) -> str:
        ck = self.cfg.checkpoint
        if ck.finetune:
            return (
                f"--finetune: weights loaded from {found}; iteration, consumed samples, "
                "optimizer, learning-rate schedule and RNG states start fresh"
            )
        line = (
            f"resumed from {found} at iteration {state.iteration}, "
            f"{state.consumed_samples} samples consumed"
        )
        fresh = [
            f"{flag}: {what} start fresh"
            for flag, what, on in (
                ("--no-load-optim", "optimizer and learning-rate schedule", ck.no_load_optim),
                ("--no-load-rng", "RNG states", ck.no_load_rng),
            )
            if on
        ]
        return line + "".join(f"; {part}" for part in fresh)

    def _log_fresh_start(self, source: str) -> None:
        """As Megatron-LM does, a --load without a checkpoint starts from scratch. --load equal
        to --save is the usual restartable job (its first start finds nothing); another --load
        names a checkpoint to start from, so finding none there is a warning."""
        if not is_reporting_rank():
            return
        save = self.cfg.checkpoint.save
        if save and Path(save).resolve() == Path(source).resolve():
            log.info(f"no checkpoint found at {source}: starting from scratch")
            return
        found = f"holds no checkpoint (no {checkpoint.TRACKER}, no {checkpoint.MODEL_CONFIG})"
        if not Path(source).exists():
            found = "does not exist"
        log.warning(f"--load {source} {found}: starting from scratch")

    # -- one step --------------------------------------------------------------------------------

    def _shape(self) -> StepShape:
        return self.objective.shape(get_num_microbatches())

    def _iterators(self, batches: list) -> list:
        """One iterator per model chunk over the step's micro-batches (interleaved pipeline
        schedules run the chunks' micro-batches in their own orders)."""
        return [iter(batches) for _ in self.model]

    def step(self) -> StepResult:
        global_batch = get_current_running_global_batch_size()
        batches = self.objective.train_batches(self.state.consumed_samples, global_batch)
        iteration = self.state.iteration + 1
        measure = self._measures_gemm_inputs(iteration)
        if measure:
            self.gemm_monitor.attach()
        result = train_step(
            self.model,
            self.optimizer,
            self._iterators(batches),
            self._shape(),
            self.objective.train_forward,
        )
        self.gemm_inputs = self.gemm_monitor.detach() if measure else {}
        if measure:
            for name, value in self.gemm_inputs.items():
                self.metrics.record(f"intermediate/{name}", iteration, value)
        self.state.iteration = iteration
        self.state.consumed_samples += global_batch
        if not result.skipped:
            self.scheduler.step(increment=global_batch)
        update_num_microbatches(self.state.consumed_samples, consistency_check=False)
        return result

    # -- reporting ---------------------------------------------------------------------------------

    def _report(self, result: StepResult, seconds: float, global_batch: int) -> None:
        """Record the step's scalars (Megatron-LM's TensorBoard and wandb tags, each with its
        "vs samples" twin where Megatron-LM writes one); every --log-interval steps, and at
        this job's first step, print Megatron-LM's iteration line."""
        it, samples = self.state.iteration, self.state.consumed_samples
        if result.loss is not None:
            self.metrics.record(
                "train/loss", it, result.loss, tag=self.objective.loss_name, samples=samples
            )
        if result.grad_norm is not None and math.isfinite(result.grad_norm):
            self.metrics.record(
                "train/grad_norm", it, result.grad_norm, tag="grad-norm", samples=samples
            )
        for name, value in result.quantities.items():
            self.metrics.record(f"train/{metric_name(name)}", it, value)
        lr = self.optimizer.param_groups[0]["lr"]
        self.metrics.record("train/lr", it, lr, tag="learning-rate", samples=samples)
        self.metrics.record("train/batch_size", it, global_batch, tag="batch-size", samples=samples)
        loss_scale = self.optimizer.get_loss_scale().item()
        if self.cfg.logging.log_loss_scale_to_tensorboard:
            self.metrics.record(
                "train/loss_scale", it, loss_scale, tag="loss-scale", samples=samples
            )
        self.metrics.record("train/step_seconds", it, seconds, tag="iteration-time")
        self.interval.add(
            seconds,
            global_batch * self.cfg.model.seq_length,
            loss=result.loss,
            skipped=result.skipped,
        )
        regular = it % self.cfg.training.log_interval == 0
        if not (regular or not self.logged_once):
            return
        self.logged_once = True
        params_norm = self._record_diagnostics(it)
        summary = self.interval.take(torch.distributed.get_world_size(), reset=regular)
        tflops = summary.tokens_per_second * flops_per_token(self.cfg.model) / 1e12
        self.metrics.record("train/throughput", it, tflops, tag="throughput")
        self.metrics.flush()  # on disk before the line says so
        if is_reporting_rank():
            log.info(
                self._iteration_line(
                    summary,
                    result,
                    lr=lr,
                    global_batch=global_batch,
                    loss_scale=loss_scale,
                    params_norm=params_norm,
                    tflops=tflops,
                )
            )

    def _iteration_line(
        self,
        summary: IntervalSummary,
        result: StepResult,
        *,
        lr: float,
        global_batch: int,
        loss_scale: float,
        params_norm: float | None,
        tflops: float,
    ) -> str:
        """Megatron-LM's iteration line: its fields, names and order, each closed by " |", the
        loss averaged over the interval's steps that updated the weights and the skipped and
        NaN steps counted over it; our fields follow."""
        fields = [
            f"iteration {self.state.iteration:8d}/{self.total_iterations:8d}",
            f"consumed samples: {self.state.consumed_samples:12d}",
            f"elapsed time per iteration (ms): {summary.ms_per_iteration:.1f}",
            f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}",
            f"learning rate: {lr:.6E}",
            f"global batch size: {global_batch:5d}",
        ]
        if summary.loss is not None:
            fields.append(f"{self.objective.loss_name}: {summary.loss:.6E}")
        fields.append(f"loss scale: {loss_scale:.1f}")
        if result.grad_norm is not None:
            fields.append(f"grad norm: {result.grad_norm:.3f}")
        if params_norm is not None:
            fields.append(f"params norm: {params_norm:.3f}")
        fields += [
            f"number of skipped iterations: {summary.skipped:3d}",
            f"number of nan iterations: {summary.nan:3d}",
            f"tokens per second per device: {summary.tokens_per_second:.0f}",
        ]
        peak = device_peak_tflops()
        if peak is not None:
            fields.append(f"MFU: {100 * tflops / peak:.1f}%")
        fields.append(f"memory (GiB): {peak_memory_gib(self.device):.2f}")
        fields += self.objective.quantity_fields(result.quantities)
        return "".join(f"{field} | " for field in fields).rstrip()

    def _record_diagnostics(self, it: int) -> float | None:
        """Parameter norms (a collective: every rank computes them) and memory use, as asked
        for; returns the total parameter norm when --log-params-norm asks for it."""
        logging_cfg = self.cfg.logging
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
                    samples=self.state.consumed_samples,
                )
            else:
                total = None
            for name, value in each.items():
                self.metrics.record(f"params-norm/{name}", it, value)
        if logging_cfg.log_memory_to_tensorboard:
            for name, value in memory_stats(self.device).items():
                self.metrics.record(name, it, value, tag=MEGATRON_MEMORY_TAGS.get(name))
        return total

    def evaluate(self) -> tuple[float, dict[str, float]] | None:
        """Mean validation loss per token over ``--eval-iters`` global batches, and the means of
        the objective's own quantities (alignment)."""
        t = self.cfg.training
        if t.eval_iters == 0 or self.objective.valid_data is None:
            return None
        for chunk in self.model:
            chunk.eval()
        reported = []
        timed_out = False
        global_batch = get_current_running_global_batch_size()
        with torch.no_grad(), synced_parameters(self.model):
            for i in range(t.eval_iters):
                batches = self.objective.valid_batches(i * global_batch, global_batch)
                losses = run_microbatches(
                    self.model,
                    self._iterators(batches),
                    self._shape(),
                    forward_only=True,
                    forward=self.objective.valid_forward,
                )
                reported.extend(losses)
                if past_duration(t.exit_duration_in_mins, self.device):
                    timed_out = True
                    break
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            # The interleaved schedule's forward-only pass with overlapped p2p returns on an
            # earlier stage before its last sends are delivered; a stage that then exits (the
            # run's final validation, no save after it) closes the pipe its next stage reads.
            torch.distributed.barrier(group=parallel_state.get_pipeline_model_parallel_group())
        for chunk in self.model:
            chunk.train()
        if timed_out:  # as Megatron-LM: no partial result; the loop saves and exits next
            if is_reporting_rank():
                log.info("--exit-duration-in-mins reached during validation: stopping it")
            return None
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return None
        total = torch.stack([entry["lm loss"] for entry in reported]).double().sum(0)
        torch.distributed.all_reduce(total, group=data_and_context_parallel_group())
        quantities = reduce_quantities(reported)
        for name, value in quantities.items():
            self.metrics.record(f"valid/{metric_name(name)}", self.state.iteration, value)
        return (total[0] / total[1]).item(), quantities

    def validate(self) -> None:
        self.gc.eval_boundary()
        evaluated = self.evaluate()
        self.gc.eval_boundary()
        if evaluated is None:
            return
        loss, quantities = evaluated
        self.metrics.record(
            "valid/loss",
            self.state.iteration,
            loss,
            tag=f"{self.objective.valid_loss_name} validation",
            samples=self.state.consumed_samples,
        )
        if is_reporting_rank():
            log.info(self.objective.validation_line(self.state.iteration, loss, quantities))
        self.metrics.flush()

    def _run_info(self) -> dict:
        """What a checkpoint records of the run that made it (``apertus_run.json``): exports
        write the run's tokenizer and a model card from it."""
        data, dataset = self.cfg.data, self.cfg.dataset
        tokenizer_model = data.tokenizer_model
        if tokenizer_model is not None and Path(tokenizer_model).exists():
            tokenizer_model = str(Path(tokenizer_model).resolve())
        return {
            "tokenizer": {"type": data.tokenizer_type, "model": tokenizer_model},
            "data_path": list(dataset.data_path or dataset.train_data_path),
            "iteration": self.state.iteration,
            "consumed_samples": self.state.consumed_samples,
            "consumed_tokens": self.state.consumed_samples * self.cfg.model.seq_length,
            "seq_length": self.cfg.model.seq_length,
            "command": list(sys.argv),
            "version": _package_version(),
            "git_commit": _source_commit(),
        }

    def save(self) -> None:
        if not self.cfg.checkpoint.save:
            return
        self.fp8_guard.save_into(self.state.extra)
        with synced_parameters(self.model):
            path = checkpoint.save(
                self.cfg.checkpoint.save,
                self._chunks(),
                self.cfg.model,
                self.state,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                run_info=self._run_info(),
                options=self.save_options,
                on_published=self._log_saved,
            )
        self.gc.boundary()
        if is_reporting_rank():
            self.metrics.snapshot(Path(self.cfg.checkpoint.save) / METRICS_FILE)
            self.metrics.plot(self._plot_path())
            self.metrics.flush()
            if self.save_options.async_queue is not None:
                log.info(f"saving checkpoint {path} in the background")
        if self.progress is not None:
            self.progress.saved(
                self.state.iteration,
                self.state.consumed_samples,
                background=self.save_options.async_queue is not None,
            )

    def _progress_log(self) -> ProgressLog | None:
        """Megatron-LM's progress file, written by global rank 0 as Megatron-LM does."""
        if not self.cfg.logging.log_progress or torch.distributed.get_rank() != 0:
            return None
        seq = self.cfg.model.seq_length
        progress = ProgressLog(
            self.cfg.checkpoint.save,
            world_size=torch.distributed.get_world_size(),
            flops_per_sample=seq * flops_per_token(self.cfg.model),
            tokens_per_sample=seq,
            consumed_samples=self.state.consumed_samples,
        )
        progress.start()
        return progress

    def _log_saved(self, path: Path) -> None:
        if is_reporting_rank():
            log.info(f"saved checkpoint {path}")

    def _save_options(self) -> checkpoint.SaveOptions:
        ck = self.cfg.checkpoint
        return checkpoint.SaveOptions(
            async_queue=AsyncCallsQueue() if ck.async_save else None,
            fully_parallel=ck.ckpt_fully_parallel_save,
            cache_distribution=ck.ckpt_assume_constant_structure,
        )

    def finish_saves(self) -> None:
        """Wait until every background save is written and published (all ranks)."""
        queue = self.save_options.async_queue
        if queue is not None:
            queue.maybe_finalize_async_calls(blocking=True)

    # -- the loop ------------------------------------------------------------------------------

    def _finished(self) -> bool:
        t = self.cfg.training
        if t.train_iters is not None:
            return self.state.iteration >= t.train_iters
        return self.state.consumed_samples >= t.train_samples

    def _check_finite(self, result: StepResult) -> None:
        """Skipped steps leave the weights untouched; too many in a row stop the run."""
        self.steps_run += 1
        if not result.skipped:
            self.skipped_in_a_row = 0
            self.steps_updated += 1
            return
        self.skipped_in_a_row += 1
        if is_reporting_rank():
            log.warning(
                f"iteration {self.state.iteration}: non-finite loss or gradient norm "
                f"({result.loss}, {result.grad_norm}); step skipped "
                f"({self.skipped_in_a_row} in a row)"
            )
        if self.skipped_in_a_row >= self.cfg.training.max_skipped_steps:
            self._stop_if_nothing_trained()
            self.save()
            raise TrainingStopped(
                f"{self.skipped_in_a_row} consecutive steps had a non-finite loss or gradient norm "
                f"(--max-skipped-steps {self.cfg.training.max_skipped_steps}); stopped at iteration "
                f"{self.state.iteration} with the last good weights saved"
                + (f" to {self.cfg.checkpoint.save}" if self.cfg.checkpoint.save else "")
            )

    def _stop_if_nothing_trained(self) -> None:
        """Stop, saving nothing, when every step of this run so far was skipped: a checkpoint
        would hold the starting weights as if trained, and a resumed job would then find the
        run finished. A loss that is never finite comes from the data or the configuration."""
        if not self.steps_run or self.steps_updated:
            return
        raise TrainingStopped(
            f"every step of this run ({self.steps_run}, up to iteration {self.state.iteration}) "
            "had a non-finite loss or gradient norm and was skipped; nothing trained, nothing "
            "saved: check the training data and the loss settings"
        )

    def run(self) -> dict:
        t = self.cfg.training
        if t.eval_interval and self.state.iteration == 0:
            self.validate()
        while not self._finished():
            global_batch = get_current_running_global_batch_size()
            start = time.perf_counter()
            result = self.step()
            self._report(result, time.perf_counter() - start, global_batch)
            it = self.state.iteration
            stop = self.fp8_guard.after_step(it, result, self.gemm_inputs)
            if stop is not None:
                self.save()
                raise TrainingStopped(stop)
            self._check_finite(result)
            self.gc.step(it)
            if t.eval_interval and it % t.eval_interval == 0:
                self.validate()
            if self.save_options.async_queue is not None:
                self.save_options.async_queue.maybe_finalize_async_calls(blocking=False)
            requests = self.stop.poll(self.device)
            interval = self.cfg.checkpoint.save_interval
            exit_now = requests.exit or bool(t.exit_interval and it % t.exit_interval == 0)
            if requests.save or exit_now or (interval and it % interval == 0):
                self._stop_if_nothing_trained()
                self.save()
            if exit_now:
                return self._close(completed=False)
        if not (t.eval_interval and self.state.iteration % t.eval_interval == 0):
            self.validate()
        if not (
            self.cfg.checkpoint.save_interval
            and self.state.iteration % self.cfg.checkpoint.save_interval == 0
        ):
            self._stop_if_nothing_trained()
            self.save()
        return self._close(completed=True)

    def _plot_path(self) -> str | None:
        """--loss-plot, by default SAVE/loss.png."""
        plot = self.cfg.logging.loss_plot
        if plot is None and self.cfg.checkpoint.save:
            plot = str(Path(self.cfg.checkpoint.save) / "loss.png")
        return plot

    def _close(self, *, completed: bool) -> dict:
        self.finish_saves()
        if is_reporting_rank():
            self.metrics.close(self._plot_path())
        self.metrics.history["completed"] = completed
        return self.metrics.history

    def shutdown(self) -> None:
        self.finish_saves()
        self.gc.close()
        self.objective.close()
        destroy_num_microbatches_calculator()
        parallel.shutdown()


def finished_run(cfg: RunConfig) -> str | None:
    """The line saying that the checkpoint --load names already ends this run (it reached
    --train-iters or --train-samples), else None. Read from the checkpoint's run record before
    anything is built, so a job resubmitted after the end exits at once instead of validating
    and saving the same checkpoint again (--finetune starts a new run: never finished; another
    model is refused by the load as usual)."""
    ck, t = cfg.checkpoint, cfg.training
    if not ck.load or ck.finetune:
        return None
    found = _checked_checkpoint(ck.load)
    info = read_run_info(found) if found is not None else None
    if not info or not info.get("iteration") or checkpoint.load_model_config(found) != cfg.model:
        return None
    if t.train_iters is not None and info["iteration"] >= t.train_iters:
        reached = f"iteration {info['iteration']} (--train-iters {t.train_iters})"
    elif t.train_samples is not None and info["consumed_samples"] >= t.train_samples:
        reached = f"{info['consumed_samples']} samples (--train-samples {t.train_samples})"
    else:
        return None
    return f"the run is already finished: {found} is at {reached}; nothing to do"


def _checked_checkpoint(load: str) -> Path | None:
    """The checkpoint ``--load`` names, refused naming its first damaged file before any of it
    is read (see :func:`checkpoint.check_files`)."""
    found = checkpoint.find_checkpoint(load)
    if found is not None:
        checkpoint.check_files(found, f"--load {load}")
    return found


def train(cfg: RunConfig) -> dict:
    """Run training as configured; returns the recorded history (losses on the last stage)."""
    done = finished_run(cfg)
    if done is not None:
        if os.environ.get("RANK", "0") == "0":
            log.info(done)
        return {"completed": True}
    try:
        trainer = Trainer(cfg)
    except BaseException:
        # A refusal found while building (a flag the data contradicts) must not leave the
        # process groups behind: a library caller or a test in the same process starts anew.
        destroy_num_microbatches_calculator()
        parallel.shutdown()
        raise
    try:
        return trainer.run()
    finally:
        trainer.shutdown()
