"""Megatron-LM's launch and initialisation flags: --data-parallel-random-init,
--use-cpu-initialization, --distributed-backend, --local-rank, and the refused --yaml-cfg.

The models are built by ``pretrain_gpt.py``'s own path on a real 2-process gloo world
(``init_worker.py``): each rank's weights as it initialised them, and as the first step
receives them.
"""

from __future__ import annotations

import json

import pytest

import pretrain_gpt
from megatron.apertus import parallel
from megatron.apertus.errors import ConfigError
from megatron.apertus.model.config import ParallelConfig
from tests.conftest import REPO, run_entry
from tests.training.test_first_hour import refused

WORKER = REPO / "tests" / "training" / "init_worker.py"
BASE = "--model-preset tiny --vocab-size 256 --train-iters 1 --global-batch-size 2".split()
RUNS = {
    "default": [],
    "random init": ["--data-parallel-random-init"],
    "cpu init": ["--use-cpu-initialization", "--distributed-backend", "gloo"],
}


@pytest.fixture(scope="module")
def weights() -> dict[str, dict[str, list[str]]]:
    """Each run's line from ``init_worker.py`` on two data-parallel ranks."""
    lines = {}
    for name, flags in RUNS.items():
        proc = run_entry(WORKER, BASE + flags, nproc=2)
        lines[name] = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("{")))
    return lines


def test_without_random_init_the_data_parallel_ranks_initialise_alike(weights):
    initial = weights["default"]["initial"]
    assert initial[0] == initial[1]
    assert weights["default"]["first step"] == initial


def test_random_init_initialises_each_data_parallel_rank_from_its_own_seed(weights):
    initial = weights["random init"]["initial"]
    assert initial[0] != initial[1]
    # rank 0 seeds with --seed itself (Megatron-LM's offset is 10 x the data-parallel rank)
    assert initial[0] == weights["default"]["initial"][0]
    assert weights["random init"]["generator"][0] != weights["random init"]["generator"][1]


def test_random_init_starts_training_from_rank_0s_weights_on_every_rank(weights):
    """Megatron-LM broadcasts data-parallel rank 0's weights once DDP wraps the model: the
    replicas start equal, on the weights of a run without the flag."""
    assert weights["random init"]["first step"] == weights["default"]["first step"]


def test_cpu_initialization_restates_what_a_cpu_run_does(weights):
    assert weights["cpu init"] == weights["default"]


def test_local_rank_is_the_launchers_or_the_flags(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert parallel.local_rank(ParallelConfig()) == 0
    assert parallel.local_rank(ParallelConfig(local_rank=3)) == 3
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert parallel.local_rank(ParallelConfig()) == 1
    config = pretrain_gpt.parse_args(BASE + ["--local-rank", "1"])
    assert parallel.local_rank(config.parallel) == 1


def test_a_local_rank_against_the_launchers_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "0")
    parallel.check_launch(ParallelConfig(local_rank=0), "cpu")
    with pytest.raises(SystemExit) as stop:
        pretrain_gpt.parse_args(BASE + ["--local-rank", "1"])
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert ": error: --local-rank 1 contradicts the launcher's LOCAL_RANK=0 (see " in line


def test_gloo_on_a_gpu_is_refused():
    with pytest.raises(ConfigError, match="--distributed-backend gloo on a GPU is not implemented"):
        parallel.check_launch(ParallelConfig(distributed_backend="gloo"), "cuda")
    parallel.check_launch(ParallelConfig(distributed_backend="nccl"), "cuda")


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--distributed-backend", "nccl"],
            "--distributed-backend nccl needs CUDA, and this run is on the CPU: give gloo, or "
            "drop the flag (the CPU's default is gloo)",
        ),
        (
            ["--distributed-backend", "mpi"],
            "argument --distributed-backend: invalid choice: 'mpi' (choose from 'nccl', 'gloo')",
        ),
        (["--local-rank", "-1"], "--local-rank must be >= 0, got -1"),
        (
            ["--yaml-cfg", "run.yaml"],
            "--yaml-cfg run.yaml: Megatron-LM's experimental YAML file (a nested schema of its own "
            "that replaces the whole command line) is not implemented; give the flags on the "
            "command line, a long blend in --data-args-path",
        ),
    ],
    ids=["nccl-on-cpu", "unknown-backend", "negative-local-rank", "yaml-cfg"],
)
def test_launch_flags_it_cannot_honour_are_refused_in_one_line(flags, line):
    assert refused(flags + ["--device", "cpu"]) == line
