"""Typed, per-concern configuration of a training run, and the command line generated from it.

Each dataclass owns one concern; its fields become Megatron-named flags (``micro_batch_size``
-> ``--micro-batch-size``) through :mod:`megatron.apertus.flags`, which also says how a field
gets its help. The groups of the lower units (model, data, optim, ...) are declared next to their
code; the ones here are the training loop's own. Nothing below ``training/`` reads the command
line: entry points parse once and pass these objects down.

:class:`RunConfig` is the registry: one field per config group, in ``--help`` order, with the
group's title. ``pretrain_gpt.py`` adds and reads every group (:func:`add_run_arguments`,
:func:`run_from_arguments`), the tools and the launch planner name the groups they need. A new
field of a registered dataclass becomes a flag with no other edit; a new group is one field
here. ``tests/training/test_cli_snapshot.py`` freezes the resulting command line.

This module and the config modules it reads import neither torch nor megatron-core: the flags
serve ``--help`` and argument errors, which must start at once. What needs them (a ramp-up's
steps, the device, GEMM statistics' names) imports them where it is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from megatron.apertus.align.config import AlignConfig
from megatron.apertus.cli import check_output
from megatron.apertus.data.datasets import DatasetConfig
from megatron.apertus.data.goldfish import GoldfishConfig
from megatron.apertus.distill.config import DistillConfig
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import (
    ADDITION_MARK,
    add_arguments,
    flag_help,
    from_arguments,
    require,
    switch,
)
from megatron.apertus.model.config import (
    ApertusConfig,
    ParallelConfig,
    padded_vocab_size,
    validate_context_parallel,
    virtual_stages,
)
from megatron.apertus.model.engine import EngineConfig, validate_engine
from megatron.apertus.model.presets import PRESETS, preset
from megatron.apertus.optim.builder import AdEMAMixSettings
from megatron.apertus.optim.schedule import ScheduleConfig
from megatron.apertus.quant.config import QuantConfig
from megatron.apertus.tokenizer.tokenizers import checked_tokenizer
from megatron.apertus.training.fp8_guard import Fp8GuardConfig

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(kw_only=True, frozen=True)
class TrainingConfig:
    micro_batch_size: int = flag_help("samples per micro-batch per data-parallel rank", 1)
    global_batch_size: int = flag_help("samples per optimizer step over all data-parallel ranks", 8)
    rampup_batch_size: Optional[list[int]] = flag_help(
        "START INCREMENT SAMPLES: grow the global batch from START by INCREMENT over SAMPLES", None
    )
    train_iters: Optional[int] = flag_help("optimizer steps to run (or give --train-samples)", None)
    train_samples: Optional[int] = flag_help("samples to train on (instead of --train-iters)", None)
    seed: int = flag_help("seed of initialisation and data order", 1234)
    log_interval: int = flag_help("iterations between log lines", 10)
    eval_interval: int = flag_help("iterations between validation passes (0: only at the end)", 0)
    eval_iters: int = flag_help("validation batches per validation pass", 4)
    device: str = flag_help("auto, cpu or cuda", "auto", ours=True)
    precision: Optional[str] = flag_help(
        "parameter dtype: fp32, bf16 or fp16 (default: fp32, or what --bf16/--fp16 say)",
        None,
        ours=True,
    )
    bf16: bool = switch("Megatron-LM's --precision bf16")
    fp16: bool = switch("Megatron-LM's --precision fp16")
    exit_signal_handler: bool = flag_help("on SIGUSR2/SIGTERM save a checkpoint and exit 0", False)
    trigger_path: Optional[str] = flag_help("directory watched for 'save' and 'exit' files", None)
    exit_interval: int = flag_help("save and stop after this many iterations (0: never)", 0)
    exit_duration_in_mins: Optional[float] = flag_help(
        "save and stop once the job has run this many minutes (checked after every step and "
        "validation batch, agreed on by all ranks)",
        None,
    )
    max_skipped_steps: int = flag_help(
        "stop after this many consecutive non-finite steps", 5, ours=True
    )
    recompute_granularity: Optional[str] = flag_help(
        "activation recomputation: full or selective", None
    )
    recompute_method: Optional[str] = flag_help("full recomputation: uniform or block", None)
    recompute_num_layers: Optional[int] = flag_help(
        "layers per recomputed group (uniform) or count (block)", None
    )
    manual_gc: bool = switch(
        "turn Python's automatic garbage collector off and collect on every rank at the same "
        "moments (start, --manual-gc-interval, around validation and saves), so no rank stalls "
        "the others at a collective"
    )
    manual_gc_interval: int = flag_help(
        "with --manual-gc: iterations between collections (0: only at start, validation, saves)",
        0,
    )
    manual_gc_eval: bool = flag_help(
        "with --manual-gc: also collect right before and after each validation pass "
        "(--no-manual-gc-eval: not there)",
        True,
    )
    decrease_batch_size_if_needed: bool = switch(
        "a --global-batch-size that does not split into --micro-batch-size x data-parallel size "
        "runs as the largest multiple of that below it (megatron-core's calculator) instead of "
        "being refused"
    )
    xielu_impl: str = flag_help("xIELU kernel: auto, cuda, cpu or torch", "auto", ours=True)
    fused_output_loss: bool = flag_help(
        "fuse the output layer and the loss (the [tokens, vocabulary] logits never exist)",
        True,
        ours=True,
    )

    def __post_init__(self) -> None:
        self._resolve_precision()
        self._check_ranges()
        if (self.train_iters is None) == (self.train_samples is None):
            raise ConfigError("give exactly one of --train-iters and --train-samples")
        if self.rampup_batch_size is not None and len(self.rampup_batch_size) != 3:
            raise ConfigError("--rampup-batch-size takes three numbers: START INCREMENT SAMPLES")
        if self.rampup_batch_size is not None and self.train_iters is not None:
            raise ConfigError("--rampup-batch-size needs --train-samples (the step count varies)")
        if (
            self.rampup_batch_size is not None
            and self.rampup_batch_size[0] == self.global_batch_size
        ):
            # Nothing to ramp: megatron-core's calculator would divide by zero increments.
            object.__setattr__(self, "rampup_batch_size", None)
        if self.rampup_batch_size is not None:
            for part, value in zip(("START", "INCREMENT"), self.rampup_batch_size):
                require(value >= 1, f"--rampup-batch-size {part}", value, ">= 1")
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins <= 0:
            raise ConfigError(
                f"--exit-duration-in-mins must be > 0, got {self.exit_duration_in_mins}"
            )
        if self.manual_gc_interval < 0:
            raise ConfigError(f"--manual-gc-interval must be >= 0, got {self.manual_gc_interval}")

    def _check_ranges(self) -> None:
        """Counts a run divides by or steps with, refused here so that ``--dry-run`` and the
        launch planner name the flag instead of dividing by zero."""
        for flag, value in (
            ("--micro-batch-size", self.micro_batch_size),
            ("--global-batch-size", self.global_batch_size),
            ("--log-interval", self.log_interval),
            ("--train-samples", self.train_samples),
            ("--recompute-num-layers", self.recompute_num_layers),
        ):
            require(value is None or value >= 1, flag, value, ">= 1")
        for flag, value in (
            ("--train-iters", self.train_iters),
            ("--eval-interval", self.eval_interval),
            ("--eval-iters", self.eval_iters),
            ("--exit-interval", self.exit_interval),
        ):
            require(value is None or value >= 0, flag, value, ">= 0")

    def total_iterations(self, dp: int) -> int:
        """Optimizer steps of the run, following megatron-core's batch-size ramp-up."""
        if self.train_iters is not None:
            return self.train_iters
        gbs, samples = self.global_batch_size, self.train_samples
        if not self.rampup_batch_size:
            return math.ceil(samples / gbs)
        from megatron.apertus.mcore_compat import rampup_calculator

        ramp = self.rampup_batch_size[2]
        calculator = rampup_calculator(self.rampup_batch_size, gbs, self.micro_batch_size, dp)
        consumed = steps = 0
        while consumed < samples and consumed <= ramp:
            calculator.update(consumed, consistency_check=False)
            consumed += calculator.get_current_global_batch_size()
            steps += 1
        return steps + max(0, math.ceil((samples - consumed) / gbs))

    def _resolve_precision(self) -> None:
        """``precision`` from --precision, --bf16 or --fp16, which must not disagree; always set
        afterwards (the frozen field is written once, here, as dataclasses document)."""
        switched = [name for name in ("bf16", "fp16") if getattr(self, name)]
        if len(switched) == 2:
            raise ConfigError("--bf16 and --fp16 exclude each other")
        if switched and self.precision not in (None, switched[0]):
            raise ConfigError(f"--{switched[0]} contradicts --precision {self.precision}")
        precision = self.precision or (switched[0] if switched else "fp32")
        if precision not in PRECISIONS:
            raise ConfigError(
                f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}"
            )
        object.__setattr__(self, "precision", precision)

    def total_samples(self) -> int:
        """Samples the run consumes (its training dataset's size)."""
        if self.train_samples is not None:
            return self.train_samples
        return self.train_iters * self.global_batch_size

    def dataset_sizes(self) -> tuple[int, int, int]:
        """Samples of the train/valid/test datasets: the run and every validation pass.

        The training dataset's sample order depends on its size, so everything that must see
        the student's order (teacher logits) builds its datasets from this.
        """
        validations = (self.total_samples() // self.global_batch_size) // max(
            self.eval_interval, 1
        ) + 2
        return (self.total_samples(), validations * self.eval_iters * self.global_batch_size, 0)

    def recompute_overrides(self) -> dict:
        """TransformerConfig fields for activation recomputation."""
        if self.recompute_granularity is None:
            return {}
        return {
            "recompute_granularity": self.recompute_granularity,
            "recompute_method": self.recompute_method,
            "recompute_num_layers": self.recompute_num_layers,
        }


