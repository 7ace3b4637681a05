"""DPO and QRPO losses and gradients against independent float64 formulas: every QRPO variant
(transform, log-partition, length normalisation, beta clamp) and the settings that reproduce
swiss-ai/posttraining."""

from __future__ import annotations

import bisect
import math
import statistics

import numpy as np
import pytest
import torch

from megatron.apertus.align.losses import (
    beta_log_partition,
    dpo,
    dpo_loss,
    qrpo,
    qrpo_loss,
    quantile_rewards,
)

GEN = torch.Generator().manual_seed(7)


def rand(*shape, scale=30.0):
    return (torch.rand(*shape, generator=GEN, dtype=torch.float64) - 0.5) * scale


@pytest.mark.parametrize("normalise", [False, True])
@pytest.mark.parametrize("beta", [0.05, 0.1, 1.0])
def test_dpo_loss_and_gradient(beta, normalise):
    n = 64
    lc, lr, rc, rr = (rand(n) - 100 for _ in range(4))
    len_c = torch.randint(1, 200, (n,), generator=GEN).double()
    len_r = torch.randint(1, 200, (n,), generator=GEN).double()
    lc.requires_grad_(True)
    lr.requires_grad_(True)
    lengths = dict(chosen_lengths=len_c, rejected_lengths=len_r) if normalise else {}
    loss = dpo_loss(lc, lr, rc, rr, beta, **lengths)
    loss.sum().backward()
    for i in range(n):
        c = (lc[i].item() - rc[i].item()) / (len_c[i].item() if normalise else 1.0)
        r = (lr[i].item() - rr[i].item()) / (len_r[i].item() if normalise else 1.0)
        x = beta * (c - r)
        assert loss[i].item() == pytest.approx(float(np.logaddexp(0.0, -x)), rel=1e-12, abs=1e-12)
        slope = -beta / (1.0 + math.exp(x))  # d loss / d margin
        assert lc.grad[i].item() == pytest.approx(
            slope / (len_c[i].item() if normalise else 1.0), rel=1e-10, abs=1e-15
        )
        assert lr.grad[i].item() == pytest.approx(
            -slope / (len_r[i].item() if normalise else 1.0), rel=1e-10, abs=1e-15
        )


def test_quantile_rewards_are_the_inclusive_empirical_cdf():
    rewards = rand(50, scale=4.0).round(decimals=1)
    ref = rand(50, 16, scale=4.0).round(decimals=1)  # ties included
    q = quantile_rewards(rewards, ref)
    for i in range(50):
        ordered = sorted(ref[i].tolist())
        assert q[i].item() == bisect.bisect_right(ordered, rewards[i].item()) / 16


@pytest.mark.parametrize("beta", [0.01, 0.05, 0.2, 0.5, 1.0, 5.0, 100.0])
def test_partition_function_matches_numerical_integration(beta):
    # Z = E_{q ~ U(0,1)} exp(q / beta), integrated on a fine grid in log space for stability.
    grid = np.linspace(0.0, 1.0, 400001)
    shifted = np.exp(grid / beta - 1.0 / beta)  # exp(q/beta) / exp(1/beta)
    integral = np.trapezoid(shifted, grid)
    want = beta * (math.log(integral) + 1.0 / beta)
    got = beta_log_partition(torch.tensor([beta], dtype=torch.float64)).item()
    assert got == pytest.approx(want, rel=1e-8, abs=1e-10)


@pytest.mark.parametrize("normalise", [False, True])
@pytest.mark.parametrize("beta", [0.05, 1.0])
def test_qrpo_loss_and_gradient(beta, normalise):
    n = 64
    logp, ref = rand(n) - 80, rand(n) - 80
    q = torch.rand(n, generator=GEN, dtype=torch.float64)
    lengths = torch.randint(1, 300, (n,), generator=GEN).double()
    logp.requires_grad_(True)
    loss = qrpo_loss(logp, ref, q, beta, lengths=lengths if normalise else None)
    loss.sum().backward()
    for i in range(n):
        b = beta / lengths[i].item() if normalise else beta
        log_z = (
            math.log(b) + math.log(math.expm1(1.0 / b))
            if 1.0 / b < 700
            else (math.log(b) + 1.0 / b)
        )  # exp(1/b) overflows: log expm1(t) = t to double precision
        residual = q[i].item() - b * log_z - b * (logp[i].item() - ref[i].item())
        assert loss[i].item() == pytest.approx(residual**2, rel=1e-9, abs=1e-12)
        assert logp.grad[i].item() == pytest.approx(-2.0 * b * residual, rel=1e-9, abs=1e-12)


