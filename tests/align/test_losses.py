"""DPO and QRPO losses and gradients against independent float64 formulas."""

from __future__ import annotations

import bisect
import math

import numpy as np
import pytest
import torch

from megatron.apertus.align.losses import (
    beta_log_partition,
    dpo_loss,
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
        assert lc.grad[i].item() == pytest.approx(slope / (len_c[i].item() if normalise else 1.0),
                                                  rel=1e-10, abs=1e-15)  # fmt: skip
        assert lr.grad[i].item() == pytest.approx(-slope / (len_r[i].item() if normalise else 1.0),
                                                  rel=1e-10, abs=1e-15)  # fmt: skip


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