@dataclass(kw_only=True, frozen=True)
class OptimizerSettings:
    """The optimizer; its schedule is ``optim.ScheduleConfig``, AdEMAMix's own knobs
    ``optim.AdEMAMixSettings`` (flags ``--ademamix-*``)."""

    optimizer: str = flag_help("adam or ademamix", "adam")
    lr: float = flag_help("peak learning rate", 1e-3)
    min_lr: float = flag_help("learning rate at the end of the decay", 0.0)
    weight_decay: float = flag_help(
        "decoupled weight decay (never on norms, biases, xIELU alphas)", 0.1
    )
    adam_beta1: float = flag_help("first-moment decay", 0.9)
    adam_beta2: float = flag_help("second-moment decay", 0.95)
    adam_eps: float = flag_help("denominator epsilon", 1e-8)
    clip_grad: float = flag_help("global gradient-norm clip (0: off)", 1.0)
    use_distributed_optimizer: bool = flag_help(
        "shard optimizer state over data-parallel ranks", False
    )

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "ademamix"):
            raise ConfigError(f"--optimizer must be adam or ademamix, got {self.optimizer!r}")
        for flag, value in (
            ("--lr", self.lr),
            ("--min-lr", self.min_lr),
            ("--weight-decay", self.weight_decay),
            ("--clip-grad", self.clip_grad),
        ):
            require(math.isfinite(value) and value >= 0, flag, value, "a finite number >= 0")
        for flag, value in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            require(0 <= value < 1, flag, value, "in [0, 1)")
        require(
            math.isfinite(self.adam_eps) and self.adam_eps > 0,
            "--adam-eps",
            self.adam_eps,
            "a finite number > 0",
        )


