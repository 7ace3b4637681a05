"""Slurm launcher shared by every ``examples/slurm/*.sbatch`` script (standard library only).

A job runs in three places, one function each:

* ``batch`` (the job's batch step, on its first node): skips a run that is finished or asked to
  stop, removes unfinished checkpoints (``.tmp`` or newer than the tracker of their directory:
  --save, and the non-persistent one, whose checkpoints are kept), writes a snapshot
  of the job (command, Slurm record, environment, git commit), starts one task per GPU with
  ``srun``, and when the run is not finished resubmits the same script with
  ``--dependency=singleton`` and the same job name, up to ``APERTUS_MAX_RESUBMISSIONS`` times.
* ``task`` (each ``srun`` task, inside the container if any): exports torch.distributed's
  ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` from Slurm's ids, snapshots the Python packages
  (global rank 0) and the GPUs (local rank 0 of each node), and execs the entry point.
* ``submit`` (``launch/submit.py``; login node): plans the layout and calls ``sbatch``.

Signals: ``#SBATCH --signal=USR2@N`` and ``scancel --signal=USR2`` reach the tasks, whose
``--exit-signal-handler`` saves a checkpoint and exits 0; the batch step then sees an unfinished
run with a new checkpoint and resubmits. Should USR2 reach the batch step itself (``B:USR2``,
``scancel --full``), it is forwarded to ``srun``, which forwards it to the tasks, and the batch
step keeps waiting for them. SIGTERM (``scancel``, the time limit) means stop: the batch step
waits for the tasks (which save) and does not resubmit.

Resubmission needs progress: a job that leaves no newer checkpoint is not resubmitted, so a run
that fails at start-up does not loop. Progress is the newest checkpoint either tracker names
(--save's, and under ``--non-persistent-ckpt-type global`` the non-persistent one's, which a
restart resumes when it is newer). A run is finished when it reaches ``--train-iters``
(or ``APERTUS_TARGET_ITERATION``, which ``submit`` sets for sample-based runs).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron.apertus.checkpoint_files import (
    latest_iteration,
    non_persistent_dir,
    unfinished_checkpoints,
)

NETWORK_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed collective ends the job instead of hanging
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # megatron-core orders TP/SP communication before compute
    "NCCL_DEBUG": "WARN",
}
"""Set for the tasks unless the job's environment already sets them (site settings win)."""
INITIAL_LOAD_FLAGS = ("--finetune", "--no-load-optim", "--no-load-rng")
"""Megatron-LM switches that start a new phase from another run's checkpoint (weights only, or
without its optimizer or RNG states); with them on every restart, a resubmitted job would
start the phase over from its own latest checkpoint."""
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.I)
DEFAULT_MAX_RESUBMISSIONS = 20


def log(message: str) -> None:
    print(f"apertus-launch: {message}", flush=True)


# -- the command line of a run ---------------------------------------------------------------


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag VALUE`` or ``--flag=VALUE``; last one wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def with_flag(args: list[str], flag: str, value: str | None = None) -> list[str]:
    """``args`` with ``flag`` (and its value) set: replaced where present, else appended."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = value is not None
        elif not arg.startswith(flag + "="):
            kept.append(arg)
    return kept + [flag] + ([value] if value is not None else [])


@dataclass(frozen=True)
class Run:
    """A run as the launcher sees it: an entry point with flags, and a directory for its
    snapshots and trigger files. Runs with ``--save`` are resumable; others (teacher logits)
    just run."""

    run_dir: Path
    command: list[str]

    @property
    def save_dir(self) -> Path | None:
        save = flag_value(self.command, "--save")
        return Path(save) if save else None

    @property
    def trigger_dir(self) -> Path:
        return Path(flag_value(self.command, "--trigger-path") or self.run_dir / "triggers")

    @property
    def target_iteration(self) -> int | None:
        value = flag_value(self.command, "--train-iters") or os.environ.get(
            "APERTUS_TARGET_ITERATION"
        )
        return int(value) if value else None

    @property
    def non_persistent_dir(self) -> Path | None:
        """Where the run keeps Megatron-LM's global non-persistent checkpoints, if it does (a
        resumed run loads them from there too: its ``--load`` is ``--save``)."""
        if self.save_dir is None:
            return None
        if flag_value(self.command, "--non-persistent-ckpt-type") != "global":
            return None
        explicit = flag_value(self.command, "--non-persistent-global-ckpt-dir")
        return non_persistent_dir(self.save_dir, explicit)

    def checkpoint_dirs(self) -> list[Path]:
        """The directories of the run's checkpoints, each with its own tracker."""
        return [d for d in (self.save_dir, self.non_persistent_dir) if d is not None]

    def latest(self) -> int | None:
        """The iteration a restart resumes from: the newest the trackers name (a non-persistent
        checkpoint newer than the persistent one is resumed, as ``--load`` does)."""
        found = [latest_iteration(d) for d in self.checkpoint_dirs()]
        return max((it for it in found if it is not None), default=None)

    def finished(self) -> bool:
        latest, target = self.latest(), self.target_iteration
        return latest is not None and target is not None and latest >= target

    def exit_requested(self) -> bool:
        return (self.trigger_dir / "exit").exists()

    def training_command(self) -> list[str]:
        """The command with the launcher's contract: signal handler, trigger directory, and
        ``--load`` of the save directory once it holds a checkpoint (resumption wins over an
        initial ``--load``, and the flags that say how to take that initial checkpoint,
        ``INITIAL_LOAD_FLAGS``, go with it: a resumed run loads its own optimizer, RNG and
        iteration)."""
        command = self.command
        if self.save_dir is None:
            return command
        command = with_flag(command, "--exit-signal-handler")
        command = with_flag(command, "--trigger-path", str(self.trigger_dir))
        if self.latest() is not None:
            command = with_flag(command, "--load", str(self.save_dir))
            command = [arg for arg in command if arg not in INITIAL_LOAD_FLAGS]
        return command


