"""Compare two replicas' weights with :mod:`megatron.apertus.training.replica_check` on a real
2-process gloo world.

    torchrun --nproc-per-node 2 tests/training/replica_worker.py [--perturb-rank R]

Every rank builds the same small model (same seed), its data- and context-parallel group the
whole world, and checks it at iteration 1 (identical: the match line). With ``--perturb-rank``,
that rank then moves one entry of one weight by one ulp, and the check at iteration 2 stops the
program as a run stops: one line, exit 2 (:func:`megatron.apertus.cli.run`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402

from megatron.apertus.cli import run  # noqa: E402
from megatron.apertus.training.replica_check import ReplicaCheck  # noqa: E402


def replica() -> torch.nn.Module:
    """A model of two layers, the same on every rank; it carries its process groups as the
    package's model chunks do, and gathers no parameters in a forward hook."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model.pg_collection = ProcessGroupCollection(dp_cp=torch.distributed.group.WORLD)
    model.use_forward_hook = False
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--perturb-rank", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    model = replica()
    check = ReplicaCheck(1, [model], reporting=rank == 0)
    check.after_step(1)
    if rank == args.perturb_rank:
        with torch.no_grad():
            weight = model[1].weight
            weight[2, 3] = torch.nextafter(weight[2, 3], torch.tensor(1.0))
    check.after_step(2)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run(main)