@dataclass(kw_only=True, frozen=True)
class CommunicationConfig:
    """How gradients, parameters and pipeline activations travel: megatron-core's
    ``DistributedDataParallelConfig`` and the pipeline schedules' overlap switches. None of them
    changes a result, only when communication happens."""

    overlap_grad_reduce: bool = switch(
        "reduce (or, with --use-distributed-optimizer, reduce-scatter) each gradient bucket as "
        "soon as the backward pass has filled it, overlapping communication with computation"
    )
    overlap_param_gather: bool = switch(
        "with --use-distributed-optimizer and --overlap-grad-reduce: all-gather the updated "
        "parameters bucket by bucket just before the next forward pass uses them"
    )
    ddp_bucket_size: Optional[int] = flag_help(
        "gradient elements per communication bucket (default: megatron-core's, max(40M, "
        "1M x data-parallel size) with --overlap-grad-reduce, else one bucket)",
        None,
    )
    overlap_p2p_communication_warmup_flush: bool = switch(
        "interleaved pipeline schedule: also overlap the sends and receives of the warmup and "
        "flush phases with computation (needs virtual pipeline stages)"
    )

    def check(self, *, distributed_optimizer: bool, virtual_pipeline: bool) -> None:
        """Megatron-LM's combinations, refused as it refuses them."""
        if self.overlap_param_gather and not (distributed_optimizer and self.overlap_grad_reduce):
            raise ConfigError(
                "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"
            )
        if self.overlap_p2p_communication_warmup_flush and not virtual_pipeline:
            raise ConfigError(
                "--overlap-p2p-communication-warmup-flush needs virtual pipeline stages "
                "(--num-layers-per-virtual-pipeline-stage or --virtual-pipeline-model-parallel-size)"
            )
        if self.ddp_bucket_size is not None and self.ddp_bucket_size < 1:
            raise ConfigError(f"--ddp-bucket-size must be >= 1, got {self.ddp_bucket_size}")

    def transformer_overrides(self, *, virtual_pipeline: bool) -> dict:
        """TransformerConfig fields: as in Megatron-LM, the interleaved schedule overlaps its
        steady-state sends and receives (unbatched), and the flag adds warmup and flush."""
        if not virtual_pipeline:
            return {}
        return {
            "overlap_p2p_comm": True,
            "overlap_p2p_comm_warmup_flush": self.overlap_p2p_communication_warmup_flush,
        }


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    save: Optional[str] = flag_help("directory to save checkpoints to", None)
    load: Optional[str] = flag_help(
        "checkpoint (save directory or iter_* directory) to start from", None
    )
    save_interval: int = flag_help("iterations between checkpoints (0: only at the end)", 0)
    finetune: bool = switch(
        "load only the weights from --load: the iteration, consumed samples, optimizer, "
        "learning-rate schedule and RNG states start fresh"
    )
    no_load_optim: bool = switch(
        "load the weights, iteration and consumed samples from --load, not the optimizer state; "
        "the learning-rate schedule starts over too (as in Megatron-LM, it goes with the optimizer)"
    )
    no_load_rng: bool = switch("keep this run's seeded RNG states instead of the checkpoint's")
    use_checkpoint_args: bool = switch(
        "take the model's shape from the --load checkpoint (each model flag not given on the "
        "command line; the preset is not used) and its tokenizer (--tokenizer-type, and "
        "--tokenizer-model unless given), as Megatron-LM does; a --load without a checkpoint "
        "keeps the command line's"
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

    def loads_optimizer(self) -> bool:
        return not (self.finetune or self.no_load_optim)

    def loads_rng(self) -> bool:
        return not (self.finetune or self.no_load_rng)

    def continuing(self) -> "CheckpointConfig":
        """These flags for a load that continues the run itself (the FP8 guard going back to one
        of its checkpoints): everything restored, whatever the first --load took."""
        return dataclasses.replace(self, finetune=False, no_load_optim=False, no_load_rng=False)


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    tokenizer_type: str = flag_help(
        "TekkenTokenizer, HuggingFaceTokenizer or SentencePieceTokenizer", "TekkenTokenizer"
    )
    tokenizer_model: Optional[str] = flag_help(
        "tokenizer file or directory (TekkenTokenizer: default the one bundled with mistral-common)",
        None,
    )
    goldfish_loss: bool = flag_help(
        "drop a deterministic 1/k of label positions from the loss", False
    )
    num_workers: int = flag_help(
        "data loader worker processes that read and collate the next step's micro-batches while "
        "this one computes (0: read in the training process; Megatron-LM's default is 2); the "
        "batches are the same for any number",
        0,
    )

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ConfigError(f"--num-workers must be >= 0, got {self.num_workers}")
        if self.tokenizer_model is not None or self.tokenizer_type != "TekkenTokenizer":
            # Read now, not at the first batch: --dry-run and the tools refuse a wrong file too.
            checked_tokenizer(self.tokenizer_type, self.tokenizer_model)


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    tensorboard_dir: Optional[str] = flag_help("write TensorBoard scalars here", None)
    wandb_project: Optional[str] = flag_help(
        "log to this wandb project (WANDB_MODE=offline works)", None
    )
    wandb_exp_name: Optional[str] = flag_help("wandb run name", None)
    log_json: Optional[str] = flag_help(
        "append every recorded scalar to this JSON-lines file (one object per iteration), "
        "flushed at every log line so a killed run keeps each logged interval; a resumed run "
        "starts it over from its checkpoint's history",
        None,
        ours=True,
    )
    loss_plot: Optional[str] = flag_help(
        "PNG of the loss curves, redrawn at every checkpoint and at the end (default: "
        "SAVE/loss.png)",
        None,
        ours=True,
    )
    log_params_norm: bool = switch(
        "log the L2 norm of all parameters (the whole model, each shard once) every --log-interval"
    )
    log_params_norm_per_param: bool = switch(
        "log each parameter's L2 norm (params-norm/NAME) to TensorBoard, wandb and --log-json "
        "every --log-interval; Apertus-fork flag"
    )
    log_progress: bool = switch(
        "append Megatron-LM's progress lines (job starts, checkpoints with job and cumulative "
        "TFLOP/s per device, FLOPs and tokens so far) to SAVE/progress.txt"
    )
    log_loss_scale_to_tensorboard: bool = flag_help(
        "record the loss scale (1.0 unless fp16 scales it) as TensorBoard's and wandb's "
        "loss-scale; --no-log-loss-scale-to-tensorboard: not (Megatron-LM has only that "
        "form; the positive form is ours)",
        True,
        ours=True,
    )
    log_memory_to_tensorboard: bool = switch(
        "log memory use every --log-interval: on a GPU the allocator's allocated, max-allocated "
        "and reserved bytes, on a CPU the process's resident memory"
    )
    log_intermediate_metrics: Optional[list[str]] = flag_help(
        "statistics of every transformer GEMM's input, per layer, among mean, rms, kurtosis, "
        "underflow, overflow (FP8 e4m3 cast); Apertus-fork flag, docs/gpu.md",
        None,
    )
    log_intermediate_metrics_interval: Optional[int] = flag_help(
        "iterations between intermediate-metric measurements (default: --log-interval); "
        "Apertus-fork flag",
        None,
    )

    def __post_init__(self) -> None:
        self._check_outputs()
        if self.wandb_project and importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                "--wandb-project needs wandb, which is not installed: "
                "pip install 'megatron-apertus[wandb]'"
            )
        from megatron.apertus.training.gemm_metrics import STATISTICS

        unknown = sorted(set(self.log_intermediate_metrics or ()) - set(STATISTICS))
        if unknown:
            raise ConfigError(
                f"--log-intermediate-metrics: unknown {', '.join(unknown)}; choose among "
                f"{', '.join(STATISTICS)}"
            )
        interval = self.log_intermediate_metrics_interval
        if interval is not None and interval < 1:
            raise ConfigError(f"--log-intermediate-metrics-interval must be >= 1, got {interval}")

    def _check_outputs(self) -> None:
        """Outputs refused when the flags are read, not when the run first writes them after
        building the model (or after its first log interval)."""
        for flag, path in (("--log-json", self.log_json), ("--loss-plot", self.loss_plot)):
            if path:
                check_output(flag, path, directory=False)
        if self.tensorboard_dir:
            check_output("--tensorboard-dir", self.tensorboard_dir, directory=True)


