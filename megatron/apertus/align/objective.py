"""Alignment micro-batches and the loss megatron-core's schedules reduce.

A micro-batch of ``m`` examples holds ``m * g`` rows (g completions per example, DPO's chosen
then rejected), each its own causal sequence padded to ``seq_length``; the model returns
per-token losses (``-log p`` of each label) and :func:`alignment_loss` sums them over each
row's loss mask into the sequence log-probability. The reference log-probabilities (and QRPO's
quantiles) travel with the rows in a :class:`PreferenceBatch`. The loss returned to the schedule is the
mean over the micro-batch's examples, in megatron-core's two-value form (loss, reported), which
its schedule averages over the micro-batches and DDP over the data-parallel ranks: every
micro-batch holds the same number of examples, so that is the global batch's mean whatever the
micro-batching and data parallelism. The loss is one value per example, not per token, so
``--calculate-per-token-loss`` (a count of tokens) is refused with it.

Under context parallelism each rank holds a share of every row's tokens: the sums over a row
(log-probability, completion length) are summed over the CP group before the loss, which every
CP rank then computes whole; the gradient flows back to each rank's own tokens unchanged, so the
ranks' gradients add up to the one-process gradient (the two-value form is multiplied by the CP
size by megatron-core, undoing DDP's division by the data- and context-parallel size), and CP
rank 0 alone counts the examples and reports the quantities.

Besides the loss, each micro-batch reports the objective's own quantities as (sum, count)
pairs under :data:`QUANTITY_PREFIX`, which the training loop averages over the global batch:
DPO's reward margin and reward accuracy (the implicit reward is ``beta * ratio``, beta as
length-normalised), QRPO's mean target ``T(q) - beta * log Z``, mean ``beta * ratio`` and mean
quantile-signed log-ratio ``(2q - 1) * ratio`` (positive when completions above the reference
policy's median reward gain probability and those below lose it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from megatron.apertus.align.config import AlignConfig
from megatron.apertus.align.losses import dpo, qrpo, sequence_log_ratio
from megatron.apertus.data.batches import QUANTITY_PREFIX, Batch
from megatron.apertus.errors import ConfigError

QUANTITIES = {
    "dpo": ("reward margin", "reward accuracy"),
    "qrpo": ("mean target", "mean beta-log-ratio", "quantile-signed log-ratio"),
}
"""What each objective reports besides its loss, in the order the log line shows them."""


def sequence_logps(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per row: the sum of ``log p`` of its loss tokens, in float64."""
    if per_token_loss.dim() != 2:
        raise ConfigError("alignment needs per-token losses: the output loss must be unfused")
    return -(per_token_loss.double() * loss_mask.double()).sum(-1)


def over_context_parallel_ranks(
    per_row: torch.Tensor, cp_group: torch.distributed.ProcessGroup
) -> torch.Tensor:
    """Per-row sums over this rank's tokens -> over the whole rows: summed over ``cp_group`` in
    the forward, passed through unchanged in the backward (megatron-core's reduce-from-region,
    on the CP group), since every CP rank differentiates the same loss through its own tokens."""
    return reduce_from_tensor_model_parallel_region(per_row, group=cp_group)


def _dpo_terms(config: AlignConfig, logps, ref, lengths):
    pair = {}
    if lengths is not None:
        pair = dict(
            chosen_lengths=lengths[0::2],
            rejected_lengths=lengths[1::2],
            length_normalization=config.align_length_normalization_of,
        )
    terms = dpo(logps[0::2], logps[1::2], ref[0::2], ref[1::2], config.align_beta, **pair)
    margin = terms.chosen_reward - terms.rejected_reward
    return terms.loss, {"reward margin": margin, "reward accuracy": (margin > 0).double()}


def _qrpo_terms(config: AlignConfig, logps, ref, lengths, quantiles, ref_counts):
    terms = qrpo(
        logps,
        ref,
        quantiles,
        config.align_beta,
        lengths=lengths,
        length_normalization=config.align_length_normalization_of,
        transform=config.qrpo_transform,
        ref_counts=ref_counts,
        log_partition=config.qrpo_log_partition,
        max_beta=config.qrpo_max_beta,
    )
    signed = (2.0 * quantiles - 1.0) * sequence_log_ratio(logps, ref).detach()
    return terms.loss, {
        "mean target": terms.target,
        "mean beta-log-ratio": terms.beta_log_ratio,
        "quantile-signed log-ratio": signed,
    }


@dataclass
class PreferenceBatch(Batch):
    """A micro-batch of examples with the targets their loss compares against."""

    ref_logps: torch.Tensor | None = None
    """The reference policy's sequence log-probability of each row, float64."""
    quantiles: torch.Tensor | None = None
    """QRPO: each completion's reward quantile among the reference completions' rewards."""
    ref_counts: torch.Tensor | None = None
    """QRPO: how many reference rewards each quantile was taken over."""


def alignment_loss(
    config: AlignConfig,
    cp_group: torch.distributed.ProcessGroup,
    batch: PreferenceBatch,
    loss_mask: torch.Tensor,
    output: torch.Tensor,
):
    """(mean loss over the examples, reported) of one micro-batch whose tokens are shared out
    over ``cp_group`` (the first two arguments bound first); ``reported`` holds the loss and the
    objective's quantities (:data:`QUANTITIES`) as sums over the examples with their count."""
    logps = over_context_parallel_ranks(sequence_logps(output, loss_mask), cp_group)
    ref = batch.ref_logps.to(logps.device)
    quantiles, ref_counts = batch.quantiles, batch.ref_counts
    lengths = None
    if config.align_length_normalization:
        lengths = over_context_parallel_ranks(loss_mask.double().sum(-1), cp_group)
    if config.align_objective == "dpo":
        losses, quantities = _dpo_terms(config, logps, ref, lengths)
    else:
        losses, quantities = _qrpo_terms(
            config, logps, ref, lengths, quantiles.to(logps.device), ref_counts.to(logps.device)
        )
    counted = cp_group.rank() == 0
    count = torch.tensor(float(losses.numel() if counted else 0), device=logps.device)
    reported = {
        "lm loss": torch.stack([losses.sum().detach().float() * counted, count]),
        "sequence logp": logps.detach(),
    }
    for name, values in quantities.items():
        reported[QUANTITY_PREFIX + name] = torch.stack([values.sum().float() * counted, count])
    return losses.mean().float(), reported


def collate(samples: list[dict], ref_logps: torch.Tensor) -> PreferenceBatch:
    """One micro-batch of examples, rows in example order; ``ref_logps`` [rows] float64."""
    tokens = torch.cat([s["tokens"] for s in samples]).long()
    labels = torch.cat([s["labels"] for s in samples]).long()
    loss_mask = torch.cat([s["loss_mask"] for s in samples]).float()
    qrpo_data = "quantile" in samples[0]
    quantiles = torch.cat([s["quantile"] for s in samples]) if qrpo_data else None
    ref_counts = torch.cat([s["ref_count"] for s in samples]) if qrpo_data else None
    positions = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
    return PreferenceBatch(
        tokens,
        labels,
        loss_mask,
        positions,
        ref_logps=ref_logps,
        quantiles=quantiles,
        ref_counts=ref_counts,
    )
