"""The training loop: build, resume, step, report, validate, save, stop. Reads like torchtitan's.

One :class:`Trainer` per process drives components with one job each: the objective (data,
targets, forward pass, loss: :mod:`~megatron.apertus.training.objectives`), the
:class:`~megatron.apertus.training.checkpointer.Checkpointer` (saves, and when to save and
exit), the :class:`~megatron.apertus.training.reporter.Reporter` (metrics, the iteration line,
diagnostics), the :class:`~megatron.apertus.training.validator.Validator`, the count of
:class:`~megatron.apertus.training.skipped_steps.SkippedSteps`, the phase timers
(:class:`~megatron.apertus.training.step_timers.StepTimers`) and the FP8 guard. Every decision
that changes what ranks do next (skip a step, save, stop) is taken from values all ranks share
(all-reduced flags, the replicated grad norm), so ranks never diverge.

Start-up checks what a user can get wrong before anything is allocated
(:mod:`~megatron.apertus.training.startup`; a --load that is no checkpoint) and raises
:class:`ConfigError` in one line; a --load that holds no checkpoint yet starts from scratch and
says so, as Megatron-LM does. Under ``--skip-train`` the trainer builds and loads as usual, then
only evaluates (:meth:`Trainer.evaluate`): no step, no save, no reporting components.
"""

from __future__ import annotations

import logging
import os
import time

from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    get_current_running_global_batch_size,
    get_num_microbatches,
    update_num_microbatches,
)

from megatron.apertus import parallel
from megatron.apertus.checkpoint import TrainingState, trusting_fp8_state
from megatron.apertus.model.precision import set_bf16_layers
from megatron.apertus.training import rerun, runtime
from megatron.apertus.training.checkpoint_config import CheckpointConfig
from megatron.apertus.training.checkpointer import (
    Checkpointer,
    check_initialization,
    find_checkpoint,
    finished_run,
    resume,
)
from megatron.apertus.training.config import RunConfig
from megatron.apertus.training.cuda_graphs import GraphCapture, check_cuda_graphs
from megatron.apertus.training.diagnostics import ManualGC
from megatron.apertus.training.fp8_guard import (
    CHECKPOINT_KEY,
    GuardedRun,
    Switch,
    decided_layers,
    decisions_at,
)
from megatron.apertus.training.metrics import Metrics
from megatron.apertus.training.objectives import build_objective
from megatron.apertus.training.optimizer import build_optimizer_and_scheduler
from megatron.apertus.training.profiling import StepProfiler
from megatron.apertus.training.replica_check import ReplicaCheck
from megatron.apertus.training.reporter import SKIPPED_SAMPLES, Reporter
from megatron.apertus.training.runtime import is_reporting_rank
from megatron.apertus.training.skipped_steps import SkippedSteps
from megatron.apertus.training.startup import (
    build_model,
    check_batch_sizes,
    check_before_start,
    start_microbatches,
    with_bf16_layers,
)
from megatron.apertus.training.step import StepResult, train_step
from megatron.apertus.training.step_timers import StepTimers
from megatron.apertus.training.validator import Validator

log = logging.getLogger("apertus")


class TrainingStopped(RuntimeError):
    """The run stopped itself (too many consecutive non-finite steps, or the FP8 guard); the
    last good state was saved."""