def add_model_arguments(parser: argparse.ArgumentParser, title: str) -> None:
    """``--model-preset`` and the model flags, which override the preset's fields."""
    parser.add_argument(
        "--model-preset",
        default="tiny",
        choices=sorted(PRESETS),
        help="architecture to start from; any model flag below overrides it" + ADDITION_MARK,
    )
    model = add_arguments(parser, ApertusConfig, title=title, defaults=False)
    model.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        help="the model's vocabulary is the tokenizer's, padded to a multiple of this x "
        "--tensor-model-parallel-size (Megatron-LM's rule; with --vocab-size: checked to be one)",
    )


def add_parallel_arguments(parser: argparse.ArgumentParser, title: str) -> None:
    """The layout flags and Megatron-LM's ``--num-layers-per-virtual-pipeline-stage``."""
    layout = add_arguments(parser, ParallelConfig, title=title)
    layout.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        help="interleaved pipeline: layers per virtual stage (sets "
        "--virtual-pipeline-model-parallel-size to --num-layers / PP / this)",
    )


def apply_checkpoint_args(args: argparse.Namespace) -> str | None:
    """``--use-checkpoint-args``: fill ``args`` from the --load checkpoint as Megatron-LM's
    ``load_args_from_checkpoint`` does: every model flag left unset from ``apertus_model.json``,
    the tokenizer type (it has a default, which Megatron-LM overwrites too) and, unless given,
    the tokenizer model from ``apertus_run.json``. Returns the line to log, None when the flag
    is off."""
    if not args.use_checkpoint_args:
        return None
    if not args.load:
        raise ConfigError("--use-checkpoint-args reads the checkpoint --load names: give --load")
    from megatron.apertus.checkpoint import find_checkpoint, load_model_config
    from megatron.apertus.checkpoint_files import read_run_info

    found = find_checkpoint(args.load)
    if found is None:
        return f"--use-checkpoint-args: no checkpoint at {args.load}, using the command line"
    taken = []
    for name, value in dataclasses.asdict(load_model_config(found)).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
            taken.append(name)
    tokenizer = (read_run_info(found) or {}).get("tokenizer") or {}
    if tokenizer.get("type"):
        args.tokenizer_type = tokenizer["type"]
        taken.append("tokenizer_type")
    if tokenizer.get("model") and args.tokenizer_model is None:
        args.tokenizer_model = tokenizer["model"]
        taken.append("tokenizer_model")
    return f"--use-checkpoint-args: {', '.join(taken) or 'nothing'} from {found}"


