"""--check-weight-hash-across-dp-replicas-interval: Megatron-LM's guard against silent data
corruption. Every N iterations each rank hashes its weights and the ranks that must hold
identical weights compare the hashes; a mismatch stops the run with one line naming the ranks.

Which ranks are replicas: those of megatron-core's data- and context-parallel group (``dp_cp``
of the model's process groups). Context-parallel ranks split the tokens, not the weights, and
DDP reduces the gradients over ``dp_cp``, so all of its ranks hold the same weights after every
step; checking the wider group catches more than Megatron-LM's data-parallel group alone. The
distributed optimizer updates one shard per rank and gathers the weights afterwards (under
--overlap-param-gather in the next forward pass: :func:`synced_parameters` gathers them now),
so the invariant holds with it too.

Hashes are SHA-256 of each parameter's bytes (no dtype conversion), taken on the host: the
check copies every weight to the CPU, which is why it runs at an interval.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter

import torch

from megatron.apertus.errors import ReplicasDiverged
from megatron.apertus.model.builder import chunk_groups
from megatron.apertus.training.step import model_device, synced_parameters

log = logging.getLogger("apertus")


def weight_hashes(model: list[torch.nn.Module]) -> tuple[list[str], torch.Tensor]:
    """The names of the chunks' parameters (``chunk<i>.<name>``) and their SHA-256 digests, one
    row of 32 bytes each."""
    names, digests = [], []
    for i, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            data = param.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            names.append(f"chunk{i}.{name}")
            digests.append(
                torch.frombuffer(
                    bytearray(hashlib.sha256(data.numpy()).digest()), dtype=torch.uint8
                )
            )
    return names, torch.stack(digests)


def differing_replicas(
    names: list[str], local: torch.Tensor, group: torch.distributed.ProcessGroup
) -> dict[int, list[str]]:
    """The global ranks of ``group`` whose hashes differ from the replicas' majority (a tie: the
    group's first rank's), each with the names of its differing parameters; empty when all
    agree. Every rank of ``group`` gets the same answer (the hashes are all-gathered)."""
    gathered = [torch.empty_like(local) for _ in range(group.size())]
    torch.distributed.all_gather(gathered, local, group=group)
    gathered = [g.cpu() for g in gathered]
    votes = Counter(g.numpy().tobytes() for g in gathered)
    reference = max(gathered, key=lambda g: votes[g.numpy().tobytes()])
    ranks = torch.distributed.get_process_group_ranks(group)
    differing = {}
    for rank, hashes in zip(ranks, gathered):
        rows = (hashes != reference).any(dim=1).nonzero().flatten().tolist()
        if rows:
            differing[rank] = [names[row] for row in rows]
    return differing


def divergence_line(
    differing: dict[int, list[str]], iteration: int, matched: int | None, ranks: list[int]
) -> str:
    """The one line that stops the run: the iteration of the check, the last that matched, and
    each differing rank with its first differing parameter."""
    since = "no check before" if matched is None else f"they matched at iteration {matched}"
    parts = [
        f"rank {rank} in {', '.join(params[:3])}"
        + (f" and {len(params) - 3} more" if len(params) > 3 else "")
        for rank, params in sorted(differing.items())
    ]
    return (
        f"the weights of the data-parallel replicas (ranks {', '.join(map(str, ranks))}) differ "
        f"at iteration {iteration} ({since}): " + "; ".join(parts) + "; silent data corruption "
        "on those ranks' devices or links (--check-weight-hash-across-dp-replicas-interval)"
    )


class ReplicaCheck:
    """Compares the replicas' weights every ``interval`` iterations (None: never)."""

    def __init__(self, interval: int | None, model: list, *, reporting: bool) -> None:
        self.interval, self.model, self.reporting = interval, model, reporting
        self.group = chunk_groups(model[0]).dp_cp
        self.matched: int | None = None

    def after_step(self, iteration: int) -> None:
        """:meth:`check` when ``iteration`` is a multiple of the interval."""
        if self.interval is not None and iteration % self.interval == 0:
            self.check(iteration)

    def check(self, iteration: int) -> None:
        """Compare the replicas' weights now (with an interval: Megatron-LM checks once before
        the first step too); raise :class:`ReplicasDiverged` when they differ. A collective:
        every rank calls it at the same iteration."""
        if self.interval is None:
            return
        with synced_parameters(self.model):
            names, local = weight_hashes(self.model)
        local = local.to(model_device(self.model[0]))
        differing = differing_replicas(names, local, self.group)
        if differing:
            ranks = torch.distributed.get_process_group_ranks(self.group)
            raise ReplicasDiverged(divergence_line(differing, iteration, self.matched, ranks))
        self.matched = iteration
        if self.reporting:
            log.info(f">>> Weight hashes match after {iteration} iterations...")
