"""``python -m megatron.apertus.launch {submit,batch,task}``: see ``launch/slurm.py``.

``batch`` and ``task`` import only the standard library (the batch step may run on a host
Python without torch); ``submit`` needs the planner, hence torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _after_dashes(values: list[str]) -> list[str]:
    return values[1:] if values[:1] == ["--"] else values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron.apertus.launch")
    commands = parser.add_subparsers(dest="action", required=True)
    submit = commands.add_parser("submit", help="plan a script's layout, then sbatch it")
    submit.add_argument("script", type=Path)
    submit.add_argument("--plan-only", action="store_true", help="check and print, do not queue")
    submit.add_argument("--gpu-memory-gib", type=float, help="override the script's declaration")
    submit.add_argument("--usable-fraction", type=float, default=0.9)
    submit.add_argument(
        "sbatch_options",
        nargs=argparse.REMAINDER,
        help="-- then sbatch options (they override the script's #SBATCH lines)",
    )
    for name, text in (("batch", "the batch step of a job"), ("task", "one srun task")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument(
            "--run-dir",
            type=Path,
            required=True,
            help="job snapshots (jobs/ID/) and trigger files (triggers/)",
        )
        if name == "batch":
            sub.add_argument(
                "--gpu-memory-gib",
                type=float,
                help="memory of the GPUs the script is written for (submit checks it)",
            )
        sub.add_argument("run", nargs=argparse.REMAINDER, help="-- ENTRY_POINT FLAGS...")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.action == "submit":
        from megatron.apertus.launch.submit import submit

        return submit(
            args.script,
            _after_dashes(args.sbatch_options),
            plan_only=args.plan_only,
            gpu_memory_gib=args.gpu_memory_gib,
            usable_fraction=args.usable_fraction,
        )
    from megatron.apertus.launch import slurm

    run = slurm.Run(run_dir=args.run_dir.resolve(), command=_after_dashes(args.run))
    if not run.command:
        sys.exit(f"{args.action}: give the entry point and its flags after --")
    if args.action == "task":
        slurm.task(run)
    if os.environ.get("APERTUS_DRY_RUN"):
        slurm.dry_run(os.environ["APERTUS_DRY_RUN"], run, args.gpu_memory_gib)
        return 0
    return slurm.batch(run, Path(os.environ.get("APERTUS_REPO") or Path.cwd()))


if __name__ == "__main__":
    sys.exit(main())
