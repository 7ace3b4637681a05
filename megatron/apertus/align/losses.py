"""Offline alignment objectives on sequence log-probabilities: DPO and QRPO.

Both compare the policy's log-probability of a completion, ``logp`` (the sum over its
completion tokens and its end token), with the frozen reference policy's, ``ref_logp``,
computed once before training. The length of a completion is its number of such tokens.

DPO (Rafailov et al. 2023, the sigmoid loss)::

    loss = -log sigmoid(beta * (ratio(chosen) - ratio(rejected)))      ratio = logp - ref_logp

QRPO (Matrenok, Moalla, Gulcehre 2025, arXiv 2507.08068; the authors' code github
CLAIRE-Labo/quantile-reward-policy-optimization, the Apertus code github swiss-ai/posttraining).
The reward ``r`` of a completion becomes its quantile under the reference policy's reward
distribution, estimated from rewards of the reference policy's own completions for the same
prompt (the inclusive empirical CDF, computed once by the preprocessing tool)::

    q = mean(ref_rewards <= r)                               in [0, 1]

Under the reference policy ``q`` is uniform on [0, 1], so for a transform ``T`` of it the
partition function ``Z = E_ref[exp(T(q) / beta)]`` of the KL-regularised optimum
``pi* = pi_ref exp(T(q) / beta) / Z`` is known in closed form, and the policy regresses its
scaled log-ratio onto the target it must reach::

    loss = (T(q) - beta * log Z - beta * ratio) ** 2

The transforms (:data:`TRANSFORMS`) and their ``beta * log Z``:

* ``identity``: ``T(q) = q``, ``Z = beta * (exp(1 / beta) - 1)``. ``approx`` drops the ``- 1``
  (``beta * log Z ~ beta * log beta + 1``, off by less than ``beta * exp(-1 / beta)``), as
  both reference codes do for small ``beta``.
* ``log``: ``T(q) = log max(q, 1/n)`` (n reference rewards), ``Z = beta / (1 + beta)``.
* ``normal-icdf``: ``T(q) = Phi^-1(min(max(q, 1/n), 1 - 1/n))``, ``Z = exp(1 / (2 beta^2))``.

The clamps keep ``T`` finite at the empirical extremes, as the authors' code does; the
partition functions are those of the unclamped, continuous ``q``.

Length normalisation (the Apertus tech report found it helped both) either divides ``beta``
by the completion's length (``beta``: DPO divides each log-ratio by its length; QRPO uses
``beta / length`` everywhere, inside ``Z`` too) or divides the loss (``loss``: QRPO each
completion's loss by its length, DPO each pair's by the mean of its two lengths, as
swiss-ai/posttraining's ``normalize_loss_by_length``). ``max_beta`` clamps the effective beta
from above (swiss-ai/posttraining clamps it at 0.1). ``beta * log Z`` of ``identity`` is
evaluated without forming ``exp(1 / beta)``: for small ``beta`` it is
``beta * log(beta) + 1 + beta * log1p(-exp(-1 / beta))``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from megatron.apertus.align.config import (  # noqa: F401
    LENGTH_NORMALIZATIONS,
    LOG_PARTITIONS,
    OBJECTIVES,
    TRANSFORMS,
)


def sequence_log_ratio(
    logp: torch.Tensor, ref_logp: torch.Tensor, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """``logp - ref_logp``, divided by ``lengths`` (completion tokens) when given."""
    ratio = logp - ref_logp
    return ratio if lengths is None else ratio / lengths


class DPOTerms(NamedTuple):
    loss: torch.Tensor
    """Per pair."""
    chosen_reward: torch.Tensor
    """The implicit reward ``beta * ratio`` of the chosen completion (beta as normalised)."""
    rejected_reward: torch.Tensor


def dpo(
    logp_chosen: torch.Tensor,
    logp_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    *,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    length_normalization: str = "beta",
) -> DPOTerms:
    """Per-pair DPO loss and implicit rewards; length-normalised (of ``beta`` or of the loss)
    when both length tensors are given."""
    normalized = chosen_lengths is not None and rejected_lengths is not None
    of_beta = normalized and length_normalization == "beta"
    chosen = beta * sequence_log_ratio(logp_chosen, ref_chosen, chosen_lengths if of_beta else None)
    rejected = beta * sequence_log_ratio(
        logp_rejected, ref_rejected, rejected_lengths if of_beta else None
    )
    loss = -F.logsigmoid(chosen - rejected)
    if normalized and not of_beta:
        loss = loss / (0.5 * (chosen_lengths + rejected_lengths))
    return DPOTerms(loss, chosen.detach(), rejected.detach())


def dpo_loss(*args, **kwargs) -> torch.Tensor:
    """Per-pair DPO loss (the arguments of :func:`dpo`)."""
    return dpo(*args, **kwargs).loss


def quantile_rewards(rewards: torch.Tensor, ref_rewards: torch.Tensor) -> torch.Tensor:
    """The quantile of each reward [n] among its prompt's reference rewards [n, m]."""
    return (ref_rewards <= rewards.unsqueeze(-1)).to(rewards.dtype).mean(-1)


