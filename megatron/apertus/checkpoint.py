"""Checkpoints in megatron-core's ``torch_dist`` format, loadable into any TP/PP layout.

Layout of a save directory::

    SAVE/latest_checkpointed_iteration.txt   iteration of the newest *complete* checkpoint
    SAVE/iter_0000100/                        dist_checkpointing files
    SAVE/iter_0000100/apertus_model.json      ApertusConfig of the model (JSON, no pickle)
    SAVE/iter_0000100/apertus_run.json        the run's record (training saves; see RUN_INFO)
    SAVE/iter_0000100/metrics.json            the run's history up to it (training saves)

What a training checkpoint holds: the model, the optimizer (its states sharded as the model is;
with the distributed optimizer in megatron-core's ``fully_reshardable`` form, so TP/PP/DP may
change on load), the scheduler, every rank's RNG states, the iteration and the consumed samples.

Implementations: checkpoints of the local and the Transformer Engine layers carry the same
weight keys. TE adds ``_extra_state`` entries (its FP8 scales and amax history); a load restores
them when the checkpoint has them and otherwise leaves TE's fresh state, so either kind of
checkpoint loads into either implementation. Any other missing weight is an error.

Atomicity: a checkpoint is written under ``iter_XXXXXXX.tmp`` and renamed when every rank has
finished; the tracker is replaced atomically afterwards. A directory left half-written (a job
killed during save) keeps its ``.tmp`` name: it is never loaded and is removed by the next save.

Damage: the save records every file with its size in ``apertus_manifest.json`` when the
checkpoint is complete, and a load checks them before megatron-core reads anything, so a shard
cut short (a copy stopped half-way) is refused naming the file instead of failing as a
mismatch of another kind. Checkpoints without a manifest load unchecked.

Refusals: a load compares every weight's global shape with the checkpoint's metadata before
megatron-core reads anything, so a checkpoint of another architecture is refused in one line
(:class:`CheckpointMismatch`) naming the first differing tensor, both shapes and the differing
fields of ``apertus_model.json``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing
import os
import queue
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    is_main_replica,
)
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import Float16Module
from torch.distributed.checkpoint import CheckpointException

from megatron.apertus.checkpoint_files import (
    MANIFEST,
    MODEL_CONFIG,
    RUN_INFO,
    TRACKER,
    iteration_dir,
    latest_iteration,
    manifest_problem,
    saved_iterations,
    write_manifest,
)
from megatron.apertus.cli import atomic_outputs, die_with_parent, end_with_parent
from megatron.apertus.errors import ConfigError
from megatron.apertus.mcore_compat import (
    async_save_arguments,
    check_checkpoint_readable,
    checkpoint_writer_errors,
)
from megatron.apertus.model.builder import chunk_groups
from megatron.apertus.model.config import ApertusConfig

SHARDING_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


@dataclass
class TrainingState:
    """Where a run stands, saved with (and restored from) every checkpoint."""

    iteration: int = 0
    consumed_samples: int = 0
    extra: dict = field(default_factory=dict)
    """State of the loop's own watchers (plain numbers, strings, lists, dicts), kept so that a
    resumed run goes on where it stopped; saved by rank 0."""


def _atomic_write(path: Path, text: str) -> None:
    with atomic_outputs(path) as (temporary,):
        Path(temporary).write_text(text)


def write_tracker(save_dir: str | os.PathLike, iteration: int) -> None:
    """Name ``iteration`` the save directory's latest checkpoint (atomically; rank 0)."""
    _atomic_write(Path(save_dir) / TRACKER, f"{iteration}\n")


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """The checkpoint at ``path`` (a save directory: follow its tracker; or an ``iter_*``
    directory itself), or None when it holds none: missing, empty, or only a save cut short
    before the tracker was first written. A tracker naming no complete checkpoint is an error:
    that directory was damaged after a save, and starting over would hide it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointMismatch(f"{path} is a file, not a checkpoint directory")
    try:
        iteration = latest_iteration(path)
    except ValueError as err:
        raise CheckpointMismatch(str(err)) from None
    resolved = path if iteration is None else iteration_dir(path, iteration)
    if (resolved / MODEL_CONFIG).is_file():
        return resolved
    if iteration is None:
        return None
    raise CheckpointMismatch(
        f"{path / TRACKER} names iteration {iteration}, but {resolved} is not a complete "
        f"Apertus checkpoint (no {MODEL_CONFIG})"
    )


def checkpoint_at(path: str | os.PathLike, iteration: int, source: str) -> Path:
    """The checkpoint of ``iteration`` in save directory ``path``, whichever its tracker names
    (Megatron-LM's --ckpt-step); refused in one line that ``source`` begins, listing the
    iterations ``path`` holds."""
    path = Path(path)
    found = iteration_dir(path, iteration)
    if (found / MODEL_CONFIG).is_file():
        return found
    if (path / MODEL_CONFIG).is_file():
        raise CheckpointMismatch(
            f"{source}: {path} is one checkpoint, not a save directory to pick an iteration "
            "from: give --load the save directory"
        )
    held = ", ".join(str(it) for it in saved_iterations(path))
    raise CheckpointMismatch(
        f"{source}: {path} holds no checkpoint of iteration {iteration}; "
        + (f"it holds iterations {held}" if held else "it holds none")
    )


def check_files(directory: Path, source: str) -> None:
    """Refuse a checkpoint with a file cut short, lost or changed since its save, naming it."""
    problem = manifest_problem(directory, source)
    if problem is not None:
        raise CheckpointMismatch(problem)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """Like :func:`find_checkpoint`, for callers that need a checkpoint there."""
    resolved = find_checkpoint(path)
    if resolved is None:
        raise CheckpointMismatch(
            f"{path} holds no Apertus checkpoint (no {TRACKER}, no {MODEL_CONFIG})"
        )
    return resolved


def check_save_dir(save_dir: str | os.PathLike, flag: str = "--save") -> None:
    """Create ``save_dir`` (given as ``flag``) and write a file there, so that a directory this
    rank cannot write fails at start-up rather than at the first save, with the steps before it
    lost."""
    path = Path(save_dir)
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker == path:
        raise ConfigError(f"{flag} {path} is a file, not a directory")
    if blocker is not None:
        raise ConfigError(f"{flag} {path}: {blocker} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ConfigError(f"{flag} {path}: cannot write there ({err.strerror})") from None


def load_model_config(path: str | os.PathLike) -> ApertusConfig:
    return ApertusConfig.from_dict(
        json.loads((resolve_checkpoint(path) / MODEL_CONFIG).read_text())
    )


# -- state dicts -------------------------------------------------------------------------------


def _model_state(chunks) -> dict:
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict(metadata=SHARDING_METADATA)}
    return {
        f"model{i}": c.sharded_state_dict(metadata=SHARDING_METADATA) for i, c in enumerate(chunks)
    }


def _layout_groups(groups: ProcessGroupCollection) -> list:
    """The PP, TP, DP (and CP when above 1) groups: RNG states have one owner per rank of
    these."""
    return [groups.pp, groups.tp, groups.dp] + ([groups.cp] if groups.cp.size() > 1 else [])


def _layout(groups: ProcessGroupCollection) -> list[int]:
    """The sizes of :func:`_layout_groups`."""
    return [group.size() for group in _layout_groups(groups)]


def _layout_ranks(groups: ProcessGroupCollection) -> tuple[int, ...]:
    """This rank's place in :func:`_layout`."""
    return tuple(group.rank() for group in _layout_groups(groups))


def _rng_state(groups: ProcessGroupCollection) -> ShardedObject:
    """This rank's Python, NumPy, torch and model-parallel RNG states, one entry per rank."""
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject(
        "rng_state", state, tuple(_layout(groups)), _layout_ranks(groups), replica_id=0
    )


def _restore_rng(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _training_state_dict(
    chunks, optimizer, scheduler, state: TrainingState, *, rng: bool, loading: bool = False
) -> dict:
    groups = chunk_groups(chunks[0])
    sharded = _model_state(chunks)
    if optimizer is not None:
        # All chunks' tensors, nested by chunk: megatron-core finds each optimizer parameter's
        # tensor among them by identity. (Merged into one dict, the chunks of virtual stages
        # would overwrite each other's entries, whose local names are alike.) is_loading makes
        # megatron-core create the (still empty) optimizer states to load into.
        sharded["optimizer"] = optimizer.sharded_state_dict(
            dict(sharded), is_loading=loading, metadata=SHARDING_METADATA
        )
    if scheduler is not None:
        sharded["scheduler"] = scheduler.state_dict()
    if rng:
        sharded["rng_state"] = _rng_state(groups)
    sharded["training_state"] = {
        "iteration": state.iteration,
        "consumed_samples": state.consumed_samples,
        "layout": _layout(groups),  # RNG states are restored only into the layout that saved them
        "rng": rng,
        "extra": state.extra,
    }
    return sharded


# -- save / load -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveOptions:
    """How a save is written (Megatron-LM's --async-save, --ckpt-fully-parallel-save,
    --ckpt-assume-constant-structure); what is saved does not change."""

    async_queue: AsyncCallsQueue | None = None
    """Write in a background process; the checkpoint is published (renamed, tracker advanced)
    when the queue finalizes the write on every rank."""
    fully_parallel: bool = False
    """Data-parallel replicas share the writing of replicated tensors instead of rank 0's
    replica writing them all."""
    cache_distribution: bool = False
    """Keep the fully parallel save's distribution of tensors between saves."""
    unpublished: dict[int, tuple[Path, str]] = field(default_factory=dict)
    """Background saves not published yet, by the queue's call index: the directory being
    written and the line to end with if its write runs out of disk."""


_background_results_queue = None
"""The queue through which background writes report (see :func:`_use_write_results_queue`)."""


def _use_write_results_queue(background: bool) -> None:
    """The queue through which megatron-core's torch_dist writer reports what it wrote.

    A synchronous save writes from this process and reads the report here, so an in-process
    queue serves it. megatron-core would start a multiprocessing manager (a fresh interpreter,
    which imports torch to unpickle the report: 3-4 s at the first save of every run) for it.
    Background writes report from another process and need that manager; it is started here,
    set to end with this process: megatron-core's own would be left waiting for ever after a
    trainer killed by SIGKILL (a job's time limit, the OOM killer). Each write keeps the queue
    it was prepared with, so a change between saves reaches no write in flight."""
    global _background_results_queue
    if not background:
        filesystem_async._results_queue = queue.Queue()
        return
    if _background_results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=end_with_parent, initargs=(os.getpid(),))
        _background_results_queue = manager.Queue()
    filesystem_async._results_queue = _background_results_queue


def _save_strategy(options: SaveOptions, groups: ProcessGroupCollection):
    """megatron-core's default writer, shared out over the data-parallel replicas if asked."""
    strategy = get_default_save_sharded_strategy("torch_dist")
    if options.fully_parallel and groups.dp.size() > 1:
        strategy = FullyParallelSaveStrategyWrapper(
            strategy,
            groups.dp_cp,
            do_cache_distribution=options.cache_distribution,
        )
    return strategy


def save(
    save_dir: str | os.PathLike,
    chunks,
    model: ApertusConfig,
    state: TrainingState,
    *,
    optimizer=None,
    scheduler=None,
    rng: bool = False,
    run_info: dict | None = None,
    options: SaveOptions = SaveOptions(),
    add_files: Callable[[Path], None] | None = None,
    on_published: Callable[[Path], None] | None = None,
) -> Path:
    """Save a complete checkpoint (a collective: every rank calls it) and advance the tracker.

    ``optimizer`` and ``scheduler`` are saved when given, every rank's RNG states with ``rng``.
    ``run_info`` (JSON-serialisable) is recorded as ``apertus_run.json``: exports read the
    tokenizer and the training data from it. ``add_files(directory)`` runs on every rank once
    its part is written (or handed to the background), to write files of its own into the
    unpublished directory: they are published with the checkpoint, never without it. With
    ``options.async_queue`` the write happens in the background and the checkpoint counts only
    once published; ``on_published(path)`` runs on every rank then (at once for a synchronous
    save)."""
    if options.async_queue is not None:
        # The previous save is published before this one clears unpublished directories.
        finalize_background_saves(options, blocking=True)
    final = iteration_dir(save_dir, state.iteration)
    tmp = final.with_name(final.name + ".tmp")
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        for stale in Path(save_dir).glob("iter_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    sharded = _training_state_dict(chunks, optimizer, scheduler, state, rng=rng)
    needed = _saved_bytes(sharded)
    if _on_any_rank(_free_bytes(save_dir) < needed):
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(_no_room_line(save_dir, final, needed))
    _use_write_results_queue(background=options.async_queue is not None)
    try:
        with checkpoint_writer_errors() as logged:
            request = dist_checkpointing.save(
                sharded,
                str(tmp),
                _save_strategy(options, chunk_groups(chunks[0])),
                async_sharded_save=options.async_queue is not None,
                **(async_save_arguments() if options.async_queue is not None else {}),
            )
        if rank0:
            (tmp / MODEL_CONFIG).write_text(model.to_json())
            if run_info is not None:
                (tmp / RUN_INFO).write_text(json.dumps(run_info, indent=2) + "\n")
        if add_files is not None:
            add_files(tmp)
    except (Exception, CheckpointException) as err:  # torch's is a BaseException
        # Measured before anything is removed: torch's zip writer reports a short write as
        # "unexpected pos", without the errno.
        full = _out_of_space(err) or _names_no_space(logged) or _free_bytes(save_dir) < needed
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise CheckpointWriteError(_out_of_space_line(save_dir, final, sharded)) from None
        raise
    publish = partial(_publish, Path(save_dir), tmp, final, state.iteration, on_published)
    if request is None:
        publish()
    else:
        request.add_finalize_fn(publish)
        if request.async_fn is not None:
            writer = partial(_write_ending_with_this_rank, request.async_fn)
            request = request._replace(async_fn=writer)
        call = options.async_queue.schedule_async_request(request)
        options.unpublished[call] = (tmp, _out_of_space_line(save_dir, final, sharded))
    return final


def finalize_background_saves(options: SaveOptions, blocking: bool) -> None:
    """Publish the background saves that every rank has written (a collective; ``blocking``:
    wait for all of them). A write that ran out of disk ends in :class:`CheckpointWriteError`
    naming the directory and the space it needed, its partial directory removed, as a
    synchronous save does."""
    try:
        published = options.async_queue.maybe_finalize_async_calls(blocking=blocking)
    except (Exception, CheckpointException) as err:  # torch's is a BaseException
        if not _out_of_space(err) or not options.unpublished:
            raise
        _, line = options.unpublished[min(options.unpublished)]
        if dist.get_rank() == 0:
            for tmp, _ in options.unpublished.values():
                shutil.rmtree(tmp, ignore_errors=True)
        options.unpublished.clear()
        raise CheckpointWriteError(line) from None
    for call in published:
        options.unpublished.pop(call, None)


def _write_ending_with_this_rank(write: Callable, *args, **kwargs) -> None:
    """megatron-core's background writer, in the process it forks: set to end with the rank.
    A rank killed by SIGKILL (a lost node, the OOM killer) would otherwise leave the writer
    waiting for ever; its save is never published, so nothing of value ends with it."""
    die_with_parent()
    write(*args, **kwargs)


NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
"""A full disk or an exhausted quota: the user's to fix, not a fault of the program."""


class CheckpointWriteError(ConfigError):
    """A save the file system could not hold (the message names the directory and the size)."""


def _out_of_space(err: BaseException) -> bool:
    """Whether ``err`` comes from a full disk: megatron-core wraps its writer's ``OSError`` in a
    ``RuntimeError`` inside a ``CheckpointException`` that keeps the failures per rank."""
    pending: list = [err]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in NO_SPACE:
            return True
        if any(f"[Errno {code}]" in str(current) for code in NO_SPACE):
            return True  # gathered from another rank: pickling kept the message, not the cause
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            pending += [f for f in failures.values() if isinstance(f, BaseException)]
            pending += [f[0] for f in failures.values() if isinstance(f, tuple) and f]
        pending += [current.__cause__, current.__context__]
    return False


def _names_no_space(messages: list[str]) -> bool:
    return any(f"[Errno {code}]" in message for message in messages for code in NO_SPACE)


def _free_bytes(save_dir: str | os.PathLike) -> int:
    """Room for this process's files in ``save_dir``, as a user without reserved blocks has it
    (``statvfs``'s available blocks)."""
    stats = os.statvfs(save_dir)
    return stats.f_bavail * stats.f_frsize


def _on_any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (a collective: every rank takes the same decision)."""
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _no_room_line(save_dir: str | os.PathLike, final: Path, needed: int) -> str:
    """A save refused before it starts: some rank's file system lacks the room for its part."""
    free = _free_bytes(save_dir)
    if free >= needed:
        return (
            f"{save_dir}: another process's file system has no room for its part of "
            f"{final.name}; nothing was written: free space or --save elsewhere"
        )
    whose = "" if dist.get_world_size() == 1 else " for this process's part"
    return (
        f"{save_dir}: no space left on device for {final.name}, which needs about "
        f"{needed / 1e6:.1f} MB there{whose} and has {free / 1e6:.1f} MB; nothing was written: "
        "free space or --save elsewhere"
    )


def _saved_bytes(sharded: dict) -> int:
    """What this process writes of ``sharded``: the tensors whose main replica it holds."""
    return sum(
        t.data.numel() * t.data.element_size()
        for t in nested_values(sharded)
        if isinstance(t, ShardedTensor) and t.data is not None and is_main_replica(t.replica_id)
    )


def _out_of_space_line(save_dir: str | os.PathLike, final: Path, sharded: dict) -> str:
    mb = _saved_bytes(sharded) / 1e6
    whose = "" if dist.get_world_size() == 1 else " for this process's part"
    return (
        f"{save_dir}: no space left on device saving {final.name}, which needs about "
        f"{mb:.1f} MB there{whose}; the partial {final.name} was removed: free space or "
        "--save elsewhere"
    )


def _publish(
    save_dir: Path,
    tmp: Path,
    final: Path,
    iteration: int,
    on_published: Callable[[Path], None] | None,
) -> None:
    """Every rank has written its part: rename the directory, then advance the tracker."""
    dist.barrier()
    if dist.get_rank() == 0:
        try:
            write_manifest(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            write_tracker(save_dir, iteration)
        except OSError as err:
            if err.errno not in NO_SPACE:
                raise
            for unpublished in (tmp, final):  # the tracker still names the last checkpoint
                shutil.rmtree(unpublished, ignore_errors=True)
            raise CheckpointWriteError(
                f"{save_dir}: no space left on device for {final.name}'s manifest or the "
                f"tracker; the unpublished {final.name} was removed: free space or --save "
                "elsewhere"
            ) from None
    dist.barrier()
    if on_published is not None:
        on_published(final)


def save_model(save_dir: str | os.PathLike, iteration: int, chunks, model: ApertusConfig) -> Path:
    """Save the model weights only (conversion tools, initial checkpoints). A tool's output is
    complete or absent: a save that fails or is interrupted (Ctrl-C, SIGTERM) removes what it
    wrote, the ``--save`` directory too when the save made it (a training run keeps a save cut
    short under its temporary name for its next save to remove)."""
    save_dir = Path(save_dir)
    made = not save_dir.exists()
    try:
        return save(save_dir, chunks, model, TrainingState(iteration=iteration))
    except BaseException:
        if dist.get_rank() == 0:
            final = iteration_dir(save_dir, iteration)
            shutil.rmtree(final.with_name(final.name + ".tmp"), ignore_errors=True)
            if made:
                with contextlib.suppress(OSError):  # only when nothing else is in it
                    save_dir.rmdir()
        raise


def load(
    path: str | os.PathLike,
    chunks,
    *,
    optimizer=None,
    scheduler=None,
    model: ApertusConfig | None = None,
    rng: bool = False,
    fully_parallel: bool = False,
) -> tuple[TrainingState, bool]:
    """Load a checkpoint into this rank's chunks (and optimizer, scheduler when given; with
    ``rng`` each rank's RNG states, when the checkpoint was saved in this layout).

    Weights reshard from whatever layout saved them. A weights-only checkpoint (converted or
    initial) restores the model and leaves the rest fresh. ``model``, the configuration the
    chunks were built from, lets a refusal name the flags that differ. With ``fully_parallel``
    (--ckpt-fully-parallel-load) the data-parallel replicas each read a share of the checkpoint
    and exchange it. Returns the training state and whether the optimizer state was restored.
    """
    directory = resolve_checkpoint(path)
    check_files(directory, str(path))
    try:
        check_checkpoint_readable(directory)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _check_shapes(chunks, directory, model)
    common = dist_checkpointing.load_common_state_dict(str(directory))
    trained = has_optimizer_states(directory)
    full = optimizer is not None and trained
    if full:
        _check_optimizer_kind(common, optimizer, path)
    # RNG states are per rank; in another layout they have no owner and the run keeps its seeds.
    groups = chunk_groups(chunks[0])
    saved = common.get("training_state", {})
    same_layout = saved.get("layout") == _layout(groups)
    # Checkpoints that do not say whether they hold RNG states hold them when trained.
    template = _training_state_dict(
        chunks,
        optimizer if full else None,
        None,
        TrainingState(),
        rng=rng and saved.get("rng", trained) and same_layout,
        loading=True,
    )
    try:
        loaded, _, absent = dist_checkpointing.load(
            template,
            str(directory),
            _load_strategy(directory, fully_parallel, groups),
            strict=StrictHandling.RETURN_UNEXPECTED,
        )
    except CheckpointException as err:
        raise CheckpointMismatch(_unreadable_line(directory, err)) from None
    _check_only_extra_state(absent, directory)
    for i, chunk in enumerate(chunks):
        try:
            _load_weights(chunk, loaded["model" if len(chunks) == 1 else f"model{i}"], directory)
        except RuntimeError as err:
            _explain_te_refusal(err, directory)
            raise
    if full:
        optimizer.load_state_dict(loaded["optimizer"])
    if "rng_state" in loaded:
        _restore_rng(loaded["rng_state"])
    if full and scheduler is not None and "scheduler" in common:
        _load_schedule(scheduler, common["scheduler"], directory)
    state = TrainingState(
        iteration=saved.get("iteration", 0),
        consumed_samples=saved.get("consumed_samples", 0),
        extra=saved.get("extra") or {},
    )
    return state, full


def _holds_sharding_type(state) -> bool:
    if not isinstance(state, dict):
        return False
    return "param_state_sharding_type" in state or any(map(_holds_sharding_type, state.values()))


def _check_optimizer_kind(common: dict, optimizer, path: str | os.PathLike) -> None:
    """Refuse, in one line, optimizer state of the other kind: megatron-core loads a distributed
    optimizer's state (which records its sharding type) only into a distributed optimizer, and a
    plain one's only into a plain one; across them it fails deep in ``load_state_dict``."""
    saved = _holds_sharding_type(common.get("optimizer"))
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    running = any(isinstance(part, DistributedOptimizer) for part in parts)
    if saved != running:
        raise ConfigError(
            f"--load {path}: its optimizer state was saved "
            f"{'with' if saved else 'without'} --use-distributed-optimizer and this run "
            f"{'uses' if running else 'does not use'} it, which megatron-core cannot convert: "
            "resume with the same choice, or add --no-load-optim to keep the weights and start "
            "the optimizer afresh"
        )


def _unreadable_line(directory: Path, err: CheckpointException) -> str:
    """A checkpoint without a manifest (saved before they existed) whose shard cannot be read:
    torch reports it per rank with a traceback; one line says what failed first."""
    failures = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
    first = next((f for f in failures if isinstance(f, BaseException)), None)
    what = ""
    if first is not None:
        what = f" ({type(first).__name__}: {first})" if str(first) else f" ({type(first).__name__})"
    return (
        f"{directory} cannot be read{what}: one of its files is damaged or cut short (it was "
        f"saved without {MANIFEST}, which would name the file)"
    )


def _load_strategy(directory: Path, fully_parallel: bool, groups: ProcessGroupCollection):
    """megatron-core's default reader, shared out over the data-parallel replicas if asked."""
    if not fully_parallel or groups.dp.size() == 1:
        return None
    return FullyParallelLoadStrategyWrapper(
        get_default_load_sharded_strategy(str(directory)), groups.dp_cp
    )


def _check_shapes(chunks, directory: Path, model: ApertusConfig | None) -> None:
    """Refuse a checkpoint whose weights have other global shapes than this model's (another
    architecture): megatron-core would stop mid-load with a traceback. Global shapes do not
    depend on the TP/PP layout, so any layout compares."""
    saved = dist_checkpointing.load_tensors_metadata(str(directory))
    for tensor in nested_values(_model_state(chunks)):
        if not isinstance(tensor, ShardedTensor) or tensor.key not in saved:
            continue
        theirs, ours = tuple(saved[tensor.key].global_shape), tuple(tensor.global_shape)
        if theirs != ours:
            raise CheckpointMismatch(
                f"{directory} holds another architecture: {tensor.key} is {list(theirs)} there, "
                f"{list(ours)} in this model{_config_differences(directory, model)}"
            )


def _config_differences(directory: Path, model: ApertusConfig | None) -> str:
    """``; its apertus_model.json differs in --flag A there, B here, ...``, or nothing. Compared
    as JSON, so a file of an older or newer version with other fields still compares."""
    if model is None:
        return ""
    saved = json.loads((directory / MODEL_CONFIG).read_text())
    ours = json.loads(model.to_json())
    differ = [
        f"--{name.replace('_', '-')} {saved.get(name)} there, {ours.get(name)} here"
        for name in sorted(saved.keys() | ours.keys())
        if saved.get(name) != ours.get(name)
    ]
    return f"; its {MODEL_CONFIG} differs in {', '.join(differ)}" if differ else ""


def _load_schedule(scheduler, state: dict, directory: Path) -> None:
    """megatron-core's scheduler keeps the step count and, under --override-opt_param-scheduler,
    takes every other value from the current flags; with neither switch it asserts that the
    flags agree with the checkpoint, which a user meets on changing e.g. --train-iters."""
    try:
        scheduler.load_state_dict(state)
    except AssertionError as err:
        raise CheckpointMismatch(
            f"{directory} was saved with another learning-rate schedule ({err}); pass "
            "--override-opt_param-scheduler to follow the flags, or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        ) from None


def _is_extra_state(key: str) -> bool:
    """Transformer Engine's per-module FP8 metadata (absent from checkpoints of local layers)."""
    return "_extra_state" in key


def _check_only_extra_state(absent: set[str], directory: Path) -> None:
    weights = sorted(key for key in absent if not _is_extra_state(key))
    if weights:
        listed = ", ".join(weights[:5]) + (" ..." if len(weights) > 5 else "")
        raise CheckpointMismatch(
            f"{directory} lacks {len(weights)} tensors this run needs: {listed}"
        )


def _load_weights(chunk, state: dict, directory: Path) -> None:
    """``load_state_dict`` that lets TE's ``_extra_state`` be absent, and nothing else."""
    while isinstance(chunk, Float16Module):  # its load_state_dict returns nothing
        chunk = chunk.module
    result = chunk.load_state_dict(state, strict=False)
    missing = [key for key in result.missing_keys if not _is_extra_state(key)]
    if missing or result.unexpected_keys:
        raise CheckpointMismatch(
            f"{directory} does not match this model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


class CheckpointMismatch(ConfigError):
    """A checkpoint that cannot be loaded into this run (the message names the directory)."""


PICKLED_FP8_STATE = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
"""Transformer Engine's switch for unpickling its delayed-scaling state from a checkpoint."""


def _explain_te_refusal(err: RuntimeError, directory: Path) -> None:
    """TE stores delayed-scaling FP8 state (amax history, scales) as a pickle and refuses to load
    it by default; say so in one line naming the checkpoint and the switch."""
    if PICKLED_FP8_STATE in str(err):
        raise CheckpointMismatch(
            f"{directory} holds FP8 delayed-scaling state that Transformer Engine stores as a "
            f"Python pickle; set {PICKLED_FP8_STATE}=1 to load a checkpoint you trust (your own "
            "run's), or resume with another --fp8-recipe"
        ) from err


@contextlib.contextmanager
def trusting_fp8_state() -> Iterator[None]:
    """Within the block, Transformer Engine loads pickled delayed-scaling state: for a load of a
    checkpoint the run wrote itself (the FP8 guard going back to one; a new process that loads
    one needs the switch set by its user)."""
    before = os.environ.get(PICKLED_FP8_STATE)
    os.environ[PICKLED_FP8_STATE] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PICKLED_FP8_STATE)
        else:
            os.environ[PICKLED_FP8_STATE] = before


def has_optimizer_states(path: str | os.PathLike) -> bool:
    """Whether the checkpoint holds optimizer moments (weights-only and step-0 checkpoints do
    not). Decided from the metadata: building a loading template would create empty states."""
    saved = dist_checkpointing.load_tensors_metadata(str(resolve_checkpoint(path)))
    return any(key.startswith("optimizer.") and "exp_avg" in key for key in saved)


def load_model(path: str | os.PathLike, chunks) -> Path:
    """Load weights only (conversion tools)."""
    load(path, chunks)
    return resolve_checkpoint(path)
