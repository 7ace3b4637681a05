"""The Slurm launcher on a real one-node cluster (``conftest.py``): the tiny CPU example with two
tasks (TP=2) runs to its end; preempted with ``scancel --signal=USR2`` it saves, resubmits
itself and the next job resumes on the same loss trajectory; an impossible layout is refused
before anything is queued."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.apertus.checkpoint_files import MODEL_CONFIG, iteration_dir, latest_iteration
from megatron.apertus.training.metrics import read_history
from tests.conftest import REPO

ITERS = 10
SCRIPT = REPO / "examples" / "slurm" / "tiny_cpu.sbatch"


def submit(slurm, run_dir: Path, name: str, *options: str) -> subprocess.CompletedProcess:
    """``examples/slurm/submit.sh`` as a user runs it, with this test's run directory."""
    rendezvous = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in slurm.env.items() if k not in rendezvous}
    env.update(
        APERTUS_PYTHON=sys.executable,
        APERTUS_RUN_DIR=str(run_dir),
        OMP_NUM_THREADS="1",
        TINY_TRAIN_ITERS=str(ITERS),
        TINY_SAVE_INTERVAL="1000",
        PYTHONUNBUFFERED="1",
    )
    command = [
        str(REPO / "examples" / "slurm" / "submit.sh"),
        str(SCRIPT),
        "--",
        f"--job-name={name}",
        f"--output={run_dir}/logs/%x-%j.out",
        *options,
    ]
    return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


def submitted_job(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: the layout is valid" in proc.stdout
    return proc.stdout.split("submitted job ")[1].split()[0]


def job_log(run_dir: Path, job_id: str) -> str:
    return next((run_dir / "logs").glob(f"*-{job_id}.out")).read_text()


def losses(run_dir: Path, job_id: str) -> list[list[float]]:
    return read_history(run_dir / f"history-{job_id}.json")["train/loss"]


def assert_completed(slurm, job_id: str, run_dir: Path) -> str:
    record = slurm.wait(job_id)
    log = job_log(run_dir, job_id)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), log[-5000:]
    return log


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    """The tiny example to its end, with leftovers of a killed save planted in its save dir."""
    run_dir = tmp_path_factory.mktemp("tiny-full")
    stale = [run_dir / "checkpoints" / "iter_0000003.tmp", run_dir / "checkpoints" / "iter_0000004"]
    for path in stale:
        path.mkdir(parents=True)
    started = time.monotonic()
    job = submitted_job(submit(slurm, run_dir, "tiny-full"))
    log = assert_completed(slurm, job, run_dir)
    print(f"uninterrupted tiny run: {time.monotonic() - started:.0f} s")
    return run_dir, job, log, stale


def test_tiny_example_runs_two_tasks_to_the_end(slurm, uninterrupted):
    run_dir, job, log, stale = uninterrupted
    assert slurm.job(job)["NumTasks"] == "2"
    for path in stale:
        assert f"removing unfinished checkpoint {path}" in log and not path.exists()
    assert f"iteration {ITERS:8d}/{ITERS:8d} |" in log
    assert f"not resubmitting: the run is finished (iteration {ITERS})" in log
    save = run_dir / "checkpoints"
    assert latest_iteration(save) == ITERS
    assert (iteration_dir(save, ITERS) / MODEL_CONFIG).is_file()
    assert [step for step, _ in losses(run_dir, job)] == list(range(1, ITERS + 1))
    snapshot = run_dir / "jobs" / job
    command = (snapshot / "command.txt").read_text()
    assert command.startswith("srun ") and "--tensor-model-parallel-size 2" in command
    assert "--exit-signal-handler" in command and f"--trigger-path {run_dir}/triggers" in command
    assert f"JobId={job} JobName=tiny-full" in (snapshot / "slurm.txt").read_text()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:
        assert head.stdout.strip() in (snapshot / "git.txt").read_text()
    assert "torch==" in (snapshot / "pip-freeze.txt").read_text()
    assert "MASTER_PORT=" in (snapshot / "environment.txt").read_text()
    assert list(snapshot.glob("gpus-*.txt")), "local rank 0 records the node's GPUs (or none)"


def _wait_for(run_dir: Path, job: str, needle: str, slurm, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = list((run_dir / "logs").glob(f"*-{job}.out"))
        if logs and needle in logs[0].read_text():
            return
        assert slurm.job(job)["JobState"] in ("PENDING", "RUNNING"), job_log(run_dir, job)[-5000:]
        time.sleep(0.5)
    raise AssertionError(f"job {job} never logged {needle!r}")


def test_preempted_job_saves_resubmits_and_resumes_on_the_same_trajectory(
    slurm, uninterrupted, tmp_path
):
    reference_dir, reference_job, _, _ = uninterrupted
    name = "tiny-preempt"
    first = submitted_job(submit(slurm, tmp_path, name))
    _wait_for(tmp_path, first, "iteration        3/", slurm)
    slurm.run("scancel", "--signal=USR2", first)
    log = assert_completed(slurm, first, tmp_path)
    assert "exit requested by signal SIGUSR2" in log
    saved_at = latest_iteration(tmp_path / "checkpoints")
    assert saved_at is not None and 3 <= saved_at < ITERS, log[-3000:]
    second = log.split("resubmitted as job ")[1].split()[0]
    assert slurm.jobs_named(name) == [first, second]
    resumed = assert_completed(slurm, second, tmp_path)
    checkpoint = iteration_dir(tmp_path / "checkpoints", saved_at)
    assert f"resuming from iteration {saved_at}" in resumed
    assert f"resumed from {checkpoint} at iteration {saved_at}" in resumed
    assert f"the run is finished (iteration {ITERS})" in resumed
    reference = losses(reference_dir, reference_job)
    assert losses(tmp_path, first) == reference[:saved_at]
    assert losses(tmp_path, second) == reference, "bitwise equal losses at every step"


def test_invalid_layout_is_refused_before_anything_is_queued(slurm, tmp_path):
    proc = submit(slurm, tmp_path, "tiny-refused", "--ntasks-per-node=3")
    assert proc.returncode == 1
    assert "world size (3) is not divisible by --tensor-model-parallel-size (2)" in proc.stdout
    assert "refused, nothing was queued" in proc.stderr
    assert slurm.jobs_named("tiny-refused") == []
