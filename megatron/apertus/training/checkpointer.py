"""A run's checkpoints: the one ``--load`` names, found before anything is built and resumed once
the model and optimizer exist; the saves, in the background under ``--async-save``, and the
decision after every step whether to save and whether to exit.

A step ends in a save on a ``--save-interval`` boundary, on an ``--exit-interval`` boundary, or
when a signal, a trigger file or ``--exit-duration-in-mins`` asks for one
(:mod:`megatron.apertus.training.signals`); every rank takes the same decision, from an
all-reduce of the requests. A ``--load`` that holds no checkpoint yet starts from scratch and
says so, as Megatron-LM does (``--exit-on-missing-checkpoint``: refused instead); one whose
checkpoint already ends the run is answered before anything is built (:func:`finished_run`).
``--ckpt-step`` picks another iteration than the tracker's; back into the run's own ``--save``,
the tracker names it once it is loaded, so that a requeued job continues this run, and the FP8
guard's go-back follows the run's own checkpoints (:attr:`Checkpointer.trail`), never those of
the history left. Under
``--non-persistent-save-interval`` the other steps of that interval save non-persistent
checkpoints into their own directory, and a ``--load`` with ``--non-persistent-ckpt-type
global`` resumes the newer of the two kinds (:func:`checkpoint_config.named_checkpoint`); what
each save replaces is removed by :mod:`~megatron.apertus.training.checkpoint_retention`. A
checkpoint saved with ``--no-save-optim`` or ``--no-save-rng`` says so in its run record, and a
load that would read what it lacks is refused naming the flag to add.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import subprocess
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.num_microbatches_calculator import update_num_microbatches

from megatron.apertus import checkpoint
from megatron.apertus.checkpoint import TrainingState
from megatron.apertus.checkpoint_files import (
    checkpoint_iteration,
    iteration_dir,
    latest_iteration,
    non_persistent_dir,
    read_run_info,
    remove_checkpoint,
    saved_iterations,
)
from megatron.apertus.errors import ConfigError
from megatron.apertus.model.config import ApertusConfig
from megatron.apertus.optim.builder import OptimizerSettings
from megatron.apertus.training.checkpoint_config import (
    LAYOUT,
    CheckpointConfig,
    named_checkpoint,
)
from megatron.apertus.training.checkpoint_retention import Retention
from megatron.apertus.training.config import RunConfig
from megatron.apertus.training.runtime import is_reporting_rank
from megatron.apertus.training.signals import StopRequests
from megatron.apertus.training.step import synced_parameters

log = logging.getLogger("apertus")


# -- finding and resuming ------------------------------------------------------------------------


def checked_checkpoint(config: CheckpointConfig) -> Path | None:
    """The checkpoint ``--load`` (and ``--ckpt-step``) name, refused naming its first damaged
    file before any of it is read (see :func:`checkpoint.check_files`)."""
    found = named_checkpoint(config.load, config.ckpt_step, config.non_persistent_load_dir())
    if found is not None:
        checkpoint.check_files(found, f"--load {config.load}")
    return found


def find_checkpoint(config: CheckpointConfig) -> Path | None:
    """The checkpoint --load names, looked up before anything is built; one that lacks states
    this run would load is refused."""
    if not config.load:
        return None
    found = checked_checkpoint(config)
    if found is not None:
        _check_saved_states(found, config)
        _warn_of_later_checkpoints(config)
    elif config.exit_on_missing_checkpoint:
        raise ConfigError(
            f"--exit-on-missing-checkpoint: --load {config.load} {_absence(config.load)}"
        )
    else:
        _log_fresh_start(config.load, config.save)
    return found


def check_initialization(found: Path | None, config: CheckpointConfig, *, initialise: bool) -> None:
    """--no-initialization leaves the weights as allocated: only a checkpoint to load makes them
    a model (Megatron-LM would train the uninitialised memory)."""
    if found is None and not initialise:
        source = f"--load {config.load} holds no checkpoint" if config.load else "no --load"
        raise ConfigError(
            f"--no-initialization: {source}, so the weights would stay uninitialised memory"
        )


def _warn_of_later_checkpoints(config: CheckpointConfig) -> None:
    """--ckpt-step into its own save directory goes back in the run: the later checkpoints there
    belong to the trajectory it leaves. Once the load succeeded the tracker names the loaded
    iteration (:func:`_name_loaded_checkpoint`), so that a requeued job continues this run, and this
    run's saves replace them as it reaches their iterations (the Slurm launcher removes those
    newer than the tracker when a job starts); said once, before anything is replaced, so that a
    user can save elsewhere."""
    later = _later_checkpoints(config)
    if later:
        listed = ", ".join(str(it) for it in later)
        log.warning(
            f"--ckpt-step {config.ckpt_step}: {config.save} also holds iterations {listed}, "
            f"which this run leaves: its tracker names iteration {config.ckpt_step} from the "
            "start and this run's saves replace them (give another --save to keep them)"
        )


def _later_checkpoints(config: CheckpointConfig) -> list[int]:
    """The iterations of --save after the one --ckpt-step loads from that same directory."""
    if config.ckpt_step is None or not config.save or not config.load:
        return []
    if Path(config.save).resolve() != Path(config.load).resolve():
        return []
    return [it for it in saved_iterations(config.save) if it > config.ckpt_step]


def _absence(source: str) -> str:
    """Why ``source`` gives no checkpoint."""
    if not Path(source).exists():
        return "does not exist"
    return f"holds no checkpoint (no {checkpoint.TRACKER}, no {checkpoint.MODEL_CONFIG})"


def _log_fresh_start(source: str, save: str | None) -> None:
    """As Megatron-LM does, a --load without a checkpoint starts from scratch. --load equal
    to --save is the usual restartable job (its first start finds nothing); another --load
    names a checkpoint to start from, so finding none there is a warning."""
    if not is_reporting_rank():
        return
    if save and Path(save).resolve() == Path(source).resolve():
        log.info(f"no checkpoint found at {source}: starting from scratch")
        return
    log.warning(f"--load {source} {_absence(source)}: starting from scratch")


SAVED_STATES = (
    (
        "optimizer",
        "--no-save-optim",
        "optimizer or learning-rate schedule state",
        "--no-load-optim",
    ),
    ("rng", "--no-save-rng", "RNG states", "--no-load-rng"),
)
"""What a training checkpoint may be saved without: its ``saved`` record's key, the flag that
leaves it out, what is then missing, and the flag that loads without it."""


def _check_saved_states(found: Path, config: CheckpointConfig) -> None:
    """Refuse, as Megatron-LM does, to load states that the checkpoint was saved without
    (recorded in its ``apertus_run.json``), naming the flag that does without them; the load
    would otherwise leave them fresh unasked."""
    saved = (read_run_info(found) or {}).get("saved", {})
    wanted = {"optimizer": config.loads_optimizer(), "rng": config.loads_rng()}
    for state, saved_without, what, loaded_without in SAVED_STATES:
        if wanted[state] and saved.get(state) is False:
            raise ConfigError(
                f"--load {found} was saved with {saved_without} and holds no {what}: add "
                f"{loaded_without} (or --finetune) to start from it"
            )


def finished_run(cfg: RunConfig) -> str | None:
    """The line saying that the checkpoint --load names already ends this run (it reached
    --train-iters or --train-samples), else None. Read from the checkpoint's run record before
    anything is built, so a job resubmitted after the end exits at once instead of validating
    and saving the same checkpoint again (--finetune starts a new run and --skip-train only
    evaluates: never finished; another model is refused by the load as usual)."""
    ck, t = cfg.checkpoint, cfg.training
    if not ck.load or ck.finetune or t.skip_train or ck.override_ckpt_iteration is not None:
        return None
    found = checked_checkpoint(ck)
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


def resume(
    found: Path | None,
    config: CheckpointConfig,
    model: list,
    optimizer,
    scheduler,
    *,
    model_config: ApertusConfig,
    optimizer_settings: OptimizerSettings,
    global_batch_size: int,
) -> TrainingState:
    """Continue from the checkpoint ``found`` (model chunks, optimizer and schedule as --load's
    flags ask), or start fresh."""
    if found is None:
        return TrainingState()
    override = config.override_ckpt_iteration
    if override is not None:
        _check_global_batch(found, override, global_batch_size)
    loaded_optimizer = optimizer if config.loads_optimizer() else None
    if loaded_optimizer is not None and checkpoint.has_optimizer_states(found):
        _check_resumable(optimizer_settings)
    state, full = checkpoint.load(
        found,
        [ddp.module for ddp in model],
        optimizer=loaded_optimizer,
        scheduler=scheduler if loaded_optimizer else None,
        model=model_config,
        rng=config.loads_rng(),
        fully_parallel=config.ckpt_fully_parallel_load,
    )
    if not full:  # weights only: the optimizer's fp32 main params must follow the new weights
        optimizer.reload_model_params()
    if override is not None:
        state = TrainingState(override, override * global_batch_size, extra=state.extra)
    if config.finetune:
        state = TrainingState()
    update_num_microbatches(state.consumed_samples, consistency_check=False)
    if is_reporting_rank():
        log.info(_describe_resume(config, found, state))
    return state


def _check_global_batch(found: Path, iteration: int, batch: int) -> None:
    """Megatron-LM's --override-ckpt-iteration resumes at the iteration given, with the samples
    consumed by as many global batches of this run's size, which must then be the checkpoint's
    (else the data would go on from another sample than that iteration's)."""
    saved = (read_run_info(found) or {}).get("global_batch_size")
    if saved is not None and saved != batch:
        raise ConfigError(
            f"--override-ckpt-iteration {iteration}: {found} was saved with --global-batch-size "
            f"{saved}, this run's is {batch}: its iteration x {batch} samples is not where that "
            "iteration's data starts"
        )


def _describe_resume(config: CheckpointConfig, found: Path, state: TrainingState) -> str:
    if config.finetune:
        flag = "--pretrained-checkpoint" if config.from_pretrained() else "--finetune"
        return (
            f"{flag}: weights loaded from {found}; iteration, consumed samples, "
            "optimizer, learning-rate schedule and RNG states start fresh"
        )
    line = (
        f"resumed from {found} at iteration {state.iteration}, "
        f"{state.consumed_samples} samples consumed"
    )
    fresh = [
        f"{flag}: {what} start fresh"
        for flag, what, on in (
            ("--no-load-optim", "optimizer and learning-rate schedule", config.no_load_optim),
            ("--no-load-rng", "RNG states", config.no_load_rng),
        )
        if on
    ]
    if config.override_ckpt_iteration is not None:
        fresh.append(f"--override-ckpt-iteration {config.override_ckpt_iteration}")
    return line + "".join(f"; {part}" for part in fresh)


# -- what a checkpoint records of its run --------------------------------------------------------


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


def run_info(cfg: RunConfig, state: TrainingState) -> dict:
    """What a checkpoint records of the run that made it (``apertus_run.json``): exports
    write the run's tokenizer and a model card from it."""
    data, dataset = cfg.data, cfg.dataset
    tokenizer_model = data.tokenizer_model
    if tokenizer_model is not None and Path(tokenizer_model).exists():
        tokenizer_model = str(Path(tokenizer_model).resolve())
    tokenizer = {"type": data.tokenizer_type, "model": tokenizer_model}
    if data.tokenizer_type == "NullTokenizer":  # ids only: they are its identity
        tokenizer |= {"eod": data.null_tokenizer_eod_id, "pad": data.null_tokenizer_pad_id}
    return {
        "tokenizer": tokenizer,
        "data_path": list(dataset.data_path or dataset.train_data_path),
        "mock_data": dataset.mock_data,
        "iteration": state.iteration,
        "consumed_samples": state.consumed_samples,
        "global_batch_size": cfg.training.global_batch_size,
        "parallel": {name: getattr(cfg.parallel, name) for name in LAYOUT},
        "consumed_tokens": state.consumed_samples * cfg.model.seq_length,
        "seq_length": cfg.model.seq_length,
        "fused_output_loss": cfg.training.fused_output_loss,
        "saved": {
            "optimizer": not cfg.checkpoint.no_save_optim,
            "rng": not cfg.checkpoint.no_save_rng,
        },
        "command": list(sys.argv),
        "version": _package_version(),
        "git_commit": _source_commit(),
    }


# -- saving ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AfterStep:
    """What a finished step asks for, the same on every rank."""

    save: bool
    exit: bool
    persistent: bool = True
    """Whether the save goes to --save (else: a non-persistent one)."""


class Checkpointer:
    """The run's saves and the save and exit decisions after each step; built once the run is
    ready to step (from then on a signal asks for a save instead of stopping the process)."""

    def __init__(
        self, cfg: RunConfig, device: torch.device, resumed_from: Path | None = None
    ) -> None:
        """``resumed_from``: the checkpoint the run was loaded from (None: a fresh start)."""
        self.run, self.config, self.device = cfg, cfg.checkpoint, device
        if resumed_from is not None and dist.get_rank() == 0:
            _name_loaded_checkpoint(self.config, resumed_from)
        t = cfg.training
        self.exit_interval = t.exit_interval
        self.requests = StopRequests(
            handle_signals=t.exit_signal_handler,
            trigger_path=t.trigger_path,
            exit_duration_in_mins=t.exit_duration_in_mins,
            exit_signal=t.exit_signal,
        )
        self.options = checkpoint.SaveOptions(
            async_queue=AsyncCallsQueue() if self.config.async_save else None,
            fully_parallel=self.config.ckpt_fully_parallel_save,
            cache_distribution=self.config.ckpt_assume_constant_structure,
        )
        self.retention = self._retention(self.config.save, self.config.save_retain_interval)
        self.frequent_dir = self.config.non_persistent_save_dir()
        self.frequent = self._retention(self.frequent_dir, None, latest_only=True)
        self.trail: list[Path] = self._own(resumed_from)
        """This run's checkpoints in --save and the non-persistent directory, oldest first: the
        one it was loaded from (when loaded whole) and those it published since, less those a
        go-back abandoned. Later checkpoints on disk belong to a history the run left."""

    def _own(self, resumed_from: Path | None) -> list[Path]:
        """The loaded checkpoint as the start of this run's trail, when it is one of --save's
        (or of the non-persistent directory) and its state was taken whole: a checkpoint
        loaded with --finetune, --no-load-optim or --no-load-rng is not where the run stood."""
        if resumed_from is None or self.config.continuing() != self.config:
            return []
        config = self.config
        if not config.save:
            return []
        frequent = non_persistent_dir(config.save, config.non_persistent_global_ckpt_dir)
        homes = [Path(config.save).resolve(), frequent.resolve()]
        return [resumed_from] if resumed_from.parent.resolve() in homes else []

    @staticmethod
    def _retention(
        save_dir: str | Path | None, interval: int | None, latest_only: bool = False
    ) -> Retention | None:
        """What removes the checkpoints a save into ``save_dir`` replaces: on rank 0, which
        publishes them; None elsewhere or without the directory."""
        if not save_dir or dist.get_rank() != 0:
            return None
        return Retention(save_dir, retain_interval=interval, latest_only=latest_only)

    @property
    def saves(self) -> bool:
        """Whether the run has a --save directory."""
        return bool(self.config.save)

    @property
    def in_background(self) -> bool:
        """Whether saves are written by a background process (--async-save)."""
        return self.options.async_queue is not None

    def interval_saves(self, iteration: int) -> bool:
        """Whether --save-interval saves after ``iteration``."""
        interval = self.config.save_interval
        return bool(interval and iteration % interval == 0)

    def non_persistent_saves(self, iteration: int) -> bool:
        """Whether --non-persistent-save-interval saves after ``iteration``."""
        interval = self.config.non_persistent_save_interval
        return bool(self.frequent_dir and interval and iteration % interval == 0)

    def after_step(self, iteration: int) -> AfterStep:
        """Publish the background saves that are done, then agree with every rank on a save
        and an exit: requests (signals, trigger files, the duration) and the intervals. As in
        Megatron-LM, a step that --save-interval or a request saves saves a persistent
        checkpoint, and only another step of the non-persistent interval a non-persistent one."""
        if self.in_background:
            checkpoint.finalize_background_saves(self.options, blocking=False)
        requests = self.requests.poll(self.device)
        exit_now = requests.exit or bool(self.exit_interval and iteration % self.exit_interval == 0)
        persistent = requests.save or exit_now or self.interval_saves(iteration)
        return AfterStep(
            save=persistent or self.non_persistent_saves(iteration),
            exit=exit_now,
            persistent=persistent,
        )

    def save(
        self,
        model: list,
        state: TrainingState,
        optimizer,
        scheduler,
        *,
        persistent: bool = True,
        history: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write the checkpoint of ``state`` (every rank) to --save or, not ``persistent``, to
        the non-persistent directory, with the run's history (``history(directory)`` writes it
        into the unpublished checkpoint); published now or, in the background, once every rank
        has written it, and then what it replaces is removed; without the optimizer and its
        schedule under --no-save-optim, without RNG states under --no-save-rng."""
        optimizer_kept = not self.config.no_save_optim
        retention = self.retention if persistent else self.frequent
        with synced_parameters(model):
            return checkpoint.save(
                self.config.save if persistent else self.frequent_dir,
                [ddp.module for ddp in model],
                self.run.model,
                state,
                optimizer=optimizer if optimizer_kept else None,
                scheduler=scheduler if optimizer_kept else None,
                rng=not self.config.no_save_rng,
                run_info=run_info(self.run, state),
                options=self.options,
                add_files=history,
                on_published=partial(self._published, retention),
            )

    def last_saved(self, before: int) -> Path | None:
        """The run's newest checkpoint at an iteration before ``before``, once every background
        save is published (all ranks): persistent or not, the newest of this run's own (see
        :attr:`trail`), never one of a history it left (a --ckpt-step back into --save leaves
        later checkpoints there); None without one. The trail forgets what comes after it: the
        run goes back there."""
        self.finish()
        kept = [path for path in self.trail if checkpoint_iteration(path) < before]
        found = next((p for p in reversed(kept) if (p / checkpoint.MODEL_CONFIG).is_file()), None)
        if found is not None:
            self.trail = kept[: kept.index(found) + 1]
        return found

    def _published(self, retention: Retention | None, path: Path) -> None:
        """``path`` is published: it joins the trail (every rank) and what it replaces goes."""
        iteration = checkpoint_iteration(path)
        self.trail = [p for p in self.trail if checkpoint_iteration(p) < iteration] + [path]
        _published(retention, path)

    def finish(self) -> None:
        """Wait until every background save is written and published (all ranks), and what
        they replace removed (rank 0)."""
        if self.in_background:
            checkpoint.finalize_background_saves(self.options, blocking=True)
        for retention in (self.retention, self.frequent):
            if retention is not None:
                retention.finish()


def _name_loaded_checkpoint(config: CheckpointConfig, loaded: Path) -> None:
    """A --ckpt-step back into --save: the tracker names the loaded iteration from now on, so
    that a job requeued before this run's first save (or without --ckpt-step) continues this
    run, not the history it left; its non-persistent checkpoints newer than the loaded one,
    which a --load would prefer, are removed (rank 0, after the load succeeded). Megatron-LM
    leaves the tracker until the next save."""
    if not _later_checkpoints(config) or loaded.parent.resolve() != Path(config.save).resolve():
        return
    iteration = checkpoint_iteration(loaded)
    checkpoint.write_tracker(config.save, iteration)
    frequent = non_persistent_dir(config.save, config.non_persistent_global_ckpt_dir)
    if (latest_iteration(frequent) or 0) > iteration:
        (frequent / checkpoint.TRACKER).unlink()
    for later in [it for it in saved_iterations(frequent) if it > iteration]:
        remove_checkpoint(iteration_dir(frequent, later))
    log.info(f"--ckpt-step {iteration}: {config.save}'s tracker names iteration {iteration}")


def _published(retention: Retention | None, path: Path) -> None:
    if is_reporting_rank():
        log.info(f"saved checkpoint {path}")
    if retention is not None:
        retention.published(path)
