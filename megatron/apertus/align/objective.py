"""Alignment micro-batches and the loss megatron-core's schedules reduce.

A micro-batch of ``m`` examples holds ``m * g`` rows (g completions per example, DPO's chosen
then rejected), each its own causal sequence padded to ``seq_length``; the model returns
per-token losses (``-log p`` of each label) and :func:`alignment_loss` sums them over each
row's loss mask into the sequence log-probability. The loss returned to the schedule is the
sum over the micro-batch's examples with the example count, so megatron-core's per-token
normalisation (here: per example) averages over the global batch whatever the micro-batching
and data parallelism.
"""

from __future__ import annotations

from functools import partial

import torch

from megatron.apertus.align.config import AlignConfig
from megatron.apertus.align.losses import dpo_loss, qrpo_loss, sequence_log_ratio
from megatron.apertus.data.batches import Batch
from megatron.apertus.errors import ConfigError


def sequence_logps(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per row: the sum of ``log p`` of its loss tokens, in float64."""
    if per_token_loss.dim() != 2:
        raise ConfigError("alignment needs per-token losses: run with --no-fused-output-loss")
    return -(per_token_loss.double() * loss_mask.double()).sum(-1)


def alignment_loss(
    config: AlignConfig,
    ref_logps: torch.Tensor,
    quantiles: torch.Tensor | None,
    batch: Batch,
    loss_mask: torch.Tensor,
    output: torch.Tensor,
):
    """(loss sum, examples, reported) of one micro-batch. ``reported["margin"]`` sums DPO's
    chosen-minus-rejected log-ratio, or QRPO's quantile-signed log-ratio ``(2q - 1) * ratio``
    (positive when completions above the reference's median reward gain probability and those
    below lose it), over the examples."""
    logps = sequence_logps(output, loss_mask)
    ref = ref_logps.to(logps.device)
    lengths = loss_mask.double().sum(-1) if config.align_length_normalization else None
    beta = config.align_beta
    if config.align_objective == "dpo":
        pair = {}
        if lengths is not None:
            pair = dict(chosen_lengths=lengths[0::2], rejected_lengths=lengths[1::2])
        losses = dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], beta, **pair)
        margin = sequence_log_ratio(logps[0::2], ref[0::2], pair.get("chosen_lengths")) - (
            sequence_log_ratio(logps[1::2], ref[1::2], pair.get("rejected_lengths"))
        )
    else:
        quantiles = quantiles.to(logps.device)
        losses = qrpo_loss(logps, ref, quantiles, beta, lengths=lengths)
        margin = (2.0 * quantiles - 1.0) * sequence_log_ratio(logps, ref, lengths)
    count = torch.tensor(float(losses.numel()), device=logps.device)
    reported = {
        "lm loss": torch.stack([losses.sum().detach().float(), count]),
        "goldfish": torch.zeros(2, device=logps.device),
        "margin": torch.stack([margin.sum().detach().float(), count]),
        "sequence logp": logps.detach(),
    }
    return losses.sum().float(), count.to(torch.int), reported


def collate(samples: list[dict], config: AlignConfig, ref_logps: torch.Tensor) -> Batch:
    """One micro-batch of examples, rows in example order; ``ref_logps`` [rows] float64."""
    tokens = torch.cat([s["tokens"] for s in samples]).long()
    labels = torch.cat([s["labels"] for s in samples]).long()
    loss_mask = torch.cat([s["loss_mask"] for s in samples]).float()
    quantiles = torch.cat([s["quantile"] for s in samples]) if "quantile" in samples[0] else None
    positions = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
    batch = Batch(tokens, labels, loss_mask, positions)
    batch.sequence_loss = partial(alignment_loss, config, ref_logps, quantiles)
    return batch
