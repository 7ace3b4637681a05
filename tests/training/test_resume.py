"""Checkpoints: exact resume (1 process, TP=2, PP=2, PP=2 with virtual stages, background saves,
DP=2 fully parallel loads, DP=2 with --calculate-per-token-loss), other layouts, signals,
interrupted saves."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.apertus import checkpoint
from megatron.apertus.checkpoint_files import METRICS_FILE
from tests.conftest import (
    PRETRAIN,
    REPO,
    SMALL_VOCABULARY,
    cpu_models,
    read_json,
    run_entry,
    series,
)
from tests.training import die_after_publishing
from tests.training.test_first_hour import refused

ITERS = 6
COMMON = [
    "--model-preset",
    "tiny",
    "--seed",
    "11",
    "--lr",
    "3e-3",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--eval-iters",
    "1",
    "--log-interval",
    "1",
    "--train-iters",
    str(ITERS),
    "--lr-decay-style",
    "WSD",
    "--lr-warmup-iters",
    "2",
    "--lr-wsd-decay-iters",
    "2",
    "--goldfish-loss",
    "--reset-position-ids",
    "--reset-attention-mask",
    *SMALL_VOCABULARY,
]


def final_weights(save_dir: Path) -> dict[str, torch.Tensor]:
    """The saved model, loaded into a one-process TP=1/PP=1 model on CPU."""
    with cpu_models() as models:
        chunk = models.build(load=save_dir)
        return {k: v.clone() for k, v in chunk.state_dict().items() if torch.is_tensor(v)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    run_entry(
        PRETRAIN, COMMON + ["--save", str(root / "full"), "--log-json", str(root / "full.json")]
    )
    return root, series(read_json(root / "full.json"), "train/loss"), final_weights(root / "full")


def interrupted_run(root: Path, name: str, extra: list[str], nproc: int) -> tuple[list, dict]:
    save = root / name
    run_entry(
        PRETRAIN,
        COMMON
        + extra
        + ["--save", str(save), "--exit-interval", "3", "--log-json", str(root / f"{name}-a.json")],
        nproc=nproc,
    )
    assert checkpoint.latest_iteration(save) == 3
    run_entry(
        PRETRAIN,
        COMMON
        + extra
        + ["--save", str(save), "--load", str(save), "--log-json", str(root / f"{name}-b.json")],
        nproc=nproc,
    )
    first = series(read_json(root / f"{name}-a.json"), "train/loss")
    whole = series(read_json(root / f"{name}-b.json"), "train/loss")  # the history continues
    assert whole[1][:3] == first[1]
    return whole, final_weights(save)


@pytest.mark.parametrize(
    "name, extra, nproc",
    [
        pytest.param("one-process", [], 1, marks=pytest.mark.smoke),
        # TP and PP: in the other megatron-core line's tier, which CI runs too.
        pytest.param(
            "tp2",
            ["--tensor-model-parallel-size", "2"],
            2,
            marks=[pytest.mark.smoke, pytest.mark.slow],
        ),
        pytest.param(
            "pp2",
            ["--pipeline-model-parallel-size", "2"],
            2,
            marks=[pytest.mark.smoke, pytest.mark.slow],
        ),
        # Virtual stages: each chunk's optimizer state is found among all chunks' tensors.
        (
            "pp2-virtual",
            ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"],
            2,
        ),
        pytest.param(
            "pp2-virtual-distributed-optimizer",
            [
                *("--pipeline-model-parallel-size", "2"),
                *("--virtual-pipeline-model-parallel-size", "2"),
                *("--use-distributed-optimizer", "--optimizer", "ademamix"),
            ],
            2,
            marks=[pytest.mark.smoke, pytest.mark.slow],
        ),
        # Background saves at every step, the one the stop asks for too.
        pytest.param(
            "async-save", ["--async-save", "--save-interval", "1"], 1, marks=pytest.mark.smoke
        ),
        # The loss divided by the global batch's loss tokens (Goldfish: they vary by step).
        pytest.param("dp2-per-token", ["--calculate-per-token-loss"], 2, marks=pytest.mark.slow),
        (
            "dp2-async-fully-parallel",
            [
                "--async-save",
                "--save-interval",
                "2",
                "--ckpt-fully-parallel-load",
                "--use-distributed-optimizer",
                "--optimizer",
                "ademamix",
            ],
            2,
        ),
    ],
)
def test_stop_and_resume_is_bitwise_identical(uninterrupted, name, extra, nproc):
    root, (ref_steps, ref_losses), ref_weights = uninterrupted
    if nproc == 1:
        expected_losses, expected_weights = ref_losses, ref_weights
    else:  # the same layout uninterrupted, for a bitwise comparison
        run_entry(
            PRETRAIN,
            COMMON
            + extra
            + ["--save", str(root / f"{name}-full"), "--log-json", str(root / f"{name}-full.json")],
            nproc=nproc,
        )
        expected_losses = series(read_json(root / f"{name}-full.json"), "train/loss")[1]
        expected_weights = final_weights(root / f"{name}-full")
    (steps, losses), weights = interrupted_run(root, name, extra, nproc)
    assert steps == ref_steps == list(range(1, ITERS + 1))
    assert losses == expected_losses, "every logged loss must be bitwise equal"
    assert weights.keys() == expected_weights.keys()
    for key, value in weights.items():
        assert torch.equal(value, expected_weights[key]), key


def test_resume_in_another_layout(uninterrupted):
    """A TP=1 checkpoint (model, optimizer, scheduler) continues under TP=2 on the same trajectory."""
    root, (_, ref_losses), _ = uninterrupted
    save = root / "relayout"
    run_entry(PRETRAIN, COMMON + ["--save", str(save), "--exit-interval", "3"])
    run_entry(
        PRETRAIN,
        COMMON
        + [
            "--save",
            str(save),
            "--load",
            str(save),
            "--tensor-model-parallel-size",
            "2",
            "--log-json",
            str(root / "relayout.json"),
        ],
        nproc=2,
    )
    steps, losses = series(read_json(root / "relayout.json"), "train/loss")
    assert steps == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)


def test_optimizer_state_of_the_other_kind_is_refused(tmp_path):
    """megatron-core cannot load a distributed optimizer's state into a plain one or back: one
    line says so, and --no-load-optim keeps the weights and starts the optimizer afresh."""
    ademamix = ["--optimizer", "ademamix", "--exit-interval", "1"]
    distributed, plain = tmp_path / "distributed", tmp_path / "plain"
    run_entry(
        PRETRAIN, COMMON + ademamix + ["--use-distributed-optimizer", "--save", str(distributed)]
    )
    run_entry(PRETRAIN, COMMON + ademamix + ["--save", str(plain)])
    line = refused(ademamix + ["--load", str(distributed)], base=COMMON)
    assert "saved with --use-distributed-optimizer and this run does not use it" in line, line
    line = refused(ademamix + ["--use-distributed-optimizer", "--load", str(plain)], base=COMMON)
    assert "saved without --use-distributed-optimizer and this run uses it" in line, line
    run_entry(PRETRAIN, COMMON + ademamix + ["--load", str(distributed), "--no-load-optim"])


def _start(args: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, str(PRETRAIN), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_line(proc: subprocess.Popen, needle: str, lines: list[str]) -> None:
    for line in proc.stdout:
        lines.append(line)
        if needle in line:
            return
    raise AssertionError(f"process ended before printing {needle!r}:\n{''.join(lines[-30:])}")


TIMED = ("train/step_seconds", "train/throughput")
"""Recorded series whose values are clock readings: only their iterations repeat between runs."""


def same_history(history: dict, expected: dict) -> bool:
    """Whether two runs' ``metrics.json`` record the same: every series at the same iterations,
    with the same values except clock readings."""

    def comparable(recorded: dict) -> dict:
        return {
            name: [it for it, _ in entries] if name in TIMED else entries
            for name, entries in recorded.items()
        }

    return comparable(history) == comparable(expected)


def killed_after_publishing(checkpoint_dir: Path, args: list[str]) -> str:
    """Run pretrain_gpt.py with ``args`` until ``checkpoint_dir`` is published, then SIGKILL
    (:mod:`tests.training.die_after_publishing`); its output."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = die_after_publishing.command(checkpoint_dir, PRETRAIN, args)
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:]
    assert f"saved checkpoint {checkpoint_dir}" in proc.stdout
    return proc.stdout


