"""The training loop's own flags: batch sizes, run length, seed, intervals, precision, exits
and recomputation (``--help``'s "training" group), and the counts derived from them.

``--help`` and argument errors need neither torch nor megatron-core: the ramp-up's steps import
megatron-core where they are counted.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Literal, Optional

from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help, require, switch

PRECISIONS = ("fp32", "bf16", "fp16")
EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGXCPU")
"""What ``--exit-signal`` may name: signals sent to ask a job to stop (by Slurm, a terminal or
the batch system's CPU-time limit). Named, not numbered, so that parsing needs no ``signal``
table of the platform."""


RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")
"""megatron-core's names of the parts of a dense layer that selective recomputation recomputes."""
RECOMPUTE_REFUSED = {
    "moe": "the model has no mixture-of-experts layers",
    "moe_act": "the model has no mixture-of-experts layers",
    "shared_experts": "the model has no mixture-of-experts layers",
    "mla_up_proj": "the attention is grouped-query attention, not multi-latent attention",
}
"""megatron-core's other names, for parts the Apertus model does not have."""


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
    use_cpu_initialization: bool = switch(
        "initialise the weights on the CPU, then move them to the GPU: each weight matrix is "
        "drawn whole by the CPU generator and cut into its tensor-parallel shards, so the initial "
        "model is the same for any --tensor-model-parallel-size (slower start for large models); "
        "a CPU run always initialises so"
    )
    no_initialization: bool = switch(
        "build the model without initialising its weights, for a run that loads them from a "
        "checkpoint (a faster start); refused when there is none to load"
    )
    te_rng_tracker: bool = switch(
        "seed the model-parallel RNG streams through Transformer Engine's tracker (the graph-safe "
        "one CUDA graphs need, and take without this flag); needs --transformer-impl "
        "transformer_engine"
    )
    disable_jit_fuser: bool = switch(
        "megatron-core's jit_fuser (torch.compile) no longer compiles the functions it "
        "decorates from then on (megatron-core's disable_jit_fuser, called before the model is "
        "built, as Megatron-LM does)"
    )
    data_parallel_random_init: bool = switch(
        "initialise each data-parallel rank from its own seed (--seed + 10 x its rank), then copy "
        "rank 0's weights to the others before the first step, as Megatron-LM does: replicas "
        "start equal, on the weights of a run without the flag, and only the ranks' random "
        "streams stay apart (this model has no dropout to draw from them)"
    )
    log_interval: int = flag_help("iterations between log lines", 10)
    eval_interval: int = flag_help("iterations between validation passes (0: only at the end)", 0)
    start_eval_at_iter: Optional[int] = flag_help(
        "--eval-interval validates only from this iteration on (the pass at the end of "
        "training still runs)",
        None,
    )
    eval_iters: int = flag_help("validation batches per validation pass", 4)
    eval_micro_batch_size: Optional[int] = flag_help(
        "samples per validation micro-batch on each data-parallel rank (default: "
        "--micro-batch-size)",
        None,
    )
    eval_global_batch_size: Optional[int] = flag_help(
        "samples per validation batch (default: the training step's global batch); a multiple "
        "of the validation micro-batch x data-parallel size",
        None,
    )
    full_validation: bool = switch(
        "each validation pass covers the whole validation data once (one epoch of the "
        "validation split or --valid-data-path), instead of --eval-iters global batches"
    )
    skip_train: bool = switch(
        "evaluate only: load --load, run one validation pass at its iteration (logged as "
        "Megatron-LM's pass after training), and exit without a step or a save"
    )
    device: Literal["auto", "cpu", "cuda"] = flag_help("auto, cpu or cuda", "auto", ours=True)
    precision: Optional[str] = flag_help(
        "parameter dtype: fp32, bf16 or fp16 (default: fp32, or what --bf16/--fp16 say)",
        None,
        ours=True,
    )
    bf16: bool = switch("Megatron-LM's --precision bf16")
    fp16: bool = switch("Megatron-LM's --precision fp16")
    exit_signal_handler: bool = flag_help(
        "on SIGUSR2, SIGTERM, Ctrl-C or --exit-signal save a checkpoint and exit 0", False
    )
    exit_signal_handler_for_training: bool = switch(
        "on SIGTERM or Ctrl-C stop at once, without saving, with one line and exit code 0 "
        "(without it: exit code 143 or 130)"
    )
    exit_signal: str = flag_help(
        "with --exit-signal-handler: one more signal that saves and exits, by name (SIGUSR1 for "
        "a Slurm --signal=USR1@N; SIGTERM, SIGUSR2 and SIGINT always do)",
        "SIGTERM",
    )
    trigger_path: Optional[str] = flag_help("directory watched for 'save' and 'exit' files", None)
    exit_interval: int = flag_help("save and stop after this many iterations (0: never)", 0)
    exit_duration_in_mins: Optional[float] = flag_help(
        "save and stop once the job has run this many minutes (checked after every step and "
        "validation batch, agreed on by all ranks)",
        None,
    )
    check_weight_hash_across_dp_replicas_interval: Optional[int] = flag_help(
        "every this many iterations (and once before the first step), hash every rank's "
        "weights and stop, naming the ranks, when data- and context-parallel replicas differ "
        "(silent data corruption); default: never",
        None,
    )
    iterations_to_skip: list[int] = flag_help(
        "iterations (1-based) not trained, e.g. around a loss spike: each one's global batch is "
        "read and counted as consumed, but no forward, backward or update runs and the "
        "learning-rate schedule does not advance (nor logging, validation, saving)",
        default_factory=list,
    )
    max_skipped_steps: int = flag_help(
        "stop after this many consecutive steps skipped for a non-finite loss or gradient "
        "norm; fp16 steps whose scaled gradients overflow the dynamic loss scale (finite "
        "loss, scale above --min-loss-scale) are skipped and counted on the iteration line but "
        "do not count",
        5,
        ours=True,
    )
    recompute_granularity: Optional[Literal["full", "selective"]] = flag_help(
        "activation recomputation: full or selective", None
    )
    recompute_activations: bool = switch(
        "selective recomputation: Megatron-LM's older spelling of --recompute-granularity "
        "selective"
    )
    recompute_method: Optional[Literal["uniform", "block"]] = flag_help(
        "full recomputation: uniform or block", None
    )
    recompute_num_layers: Optional[int] = flag_help(
        "layers per recomputed group (uniform) or count (block)", None
    )
    recompute_modules: Optional[list[str]] = flag_help(
        "selective recomputation: the parts of each layer recomputed in the backward pass, among "
        "core_attn (the attention's softmax and products; the default), mlp (the whole MLP) and "
        "layernorm (the two RMSNorms; needs Transformer Engine, whose layers fuse them into "
        "the next linear, where they are not recomputed)",
        None,
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
    empty_unused_memory_level: Literal[0, 1, 2] = flag_help(
        "return the CUDA caching allocator's unused blocks to the device (torch.cuda.empty_cache"
        "): 1 before each optimizer step and after each validation batch, 2 also after each "
        "optimizer step; less fragmentation, slower steps. GPU only: on a CPU there is no cache "
        "and it does nothing",
        0,
    )
    decrease_batch_size_if_needed: bool = switch(
        "a --global-batch-size that does not split into --micro-batch-size x data-parallel size "
        "runs as the largest multiple of that below it (megatron-core's calculator) instead of "
        "being refused"
    )
    calculate_per_token_loss: bool = switch(
        "divide the loss and its gradients by the loss tokens of the whole global batch (all "
        "micro-batches and data-parallel ranks) instead of averaging each micro-batch's mean "
        "over the micro-batches and data-parallel ranks; refused with --align-objective"
    )
    xielu_impl: Literal["auto", "cuda", "cpu", "torch"] = flag_help(
        "xIELU kernel: auto, cuda, cpu or torch", "auto", ours=True
    )
    fused_output_loss: bool = flag_help(
        "fuse the output layer and the loss (the [tokens, vocabulary] logits never exist); "
        "--align-objective runs it unfused",
        True,
        ours=True,
    )

    def __post_init__(self) -> None:
        self._resolve_precision()
        self._resolve_recompute_activations()
        self._check_recompute_modules()
        self._check_ranges()
        self._check_exit_signal()
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
        for iteration in self.iterations_to_skip:
            require(
                iteration >= 1, "--iterations-to-skip", iteration, ">= 1 (iterations count from 1)"
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
            ("--eval-micro-batch-size", self.eval_micro_batch_size),
            ("--eval-global-batch-size", self.eval_global_batch_size),
            (
                "--check-weight-hash-across-dp-replicas-interval",
                self.check_weight_hash_across_dp_replicas_interval,
            ),
        ):
            require(value is None or value >= 1, flag, value, ">= 1")
        for flag, value in (
            ("--train-iters", self.train_iters),
            ("--eval-interval", self.eval_interval),
            ("--start-eval-at-iter", self.start_eval_at_iter),
            ("--eval-iters", self.eval_iters),
            ("--exit-interval", self.exit_interval),
        ):
            require(value is None or value >= 0, flag, value, ">= 0")
        # numpy's generator, seeded with it as in Megatron-LM, takes 32 bits
        require(0 <= self.seed < 2**32, "--seed", self.seed, f"in [0, {2**32 - 1}]")

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

    def _check_exit_signal(self) -> None:
        """A signal a process can catch and that the system sends only on request: the fault
        signals (SIGSEGV, SIGBUS, ...) and SIGCHLD would fire for other reasons."""
        if self.exit_signal_handler and self.exit_signal_handler_for_training:
            raise ConfigError(
                "--exit-signal-handler and --exit-signal-handler-for-training exclude each other: "
                "one saves a checkpoint before it exits, the other stops at once"
            )
        if self.exit_signal not in EXIT_SIGNALS:
            raise ConfigError(
                f"--exit-signal {self.exit_signal}: choose one of {', '.join(EXIT_SIGNALS)}"
            )

    def _resolve_recompute_activations(self) -> None:
        """--recompute-activations sets the granularity to selective, as in Megatron-LM, which
        silently replaces a --recompute-granularity full given with it; here that is refused."""
        if not self.recompute_activations:
            return
        if self.recompute_granularity not in (None, "selective"):
            raise ConfigError(
                f"--recompute-activations (selective recomputation) contradicts "
                f"--recompute-granularity {self.recompute_granularity}"
            )
        object.__setattr__(self, "recompute_granularity", "selective")

    def total_samples(self) -> int:
        """Samples the run consumes (its training dataset's size)."""
        if self.train_samples is not None:
            return self.train_samples
        return self.train_iters * self.global_batch_size

    def dataset_sizes(self) -> tuple[int, int | None, int]:
        """Samples of the train/valid/test datasets: the run and every validation pass (None
        under --full-validation: one epoch of the validation data).

        The training dataset's sample order depends on its size, so everything that must see
        the student's order (teacher logits) builds its datasets from this.
        """
        if self.full_validation:
            return (self.total_samples(), None, 0)
        validations = (self.total_samples() // self.global_batch_size) // max(
            self.eval_interval, 1
        ) + 2
        valid_batch = self.eval_global_batch_size or self.global_batch_size
        return (self.total_samples(), validations * self.eval_iters * valid_batch, 0)

    def _check_recompute_modules(self) -> None:
        """megatron-core's module names, those of a dense model with standard attention only;
        they choose what selective recomputation recomputes, so they need it."""
        if self.recompute_modules is None:
            return
        if self.recompute_granularity != "selective":
            raise ConfigError(
                "--recompute-modules chooses what selective recomputation recomputes: give "
                "--recompute-granularity selective (or --recompute-activations)"
            )
        for name in self.recompute_modules:
            if name in RECOMPUTE_REFUSED:
                raise ConfigError(f"--recompute-modules {name}: {RECOMPUTE_REFUSED[name]}")
            if name not in RECOMPUTE_MODULES:
                raise ConfigError(
                    f"--recompute-modules {name}: choose among {', '.join(RECOMPUTE_MODULES)}"
                )
        if "layernorm" in self.recompute_modules and not importlib.util.find_spec(
            "transformer_engine"
        ):
            raise ConfigError(
                "--recompute-modules layernorm needs Transformer Engine, through which "
                "megatron-core's output-discarding checkpoint of the norms runs"
            )

    def recompute_overrides(self) -> dict:
        """TransformerConfig fields for activation recomputation (megatron-core's default
        modules, core attention, unless --recompute-modules)."""
        if self.recompute_granularity is None:
            return {}
        overrides = {
            "recompute_granularity": self.recompute_granularity,
            "recompute_method": self.recompute_method,
            "recompute_num_layers": self.recompute_num_layers,
        }
        if self.recompute_modules is not None:
            overrides["recompute_modules"] = list(self.recompute_modules)
        return overrides
