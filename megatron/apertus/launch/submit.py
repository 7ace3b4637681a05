"""Submit an sbatch script only after its layout passes the planner.

The script itself is the single description of its run: ``submit`` runs it with
``APERTUS_DRY_RUN`` set, so that its ``apertus_launch`` call records the run (entry point,
flags, run directory, declared GPU memory) instead of starting it; it reads the job's shape
from the script's ``#SBATCH`` lines and the extra ``sbatch`` options (these win, as with
``sbatch``), plans the layout on that many GPUs, and either refuses with every reason or
calls ``sbatch`` with what the batch step needs to resubmit the same job later.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megatron.apertus.errors import ConfigError
from megatron.apertus.launch.planner import Cluster, Plan, format_plan, plan, run_from_command

REPO = Path(os.environ.get("APERTUS_REPO") or Path(__file__).resolve().parents[3])


def sbatch_directives(script: Path) -> list[str]:
    """The options of the ``#SBATCH`` lines at the top of ``script`` (where sbatch reads them)."""
    options = []
    for line in script.read_text().splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            options += shlex.split(stripped[len("#SBATCH") :], comments=True)
        elif stripped and not stripped.startswith("#"):
            break
    return options


@dataclass(frozen=True)
class Resources:
    tasks: int
    tasks_per_node: int
    job_name: str | None
    log_files: list[str]
    workdir: Path


def resources(options: list[str]) -> Resources:
    """Tasks (one per GPU) and tasks per node requested by sbatch ``options`` (later win)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("-N", "--nodes", default="1")
    parser.add_argument("-n", "--ntasks", type=int)
    parser.add_argument("--ntasks-per-node", type=int)
    parser.add_argument("--gpus-per-node")
    parser.add_argument("-J", "--job-name")
    parser.add_argument("-o", "--output")
    parser.add_argument("-e", "--error")
    parser.add_argument("-D", "--chdir", default=".")
    args, _ = parser.parse_known_args(options)
    if not args.nodes.isdigit():
        raise ConfigError(f"--nodes={args.nodes}: the planner needs a fixed number of nodes")
    nodes = int(args.nodes)
    per_node = args.ntasks_per_node or (math.ceil(args.ntasks / nodes) if args.ntasks else 1)
    tasks = args.ntasks or nodes * per_node
    if args.gpus_per_node and int(args.gpus_per_node.split(":")[-1]) != per_node:
        raise ConfigError(
            f"--gpus-per-node={args.gpus_per_node} but {per_node} tasks per node: the launcher "
            "runs one process per GPU (set --ntasks-per-node to the GPUs per node)"
        )
    logs = [f for f in (args.output, args.error) if f]
    return Resources(
        tasks=tasks,
        tasks_per_node=per_node,
        job_name=args.job_name,
        log_files=logs,
        workdir=Path(args.chdir),
    )


def read_run(script: Path, env: dict[str, str]) -> dict:
    """Run ``script`` in dry-run mode: its ``apertus_launch`` call records the run."""
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "run.json"
        dry = dict(env, APERTUS_DRY_RUN=str(record), APERTUS_HOST_PYTHON=sys.executable)
        proc = subprocess.run(["bash", str(script)], env=dry, capture_output=True, text=True)
        if proc.returncode or not record.is_file():
            raise ConfigError(
                f"{script} did not describe its run (exit {proc.returncode}); does "
                f"it end with apertus_launch?\n{proc.stdout}{proc.stderr}"
            )
        return json.loads(record.read_text())


def check(
    script: Path,
    options: list[str],
    env: dict[str, str],
    *,
    gpu_memory_gib: float | None,
    usable_fraction: float,
) -> tuple[Plan, Resources, dict]:
    """The plan of ``script`` submitted with ``options``."""
    shape = resources(sbatch_directives(script) + options)
    recorded = read_run(script, env)
    run = run_from_command(recorded["command"])
    memory = gpu_memory_gib or recorded.get("gpu_memory_gib")
    if run.training.device != "cpu" and memory is None:
        raise ConfigError(
            f"{script}: declare the GPU memory (apertus_launch --gpu-memory-gib N) "
            "or pass --gpu-memory-gib to submit"
        )
    cluster = Cluster(
        gpus=shape.tasks,
        gpus_per_node=shape.tasks_per_node,
        gpu_memory_gib=None if run.training.device == "cpu" else memory,
        usable_fraction=usable_fraction,
    )
    return plan(run, cluster), shape, recorded


def job_environment(script: Path, options: list[str], result: Plan) -> dict[str, str]:
    """The environment sbatch exports to the job: what its batch step needs to resubmit."""
    env = dict(os.environ)
    env.update(
        APERTUS_REPO=str(REPO),
        APERTUS_SBATCH_SCRIPT=str(script.resolve()),
        APERTUS_SBATCH_OPTIONS=shlex.join(options),
        APERTUS_RESUBMISSION="0",
    )
    if "APERTUS_CONTAINER_IMAGE" not in env:
        env.setdefault("APERTUS_PYTHON", sys.executable)  # the tasks use the submitting Python
    t = result.run.training
    if t.train_iters is None and result.train_iters is not None:
        env["APERTUS_TARGET_ITERATION"] = str(result.train_iters)
    return env


def submit(
    script: Path,
    options: list[str],
    *,
    plan_only: bool = False,
    gpu_memory_gib: float | None = None,
    usable_fraction: float = 0.9,
) -> int:
    """Plan ``script``'s layout; refuse it with the reasons, or queue it. Returns an exit code."""
    env = dict(os.environ, APERTUS_REPO=str(REPO))
    try:
        result, shape, recorded = check(
            script, options, env, gpu_memory_gib=gpu_memory_gib, usable_fraction=usable_fraction
        )
    except ConfigError as err:
        print(f"submit: {script}: refused: {err}", file=sys.stderr)
        return 1
    print(format_plan(result, name=shape.job_name or script.stem))
    if not result.ok:
        print(f"submit: {script}: refused, nothing was queued", file=sys.stderr)
        return 1
    if plan_only:
        return 0
    for log in shape.log_files:  # sbatch cannot create the directory of its log file
        parent = (shape.workdir / log).parent
        if "%" not in str(parent):
            parent.mkdir(parents=True, exist_ok=True)
    Path(recorded["run_dir"]).mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["sbatch", "--parsable", *options, str(script)],
        capture_output=True,
        text=True,
        env=job_environment(script, options, result),
    )
    if proc.returncode:
        print(f"submit: sbatch failed: {proc.stderr}", file=sys.stderr)
        return proc.returncode
    print(f"submitted job {proc.stdout.strip().split(';')[0]}")
    return 0
