"""Pretrain an Apertus model on megatron-core: parse, train.

python pretrain_gpt.py --model-preset tiny --train-iters 50 --global-batch-size 8
torchrun --nproc-per-node 2 pretrain_gpt.py --tensor-model-parallel-size 2 ...

torch and megatron-core load after the flags are parsed: ``--help`` and argument errors are
instant.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron.apertus.cli import ArgumentParser, Terminated, run
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import ADDITION_MARK, given_destinations
from megatron.apertus.training.checkpoint_config import apply_checkpoint_args
from megatron.apertus.training.config import RunConfig, add_run_arguments, run_from_arguments
from megatron.apertus.training.megatron_flags import add_megatron_flags, refusals


def build_parser() -> argparse.ArgumentParser:
    """Every registered config group's flags, Megatron-LM's flags we accept or refuse, and
    ``--dry-run``. As in Megatron-LM, flags are never abbreviated: ``--xielu`` is a flag of its
    own, not a prefix of ``--xielu-beta``."""
    parser = ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_run_arguments(parser)
    add_megatron_flags(parser)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the flags, print the layout plan (memory and FLOPs per step) for the "
        "processes this command runs as (torchrun's WORLD_SIZE, else Slurm's SLURM_NTASKS, "
        "else 1) and exit without reading data or building the model; exit 1 when the "
        "layout cannot run" + ADDITION_MARK,
    )
    return parser


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """The run a command line describes; exits 2 with one line per flag it cannot honour."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    refused = refusals(args)
    if len(refused) > 1:
        parser.error(f"{len(refused)} flags cannot be honoured:\n  " + "\n  ".join(refused))
    if refused:
        parser.error(refused[0])
    from megatron.apertus.launch.planner import dry_run
    from megatron.apertus.training.objectives import with_objective_output_loss
    from megatron.apertus.training.optimizer import check_schedule

    try:
        restored = apply_checkpoint_args(args)
        if restored and os.environ.get("RANK", "0") == "0":
            print(restored)
        given = given_destinations(parser, argv)
        config = with_objective_output_loss(run_from_arguments(args, given), given)
        check_schedule(config.schedule, config.training)
    except (ConfigError, ValueError) as err:
        parser.error(str(err))
    except RuntimeError as err:  # --device cuda without a GPU
        parser.error(str(err))
    if args.dry_run:
        dry_run(config)
    return config


CHECKPOINTS_KEPT = "the checkpoints saved before it are kept"
"""What an interrupted run leaves: a save cut short stays under its temporary name, which
the next save removes; a resumed run never reads it."""


def main(argv: list[str] | None = None) -> None:
    """Parse and train; user errors and interruptions end in one line (:func:`cli.run`)."""
    config = parse_args(argv)
    from megatron.apertus.distill.logit_store import LogitStoreError
    from megatron.apertus.training.loop import TrainingStopped, train
    from megatron.apertus.training.run_log import configure_logging

    configure_logging(config.checkpoint.save, config.logging.logging_level)
    try:
        train(config)
    except LogitStoreError as err:
        raise ConfigError(str(err)) from None
    except TrainingStopped as err:
        sys.exit(f"pretrain_gpt.py: stopped: {err}")
    except (KeyboardInterrupt, Terminated):
        if not config.training.exit_signal_handler_for_training:
            raise
        # Megatron-LM's orderly shutdown: one line, exit 0; the run's cleanups have run.
        print(f"pretrain_gpt.py: termination requested; {CHECKPOINTS_KEPT}", file=sys.stderr)


if __name__ == "__main__":
    run(main, kept=CHECKPOINTS_KEPT)