def test_qrpo_optimum_is_the_closed_form_policy():
    """The loss vanishes at beta * log(pi/pi_ref) = q - beta * log Z, i.e. pi = pi_ref e^{q/beta}/Z."""
    beta, q = 0.3, torch.tensor([0.0, 0.25, 1.0], dtype=torch.float64)
    log_z = math.log(beta * math.expm1(1 / beta))
    logp = q / beta - log_z
    loss = qrpo_loss(logp, torch.zeros(3, dtype=torch.float64), q, beta)
    assert torch.allclose(loss, torch.zeros(3, dtype=torch.float64), atol=1e-24)


def test_float32_matches_float64():
    lc, lr, rc, rr = (rand(32) - 50 for _ in range(4))
    wide = dpo_loss(lc, lr, rc, rr, 0.1)
    narrow = dpo_loss(lc.float(), lr.float(), rc.float(), rr.float(), 0.1)
    assert torch.allclose(narrow.double(), wide, rtol=1e-5, atol=1e-6)
    q = torch.rand(32, generator=GEN, dtype=torch.float64)
    wide = qrpo_loss(lc, rc, q, 0.05, lengths=torch.full((32,), 7.0, dtype=torch.float64))
    narrow = qrpo_loss(lc.float(), rc.float(), q.float(), 0.05, lengths=torch.full((32,), 7.0))
    assert torch.allclose(narrow.double(), wide, rtol=1e-4, atol=1e-6)


# -- QRPO's variants against an independent float64 re-derivation -------------------------------


def transformed(q: float, transform: str, n: int) -> float:
    """T(q) with the clamps of the QRPO authors' code, from the standard library."""
    if transform == "identity":
        return q
    q = max(q, 1.0 / n) if transform == "log" else min(max(q, 1.0 / n), 1.0 - 1.0 / n)
    return math.log(q) if transform == "log" else statistics.NormalDist().inv_cdf(q)


def beta_log_z(b: float, transform: str, log_partition: str) -> float:
    """beta * log E[exp(T(q) / beta)] for q uniform on [0, 1], by hand."""
    if transform == "log":  # E[q^(1/b)] = 1 / (1 + 1/b)
        return b * math.log(b / (1.0 + b))
    if transform == "normal-icdf":  # the moment generating function of N(0, 1) at 1/b
        return b * (1.0 / (2.0 * b * b))
    if log_partition == "approx":
        return b * (math.log(b) + 1.0 / b)
    return b * (math.log(b) + 1.0 / b + math.log1p(-math.exp(-1.0 / b)))  # log(e^x - 1), stably


def qrpo_by_hand(
    logp,
    ref,
    q,
    n,
    length,
    beta,
    *,
    transform="identity",
    log_partition="exact",
    normalize=None,
    max_beta=None,
) -> tuple[float, float]:
    """(loss, d loss / d logp) of one completion."""
    b = beta / length if normalize == "beta" else beta
    if max_beta is not None:
        b = min(b, max_beta)
    residual = (
        transformed(q, transform, n) - beta_log_z(b, transform, log_partition) - b * (logp - ref)
    )
    divisor = length if normalize == "loss" else 1.0
    return residual**2 / divisor, -2.0 * b * residual / divisor


VARIANTS = [
    dict(transform=t, log_partition=p, normalize=norm, max_beta=clamp)
    for t, p in (
        ("identity", "exact"),
        ("identity", "approx"),
        ("log", "exact"),
        ("normal-icdf", "exact"),
    )
    for norm in (None, "beta", "loss")
    for clamp in (None, 0.1)
]


