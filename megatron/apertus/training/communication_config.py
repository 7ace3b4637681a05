"""How gradients, parameters and pipeline activations travel (``--help``'s "communication
overlap" group): megatron-core's ``DistributedDataParallelConfig`` and the pipeline schedules'
overlap switches, with Megatron-LM's refusals of their combinations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help, switch


@dataclass(kw_only=True, frozen=True)
class CommunicationConfig:
    """How gradients, parameters and pipeline activations travel: megatron-core's
    ``DistributedDataParallelConfig`` and the pipeline schedules' overlap switches. None of them
    changes a result, only when communication happens."""

    overlap_grad_reduce: bool = switch(
        "reduce (or, with --use-distributed-optimizer, reduce-scatter) each gradient bucket as "
        "soon as the backward pass has filled it, overlapping communication with computation"
    )
    overlap_param_gather: bool = switch(
        "with --use-distributed-optimizer and --overlap-grad-reduce: all-gather the updated "
        "parameters bucket by bucket just before the next forward pass uses them"
    )
    ddp_bucket_size: Optional[int] = flag_help(
        "gradient elements per communication bucket (default: megatron-core's, max(40M, "
        "1M x data-parallel size) with --overlap-grad-reduce, else one bucket)",
        None,
    )
    overlap_p2p_communication_warmup_flush: bool = switch(
        "interleaved pipeline schedule: also overlap the sends and receives of the warmup and "
        "flush phases with computation (needs virtual pipeline stages)"
    )

    def check(self, *, distributed_optimizer: bool, virtual_pipeline: bool) -> None:
        """Megatron-LM's combinations, refused as it refuses them."""
        if self.overlap_param_gather and not (distributed_optimizer and self.overlap_grad_reduce):
            raise ConfigError(
                "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"
            )
        if self.overlap_p2p_communication_warmup_flush and not virtual_pipeline:
            raise ConfigError(
                "--overlap-p2p-communication-warmup-flush needs virtual pipeline stages "
                "(--num-layers-per-virtual-pipeline-stage or --virtual-pipeline-model-parallel-size)"
            )
        if self.ddp_bucket_size is not None and self.ddp_bucket_size < 1:
            raise ConfigError(f"--ddp-bucket-size must be >= 1, got {self.ddp_bucket_size}")

    def transformer_overrides(self, *, virtual_pipeline: bool) -> dict:
        """TransformerConfig fields: as in Megatron-LM, the interleaved schedule overlaps its
        steady-state sends and receives (unbatched), and the flag adds warmup and flush."""
        if not virtual_pipeline:
            return {}
        return {
            "overlap_p2p_comm": True,
            "overlap_p2p_comm_warmup_flush": self.overlap_p2p_communication_warmup_flush,
        }
