"""Checkpoints in megatron-core's ``torch_dist`` format, loadable into any TP/PP layout.

Layout of a save directory::

    SAVE/latest_checkpointed_iteration.txt   iteration of the newest *complete* checkpoint
    SAVE/iter_0000100/                        dist_checkpointing files
    SAVE/iter_0000100/apertus_model.json      ApertusConfig of the model (JSON, no pickle)

A checkpoint is written under ``iter_XXXXXXX.tmp`` and renamed when complete; the tracker is
replaced atomically afterwards, so an interrupted save is never loaded.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron.apertus.model.config import ApertusConfig

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_CONFIG = "apertus_model.json"


def iteration_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def _model_state(chunks) -> dict:
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_model(save_dir: str | os.PathLike, iteration: int, chunks, model: ApertusConfig) -> Path:
    """Save the model chunks of every rank (a collective) and advance the tracker."""
    final = iteration_dir(save_dir, iteration)
    tmp = final.with_name(final.name + ".tmp")
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_model_state(chunks), str(tmp))
    dist.barrier()
    if rank0:
        (tmp / MODEL_CONFIG).write_text(model.to_json())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _atomic_write(Path(save_dir) / TRACKER, f"{iteration}\n")
    dist.barrier()
    return final


def latest_iteration(load_dir: str | os.PathLike) -> int | None:
    tracker = Path(load_dir) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected an iteration number, found {text!r}")
    return int(text)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A save directory (follow its tracker) or an ``iter_*`` directory itself."""
    path = Path(path)
    iteration = latest_iteration(path)
    resolved = path if iteration is None else iteration_dir(path, iteration)
    if not (resolved / MODEL_CONFIG).is_file():
        raise FileNotFoundError(
            f"{resolved} is not a complete Apertus checkpoint (no {MODEL_CONFIG})"
        )
    return resolved


def load_model_config(path: str | os.PathLike) -> ApertusConfig:
    return ApertusConfig.from_dict(
        json.loads((resolve_checkpoint(path) / MODEL_CONFIG).read_text())
    )


def load_model(path: str | os.PathLike, chunks) -> Path:
    """Load weights into this rank's chunks, resharding from whatever layout saved them."""
    directory = resolve_checkpoint(path)
    state = dist_checkpointing.load(_model_state(chunks), str(directory))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"])
    return directory
