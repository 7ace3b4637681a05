"""Checkpointing flags (``--help``'s "checkpointing" group) and ``--use-checkpoint-args``,
which fills the command line's unset model and tokenizer flags from the ``--load`` checkpoint
before the groups are built.

The checkpoint is read (with torch) only when ``--use-checkpoint-args`` is given: ``--help`` and
argument errors need neither torch nor megatron-core.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from megatron.apertus.checkpoint_files import latest_iteration, non_persistent_dir
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help, require, switch

NON_PERSISTENT_REFUSALS = {
    "local": "each rank's part on node-local storage is saved by NVIDIA's resiliency extension "
    "(nvidia_resiliency_ext), which this code does not use: use global",
    "in_memory": "Megatron-LM itself has not implemented it: use global",
}
"""Why each Megatron-LM type of non-persistent checkpoint other than ``global`` is refused."""


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    save: Optional[str] = flag_help("directory to save checkpoints to", None)
    load: Optional[str] = flag_help(
        "checkpoint (save directory or iter_* directory) to start from", None
    )
    save_interval: int = flag_help("iterations between checkpoints (0: only at the end)", 0)
    save_retain_interval: Optional[int] = flag_help(
        "keep the checkpoints of multiples of this iteration and the latest: after each save, "
        "the checkpoint the tracker named before it is removed unless its iteration is such a "
        "multiple (a multiple of --save-interval)",
        None,
    )
    non_persistent_save_interval: Optional[int] = flag_help(
        "iterations between non-persistent checkpoints, of which only the latest is kept (a "
        "--save-interval step saves a persistent one instead); needs --non-persistent-ckpt-type",
        None,
    )
    non_persistent_ckpt_type: Optional[Literal["global", "local", "in_memory"]] = flag_help(
        "global: non-persistent checkpoints are whole checkpoints in "
        "--non-persistent-global-ckpt-dir, and --load resumes the newest of them and the "
        "persistent one (local and in_memory are refused)",
        None,
    )
    non_persistent_global_ckpt_dir: Optional[str] = flag_help(
        "directory of the global non-persistent checkpoints (default: non_persistent inside "
        "--save when saving, inside --load when loading)",
        None,
    )
    no_save_optim: bool = switch(
        "save checkpoints without the optimizer state and, as in Megatron-LM, without the "
        "learning-rate schedule that goes with it; loading one then needs --no-load-optim or "
        "--finetune"
    )
    no_save_rng: bool = switch(
        "save checkpoints without the RNG states; loading one then needs --no-load-rng or "
        "--finetune"
    )
    finetune: bool = switch(
        "load only the weights from --load: the iteration, consumed samples, optimizer, "
        "learning-rate schedule and RNG states start fresh"
    )
    pretrained_checkpoint: Optional[str] = flag_help(
        "checkpoint (save directory or iter_* directory) to start from while --load holds none: "
        "its weights only, as --finetune loads them; once this run has saved into --load, a "
        "restart resumes from there instead (continued pretraining or fine-tuning from a base "
        "model, restartable with one command)",
        None,
    )
    no_load_optim: bool = switch(
        "load the weights, iteration and consumed samples from --load, not the optimizer state; "
        "the learning-rate schedule starts over too (as in Megatron-LM, it goes with the optimizer)"
    )
    no_load_rng: bool = switch("keep this run's seeded RNG states instead of the checkpoint's")
    override_ckpt_iteration: Optional[int] = flag_help(
        "resume as if the checkpoint were of this iteration: the data goes on after its "
        "iteration x --global-batch-size samples (the global batch must be the checkpoint's); "
        "weights, optimizer and learning-rate schedule are the checkpoint's",
        None,
    )
    ckpt_step: Optional[int] = flag_help(
        "load the checkpoint of this iteration from the --load save directory instead of the "
        "latest one its tracker names",
        None,
    )
    use_checkpoint_args: bool = switch(
        "take the model's shape from the --load checkpoint (each model flag not given on the "
        "command line; the preset is not used) and its tokenizer (--tokenizer-type, and "
        "--tokenizer-model unless given), as Megatron-LM does; a --load without a checkpoint "
        "keeps the command line's"
    )
    use_mp_args_from_checkpoint_args: bool = switch(
        "with --use-checkpoint-args: take the tensor-, pipeline- and virtual-pipeline-parallel "
        "sizes from the checkpoint too, over the command line's, as Megatron-LM does (any layout "
        "loads any checkpoint here; this one repeats the run's)"
    )
    exit_on_missing_checkpoint: bool = switch(
        "a --load that holds no checkpoint (a path typo) ends the run, exit 2, instead of "
        "starting from scratch"
    )
    async_save: bool = switch(
        "write checkpoints in a background process while training goes on (megatron-core's "
        "asynchronous torch_dist save); a checkpoint counts once every rank has written it, and "
        "the run waits for the last one before it exits"
    )
    ckpt_fully_parallel_save: bool = flag_help(
        "data-parallel replicas share the writing of the checkpoint (megatron-core's fully "
        "parallel save; Megatron-LM's default)",
        True,
    )
    ckpt_fully_parallel_load: bool = switch(
        "data-parallel replicas each read a share of the checkpoint and exchange it"
    )
    ckpt_assume_constant_structure: bool = switch(
        "with the fully parallel save: keep the distribution of tensors between the replicas "
        "from the first save instead of computing it again (the state's structure must not change)"
    )

    def __post_init__(self) -> None:
        if self.ckpt_step is not None and not (self.load or self.pretrained_checkpoint):
            raise ConfigError(
                "--ckpt-step picks an iteration of the --load directory: give --load (or "
                "--pretrained-checkpoint)"
            )
        if self.ckpt_step is not None and self.ckpt_step < 0:
            raise ConfigError(f"--ckpt-step must be >= 0, got {self.ckpt_step}")
        override = self.override_ckpt_iteration
        require(override is None or override >= 0, "--override-ckpt-iteration", override, ">= 0")
        if override is not None and self.finetune:
            raise ConfigError(
                "--override-ckpt-iteration and --finetune exclude each other: --finetune starts "
                "at iteration 0"
            )
        self._check_retention()
        self._check_non_persistent()

    def _check_retention(self) -> None:
        """Megatron-LM's rules: a positive interval, a multiple of --save-interval's."""
        retain = self.save_retain_interval
        if retain is None:
            return
        require(retain > 0, "--save-retain-interval", retain, "> 0")
        if self.save_interval and retain % self.save_interval:
            raise ConfigError(
                f"--save-retain-interval {retain} must be a multiple of --save-interval "
                f"{self.save_interval}"
            )

    def _check_non_persistent(self) -> None:
        kind, interval = self.non_persistent_ckpt_type, self.non_persistent_save_interval
        if kind in NON_PERSISTENT_REFUSALS:
            raise ConfigError(f"--non-persistent-ckpt-type {kind}: {NON_PERSISTENT_REFUSALS[kind]}")
        if interval is not None:
            require(interval > 0, "--non-persistent-save-interval", interval, "> 0")
            if kind is None:
                raise ConfigError(
                    "--non-persistent-save-interval needs --non-persistent-ckpt-type global"
                )
        save = self.non_persistent_save_dir()
        if save is not None and self.save and Path(save).resolve() == Path(self.save).resolve():
            raise ConfigError(
                f"--non-persistent-global-ckpt-dir {save} is --save: each keeps its own tracker "
                "there; give another directory"
            )

    def non_persistent_save_dir(self) -> Path | None:
        """Where non-persistent checkpoints are saved (None: not saved)."""
        if self.non_persistent_save_interval is None or not self.save:
            return None
        return non_persistent_dir(self.save, self.non_persistent_global_ckpt_dir)

    def non_persistent_load_dir(self) -> Path | None:
        """Where --load looks for non-persistent checkpoints too (None: it does not)."""
        if self.non_persistent_ckpt_type is None or not self.load:
            return None
        return non_persistent_dir(self.load, self.non_persistent_global_ckpt_dir)

    def loads_optimizer(self) -> bool:
        return not (self.finetune or self.no_load_optim)

    def loads_rng(self) -> bool:
        return not (self.finetune or self.no_load_rng)

    def saves_left_out(self) -> list[str]:
        """The flags that leave states out of this run's checkpoints."""
        return [
            flag
            for flag, on in (
                ("--no-save-optim", self.no_save_optim),
                ("--no-save-rng", self.no_save_rng),
            )
            if on
        ]

    def loaded(self) -> "CheckpointConfig":
        """The flags the run loads with (Megatron-LM's rule): --load's own while it holds a
        checkpoint (persistent or, under --non-persistent-ckpt-type global, non-persistent);
        otherwise, given --pretrained-checkpoint, that checkpoint taken as --finetune takes it
        (refused when it holds none: the run would train a random model)."""
        if self.pretrained_checkpoint is None or holds_checkpoint(
            self.load, self.non_persistent_load_dir()
        ):
            return self
        pretrained = self.pretrained_checkpoint
        if not holds_checkpoint(pretrained):
            neither = f" (and --load {self.load} none either)" if self.load else ""
            raise ConfigError(f"--pretrained-checkpoint {pretrained} holds no checkpoint{neither}")
        return dataclasses.replace(
            self,
            load=pretrained,
            finetune=True,
            non_persistent_ckpt_type=None,  # the base's directory alone (these flags only load)
            non_persistent_save_interval=None,
            override_ckpt_iteration=None,  # Megatron-LM's --finetune starts at 0 all the same
        )

    def from_pretrained(self) -> bool:
        """Whether these flags load --pretrained-checkpoint (see :meth:`loaded`)."""
        return self.finetune and self.load is not None and self.load == self.pretrained_checkpoint

    def continuing(self) -> "CheckpointConfig":
        """These flags for a load that continues the run itself (the FP8 guard going back to one
        of its checkpoints): everything restored, whatever the first --load took."""
        return dataclasses.replace(self, finetune=False, no_load_optim=False, no_load_rng=False)