def model_from_arguments(args: argparse.Namespace) -> ApertusConfig:
    """The preset, overridden by the model flags; ``--make-vocab-size-divisible-by`` pads the
    tokenizer's vocabulary as Megatron-LM does unless ``--vocab-size`` is given (then it checks).

    A parser without the tokenizer flags (the launch planner's) checks the preset's vocabulary
    instead of loading a tokenizer.
    """
    model = from_arguments(ApertusConfig, args, base=preset(args.model_preset))
    divisor = args.make_vocab_size_divisible_by
    if divisor is None:
        return model
    tp = args.tensor_model_parallel_size
    if args.vocab_size is None and "tokenizer_type" in args:
        return dataclasses.replace(
            model, vocab_size=padded_vocab_size(_tokenizer_vocab_size(args), divisor, tp)
        )
    if padded_vocab_size(model.vocab_size, divisor, tp) != model.vocab_size:
        raise ConfigError(
            f"--make-vocab-size-divisible-by {divisor}: the vocabulary ({model.vocab_size}, "
            f"--vocab-size) is not a multiple of {divisor} x --tensor-model-parallel-size ({tp})"
        )
    return model


def _tokenizer_vocab_size(args: argparse.Namespace) -> int:
    return checked_tokenizer(args.tokenizer_type, args.tokenizer_model).vocab_size


