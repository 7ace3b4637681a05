"""A fault soak (slow tier): a DP=2 run with background saves is killed with SIGKILL at random
moments, one rank or the whole job at once (a node lost), in the middle of steps, saves and
start-up; each time the same command is started again and must finish on the uninterrupted
run's losses exactly, needing no hand fix.

What a kill may lose: a background save counts once every rank has written it, and the next
save waits for it, so at most one is in flight. A kill loses the iterations since the last
save that was due, and the save before that one when it was still being written: at most two
save intervals, one when writes are faster than an interval.

    pytest -m slow tests/training/test_fault_soak.py -s   # prints one line per trial
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from megatron.apertus import checkpoint
from tests.conftest import PRETRAIN, REPO, SMALL_VOCABULARY, read_json, run_entry, series

pytestmark = pytest.mark.slow

ITERS = 12
SAVE_INTERVAL = 2
TRIALS = 30
ITERATION_LINE = re.compile(r"\biteration +(\d+)/")
ARGS = [
    "--model-preset",
    "tiny",
    "--seed",
    "5",
    "--lr",
    "3e-3",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "1",
    "--log-interval",
    "1",
    "--eval-interval",
    "1000",
    "--train-iters",
    str(ITERS),
    "--goldfish-loss",
    "--use-distributed-optimizer",
    "--optimizer",
    "ademamix",
    "--async-save",
    "--save-interval",
    str(SAVE_INTERVAL),
    *SMALL_VOCABULARY,
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """The uninterrupted run's losses."""
    root = tmp_path_factory.mktemp("soak-reference")
    log = root / "losses.json"
    run_entry(PRETRAIN, ARGS + ["--save", str(root / "ckpt"), "--log-json", str(log)], nproc=2)
    steps, losses = series(read_json(log), "train/loss")
    assert steps == list(range(1, ITERS + 1))
    return losses


def _launch(save: Path, log: Path) -> subprocess.Popen:
    """The job as a user's batch script runs it: torchrun with two ranks, in its own process
    group so that the whole job can be killed at once."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--standalone", str(PRETRAIN), *ARGS]
    command += ["--save", str(save), "--load", str(save), "--log-json", str(log)]
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _collect(proc: subprocess.Popen, lines: list[str], seen: list[int]) -> threading.Thread:
    """Read the job's output in the background, noting each iteration it reports."""

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            reported = ITERATION_LINE.search(line)
            if reported:
                seen.append(int(reported.group(1)))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader


def _kill(launcher: psutil.Process, target: str, rng: random.Random) -> list[psutil.Process]:
    """SIGKILL one rank (chosen at random), or the launcher and every process under it at once
    as when a node is lost (torchrun starts each rank with setsid, outside the launcher's process
    group: a signal to that group alone would leave them running). Returns the processes of the
    job seen at the kill. The ranks are the launcher's own children: a rank's background checkpoint
    writer has the rank's command line too, and killing it would stop no training."""
    victims = [] if target == "job" else [rng.choice(_ranks(launcher))]
    job = [launcher, *launcher.children(recursive=True)]
    for process in victims or job:
        process.kill()
    return job


def _ranks(launcher: psutil.Process) -> list[psutil.Process]:
    """The job's two ranks, once the launcher has started them (a kill aimed early in start-up
    waits for them)."""
    deadline = time.time() + 120
    while len(ranks := launcher.children()) < 2:
        assert time.time() < deadline, "the launcher started no two ranks"
        time.sleep(0.05)
    return sorted(ranks, key=lambda process: process.pid)


def _interrupt(save: Path, log: Path, trial: int) -> tuple[str, int, float]:
    """Start the job and kill it at a random moment: after a random number of reported
    iterations and a random fraction of a second more, or (no iteration) a random number of
    seconds into its start-up. Returns what was killed, the last iteration reported and the
    delay."""
    rng = random.Random(trial)
    target = rng.choice(["rank", "job"])
    after_iteration = rng.randrange(0, ITERS - 2)
    delay = rng.uniform(0.0, 1.0) if after_iteration else rng.uniform(2.0, 15.0)
    proc = _launch(save, log)
    lines: list[str] = []
    seen: list[int] = []
    reader = _collect(proc, lines, seen)
    deadline = time.time() + 600
    while after_iteration and not (seen and seen[-1] >= after_iteration) and proc.poll() is None:
        assert time.time() < deadline, "".join(lines[-30:])
        time.sleep(0.01)
    time.sleep(delay)
    assert proc.poll() is None, "the job ended before the kill:\n" + "".join(lines[-30:])
    job = _kill(psutil.Process(proc.pid), target, rng)
    proc.wait(timeout=300)
    reader.join(timeout=60)
    _end_leftovers(job)
    _assert_nothing_of_the_job_survives(save)
    return target, max(seen, default=0), delay


def _assert_nothing_of_the_job_survives(save: Path) -> None:
    """No process of the killed job is left, including those its ranks started after the kill
    was aimed (a background checkpoint writer forks from its rank at each save): each has to end
    with its rank by itself, as nothing else is left to stop it on a machine without Slurm."""
    deadline = time.time() + 30
    while True:
        left = [
            p.info["pid"]
            for p in psutil.process_iter(["pid", "cmdline"])
            if str(save) in " ".join(p.info["cmdline"] or [])
        ]
        if not left or time.time() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"processes of the killed job still run: {left}"


def _end_leftovers(job: list[psutil.Process]) -> None:
    """After a rank is killed torchrun stops the others; whatever is left of the job goes
    before the job is started again."""
    for process in job:
        if process.is_running():
            process.kill()
    psutil.wait_procs(job, timeout=60)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_killed_run_resumes_on_the_same_losses(reference, tmp_path, trial):
    save, first, second = tmp_path / "ckpt", tmp_path / "a.json", tmp_path / "b.json"
    target, last_reported, delay = _interrupt(save, first, trial)
    resumed_from = checkpoint.latest_iteration(save) or 0
    run_entry(
        PRETRAIN,
        ARGS + ["--save", str(save), "--load", str(save), "--log-json", str(second)],
        nproc=2,
    )
    steps, losses = series(read_json(second), "train/loss")
    lost = max(last_reported - resumed_from, 0)
    print(
        f"trial {trial:2d}: killed {target} after iteration {last_reported} (+{delay:.2f} s), "
        f"resumed from {resumed_from}, lost {lost}"
    )
    assert steps == list(range(1, ITERS + 1))
    assert losses == reference
    assert lost <= 2 * SAVE_INTERVAL, f"lost {lost} iterations: more than the save in flight"
    assert not list(save.glob("iter_*.tmp")), "a half-written save outlived the resumed run"