def test_a_kill_just_after_a_save_is_published_loses_no_history(uninterrupted):
    """SIGKILL right after the checkpoint of step 5, the run's first, is published, before the
    run writes its history beside the checkpoints: the restart continues the history published
    inside the checkpoint, and ends with the uninterrupted run's losses and metrics.json."""
    root, (ref_steps, ref_losses), _ = uninterrupted
    save, log = root / "killed-after-publishing", root / "killed-after-publishing.json"
    flags = COMMON + ["--save", str(save), "--save-interval", "5"]
    killed_after_publishing(save / "iter_0000005", flags)
    assert checkpoint.latest_iteration(save) == 5
    assert not (save / METRICS_FILE).exists(), "killed before the history beside it was written"
    run_entry(PRETRAIN, flags + ["--load", str(save), "--log-json", str(log)])
    assert series(read_json(log), "train/loss") == (ref_steps, ref_losses)
    history = json.loads((save / METRICS_FILE).read_text())
    assert same_history(history, json.loads((root / "full" / METRICS_FILE).read_text()))


@pytest.mark.parametrize(
    "extra",
    [[], pytest.param(["--async-save"], marks=pytest.mark.slow)],  # async saves: the matrix above
    ids=["sync", "async"],
)
def test_sigusr2_saves_exits_zero_and_resumes_on_the_same_trajectory(uninterrupted, extra):
    root, (ref_steps, ref_losses), _ = uninterrupted
    save = root / f"signal{'-'.join(extra)}"
    slow = (
        COMMON
        + extra
        + [
            "--save",
            str(save),
            "--exit-signal-handler",
            "--log-json",
            str(save) + "-a.json",
        ]
    )
    proc = _start(slow)
    lines: list[str] = []
    _wait_for_line(proc, "iteration        2/", lines)
    proc.send_signal(signal.SIGUSR2)
    lines += proc.stdout.readlines()
    assert proc.wait(timeout=300) == 0, "".join(lines[-30:])
    stopped_at = checkpoint.latest_iteration(save)
    assert stopped_at is not None and 2 <= stopped_at < ITERS, "".join(lines[-30:])
    assert "exit requested by signal SIGUSR2" in "".join(lines)
    run_entry(
        PRETRAIN,
        COMMON + ["--save", str(save), "--load", str(save), "--log-json", str(save) + "-b.json"],
    )
    steps, losses = series(read_json(Path(str(save) + "-b.json")), "train/loss")
    assert steps == ref_steps
    assert losses == ref_losses