# -- snapshots -------------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


QUERY_ATTEMPTS = 5
"""How often a Slurm query is tried before its failure counts."""


def slurm_query(
    command: list[str], env: dict[str, str] | None = None, attempts: int = QUERY_ATTEMPTS
) -> str:
    """The output of a read-only Slurm command (``scontrol show ...``), retried with a growing
    pause: a busy slurmctld drops connections, and the client then dies of SIGPIPE or reports a
    socket timeout, though it answers a moment later. Only queries are retried; a repeated
    ``sbatch`` could queue a job twice."""
    for attempt in range(1, attempts + 1):
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode == 0:
            return proc.stdout
        if attempt < attempts:
            time.sleep(attempt)
    raise subprocess.CalledProcessError(proc.returncode, command, proc.stdout, proc.stderr)


def _output_of(command: list[str], cwd: Path | None = None) -> str:
    """A command's output, or why there is none (snapshots never fail the job)."""
    try:
        proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"$ {shlex.join(command)}\n(not available: {err})\n"
    return f"$ {shlex.join(command)}\n{proc.stdout}{proc.stderr}"


def environment_text(env: dict[str, str]) -> str:
    """The environment, with the values of secret-looking variables withheld."""
    return "".join(
        f"{k}={'<withheld>' if SECRET.search(k) else v}\n" for k, v in sorted(env.items())
    )


def snapshot_job(directory: Path, repo: Path, srun: list[str], env: dict[str, str]) -> None:
    """What this job ran and where: command, Slurm's record, environment, code version."""
    _write(directory / "command.txt", shlex.join(srun) + "\n")
    _write(directory / "slurm.txt", _output_of(["scontrol", "show", "job", env["SLURM_JOB_ID"]]))
    _write(directory / "environment.txt", environment_text(env))
    git = [["git", "rev-parse", "HEAD"], ["git", "status", "--short"], ["git", "diff", "--stat"]]
    _write(directory / "git.txt", "".join(_output_of(c, cwd=repo) for c in git))


def snapshot_task(directory: Path, rank: int, local_rank: int) -> None:
    """The Python packages (once per job) and GPUs (once per node) the tasks see."""
    host = os.uname().nodename
    if rank == 0:
        _write(directory / "python.txt", f"{sys.executable}\n{sys.version}\n")
        _write(directory / "pip-freeze.txt", _output_of([sys.executable, "-m", "pip", "freeze"]))
    if local_rank == 0:
        _write(directory / f"gpus-{host}.txt", _output_of(["nvidia-smi"]))


# -- one job ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """This Slurm job, from the variables Slurm sets in the batch step."""

    id: str
    name: str
    nodelist: str

    @classmethod
    def from_env(cls) -> "Job":
        if "SLURM_JOB_ID" not in os.environ:
            raise SystemExit(
                "apertus-launch: not inside a Slurm job; submit the script with "
                "examples/slurm/submit.sh SCRIPT (it checks the layout first)"
            )
        env = os.environ
        return cls(
            id=env["SLURM_JOB_ID"], name=env["SLURM_JOB_NAME"], nodelist=env["SLURM_JOB_NODELIST"]
        )

    def master_addr(self) -> str:
        """The first host of the allocation (``scontrol show hostnames``)."""
        return slurm_query(["scontrol", "show", "hostnames", self.nodelist]).split()[0]

    def master_port(self, master_addr: str) -> int:
        """The rendezvous port: ``MASTER_PORT`` when the submitting environment exports one;
        else one the operating system finds free on the rendezvous host, which is where the
        batch step runs (the allocation's first host), so that no other job or program that
        holds a port there collides with this job; else (a batch step elsewhere) one derived
        from the job id."""
        if os.environ.get("MASTER_PORT"):
            return int(os.environ["MASTER_PORT"])
        if master_addr.split(".")[0] == socket.gethostname().split(".")[0]:
            return free_port()
        return 10000 + int(self.id) % 20000


