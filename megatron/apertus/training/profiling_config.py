"""Profiling flags (``--help``'s "profiling" group), Megatron-LM's names, defaults and meaning:
``--profile`` over a window of iterations on some ranks, with the PyTorch profiler or the CUDA
profiler API (for Nsight Systems), and the CUDA allocator's memory history.

Steps are the run's iteration numbers, as Megatron-LM's help says ("global step"); the two
profilers keep Megatron-LM's windows, which differ by one: the PyTorch profiler records
iterations START to END-1 after one warm-up iteration, the CUDA capture range holds iterations
START+1 to END (it opens once iteration START is done and closes once END is). Both need only
the flags: what cannot work on this machine is refused when they are read
(:meth:`ProfilingConfig.check`), not when the window comes.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.apertus.cli import check_output
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help, switch

NSYS = "nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop"
"""The Nsight Systems command whose capture range the CUDA profiler API opens and closes."""


@dataclass(kw_only=True, frozen=True)
class ProfilingConfig:
    profile: bool = switch(
        "profile iterations --profile-step-start to --profile-step-end on the ranks of "
        "--profile-ranks: with --use-pytorch-profiler a PyTorch profiler trace in "
        f"--tensorboard-dir, else through the CUDA profiler API for `{NSYS}` (GPU only)"
    )
    use_pytorch_profiler: bool = switch(
        "with --profile: torch.profiler over iterations START to "
        "END-1 after one warm-up iteration; its trace (*.pt.trace.json, Chrome format, with "
        "ProfilerStep#N markers counting this job's steps) goes to --tensorboard-dir, which it "
        "needs"
    )
    pytorch_profiler_collect_shapes: bool = switch(
        "the PyTorch profiler records each operator's input shapes (the trace's 'Input Dims')"
    )
    pytorch_profiler_collect_callstack: bool = switch(
        "the PyTorch profiler records the Python call stack of each operator"
    )
    pytorch_profiler_collect_chakra: bool = switch(
        "also record an execution trace for Chakra (torch's ExecutionTraceObserver) to "
        "TENSORBOARD_DIR/../chakra/rank-R.json.gz"
    )
    record_shapes: bool = switch(
        "without --use-pytorch-profiler: the NVTX ranges of every operator (emit_nvtx) carry "
        "their input shapes"
    )
    nvtx_ranges: bool = switch(
        "from --profile-step-start on, megatron-core's own NVTX ranges (its nvtx_range_push/pop "
        "markers) are emitted for Nsight Systems; GPU only"
    )
    profile_step_start: int = flag_help(
        "iteration at which --profile starts (the CUDA capture range opens after it)", 10
    )
    profile_step_end: int = flag_help(
        "iteration at which --profile stops; greater than --profile-step-start", 12
    )
    profile_ranks: list[int] = flag_help(
        "global ranks that --profile profiles", default_factory=lambda: [0]
    )
    record_memory_history: bool = switch(
        "record the CUDA caching allocator's allocations and frees (the last 100,000, with "
        "Python stacks) from before the model is built; the last rank writes the snapshot to "
        "--memory-snapshot-path every --log-interval, a rank that runs out of memory writes "
        "oom_rank-R_NAME beside it; GPU only (view at pytorch.org/memory_viz)"
    )
    memory_snapshot_path: str = flag_help(
        "the pickle --record-memory-history writes its snapshot to", "snapshot.pickle"
    )

    def __post_init__(self) -> None:
        if self.profile_step_start < 0:
            raise ConfigError(f"--profile-step-start must be >= 0, got {self.profile_step_start}")
        if self.profile_step_end <= self.profile_step_start:
            raise ConfigError(
                f"--profile-step-end ({self.profile_step_end}) must be greater than "
                f"--profile-step-start ({self.profile_step_start})"
            )
        if any(rank < 0 for rank in self.profile_ranks):
            raise ConfigError(f"--profile-ranks must be >= 0, got {self.profile_ranks}")
        if self.record_memory_history:
            check_output("--memory-snapshot-path", self.memory_snapshot_path, directory=False)

    def check(self, *, device: str, tensorboard_dir: str | None) -> None:
        """What this machine and the other groups' flags cannot honour, one line each."""
        if self.profile and self.use_pytorch_profiler and not tensorboard_dir:
            raise ConfigError(
                "--use-pytorch-profiler writes its trace to --tensorboard-dir: give one"
            )
        if device == "cuda":
            return
        if self.profile and not self.use_pytorch_profiler:
            raise ConfigError(
                "--profile without --use-pytorch-profiler uses the CUDA profiler API (for nsys), "
                "which needs a GPU; add --use-pytorch-profiler (and --tensorboard-dir) on a CPU"
            )
        if self.record_memory_history:
            raise ConfigError(
                "--record-memory-history records the CUDA caching allocator, which needs a GPU"
            )
        if self.nvtx_ranges:
            raise ConfigError(
                "--nvtx-ranges emits NVTX ranges for Nsight Systems, which profiles a GPU; a "
                "CPU build of torch has no NVTX"
            )

    def profiles(self, rank: int) -> bool:
        """Whether global rank ``rank`` runs a profiler."""
        return self.profile and rank in self.profile_ranks