def holds_checkpoint(directory: str | None, non_persistent: Path | None = None) -> bool:
    """Whether ``directory`` (or its ``non_persistent`` directory) holds a checkpoint."""
    from megatron.apertus import checkpoint

    return bool(directory) and any(
        checkpoint.find_checkpoint(d) is not None for d in (directory, non_persistent) if d
    )


def named_checkpoint(
    load: str, ckpt_step: int | None, non_persistent: Path | None = None
) -> Path | None:
    """The checkpoint ``--load`` names: the iteration ``--ckpt-step`` gives (refused, listing
    the iterations there, when it has none of it), else the latest; None when ``--load`` holds
    no checkpoint yet. Given the ``non_persistent`` directory, its latest checkpoint is taken
    instead when its iteration is at least the tracker's in ``--load`` (Megatron-LM's rule);
    --ckpt-step picks from ``--load`` alone."""
    from megatron.apertus import checkpoint

    if ckpt_step is not None:
        return checkpoint.checkpoint_at(load, ckpt_step, f"--ckpt-step {ckpt_step}")
    found = checkpoint.find_checkpoint(load)
    frequent = None if non_persistent is None else checkpoint.find_checkpoint(non_persistent)
    if frequent is None:
        return found
    persistent = latest_iteration(load)
    if persistent is not None and persistent > (latest_iteration(non_persistent) or 0):
        return found
    return frequent


