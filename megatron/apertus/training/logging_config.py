"""Monitoring flags (``--help``'s "logging" group): TensorBoard, wandb, the JSON-lines history,
the loss plot and the optional diagnostics. Outputs and the wandb package are checked when the
flags are read, not when the run first writes."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

from megatron.apertus.cli import check_output
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help, require, switch


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    tensorboard_dir: Optional[str] = flag_help("write TensorBoard scalars here", None)
    tensorboard_log_interval: int = flag_help(
        "write the training scalars to TensorBoard and wandb at the iterations that are "
        "multiples of this (validation scalars at every validation; --log-json keeps every "
        "iteration)",
        1,
    )
    tensorboard_queue_size: int = flag_help(
        "events TensorBoard's writer holds before an add writes them to disk (its max_queue; "
        "every iteration line also writes them)",
        1000,
    )
    log_validation_ppl_to_tensorboard: bool = switch(
        "also write the validation perplexity, exp(validation loss), as '<loss> validation ppl' "
        "(and its 'vs samples' twin)"
    )
    wandb_project: Optional[str] = flag_help(
        "log to this wandb project (WANDB_MODE=offline works)", None
    )
    wandb_exp_name: Optional[str] = flag_help("wandb run name", None)
    wandb_entity: Optional[str] = flag_help(
        "with --wandb-project: the wandb entity (user or team) the run is logged under "
        "(default: wandb's own, the login's)",
        None,
    )
    wandb_save_dir: Optional[str] = flag_help(
        "with --wandb-project: wandb's local folder (default: SAVE/wandb, else wandb's ./wandb)",
        None,
    )
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
    log_num_zeros_in_grad: bool = switch(
        "count the zero entries of the gradients the optimizer steps with (all ranks' shards, "
        "after clipping) and log them as 'num zeros' and TensorBoard's num-zeros; an extra pass "
        "over the gradients each step"
    )
    log_max_attention_logit: bool = switch(
        "write the step's largest pre-softmax attention logit (q.k/sqrt(d) over the attended "
        "keys, every layer and head; QK-clip's statistic) as TensorBoard's and wandb's "
        "max_attention_logit; our SDPA attention computes it (an extra QK^T per layer), "
        "Transformer Engine's needs TE >= 2.9; not with context parallelism on SDPA"
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
    log_memory_interval: Optional[int] = flag_help(
        "every this many iterations (a multiple of --log-interval) each rank of the first "
        "data-parallel replica prints Megatron-LM's memory line: on a GPU the allocator's "
        "allocated, max allocated, reserved and max reserved MB, on a CPU the process's "
        "resident and peak resident MB",
        None,
    )
    log_device_memory_used: bool = switch(
        "end the --log-memory-interval line with the memory used on the whole device by every "
        "process, as nvidia-smi reports it (on a CPU: the host's used memory)"
    )
    log_world_size_to_tensorboard: bool = switch(
        "write the number of processes as TensorBoard's and wandb's world-size (and its 'vs "
        "samples' twin) with the other training scalars"
    )
    logging_level: Optional[int] = flag_help(
        "level of Python's root logger (10 DEBUG, 20 INFO, 30 WARNING, ...; default INFO): "
        "the console and SAVE/debug.log keep records at or above it. Our lines, the iteration "
        "line among them, are INFO records, so a level above 20 hides them too (Megatron-LM "
        "prints its iteration line outside logging); MEGATRON_LOGGING_LEVEL is not read",
        None,
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
        for flag, value, least in (
            ("--tensorboard-log-interval", self.tensorboard_log_interval, 1),
            ("--tensorboard-queue-size", self.tensorboard_queue_size, 1),
            ("--log-memory-interval", self.log_memory_interval, 1),
            ("--logging-level", self.logging_level, 0),
        ):
            if value is not None:
                require(value >= least, flag, value, f">= {least}")
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

    def check_device_memory(self, device: str) -> None:
        """torch reads a GPU's used memory through NVML (the pynvml package)."""
        if (
            self.log_device_memory_used
            and device == "cuda"
            and not importlib.util.find_spec("pynvml")
        ):
            raise ConfigError(
                "--log-device-memory-used reads the GPU's used memory through NVML: "
                "pip install nvidia-ml-py"
            )

    def check_max_attention_logit(self, *, te_attention: bool, context_parallel: bool) -> None:
        """Where the attention can give its largest logit: our SDPA attention outside context
        parallelism, Transformer Engine's from 2.9 on (its kernels return it)."""
        if not self.log_max_attention_logit:
            return
        if te_attention:
            from importlib.metadata import PackageNotFoundError, version

            try:
                te = version("transformer_engine")
            except PackageNotFoundError:
                te = "0"
            if tuple(int(p) for p in te.split(".")[:2] if p.isdigit()) < (2, 9):
                raise ConfigError(
                    "--log-max-attention-logit with Transformer Engine's attention needs TE >= "
                    f"2.9 (its kernels return the logits' maximum), found {te}; or give "
                    "--attention-backend local"
                )
        elif context_parallel:
            raise ConfigError(
                "--log-max-attention-logit: the context-parallel SDPA attention does not compute "
                "the logits' maximum"
            )

    def check_memory_interval(self, log_interval: int) -> None:
        """The memory line comes with an iteration line, as in Megatron-LM."""
        interval = self.log_memory_interval
        if interval is not None and interval % log_interval:
            raise ConfigError(
                f"--log-memory-interval must be a multiple of --log-interval ({log_interval}), "
                f"got {interval}"
            )

    def _check_outputs(self) -> None:
        """Outputs refused when the flags are read, not when the run first writes them after
        building the model (or after its first log interval)."""
        for flag, path in (("--log-json", self.log_json), ("--loss-plot", self.loss_plot)):
            if path:
                check_output(flag, path, directory=False)
        if self.tensorboard_dir:
            check_output("--tensorboard-dir", self.tensorboard_dir, directory=True)