def transform_quantiles(
    quantiles: torch.Tensor, transform: str, ref_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """``T(q)``; ``log`` and ``normal-icdf`` clamp ``q`` into ``[1/n, 1 - 1/n]`` first (n: the
    number of reference rewards of each quantile, ``ref_counts``)."""
    if transform == "identity":
        return quantiles
    if ref_counts is None:
        raise ValueError(f"the {transform} transform needs the number of reference rewards")
    low = 1.0 / ref_counts.to(quantiles.dtype)
    if transform == "log":
        return torch.log(torch.maximum(quantiles, low))
    if transform == "normal-icdf":
        return torch.special.ndtri(torch.minimum(torch.maximum(quantiles, low), 1.0 - low))
    raise ValueError(f"unknown QRPO transform {transform!r} (one of {', '.join(TRANSFORMS)})")


def beta_log_partition(
    beta: torch.Tensor, transform: str = "identity", log_partition: str = "exact"
) -> torch.Tensor:
    """``beta * log Z(beta)`` of ``transform`` for the uniform quantile; stable for any beta > 0."""
    if transform == "log":
        return beta * (torch.log(beta) - torch.log1p(beta))
    if transform == "normal-icdf":
        return 0.5 / beta
    if transform != "identity":
        raise ValueError(f"unknown QRPO transform {transform!r} (one of {', '.join(TRANSFORMS)})")
    if log_partition == "approx":
        return beta * torch.log(beta) + 1.0
    inverse = 1.0 / beta
    small = inverse <= math.log(10.0)  # expm1 is accurate and finite here
    direct = beta * (torch.log(beta) + torch.log(torch.expm1(inverse.clamp(max=math.log(10.0)))))
    asymptotic = beta * torch.log(beta) + 1.0 + beta * torch.log1p(-torch.exp(-inverse))
    return torch.where(small, direct, asymptotic)


class QRPOTerms(NamedTuple):
    loss: torch.Tensor
    """Per completion."""
    target: torch.Tensor
    """``T(q) - beta * log Z``: what ``beta * ratio`` regresses onto."""
    beta_log_ratio: torch.Tensor
    """``beta * ratio`` (beta as normalised and clamped)."""


def qrpo(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    quantiles: torch.Tensor,
    beta: float,
    *,
    lengths: torch.Tensor | None = None,
    length_normalization: str = "beta",
    transform: str = "identity",
    ref_counts: torch.Tensor | None = None,
    log_partition: str = "exact",
    max_beta: float | None = None,
) -> QRPOTerms:
    """Per-completion QRPO loss, target and scaled log-ratio for quantile rewards in [0, 1]
    (the variants: the module's docstring)."""
    effective = torch.full_like(logp, beta)
    if lengths is not None and length_normalization == "beta":
        effective = effective / lengths.to(logp.dtype)
    if max_beta is not None:
        effective = effective.clamp(max=max_beta)
    target = transform_quantiles(quantiles, transform, ref_counts) - beta_log_partition(
        effective, transform, log_partition
    )
    scaled = effective * (logp - ref_logp)
    loss = (target - scaled).square()
    if lengths is not None and length_normalization == "loss":
        loss = loss / lengths.to(logp.dtype)
    return QRPOTerms(loss, target.detach(), scaled.detach())


def qrpo_loss(*args, **kwargs) -> torch.Tensor:
    """Per-completion QRPO loss (the arguments of :func:`qrpo`)."""
    return qrpo(*args, **kwargs).loss