def apply_checkpoint_args(args: argparse.Namespace) -> str | None:
    """``--use-checkpoint-args``: fill ``args`` from the checkpoint the run loads (--load's,
    else --pretrained-checkpoint's) as Megatron-LM's
    ``load_args_from_checkpoint`` does: every model flag left unset from ``apertus_model.json``,
    the tokenizer type (it has a default, which Megatron-LM overwrites too) and, unless given,
    the tokenizer model (a NullTokenizer's end-of-document and padding ids) from
    ``apertus_run.json``. Returns the line to log, None when the flag
    is off."""
    if args.use_mp_args_from_checkpoint_args and not args.use_checkpoint_args:
        raise ConfigError(
            "--use-mp-args-from-checkpoint-args takes effect with --use-checkpoint-args (as in "
            "Megatron-LM): add it"
        )
    if not args.use_checkpoint_args:
        return None
    if not (args.load or args.pretrained_checkpoint):
        raise ConfigError(
            "--use-checkpoint-args reads the checkpoint --load (or --pretrained-checkpoint) "
            "names: give one"
        )
    from megatron.apertus.checkpoint import load_model_config
    from megatron.apertus.checkpoint_files import read_run_info

    load, kind = args.load, args.non_persistent_ckpt_type
    frequent = None
    if load and kind == "global":
        frequent = non_persistent_dir(load, args.non_persistent_global_ckpt_dir)
    if args.pretrained_checkpoint and not holds_checkpoint(load, frequent):
        load, frequent = args.pretrained_checkpoint, None  # the checkpoint the run starts from
    found = named_checkpoint(load, args.ckpt_step, frequent)
    if found is None:
        return f"--use-checkpoint-args: no checkpoint at {load}, using the command line"
    taken = []
    for name, value in dataclasses.asdict(load_model_config(found)).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
            taken.append(name)
    info = read_run_info(found) or {}
    if args.use_mp_args_from_checkpoint_args:
        taken += _take_layout(args, found, info.get("parallel"))
    tokenizer = info.get("tokenizer") or {}
    if tokenizer.get("type"):
        args.tokenizer_type = tokenizer["type"]
        taken.append("tokenizer_type")
    if tokenizer.get("model") and args.tokenizer_model is None:
        args.tokenizer_model = tokenizer["model"]
        taken.append("tokenizer_model")
    for name, key, unset in (
        ("null_tokenizer_eod_id", "eod", None),
        ("null_tokenizer_pad_id", "pad", -1),
    ):
        if tokenizer.get(key, unset) != unset and getattr(args, name) == unset:
            setattr(args, name, tokenizer[key])
            taken.append(name)
    return f"--use-checkpoint-args: {', '.join(taken) or 'nothing'} from {found}"


LAYOUT = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
)
"""The parallel sizes a run record holds, which --use-mp-args-from-checkpoint-args takes."""


def _take_layout(args: argparse.Namespace, found: Path, layout: dict | None) -> list[str]:
    """Set ``args``' parallel sizes to the checkpoint's ``layout`` (its run record's), over the
    command line's as Megatron-LM does; the names set."""
    if layout is None:
        raise ConfigError(
            f"--use-mp-args-from-checkpoint-args: {found} records no parallel layout; give the "
            "sizes on the command line"
        )
    for name in LAYOUT:
        setattr(args, name, layout[name])
    args.num_layers_per_virtual_pipeline_stage = None  # the virtual stages are the checkpoint's
    return list(LAYOUT)
