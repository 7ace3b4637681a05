"""The profilers of ``--profile`` and ``--record-memory-history``
(:mod:`~megatron.apertus.training.profiling_config`), as Megatron-LM runs them.

:class:`StepProfiler` is told when each step begins and ends, with the iterations done so far.
With ``--use-pytorch-profiler`` it is a ``torch.profiler.profile`` started before the first step
and stepped before each one; its schedule waits, warms up for one iteration and records
iterations START to END-1, and ``tensorboard_trace_handler`` writes the trace to
``--tensorboard-dir`` once the window is over (or when the run ends inside it). The schedule is
shifted by the iteration the job starts at, so a resumed run profiles the same iterations; the
profiler's own ProfilerStep#N markers count this job's steps. Without it, the CUDA profiler API
opens the capture range once iteration START is done (with NVTX ranges for every operator) and
closes it once END is. Ranks outside ``--profile-ranks`` do nothing.

The memory history starts where the model is built (:func:`start_memory_history`, as
Megatron-LM's model provider does), so the weights' allocations are in it; the last rank writes
the snapshot every ``--log-interval``.
"""

from __future__ import annotations

import logging
import os

import torch
from megatron.core.utils import configure_nvtx_profiling

from megatron.apertus.cli import atomic_outputs
from megatron.apertus.training.profiling_config import ProfilingConfig

log = logging.getLogger("apertus")

MEMORY_EVENTS = 100_000
"""Allocations and frees the memory history keeps (Megatron-LM's number)."""


def start_memory_history(config: ProfilingConfig) -> None:
    """Record the CUDA allocator from now on, and dump its snapshot when this rank runs out of
    memory (``oom_rank-R_NAME`` beside ``--memory-snapshot-path``)."""
    if not config.record_memory_history:
        return
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS, stacks="python")
    head, name = os.path.split(config.memory_snapshot_path)
    oom_path = os.path.join(head, f"oom_rank-{torch.distributed.get_rank()}_{name}")

    def dump_on_oom(device, alloc, device_alloc, device_free) -> None:
        torch.cuda.memory._dump_snapshot(oom_path)

    torch._C._cuda_attach_out_of_memory_observer(dump_on_oom)


def _window_passed(config: ProfilingConfig, first_iteration: int) -> bool:
    """Whether a job that starts after ``first_iteration`` comes after the whole window."""
    if config.use_pytorch_profiler:
        return first_iteration >= config.profile_step_end - 1
    return first_iteration > config.profile_step_start


def _torch_profiler(
    config: ProfilingConfig, tensorboard_dir: str, first_iteration: int
) -> torch.profiler.profile:
    """Megatron-LM's profiler: its schedule in iterations, step ``n`` of this job being
    iteration ``first_iteration + n``."""
    start, end = config.profile_step_start, config.profile_step_end
    window = torch.profiler.schedule(
        wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start, repeat=1
    )
    return torch.profiler.profile(
        schedule=lambda step: window(first_iteration + step),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(tensorboard_dir),
        record_shapes=config.pytorch_profiler_collect_shapes,
        with_stack=config.pytorch_profiler_collect_callstack,
        execution_trace_observer=_chakra_observer(config, tensorboard_dir),
    )


def _chakra_observer(config: ProfilingConfig, tensorboard_dir: str):
    """--pytorch-profiler-collect-chakra: torch's execution-trace observer writing where
    Megatron-LM's does, TENSORBOARD_DIR/../chakra/rank-R.json.gz; else None."""
    if not config.pytorch_profiler_collect_chakra:
        return None
    folder = os.path.join(tensorboard_dir, "..", "chakra")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank-{torch.distributed.get_rank()}.json.gz")
    return torch.profiler.ExecutionTraceObserver().register_callback(path)


class StepProfiler:
    """This rank's profilers, driven by the loop: :meth:`before_step`, :meth:`after_step`,
    :meth:`close`."""

    def __init__(
        self,
        config: ProfilingConfig,
        *,
        tensorboard_dir: str | None,
        log_interval: int,
        first_iteration: int,
    ) -> None:
        self.config = config
        self.log_interval = log_interval
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.snapshots = config.record_memory_history and rank == world - 1
        self.active = config.profiles(rank)
        if self.active and _window_passed(config, first_iteration):
            log.info(
                f"--profile: this job starts after iteration {first_iteration}, past the "
                f"profiled iterations ({config.profile_step_start} to {config.profile_step_end}); "
                "nothing is profiled"
            )
            self.active = False
        self.torch_profiler = None
        self.nvtx = None
        if self.active and config.use_pytorch_profiler:
            self.torch_profiler = _torch_profiler(config, tensorboard_dir, first_iteration)
            self.torch_profiler.start()

    def before_step(self, iteration: int) -> None:
        """A step is about to follow iteration ``iteration``."""
        if self.active and iteration == self.config.profile_step_start and self.config.nvtx_ranges:
            configure_nvtx_profiling(True)
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif self.active and iteration == self.config.profile_step_start:
            torch.cuda.cudart().cudaProfilerStart()
            self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=self.config.record_shapes)
            self.nvtx.__enter__()

    def after_step(self, iteration: int) -> None:
        """Iteration ``iteration`` is done."""
        if self.active and iteration == self.config.profile_step_end:
            self.close()
        if self.snapshots and iteration % self.log_interval == 0:
            with atomic_outputs(self.config.memory_snapshot_path) as (temporary,):
                torch.cuda.memory._dump_snapshot(temporary)

    def close(self) -> None:
        """Stop profiling (a PyTorch profiler inside its window writes what it recorded)."""
        self.active = False
        if self.config.nvtx_ranges:
            configure_nvtx_profiling(False)
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        if self.nvtx is not None:
            torch.cuda.cudart().cudaProfilerStop()
            self.nvtx.__exit__(None, None, None)
            self.nvtx = None