def parallel_from_arguments(args: argparse.Namespace, model: ApertusConfig) -> ParallelConfig:
    """The layout flags; Megatron-LM's ``--num-layers-per-virtual-pipeline-stage`` becomes the
    number of virtual stages per pipeline rank."""
    parallel = from_arguments(ParallelConfig, args)
    validate_context_parallel(model, parallel)
    per_stage = args.num_layers_per_virtual_pipeline_stage
    if per_stage is None:
        return parallel
    if parallel.virtual_pipeline_model_parallel_size is not None:
        raise ConfigError(
            "give --num-layers-per-virtual-pipeline-stage or --virtual-pipeline-model-parallel-size"
            ", not both"
        )
    stages = virtual_stages(model.num_layers, parallel.pipeline_model_parallel_size, per_stage)
    return dataclasses.replace(parallel, virtual_pipeline_model_parallel_size=stages)


# -- the registry of config groups -----------------------------------------------------------


def group(title: str, *, prefix: str = "") -> Any:
    """A :class:`RunConfig` field holding one config group: flags ``--<prefix><field>`` under
    ``title`` in ``--help``."""
    return field(metadata={"title": title, "prefix": prefix})


@dataclass(kw_only=True)
class RunConfig:
    """A training run: every config group, in ``--help`` order. The one table of groups."""

    model: ApertusConfig = group("model (overrides the preset)")
    parallel: ParallelConfig = group("parallelism")
    training: TrainingConfig = group("training")
    engine: EngineConfig = group("transformer implementation and FP8")
    optimizer: OptimizerSettings = group("optimizer")
    ademamix: AdEMAMixSettings = group("AdEMAMix", prefix="ademamix_")
    schedule: ScheduleConfig = group("learning-rate schedule")
    communication: CommunicationConfig = group("communication overlap")
    checkpoint: CheckpointConfig = group("checkpointing")
    data: DataConfig = group("data")
    dataset: DatasetConfig = group("datasets")
    goldfish: GoldfishConfig = group("goldfish loss", prefix="goldfish_")
    logging: LoggingConfig = group("logging")
    fp8_guard: Fp8GuardConfig = group("FP8 guard")
    distill: DistillConfig = group("distillation (sparse top-k teacher logits)")
    align: AlignConfig = group("alignment (DPO, QRPO)")
    quant: QuantConfig = group("quantization-aware training")