@pytest.mark.parametrize("beta", [0.003, 0.25, 5.0])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())))
def test_qrpo_variants_match_the_formula(variant, beta):
    n = 48
    logp, ref = rand(n) - 80, rand(n) - 80
    counts = torch.randint(1, 12, (n,), generator=GEN).double()
    q = torch.floor(torch.rand(n, generator=GEN, dtype=torch.float64) * (counts + 1)) / counts
    lengths = torch.randint(1, 300, (n,), generator=GEN).double()
    logp.requires_grad_(True)
    normalize = variant["normalize"]
    terms = qrpo(
        logp,
        ref,
        q,
        beta,
        lengths=None if normalize is None else lengths,
        length_normalization=normalize or "beta",
        transform=variant["transform"],
        ref_counts=counts,
        log_partition=variant["log_partition"],
        max_beta=variant["max_beta"],
    )
    terms.loss.sum().backward()
    for i in range(n):
        if variant["transform"] == "normal-icdf" and counts[i] < 2:
            continue  # no quantile strictly inside (0, 1): refused by the preprocessing tool
        loss, grad = qrpo_by_hand(
            logp[i].item(),
            ref[i].item(),
            q[i].item(),
            int(counts[i]),
            lengths[i].item(),
            beta,
            **variant,
        )
        assert terms.loss[i].item() == pytest.approx(loss, rel=1e-9, abs=1e-15)
        assert logp.grad[i].item() == pytest.approx(grad, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("transform", ["log", "normal-icdf"])
@pytest.mark.parametrize("beta", [0.5, 1.0, 3.0])
def test_partition_functions_of_the_transforms_match_numerical_integration(transform, beta):
    # Z = E_{q ~ U(0,1)} exp(T(q) / beta), T unclamped: over a fine midpoint grid of q for log;
    # for normal-icdf, T(q) is N(0, 1)-distributed, so over a fine grid of its density.
    if transform == "log":
        q = (np.arange(2_000_000) + 0.5) / 2_000_000
        z = np.mean(np.exp(np.log(q) / beta))
    else:
        x = np.linspace(-40.0, 40.0, 1_600_001)
        z = np.trapezoid(np.exp(-0.5 * x * x + x / beta) / math.sqrt(2 * math.pi), x)
    got = beta_log_partition(torch.tensor([beta], dtype=torch.float64), transform).item()
    assert got == pytest.approx(beta * math.log(z), rel=1e-4)


def swiss_ai_qrpo(logp, ref, q, length, beta, normalize_beta, normalize_loss) -> float:
    """swiss-ai/posttraining's QRPO loss of one completion, re-derived from its description:
    beta (over the length when asked) clamped at 0.1, log Z approximated as log beta + 1/beta
    when beta <= 0.2 (always, after the clamp), the squared error divided by the length when
    asked."""
    b = min(beta / length if normalize_beta else beta, 0.1)
    beta_log_z_value = b * math.log(b) + 1.0 if b <= 0.2 else b * math.log(b * math.expm1(1 / b))
    loss = (q - beta_log_z_value - b * (logp - ref)) ** 2
    return loss / length if normalize_loss else loss


@pytest.mark.parametrize("normalize", ["beta", "loss"])
@pytest.mark.parametrize("beta", [0.01, 0.25, 3.0])
def test_swiss_ai_settings_reproduce_swiss_ai_posttraining(normalize, beta):
    n = 32
    logp, ref = rand(n) - 60, rand(n) - 60
    q = torch.rand(n, generator=GEN, dtype=torch.float64)
    lengths = torch.randint(1, 400, (n,), generator=GEN).double()
    ours = qrpo_loss(
        logp,
        ref,
        q,
        beta,
        lengths=lengths,
        length_normalization=normalize,
        log_partition="approx",
        max_beta=0.1,
    )
    for i in range(n):
        want = swiss_ai_qrpo(
            logp[i].item(),
            ref[i].item(),
            q[i].item(),
            lengths[i].item(),
            beta,
            normalize_beta=normalize == "beta",
            normalize_loss=normalize == "loss",
        )
        assert ours[i].item() == pytest.approx(want, rel=1e-12, abs=1e-15)
    default = qrpo_loss(logp, ref, q, beta, lengths=lengths, length_normalization=normalize)
    if beta >= 0.25 and normalize == "loss":  # our default differs: no clamp, exact log Z
        assert (default - ours).abs().max().item() > 1e-3


def test_dpo_loss_normalization_divides_by_the_mean_length():
    n = 32
    lc, lr, rc, rr = (rand(n) - 100 for _ in range(4))
    len_c = torch.randint(1, 200, (n,), generator=GEN).double()
    len_r = torch.randint(1, 200, (n,), generator=GEN).double()
    terms = dpo(
        lc,
        lr,
        rc,
        rr,
        0.1,
        chosen_lengths=len_c,
        rejected_lengths=len_r,
        length_normalization="loss",
    )
    for i in range(n):
        x = 0.1 * ((lc[i] - rc[i]) - (lr[i] - rr[i])).item()
        want = float(np.logaddexp(0.0, -x)) / ((len_c[i].item() + len_r[i].item()) / 2.0)
        assert terms.loss[i].item() == pytest.approx(want, rel=1e-12)
        assert terms.chosen_reward[i].item() == pytest.approx(0.1 * (lc[i] - rc[i]).item())
