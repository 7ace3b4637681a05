"""Run ``pretrain_gpt.py`` and keep every parameter's gradient of its first step.

    python tests/parallel/grad_worker.py GRADS_PREFIX [--without-cp-reduction] -- PRETRAIN_FLAGS
        (alone or under torchrun)

Each rank writes ``GRADS_PREFIX.rank<R>.pt``, a dict of

* ``grads``: ``{parameter name: gradient}`` as the optimizer receives it after the first backward
  pass (DDP's ``main_grad``, reduced over the data- and context-parallel ranks and normalised as
  the run's flags say), before the step updates the weights: this rank's shard of a weight split
  over the tensor-parallel ranks;
* ``splits``: ``{parameter name: (partition_dim, partition_stride)}`` for those split weights,
  megatron-core's own attributes of the parameter (set where ``tensor_model_parallel`` is);
* ``tp_ranks``: the global ranks of this rank's tensor-parallel group, in TP-rank order.

The run goes on as ``pretrain_gpt.py`` runs it (same flags, same exit status).

``--without-cp-reduction`` is the negative control of the context-parallel comparisons: in this
process only, DDP's gradient reduction and the reported loss's sum leave out the context-parallel
ranks, so each rank keeps the gradient and loss of its own share of the tokens.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
USAGE = "usage: grad_worker.py GRADS_PREFIX [--without-cp-reduction] -- PRETRAIN_FLAGS"


def without_cp_reduction() -> None:
    """Break the two reductions over the context-parallel ranks: megatron-core DDP's gradient
    all-reduce over ``dp_cp`` (skipped: the control runs with one data-parallel rank, where
    ``dp_cp`` is the CP group) and the loss sums of :mod:`megatron.apertus.training.step`
    (reduced over the model's data-parallel group only). The token count that scales the
    gradients is still the global batch's (megatron-core's ``finalize_model_grads``)."""
    import copy

    from megatron.core.distributed import DistributedDataParallel

    from megatron.apertus.training import step

    reduce_over_dp_cp = step._reduce

    def unreduced(self, force_all_reduce: bool = False) -> None:
        assert self.dp_group.size() == 1, "controls run at DP=1"

    def reduce_over_dp(losses: list, key: str, groups):
        data_parallel_only = copy.copy(groups)
        data_parallel_only.dp_cp = groups.dp
        return reduce_over_dp_cp(losses, key, data_parallel_only)

    DistributedDataParallel.finish_grad_sync = unreduced
    step._reduce = reduce_over_dp


def main() -> None:
    prefix, *options = sys.argv[1:]
    separator = options.index("--") if "--" in options else None
    assert separator is not None and set(options[:separator]) <= {"--without-cp-reduction"}, USAGE
    flags = options[separator + 1 :]
    import torch

    from megatron.apertus.model.builder import chunk_groups
    from tests.conftest import after_backward

    if "--without-cp-reduction" in options[:separator]:
        without_cp_reduction()

    def keep_first(passes: int, model: list) -> None:
        if passes != 1:
            return
        params = {
            f"{i}.{name}": param
            for i, chunk in enumerate(model)
            for name, param in chunk.named_parameters()
        }
        record = {
            "grads": {name: param.main_grad.detach().clone() for name, param in params.items()},
            "splits": {
                name: (param.partition_dim, param.partition_stride)
                for name, param in params.items()
                if getattr(param, "tensor_model_parallel", False)
            },
            "tp_ranks": torch.distributed.get_process_group_ranks(chunk_groups(model[0]).tp),
        }
        torch.save(record, f"{prefix}.rank{os.environ.get('RANK', '0')}.pt")

    sys.argv = [str(REPO / "pretrain_gpt.py"), *flags]
    with after_backward(keep_first):
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
