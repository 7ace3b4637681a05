"""megatron-core's distributed optimizer running AdEMAMix, with all three moments in checkpoints.

megatron-core 0.16.1's ``DistributedOptimizer`` shards any inner optimizer's state over the
data-parallel ranks, but it was written for Adam (docs/megatron_core_changes.md lists why each
override exists):

* its constructor asserts the inner optimizer is an Adam ("due to checkpointing requirements");
* the gather behind the ``fully_reshardable`` checkpoint format (and ``save_parameter_state``)
  copies the literal keys ``param``, ``exp_avg``, ``exp_avg_sq``: AdEMAMix's ``exp_avg_slow``
  would silently be left out;
* without Transformer Engine or Apex, ``state_dict()`` asserts the inner optimizer already has
  state (so a fresh optimizer cannot build a load template), and loading copies a ``step`` entry
  that the checkpoint formats never carry (KeyError); with them, the step is read from
  param-group keys that only their fused Adam keeps.

The overrides keep every other path of megatron-core's class (sharding, gradient copies,
parameter all-gather, the ``dp_reshardable`` format, which already enumerates whatever state the
inner optimizer holds). Checkpoint formats: ``fully_reshardable`` (any TP/PP/DP on load) and
``dp_reshardable`` work; ``fully_sharded_model_space`` fails in megatron-core 0.16.1 itself
(its ShardedTensors use the unsupported ``flattened_range``), for Adam too; the deprecated
``dp_zero_gather_scatter`` and the legacy torch format load only Adam's two moments and are
refused with a clear error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.optimizer import DistributedOptimizer

from megatron.apertus.optim.ademamix import STATE_KEYS, AdEMAMix

PARAM_STATE_KEYS = ("param", *STATE_KEYS)
"""Per-parameter tensors a checkpoint holds: the fp32 main parameter and the three moments."""


class AdEMAMixDistributedOptimizer(DistributedOptimizer):
    """``DistributedOptimizer`` whose inner optimizer is :class:`AdEMAMix`.

    ``optimizer`` is an AdEMAMix over megatron-core's (unsharded) param groups; the arguments
    after it are ``DistributedOptimizer``'s. The common step lives in each parameter's ``step``
    tensor and is checkpointed as ``param_groups[i]["step"]`` in every case.
    """

    def __init__(self, optimizer: AdEMAMix, *args, **kwargs) -> None:
        # The parent only admits an Adam: let it shard a stand-in AdamW over the same parameters
        # (it holds no state), then give AdEMAMix the sharded groups it built, in group order.
        # Assigned, not added: shards are views, which add_param_group refuses (as for Adam).
        stand_in = torch.optim.AdamW([{"params": g["params"]} for g in optimizer.param_groups])
        super().__init__(stand_in, *args, **kwargs)
        optimizer.param_groups = [
            {**group, "params": shard["params"]}
            for group, shard in zip(optimizer.param_groups, self.optimizer.param_groups)
        ]
        self.optimizer = optimizer

    def _common_step(self) -> float:
        steps = {state["step"].item() for state in self.optimizer.state.values()}
        if len(steps) > 1:
            raise RuntimeError(f"AdEMAMix parameters are at different steps: {sorted(steps)}")
        return steps.pop() if steps else 0.0

    def state_dict(self) -> dict:
        self.optimizer.initialize_state()
        state_dict = super().state_dict()
        step = self._common_step()
        for group in state_dict["optimizer"]["param_groups"]:
            group["step"] = step
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        # With state allocated, the parent reuses our tensors (all three moments) instead of
        # allocating Adam's two.
        self.optimizer.initialize_state()
        super().load_state_dict(state_dict)
        steps = {group["step"] for group in state_dict["optimizer"]["param_groups"]}
        if len(steps) != 1:
            raise RuntimeError(f"optimizer checkpoint holds no single step: {sorted(steps)}")
        step = steps.pop()
        for group in self.optimizer.param_groups:
            group.pop("step", None)
            for param in group["params"]:
                self.optimizer.state[param]["step"] = torch.tensor(step, dtype=torch.float32)

    @torch.no_grad()
    def _set_main_param_and_optimizer_states(self, model_param, tensors: dict) -> None:
        """Copy a loaded main-parameter shard and its moments; the step comes from param groups.

        Without autograd: fp32 main parameters are views of the model's (``dp_reshardable``
        loads call this with grad mode on, and the parent's copy fails there).
        """
        missing = [key for key in PARAM_STATE_KEYS if key not in tensors]
        if missing:
            raise KeyError(
                f"the optimizer checkpoint has no {missing} for a parameter: it was saved in a "
                "format that keeps only Adam's moments (dp_zero_gather_scatter or the legacy "
                "torch format); AdEMAMix needs fully_reshardable or dp_reshardable"
            )
        destination = self._get_main_param_and_optimizer_states(model_param)
        for key in PARAM_STATE_KEYS:
            destination[key].copy_(tensors[key])

    def get_parameter_state_dp_zero(
        self,
        use_gloo_comm: bool = True,
        empty_data: bool = False,
        return_on_all_ranks: bool = False,
    ) -> dict | None:
        """Every rank's shards of the main parameters and all moments, concatenated per buffer.

        Same layout and arguments as megatron-core's method (which it replaces because that one
        gathers a fixed key list): ``state[gbuf_idx][dtype][key]`` is a CPU fp32 tensor over the
        buffer without bucket padding; ``numel_unpadded`` its length. Returned on DP rank 0, or
        on every rank with ``return_on_all_ranks``; ``empty_data`` skips the gather (zeros).
        """
        group = self.data_parallel_group_gloo if use_gloo_comm else self.data_parallel_group
        keep = group.rank() == 0 or return_on_all_ranks
        comm_device = "cpu" if use_gloo_comm else torch.cuda.current_device()
        state: dict = {"buckets_coalesced": True}
        for gbuf_idx, gbuf_range_maps in enumerate(self.gbuf_ranges):
            buffer = self.buffers[gbuf_idx]
            state[gbuf_idx] = {}
            for dtype, bucket_range_maps in gbuf_range_maps.items():
                world = {}
                if keep:
                    world = {k: torch.zeros(buffer.numel_unpadded) for k in PARAM_STATE_KEYS}
                    world["numel_unpadded"] = buffer.numel_unpadded
                offset = 0
                for bucket, range_map in zip(buffer.buckets, bucket_range_maps):
                    if not empty_data:
                        for key, shard in self._bucket_shards(bucket, range_map, group).items():
                            parts = _gather(shard.to(comm_device), group, keep, return_on_all_ranks)
                            if keep:
                                gathered = torch.cat([part.cpu() for part in parts])
                                end = offset + bucket.numel_unpadded
                                world[key][offset:end].copy_(gathered[: bucket.numel_unpadded])
                    offset += bucket.numel_unpadded
                state[gbuf_idx][dtype] = world
        return state if keep else None

    def _bucket_shards(self, bucket, range_map: dict, group) -> dict[str, torch.Tensor]:
        """This rank's contiguous slice of ``bucket`` for each of PARAM_STATE_KEYS (CPU fp32)."""
        numel = bucket.grad_data.numel() // group.size()
        shards = {key: torch.zeros(numel) for key in PARAM_STATE_KEYS}
        for model_param, ranges in range_map["param_map"].items():
            tensors = self._get_main_param_and_optimizer_states(model_param)
            local = ranges["gbuf_local"]
            for key, shard in shards.items():
                shard[local.start : local.end].copy_(tensors[key].detach())
        return shards


def _gather(tensor: torch.Tensor, group, keep: bool, to_all: bool) -> list[torch.Tensor] | None:
    """All-gather, or gather on the group's first rank; the parts where ``keep``, else None."""
    parts = [torch.empty_like(tensor) for _ in range(group.size())] if keep else None
    if to_all:
        dist.all_gather(parts, tensor, group=group)
    else:
        dist.gather(tensor, parts, dst=dist.get_process_group_ranks(group)[0], group=group)
    return parts