class Trainer:
    """One process's run: its objective, model chunks, optimizer and the state it continues."""

    def __init__(self, cfg: RunConfig) -> None:
        """Build in the order a run needs: refusals of the flags first, then the process
        groups, the checkpoint to continue from, the batch-size calculator, the objective with
        its data, the model, the optimizer, the state, and what saves and reports on the run."""
        self.cfg = cfg
        check_before_start(cfg)
        self.runtime = runtime.start(
            cfg.parallel,
            model=cfg.model,
            training=cfg.training,
            engine=cfg.engine,
            packed_documents=cfg.dataset.reset_attention_mask,
            te_rng_tracker=cfg.cuda_graphs.enabled or cfg.training.te_rng_tracker,
        )
        started = self.runtime
        check_cuda_graphs(
            cfg, device=started.device_name, impl=started.transformer_impl, engine=started.engine
        )
        self.device, self.dp = self.runtime.device, self.runtime.dp
        check_batch_sizes(
            cfg.training,
            cfg.parallel,
            self.dp,
            cfg.communication.microbatch_group_size_per_virtual_pipeline_stage,
        )
        self.loading = cfg.checkpoint.loaded()
        self.resume_from = find_checkpoint(self.loading)
        check_initialization(
            self.resume_from, cfg.checkpoint, initialise=not cfg.training.no_initialization
        )
        self._apply_guard_decisions()
        start_microbatches(cfg.training, self.dp)
        tokenizer = runtime.tokenizer(cfg.data, cfg.model)
        self.objective = build_objective(
            cfg, tokenizer=tokenizer, dp=self.dp, dp_rank=self.runtime.groups.dp.rank()
        )
        self.model = build_model(cfg, self.runtime)
        self.optimizer, self.scheduler = build_optimizer_and_scheduler(
            self.model,
            cfg.optimizer,
            cfg.schedule,
            cfg.ademamix,
            cfg.training,
            precision=cfg.training.precision,
            log_num_zeros_in_grad=cfg.logging.log_num_zeros_in_grad,
        )
        self.state = self._resume()
        self.objective.prepare(self.model, state=self.state, resume_from=self.resume_from)
        t = cfg.training
        self.timeout_updated = False
        self.gc = ManualGC(t.manual_gc, t.manual_gc_interval, around_eval=t.manual_gc_eval)
        self.checkpointer: Checkpointer | None = None
        if not t.skip_train:
            self._start_components()

    def _apply_guard_decisions(self) -> None:
        """The FP8 guard's decisions that hold for the checkpoint this run continues (none with
        --finetune, a new run): their layers join --bf16-layers before the model is built."""
        finetune = self.loading.finetune
        self.decisions = [] if finetune else decisions_at(self.resume_from)
        decided = decided_layers(self.cfg.fp8_guard, self.decisions, reporting=is_reporting_rank())
        self.runtime = with_bf16_layers(self.runtime, decided)

    def _resume(self, config: CheckpointConfig | None = None) -> TrainingState:
        """The state the checkpoint ``self.resume_from`` continues (taken as ``config`` says,
        default as the run loads it: :meth:`CheckpointConfig.loaded`), or a fresh one."""
        return resume(
            self.resume_from,
            config or self.loading,
            self.model,
            self.optimizer,
            self.scheduler,
            model_config=self.cfg.model,
            optimizer_settings=self.cfg.optimizer,
            global_batch_size=self.cfg.training.global_batch_size,
        )

    def _start_components(self) -> None:
        """What training drives: the step's own hooks, saving (from now on a signal asks for a
        save) and what reports on the run."""
        self._start_step_hooks()
        self.checkpointer = Checkpointer(self.cfg, self.device, self.resume_from)
        self._start_reporting()

    def _start_step_hooks(self) -> None:
        """Around each step: the capture of CUDA graphs, the count of skipped steps, the
        profilers, the phase timers, the comparison of the replicas' weights (once now, then
        at its interval) and megatron-core's rerun state machine, which validates the step's
        results (--check-for-spiky-loss, --check-for-large-grads)."""
        cfg, t = self.cfg, self.cfg.training
        rerun.start(cfg.rerun, self.state.iteration)
        self.train_forward = self.objective.train_forward
        if cfg.rerun.check_for_spiky_loss:
            self.train_forward = rerun.checking_spiky_loss(self.train_forward)
        self.graphs = GraphCapture(
            cfg.cuda_graphs,
            self.model,
            self.optimizer,
            seq_length=cfg.model.seq_length,
            micro_batch_size=t.micro_batch_size,
            start_iteration=self.state.iteration,
            reporting=is_reporting_rank(),
        )
        self.skipped = SkippedSteps(t.max_skipped_steps)
        interval = t.check_weight_hash_across_dp_replicas_interval
        self.replicas = ReplicaCheck(interval, self.model, reporting=is_reporting_rank())
        self.replicas.check(self.state.iteration)
        self.profiler = StepProfiler(
            cfg.profiling,
            tensorboard_dir=cfg.logging.tensorboard_dir,
            log_interval=t.log_interval,
            first_iteration=self.state.iteration,
        )
        self.timers = StepTimers(cfg.timing, self.model, self.optimizer)

    def _start_reporting(self) -> None:
        """Reporting (continued from a resumed checkpoint's metrics), validation and the FP8
        guard (its counts continued too)."""
        cfg = self.cfg
        self.reporter = Reporter(
            cfg,
            objective=self.objective,
            model=self.model,
            optimizer=self.optimizer,
            state=self.state,
            resumed_from=self.resume_from,
            device=self.device,
            dp=self.dp,
            timers=self.timers,
        )
        metrics = self.reporter.metrics
        self.validator = Validator(
            self.objective,
            self.model,
            cfg.training,
            metrics=metrics,
            gc=self.gc,
            device=self.device,
            perplexity=cfg.logging.log_validation_ppl_to_tensorboard,
        )
        self.validated_at: int | None = None
        """The iteration the last validation pass was at."""
        self.fp8_guard = GuardedRun(
            cfg.fp8_guard,
            reporting=is_reporting_rank(),
            metrics=metrics,
            save_dir=cfg.checkpoint.save,
            num_layers=cfg.model.num_layers,
            state=self.state.extra.get(CHECKPOINT_KEY),
            decisions=self.decisions,
            bf16_layers=self.runtime.engine.bf16_layers or (),
        )

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> StepResult:
        """One optimizer step on the objective's next global batch; the state advances."""
        global_batch = get_current_running_global_batch_size()
        with self.timers.phase("batch-generator", 2):
            batches = self.objective.train_batches(self.state.consumed_samples, global_batch)
        iteration = self.state.iteration + 1
        self.profiler.before_step(self.state.iteration)
        self.graphs.before_step(iteration)
        with self.reporter.gemm_inputs(iteration) as measured:
            result = train_step(
                self.model,
                self.optimizer,
                batches,
                self.objective.shape(get_num_microbatches()),
                self.train_forward,
                empty_unused_memory_level=self.cfg.training.empty_unused_memory_level,
            )
        self.gemm_inputs = measured
        self.graphs.after_step()
        self.state.iteration = iteration
        self.state.consumed_samples += global_batch
        if not result.skipped:
            self.scheduler.step(increment=global_batch)
        update_num_microbatches(self.state.consumed_samples, consistency_check=False)
        self.profiler.after_step(iteration)
        self.replicas.after_step(iteration)
        return result

    def skip_iteration(self) -> None:
        """An iteration of --iterations-to-skip, as Megatron-LM runs it: its global batch is read
        and counted as consumed (and as skipped, for the iteration line), the iteration counts;
        no forward, backward or update, the schedule does not advance, and nothing is logged,
        validated or saved for it. CUDA graphs due before it are captured before it, as in
        Megatron-LM, so that skipping that iteration never leaves the run without them."""
        self.graphs.before_step(self.state.iteration + 1)
        global_batch = get_current_running_global_batch_size()
        self.objective.train_batches(self.state.consumed_samples, global_batch)
        self.state.iteration += 1
        self.state.consumed_samples += global_batch
        extra = self.state.extra
        extra[SKIPPED_SAMPLES] = extra.get(SKIPPED_SAMPLES, 0) + global_batch
        update_num_microbatches(self.state.consumed_samples, consistency_check=False)
        if is_reporting_rank():
            log.info(
                f"iteration {self.state.iteration}: skipped (--iterations-to-skip), its "
                f"{global_batch} samples consumed untrained"
            )

    def _train_one_step(self) -> bool:
        """A step and what follows it (report, stop checks, validation, saving); whether the
        run exits now."""
        if self.state.iteration + 1 in self.cfg.training.iterations_to_skip:
            self.skip_iteration()
            return False
        global_batch = get_current_running_global_batch_size()
        start = time.perf_counter()
        result = self.step()
        self._timeout_after_first_step()
        self.reporter.step(result, time.perf_counter() - start, global_batch, self.state)
        if self._went_back(result):
            return False
        self._stop_if_unhealthy(result)
        self.gc.step(self.state.iteration)
        if self.validator.due(self.state.iteration) or self._finished():
            self._validate()  # the last step's before its save: the checkpoint's history has it
        after = self.checkpointer.after_step(self.state.iteration)
        if after.save:
            self._save_trained(persistent=after.persistent, going_on=not after.exit)
        return after.exit

    def _timeout_after_first_step(self) -> None:
        """--distributed-timeout-seconds-after-init: every process group's timeout once this
        job's first step is done, through megatron-core's update (a barrier first)."""
        seconds = self.cfg.parallel.distributed_timeout_seconds_after_init
        if seconds is None or self.timeout_updated:
            return
        parallel.update_timeout(seconds)
        self.timeout_updated = True

    def _validate(self) -> None:
        self.validator.validate(self.state)
        self.validated_at = self.state.iteration

    def _went_back(self, result: StepResult) -> bool:
        """Let the FP8 guard judge the step: save and stop when it says so; when it switches
        layers out of FP8, go back to the last checkpoint saved before its alarm (the step and
        what would follow it are abandoned). Whether the run went back."""
        verdict = self.fp8_guard.after_step(self.state.iteration, result, self.gemm_inputs)
        if isinstance(verdict, Switch):
            self._continue_in_bf16(verdict)
            return True
        if verdict is not None:
            self.save()
            raise TrainingStopped(verdict)
        return False

    def _continue_in_bf16(self, switch: Switch) -> None:
        """Carry out ``switch`` in this job: its layers leave FP8 and the run continues from its
        own newest checkpoint before the alarm, persistent or not (every background save
        published first; :meth:`Checkpointer.last_saved`), as a job started from it with those
        layers in --bf16-layers would: weights, optimizer, schedule, RNG states, data position and the guard's counts
        are the checkpoint's. Without a checkpoint to go back to, the run stops."""
        found = self.checkpointer.last_saved(before=switch.iteration)
        if found is None:
            raise TrainingStopped(switch.no_checkpoint_line(self.cfg.checkpoint.save))
        self.fp8_guard.commit(switch, found)
        set_bf16_layers(self.model, self.fp8_guard.bf16_layers)
        self.objective.close()
        self.resume_from = found
        with trusting_fp8_state():  # --save's own checkpoint
            self.state = self._resume(self.cfg.checkpoint.continuing())
        self.objective.prepare(self.model, state=self.state, resume_from=found)
        self.reporter.rewind(self.state)
        self.fp8_guard.resumed(self.state.extra.get(CHECKPOINT_KEY))

    def _stop_if_unhealthy(self, result: StepResult) -> None:
        """Save and stop when too many steps in a row were skipped."""
        it = self.state.iteration
        if self.skipped.count(result, it):
            self._save_trained()
            raise TrainingStopped(self.skipped.too_many(it, self.cfg.checkpoint.save))

    # -- saving ----------------------------------------------------------------------------------

    def save(self, *, persistent: bool = True) -> None:
        """A checkpoint of the current state (``persistent``: in --save, else a non-persistent
        one), when the run has a --save directory."""
        if not self.checkpointer.saves:
            return
        self.fp8_guard.save_into(self.state.extra)
        path = self.checkpointer.save(
            self.model,
            self.state,
            self.optimizer,
            self.scheduler,
            persistent=persistent,
            history=self.reporter.write_history,
        )
        self.gc.boundary()
        self.reporter.saved(path, self.state, background=self.checkpointer.in_background)

    def _save_trained(self, *, persistent: bool = True, going_on: bool = False) -> None:
        """:meth:`save`, unless no step of this job trained: then stop, saving nothing; or,
        when the run goes on (``going_on``) while fp16's dynamic loss scale is still coming
        down from its start, save nothing yet and go on to the first update."""
        nothing = self.skipped.nothing_trained(self.state.iteration)
        if nothing is None:
            self.save(persistent=persistent)
        elif going_on and self.skipped.scaling_down():
            if is_reporting_rank():
                log.info(
                    f"iteration {self.state.iteration}: not saved: no step has updated the "
                    "weights yet (fp16's dynamic loss scale is still coming down)"
                )
        else:
            raise TrainingStopped(nothing)

    # -- the loop ----------------------------------------------------------------------------------

    def _finished(self) -> bool:
        t = self.cfg.training
        if t.train_iters is not None:
            return self.state.iteration >= t.train_iters
        return self.state.consumed_samples >= t.train_samples

    def run(self) -> dict:
        """Train to the end (or an exit request); returns the recorded history."""
        if self.state.iteration == 0 and self.validator.due(0):
            self._validate()
        while not self._finished():
            if self._train_one_step():
                return self._close(completed=False)
        if self.validated_at != self.state.iteration:  # the last iteration was skipped
            self._validate()
        if not self.checkpointer.interval_saves(self.state.iteration):
            self._save_trained()
        return self._close(completed=True)

    def evaluate(self) -> dict:
        """--skip-train, Megatron-LM's evaluation-only mode: one validation pass at the loaded
        state, logged as Megatron-LM logs it; no step, no save, and nothing recorded for the
        run's metrics (Megatron-LM writes nothing to TensorBoard then). Returns the pass's
        history."""
        if is_reporting_rank():
            log.info("skipping training (--skip-train is on) ...")
        metrics = Metrics(tensorboard_dir=None, wandb_project=None, wandb_exp_name=None, config={})
        validator = Validator(
            self.objective,
            self.model,
            self.cfg.training,
            metrics=metrics,
            gc=self.gc,
            device=self.device,
        )
        validator.validate(self.state, split="validation set")
        return {**metrics.history, "completed": True}

    def _close(self, *, completed: bool) -> dict:
        self.checkpointer.finish()
        return self.reporter.close(completed=completed)

    def shutdown(self) -> None:
        if self.checkpointer is not None:  # it trained (not --skip-train)
            self.profiler.close()
            self.checkpointer.finish()
            rerun.stop()
        self.gc.close()
        self.objective.close()
        destroy_num_microbatches_calculator()
        parallel.shutdown()


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
        return trainer.evaluate() if cfg.training.skip_train else trainer.run()
    finally:
        trainer.shutdown()
