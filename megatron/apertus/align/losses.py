"""Offline alignment objectives on sequence log-probabilities: DPO and QRPO.

Both compare the policy's log-probability of a completion, ``logp`` (the sum over its
assistant tokens), with the frozen reference policy's, ``ref_logp``, computed once before
training. With length normalisation (the Apertus tech report found it helped both) each
sequence log-ratio ``logp - ref_logp`` enters divided by the completion's length in tokens.

DPO (Rafailov et al. 2023, the sigmoid loss)::

    loss = -log sigmoid(beta * (ratio(chosen) - ratio(rejected)))

QRPO (Matrenok, Moalla, Gulcehre 2025, arXiv 2507.08068; reference code github
swiss-ai/posttraining, ``qrpo-verl/algorithm``). The reward ``r`` of a completion becomes its
quantile under the reference policy's reward distribution, estimated from rewards of the
reference policy's own completions for the same prompt (the inclusive empirical CDF)::

    q = mean(ref_rewards <= r)                               in [0, 1]

Under the reference policy ``q`` is uniform on [0, 1], so the partition function of the
KL-regularised optimum ``pi* = pi_ref exp(q / beta) / Z`` is known in closed form::

    Z(beta) = E_ref[exp(q / beta)] = beta * (exp(1 / beta) - 1)

and the policy regresses its scaled log-ratio onto the target it must reach::

    loss = (q - beta * log Z(beta) - beta * (logp - ref_logp)) ** 2

Length normalisation replaces ``beta`` by ``beta / length`` everywhere (also inside ``Z``),
which is the same as dividing the log-ratio by the length with the original ``beta``
rescaled per sample. ``beta * log Z`` is evaluated without forming ``exp(1 / beta)``: for
small ``beta`` it is ``beta * log(beta) + 1 + beta * log1p(-exp(-1 / beta))``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

OBJECTIVES = ("dpo", "qrpo")


def sequence_log_ratio(
    logp: torch.Tensor, ref_logp: torch.Tensor, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """``logp - ref_logp``, divided by ``lengths`` (completion tokens) when given."""
    ratio = logp - ref_logp
    return ratio if lengths is None else ratio / lengths


def dpo_loss(
    logp_chosen: torch.Tensor,
    logp_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    *,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-pair DPO loss; length-normalised when both length tensors are given."""
    margin = sequence_log_ratio(logp_chosen, ref_chosen, chosen_lengths) - sequence_log_ratio(
        logp_rejected, ref_rejected, rejected_lengths
    )
    return -F.logsigmoid(beta * margin)


def quantile_rewards(rewards: torch.Tensor, ref_rewards: torch.Tensor) -> torch.Tensor:
    """The quantile of each reward [n] among its prompt's reference rewards [n, m]."""
    return (ref_rewards <= rewards.unsqueeze(-1)).to(rewards.dtype).mean(-1)


def beta_log_partition(beta: torch.Tensor) -> torch.Tensor:
    """``beta * log Z(beta)`` with ``Z(beta) = beta * expm1(1 / beta)``, stable for any beta > 0."""
    inverse = 1.0 / beta
    small = inverse <= math.log(10.0)  # expm1 is accurate and finite here
    direct = beta * (torch.log(beta) + torch.log(torch.expm1(inverse.clamp(max=math.log(10.0)))))
    asymptotic = beta * torch.log(beta) + 1.0 + beta * torch.log1p(-torch.exp(-inverse))
    return torch.where(small, direct, asymptotic)


def qrpo_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    quantiles: torch.Tensor,
    beta: float,
    *,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-completion QRPO loss for quantile rewards in [0, 1]; ``beta / length`` when
    ``lengths`` are given."""
    effective = torch.full_like(logp, beta) if lengths is None else beta / lengths.to(logp.dtype)
    residual = quantiles - beta_log_partition(effective) - effective * (logp - ref_logp)
    return residual.square()
