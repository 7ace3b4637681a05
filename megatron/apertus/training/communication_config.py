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
    ddp_num_buckets: Optional[int] = flag_help(
        "with --overlap-grad-reduce: split the gradients into this many buckets of (this rank's "
        "parameters / N) elements each (excludes --ddp-bucket-size)",
        None,
    )
    ddp_average_in_collective: bool = switch(
        "average the gradients in the data-parallel collective (NCCL's AVG) instead of scaling "
        "them by 1 / data-parallel size before a summing one; not with --calculate-per-token-loss "
        "(its gradients are sums), and not on CPU (gloo has no AVG)"
    )
    gradient_reduce_div_fusion: bool = flag_help(
        "--no-gradient-reduce-div-fusion: Megatron-FSDP's division fused into its gradient "
        "reduction off; megatron-core's DDP, the one trained here, scales before it reduces and "
        "has no such fusion, so the flag changes nothing (the positive form is ours)",
        True,
        ours=True,
    )
    overlap_p2p_communication: bool = flag_help(
        "interleaved pipeline schedule: overlap the steady-state sends and receives with "
        "computation, unbatched; --no-overlap-p2p-communication: batched, not overlapped, which "
        "needs --pipeline-model-parallel-size > 2 (the positive form is ours)",
        True,
        ours=True,
    )
    microbatch_group_size_per_virtual_pipeline_stage: Optional[int] = flag_help(
        "interleaved pipeline schedule: micro-batches each virtual stage runs in a row before the "
        "next stage's (default: --pipeline-model-parallel-size); between the pipeline size and "
        "the step's micro-batches",
        None,
    )
    overlap_p2p_communication_warmup_flush: bool = switch(
        "interleaved pipeline schedule: also overlap the sends and receives of the warmup and "
        "flush phases with computation (needs virtual pipeline stages)"
    )

    def check(
        self,
        *,
        distributed_optimizer: bool,
        virtual_pipeline: bool,
        pipeline: int = 1,
        device: str = "cpu",
        per_token_loss: bool = False,
    ) -> None:
        """Megatron-LM's and megatron-core's combinations, refused as they refuse them;
        ``pipeline``: the pipeline-parallel size."""
        if self.overlap_param_gather and not (distributed_optimizer and self.overlap_grad_reduce):
            raise ConfigError(
                "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"
            )
        if self.overlap_p2p_communication_warmup_flush and not virtual_pipeline:
            raise ConfigError(
                "--overlap-p2p-communication-warmup-flush needs virtual pipeline stages "
                "(--num-layers-per-virtual-pipeline-stage or --virtual-pipeline-model-parallel-size)"
            )
        for flag, value in (
            ("--ddp-bucket-size", self.ddp_bucket_size),
            ("--ddp-num-buckets", self.ddp_num_buckets),
        ):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        if self.ddp_num_buckets is not None and self.ddp_bucket_size is not None:
            raise ConfigError("--ddp-num-buckets and --ddp-bucket-size exclude each other")
        self._check_average_in_collective(device, per_token_loss)
        self._check_interleaved(virtual_pipeline, pipeline)

    def _check_average_in_collective(self, device: str, per_token_loss: bool) -> None:
        if not self.ddp_average_in_collective:
            return
        if per_token_loss:
            raise ConfigError(
                "--ddp-average-in-collective and --calculate-per-token-loss exclude each other: "
                "per-token gradients are sums megatron-core divides by the global batch's tokens"
            )
        if device == "cpu":
            raise ConfigError(
                "--ddp-average-in-collective needs a GPU: gloo, the CPU backend, has no AVG "
                "reduction"
            )

    def _check_interleaved(self, virtual_pipeline: bool, pipeline: int) -> None:
        """The interleaved schedule's switches; without it they change nothing, as in
        Megatron-LM, except the group size, which is refused there."""
        group = self.microbatch_group_size_per_virtual_pipeline_stage
        if group is not None and not virtual_pipeline:
            raise ConfigError(
                "--microbatch-group-size-per-virtual-pipeline-stage needs virtual pipeline stages "
                "(--num-layers-per-virtual-pipeline-stage or --virtual-pipeline-model-parallel-size)"
            )
        if group is not None and group < pipeline:
            raise ConfigError(
                f"--microbatch-group-size-per-virtual-pipeline-stage must be >= "
                f"--pipeline-model-parallel-size ({pipeline}), got {group}"
            )
        if not virtual_pipeline or self.overlap_p2p_communication:
            return
        if self.overlap_p2p_communication_warmup_flush:
            raise ConfigError(
                "--overlap-p2p-communication-warmup-flush and --no-overlap-p2p-communication "
                "exclude each other"
            )
        if pipeline <= 2:
            raise ConfigError(
                f"--no-overlap-p2p-communication with virtual pipeline stages needs "
                f"--pipeline-model-parallel-size > 2 (got {pipeline}): batched sends and receives "
                "between the same two ranks would pair up wrongly"
            )

    def transformer_overrides(self, *, virtual_pipeline: bool) -> dict:
        """TransformerConfig fields: as in Megatron-LM, the interleaved schedule overlaps its
        steady-state sends and receives (unbatched) unless --no-overlap-p2p-communication, and
        --overlap-p2p-communication-warmup-flush adds warmup and flush."""
        if not virtual_pipeline:
            return {}
        return {
            "overlap_p2p_comm": self.overlap_p2p_communication,
            "overlap_p2p_comm_warmup_flush": self.overlap_p2p_communication_warmup_flush,
            "microbatch_group_size_per_vp_stage": (
                self.microbatch_group_size_per_virtual_pipeline_stage
            ),
        }
