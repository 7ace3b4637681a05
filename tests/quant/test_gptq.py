"""GPTQ against round-to-nearest on a layer with correlated inputs: its output error on the
calibration inputs is smaller, and its weights still lie on the format's grid."""

from __future__ import annotations

import pytest
import torch

from megatron.apertus.quant.gptq import gptq, hessian, rtn


def correlated_inputs(tokens: int, features: int, seed: int = 0) -> torch.Tensor:
    """Inputs with a few strong shared directions and some loud channels, as in LLM layers."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(8, features, generator=g)
    x = torch.randn(tokens, 8, generator=g) @ basis + 0.1 * torch.randn(
        tokens, features, generator=g
    )
    return x * (1 + 4 * (torch.arange(features) % 16 == 0))


@pytest.mark.parametrize("bits,group", [(4, 16), (3, -1), (2, 32)])
def test_gptq_beats_rtn_on_the_calibration_inputs(bits, group):
    x = correlated_inputs(512, 64)
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1)) * 0.05
    h = hessian(x)
    q_gptq, q_rtn = gptq(w, h, bits, group), rtn(w, bits, group)

    def error(q: torch.Tensor) -> float:
        return float((x.double() @ (w - q).double().T).pow(2).mean())

    assert error(q_gptq) < 0.7 * error(q_rtn)


def _on_a_grid(group: torch.Tensor, levels: int) -> bool:
    """Whether one scale ``s`` makes every value an integer multiple of ``s`` within
    ``[-levels, levels]``: the largest magnitude is then ``k s`` for some ``k`` in 1..levels."""
    top = group.abs().max()
    if top == 0:
        return True
    for k in range(1, levels + 1):
        multiples = group / (top / k)
        if torch.allclose(multiples, multiples.round(), rtol=0, atol=1e-6):
            return True
    return False


def test_gptq_weights_lie_on_their_groups_grid():
    x = correlated_inputs(256, 64)
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)) * 0.05
    q = gptq(w, hessian(x), 4, 16).double().reshape(16 * 4, 16)
    # Codes run over [-8, 7]: a column updated after its group's scale was set can reach -8.
    assert all(_on_a_grid(group, 8) for group in q)
    assert not all(_on_a_grid(group, 8) for group in w.double().reshape(16 * 4, 16))