GROUPS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(RunConfig)}
"""The config groups by name, in ``--help`` order."""


def group_class(name: str) -> type:
    """The dataclass of config group ``name``."""
    return typing.get_type_hints(RunConfig)[name]


def add_run_arguments(
    parser: argparse.ArgumentParser,
    names: Iterable[str] = GROUPS,
    *,
    titles: dict[str, str] | None = None,
) -> None:
    """The flags of the groups ``names`` (default: all), in registry order; ``titles`` renames
    groups in a tool's ``--help``."""
    wanted = set(names)
    for name, f in GROUPS.items():
        if name not in wanted:
            continue
        title = (titles or {}).get(name, f.metadata["title"])
        if name == "model":
            add_model_arguments(parser, title)
        elif name == "parallel":
            add_parallel_arguments(parser, title)
        else:
            add_arguments(parser, group_class(name), title=title, prefix=f.metadata["prefix"])


def groups_from_arguments(
    args: argparse.Namespace, names: Iterable[str] = GROUPS, *, model: ApertusConfig | None = None
) -> dict[str, Any]:
    """The config groups ``names`` built from parsed flags, by name. The layout reads the
    model's layer count: ``model`` when the model is not among ``names`` (a checkpoint's)."""
    wanted = set(names)
    values: dict[str, Any] = {}
    for name, f in GROUPS.items():
        if name not in wanted:
            continue
        if name == "model":
            values[name] = model = model_from_arguments(args)
        elif name == "parallel":
            values[name] = parallel_from_arguments(args, model)
        else:
            values[name] = from_arguments(group_class(name), args, prefix=f.metadata["prefix"])
    return values


def run_from_arguments(args: argparse.Namespace, given: Iterable[str] = ()) -> RunConfig:
    """The whole run, checked across groups (overlap flags, engine against device and layout);
    ``given``: the destinations the command line set (:func:`~megatron.apertus.flags.given_destinations`), for the
    flags that must not appear without another even at their default values."""
    from megatron.apertus.parallel import resolve_device

    config = RunConfig(**groups_from_arguments(args))
    config.align.check_given(given)
    config.communication.check(
        distributed_optimizer=config.optimizer.use_distributed_optimizer,
        virtual_pipeline=config.parallel.virtual_pipeline_model_parallel_size is not None,
    )
    validate_engine(
        config.engine,
        device=resolve_device(config.training.device),
        num_layers=config.model.num_layers,
    )
    config.fp8_guard.check_run(
        save=config.checkpoint.save, fp8_param_gather=config.engine.fp8_param_gather
    )
    return config