def test_half_written_checkpoint_is_ignored(uninterrupted):
    root, (_, ref_losses), _ = uninterrupted
    save = root / "killed"
    run_entry(PRETRAIN, COMMON + ["--save", str(save), "--exit-interval", "3"])
    # A save killed with -9: start a run that saves every step and kill it as soon as a
    # checkpoint directory is being written.
    proc = _start(COMMON + ["--save", str(save), "--load", str(save), "--save-interval", "1"])
    deadline = time.time() + 300
    while not list(save.glob("iter_*.tmp")):
        assert proc.poll() is None and time.time() < deadline, "the run ended before saving"
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    half = list(save.glob("iter_*.tmp"))
    assert half, "the kill must leave a half-written directory behind"
    resumed_from = checkpoint.latest_iteration(save)
    assert (
        resumed_from is not None
        and (save / f"iter_{resumed_from:07d}" / checkpoint.MODEL_CONFIG).is_file()
    )
    run_entry(
        PRETRAIN,
        COMMON
        + ["--save", str(save), "--load", str(save), "--log-json", str(root / "killed.json")],
    )
    steps, losses = series(read_json(root / "killed.json"), "train/loss")
    assert steps == list(range(1, ITERS + 1))
    assert losses[resumed_from:] == ref_losses[resumed_from:]
    assert not list(save.glob("iter_*.tmp")), "the next save removes the half-written directory"
    shutil.rmtree(save)