def free_port() -> int:
    """A TCP port that no process on this host holds now (the operating system's choice)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def container_prefix(repo: Path, run_dir: Path) -> tuple[list[str], list[str]]:
    """(``srun`` options, command prefix) that run the tasks in ``APERTUS_CONTAINER_IMAGE``.

    ``APERTUS_CONTAINER_RUNTIME=pyxis`` (default) uses ``srun --container-image``;
    ``apptainer`` wraps the task in ``apptainer exec --nv``. The repository and the run directory
    are mounted at their own paths, plus ``APERTUS_CONTAINER_MOUNTS`` (comma-separated).
    """
    image = os.environ.get("APERTUS_CONTAINER_IMAGE")
    if not image:
        return [], []
    mounts = [str(repo), str(run_dir)] + [
        m for m in os.environ.get("APERTUS_CONTAINER_MOUNTS", "").split(",") if m
    ]
    runtime = os.environ.get("APERTUS_CONTAINER_RUNTIME", "pyxis")
    if runtime == "pyxis":
        binds = ",".join(m if ":" in m else f"{m}:{m}" for m in mounts)
        return [
            f"--container-image={image}",
            f"--container-mounts={binds}",
            f"--container-workdir={os.getcwd()}",
        ], []
    if runtime == "apptainer":
        return [], ["apptainer", "exec", "--nv", "--bind", ",".join(mounts), image]
    raise SystemExit(
        f"apertus-launch: APERTUS_CONTAINER_RUNTIME must be pyxis or apptainer, " f"got {runtime!r}"
    )


def task_python() -> str:
    """The tasks' interpreter: ``APERTUS_PYTHON``, else this one (outside a container) or the
    container's ``python3``."""
    default = "python3" if os.environ.get("APERTUS_CONTAINER_IMAGE") else sys.executable
    return os.environ.get("APERTUS_PYTHON", default)


def srun_command(repo: Path, run: Run, command: list[str]) -> list[str]:
    options, prefix = container_prefix(repo, run.run_dir)
    entry = str(repo / command[0])
    return [
        "srun",
        "--kill-on-bad-exit=1",
        *options,
        *prefix,
        task_python(),
        "-m",
        "megatron.apertus.launch",
        "task",
        "--run-dir",
        str(run.run_dir),
        "--",
        entry,
        *command[1:],
    ]


def task_environment(job: Job, repo: Path) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in NETWORK_DEFAULTS.items():
        env.setdefault(key, value)
    env.setdefault("OMP_NUM_THREADS", env.get("SLURM_CPUS_PER_TASK", "1"))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(repo)]
    env["PYTHONPATH"] = os.pathsep.join([str(repo), *paths])
    env["MASTER_ADDR"] = job.master_addr()
    env["MASTER_PORT"] = str(job.master_port(env["MASTER_ADDR"]))
    return env


class _SignalWatch:
    """Signals that reach the batch step while it waits for ``srun``."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.received: list[int] = []
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        self.received.append(signum)
        log(f"batch step received {signal.Signals(signum).name}")
        if signum == signal.SIGUSR2 and self.proc is not None:
            self.proc.send_signal(signal.SIGUSR2)  # srun forwards it to every task

    @property
    def terminated(self) -> bool:
        return signal.SIGTERM in self.received


def _run_step(command: list[str], env: dict[str, str], watch: _SignalWatch) -> int:
    watch.proc = subprocess.Popen(command, env=env)
    if signal.SIGUSR2 in watch.received:  # it came before srun existed
        watch.proc.send_signal(signal.SIGUSR2)
    return watch.proc.wait()  # a handled signal interrupts wait(), which then resumes


def _script_path(job: Job) -> str:
    """The submitted script: as ``submit`` recorded it, else from Slurm's job record."""
    if os.environ.get("APERTUS_SBATCH_SCRIPT"):
        return os.environ["APERTUS_SBATCH_SCRIPT"]
    record = slurm_query(["scontrol", "show", "job", job.id])
    return re.search(r"Command=(\S+)", record).group(1)


