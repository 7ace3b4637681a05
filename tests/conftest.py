"""Shared helpers: run our entry points as real subprocesses (one process or torchrun)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.apertus.training.metrics import read_history

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = REPO / "pretrain_gpt.py"


def run_entry(
    script: Path, args: list[str], *, nproc: int = 1, timeout: int = 600, python: str = ""
) -> subprocess.CompletedProcess:
    """Run ``script`` with ``args`` (under torchrun when ``nproc`` > 1) by ``python`` (this
    interpreter unless given); fail with its output."""
    python = python or sys.executable
    if nproc == 1:
        cmd = [python, str(script), *args]
    else:
        cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--standalone", str(script), *args]  # fmt: skip
    rendezvous = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def read_json(path: Path) -> dict:
    """A ``--log-json`` file as ``{name: [[iteration, value], ...]}``."""
    return read_history(path)


def series(history: dict, name: str) -> tuple[list[int], list[float]]:
    """Iterations and values of one recorded metric (``--log-json`` stores [iteration, value])."""
    pairs = history.get(name, [])
    return [int(i) for i, _ in pairs], [float(v) for _, v in pairs]
