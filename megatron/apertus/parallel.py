"""Process-group setup: torch.distributed (NCCL on GPU, gloo on CPU) and megatron-core's groups.

The one module of ours that reads megatron-core's global parallel state: :func:`initialize`
creates the groups, :func:`process_groups` hands them out as megatron-core's own
``ProcessGroupCollection``, which the runtime passes down to the model and every component that
communicates (docs/megatron_core_changes.md, "Process groups", says what stays global and why).

Ranks come from the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) as set by torchrun or by our Slurm launchers; a bare single process gets
a world of one on a free local port.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
from datetime import timedelta
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel.utils import is_pp_last_stage
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron.apertus import cpu_compat
from megatron.apertus.errors import ConfigError
from megatron.apertus.model.builder import build_model
from megatron.apertus.model.config import ApertusConfig, ParallelConfig, validate_layout


def resolve_device(requested: str = "auto") -> str:
    """``cuda`` when asked for or available, else ``cpu``; fail clearly if CUDA is asked for but absent."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {requested!r}")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but torch sees no GPU")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
"""The variables of an ``env://`` rendezvous, as torchrun and the Slurm launchers set them."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_launch(layout: ParallelConfig, device: str) -> None:
    """Refuse ``--distributed-backend`` and ``--local-rank`` values this process cannot start
    with: NCCL without CUDA, gloo for a GPU run (megatron-core's gradient reduce-scatter has no
    gloo implementation for CUDA tensors), a local rank that contradicts the launcher's
    ``LOCAL_RANK``."""
    backend = layout.distributed_backend
    if backend == "nccl" and device != "cuda":
        raise ConfigError(
            "--distributed-backend nccl needs CUDA, and this run is on the CPU: give gloo, or "
            "drop the flag (the CPU's default is gloo)"
        )
    if backend == "gloo" and device == "cuda":
        raise ConfigError(
            "--distributed-backend gloo on a GPU is not implemented: megatron-core's collectives "
            "on CUDA tensors (the gradient reduce-scatter) need nccl; give nccl or --device cpu"
        )
    launched = os.environ.get("LOCAL_RANK")
    if layout.local_rank is not None and launched not in (None, str(layout.local_rank)):
        raise ConfigError(
            f"--local-rank {layout.local_rank} contradicts the launcher's LOCAL_RANK={launched}"
        )


def local_rank(layout: ParallelConfig) -> int:
    """This process's rank on its node: ``--local-rank``, else the launcher's ``LOCAL_RANK``,
    else 0."""
    if layout.local_rank is not None:
        return layout.local_rank
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_distributed(
    device: str, timeout_minutes: int | None = None, *, local_rank: int = 0
) -> None:
    """Start torch.distributed from the environment, or as a world of one when none is set:
    NCCL on CUDA device ``local_rank``, gloo on the CPU (:func:`check_launch` refused any other
    ``--distributed-backend``).

    A world of one gets its own free port and leaves ``os.environ`` alone, so subprocesses
    started later (tests, tools) do not inherit a rendezvous that is not theirs.
    ``timeout_minutes`` bounds every collective of the default group (None: torch's default).
    """
    if dist.is_initialized():
        return
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    backend = "nccl" if device == "cuda" else "gloo"
    timeout = {} if timeout_minutes is None else {"timeout": timedelta(minutes=timeout_minutes)}
    if "WORLD_SIZE" in os.environ:
        _join_environment_rendezvous(backend, timeout)
    else:
        address = f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(
            backend=backend, init_method=address, rank=0, world_size=1, **timeout
        )


def _join_environment_rendezvous(backend: str, timeout: dict) -> None:
    """``init_process_group`` from torchrun's or a launcher's environment (``env://``). A
    rendezvous that cannot start is the user's to fix, and a traceback from inside torch names
    neither the variables nor the remedy: rank 0 finds ``MASTER_PORT`` taken (another job on
    the node), or a variable is not set."""
    where = " ".join(f"{name}={os.environ.get(name, '(unset)')}" for name in RENDEZVOUS)
    try:
        dist.init_process_group(backend=backend, **timeout)
    except dist.DistNetworkError as err:
        reason = str(err).rsplit("message: ", 1)[-1].splitlines()[0]
        raise ConfigError(
            f"{where}: the rendezvous cannot start ({reason}); another job on this node may "
            "hold the port: choose a free MASTER_PORT"
        ) from None
    except ValueError as err:  # torch's env:// handler: a variable it needs is not set
        raise ConfigError(f"{where}: {err}") from None


@contextlib.contextmanager
def single_process_model(
    model: ApertusConfig, *, job: str, device: str = "cpu", quant=None
) -> Iterator[torch.nn.Module]:
    """A fp32 TP=1/PP=1 model of ``model`` in this one process on ``device`` (fake-quantizing
    as ``quant`` says), its process groups torn down on exit. Its random init is skipped: every
    weight is to be replaced (loaded from a checkpoint or copied in). ``job`` names the work in
    the refusal under torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ConfigError(f"{job} runs in one process; do not start it with torchrun")
    layout = ParallelConfig()
    initialize(layout, device=device, seed=0, model=model)
    try:
        (chunk,) = build_model(
            model,
            layout,
            quant=quant,
            use_cpu_initialization=device == "cpu",
            perform_initialization=False,
        )
        yield chunk
    finally:
        shutdown()


def update_timeout(seconds: float) -> None:
    """Every process group's timeout from now on (Megatron-LM's
    --distributed-timeout-seconds-after-init), through megatron-core's update (a barrier
    first)."""
    parallel_state.update_pg_timeout(timedelta(seconds=seconds))


def set_seed(seed: int, *, te_rng_tracker: bool = False) -> None:
    """Seed Python, NumPy, torch and megatron-core's model-parallel RNG tracker.

    ``te_rng_tracker``: the tracker is Transformer Engine's, the graph-safe one megatron-core's
    CUDA graphs require (made anew: megatron-core keeps the first tracker of a process)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, te_rng_tracker=te_rng_tracker, force_reset_rng=te_rng_tracker
    )


def initialize(
    parallel: ParallelConfig,
    *,
    device: str,
    seed: int,
    model=None,
    te_rng_tracker: bool = False,
    data_parallel_random_init: bool = False,
) -> int:
    """Set up everything a training or conversion process needs; returns the data-parallel size
    (context-parallel ranks share their data and are not counted in it).
    ``te_rng_tracker``: see :func:`set_seed` (CUDA graphs). ``data_parallel_random_init``: each
    data-parallel rank seeds with ``seed`` + 10 x its rank (Megatron-LM's offset; the caller
    copies data-parallel rank 0's weights to the others once the model is built).

    ``model`` (an :class:`ApertusConfig`) is checked against the layout before any group exists.
    """
    if device == "cpu":
        cpu_compat.enable()
    timeout = parallel.distributed_timeout_minutes
    check_launch(parallel, device)
    init_distributed(device, timeout, local_rank=local_rank(parallel))
    if model is not None:
        validate_layout(model, parallel, dist.get_world_size())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        hierarchical_context_parallel_sizes=parallel.hierarchical_context_parallel_sizes,
        **({} if timeout is None else {"distributed_timeout_minutes": timeout}),
    )
    if data_parallel_random_init:
        seed += 10 * parallel_state.get_data_parallel_rank()
    set_seed(seed, te_rng_tracker=te_rng_tracker)
    return parallel_state.get_data_parallel_world_size()


def process_groups() -> ProcessGroupCollection:
    """This process's megatron-core groups (after :func:`initialize`), all of them in one
    collection: the same groups megatron-core's modules take when given none."""
    return ProcessGroupCollection.use_mpu_process_groups()


def is_reporting_rank(groups: ProcessGroupCollection) -> bool:
    """The one rank that holds the loss and writes reports: last stage, first TP, CP and DP
    rank."""
    return (
        is_pp_last_stage(groups.pp)
        and groups.tp.rank() == 0
        and groups.dp.rank() == 0
        and groups.cp.rank() == 0
    )


def shutdown() -> None:
    """Destroy megatron-core's groups and the default process group."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