def resubmit(job: Job, count: int) -> str | None:
    """Queue the same script behind this job (singleton: same name, starts after it ends);
    its job id, or None when sbatch refused (logged)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env["APERTUS_RESUBMISSION"] = str(count + 1)
    options = shlex.split(os.environ.get("APERTUS_SBATCH_OPTIONS", ""))
    command = [
        "sbatch",
        "--parsable",
        *options,
        f"--job-name={job.name}",
        "--dependency=singleton",
        _script_path(job),
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode:
        log(f"resubmission failed: {shlex.join(command)}: {proc.stderr.strip()}")
        return None
    return proc.stdout.strip().split(";")[0]


def _should_resubmit(run: Run, start: int | None, watch: _SignalWatch) -> str | None:
    """Why the run must not be resubmitted, or None when it should be."""
    end = run.latest()
    if run.finished():
        return f"the run is finished (iteration {end})"
    if run.exit_requested():
        return f"{run.trigger_dir / 'exit'} asks the run to stop"
    if watch.terminated:
        return "the job was terminated (scancel or time limit)"
    if end is None or (start is not None and end <= start):
        return "this job saved no new checkpoint (see the log above); fix it and resubmit"
    count = int(os.environ.get("APERTUS_RESUBMISSION", "0"))
    limit = int(os.environ.get("APERTUS_MAX_RESUBMISSIONS", DEFAULT_MAX_RESUBMISSIONS))
    if count >= limit:
        return f"{count} resubmissions reached APERTUS_MAX_RESUBMISSIONS ({limit})"
    return None


def _prepare(run: Run) -> str | None:
    """Before the tasks start: why there is nothing to run, or None; removes unfinished
    checkpoints (a job killed while saving leaves one)."""
    if run.save_dir is None:
        return None
    if run.exit_requested():
        return f"{run.trigger_dir / 'exit'} exists: not starting (remove it to continue the run)"
    if run.finished():
        return f"the run is already finished (iteration {run.latest()})"
    for directory in run.checkpoint_dirs():  # each against its own tracker
        for path in unfinished_checkpoints(directory):
            tracked = latest_iteration(directory)
            log(f"removing unfinished checkpoint {path} (tracker: iteration {tracked})")
            shutil.rmtree(path)
    run.trigger_dir.mkdir(parents=True, exist_ok=True)  # where users touch save / exit
    return None


def batch(run: Run, repo: Path) -> int:
    """The batch step of a job: prepare, run the tasks, resubmit if unfinished."""
    watch = _SignalWatch()  # before anything else: USR2's default action would end this step
    job = Job.from_env()
    reason = _prepare(run)
    if reason:
        log(reason)
        return 0
    start = run.latest()
    log(
        f"job {job.id} ({job.name}): "
        + (f"resuming from iteration {start}" if start is not None else "starting")
    )
    command = srun_command(repo, run, run.training_command())
    env = task_environment(job, repo)
    snapshot_job(run.run_dir / "jobs" / job.id, repo, command, env)
    started = time.monotonic()
    rc = _run_step(command, env, watch)
    log(
        f"srun exited {rc} after {time.monotonic() - started:.0f} s; checkpoint at iteration "
        f"{run.latest()}"
    )
    if run.save_dir is None:
        return rc
    reason = _should_resubmit(run, start, watch)
    if reason:
        log(f"not resubmitting: {reason}")
        return rc
    count = int(os.environ.get("APERTUS_RESUBMISSION", "0"))
    new_job = resubmit(job, count)
    if new_job is None:
        return rc or 1
    log(
        f"resubmitted as job {new_job} (resubmission {count + 1}), resuming from iteration "
        f"{run.latest()}"
    )
    return rc


def task(run: Run) -> None:
    """One ``srun`` task: torch.distributed's variables from Slurm's, snapshot, exec."""
    env = os.environ
    rank, local_rank = int(env["SLURM_PROCID"]), int(env["SLURM_LOCALID"])
    env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=env["SLURM_NTASKS"])
    snapshot_task(run.run_dir / "jobs" / env["SLURM_JOB_ID"], rank, local_rank)
    os.execv(sys.executable, [sys.executable, *run.command])


def dry_run(path: str, run: Run, gpu_memory_gib: float | None) -> None:
    """What ``submit`` asks of a script before queueing it: its run, as JSON."""
    record = {"run_dir": str(run.run_dir), "command": run.command, "gpu_memory_gib": gpu_memory_gib}
    _write(Path(path), json.dumps(record))
