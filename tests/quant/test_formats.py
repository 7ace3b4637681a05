"""Each fake quantizer against a float64 reference of its format, and its straight-through
gradient. The references enumerate the formats' values from their bit layouts and round to the
nearest, ties to the even code, in float64; the quantizers compute in fp32, so an element may
round the other way only where its scaled value lies within fp32 round-off of a tie, and its
scale differs from the float64 one by fp32 round-off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.apertus.quant.formats import (
    fake_fp8,
    fake_int,
    fake_nvfp4,
    int_quantize,
    round_e2m1,
    round_e4m3,
)


def _grid(exponent_bits: int, mantissa_bits: int, bias: int, drop_top: bool) -> np.ndarray:
    """Non-negative values of a minifloat with subnormals, in code order (even code = even
    mantissa); ``drop_top`` removes the all-ones code (NaN of e4m3fn)."""
    values = []
    for e in range(2**exponent_bits):
        for m in range(2**mantissa_bits):
            frac = m / 2**mantissa_bits
            values.append(frac * 2.0 ** (1 - bias) if e == 0 else (1 + frac) * 2.0 ** (e - bias))
    return np.array(values[:-1] if drop_top else values)


E4M3 = _grid(4, 3, 7, drop_top=True)
E2M1 = _grid(2, 1, 1, drop_top=False)


def _round_to_grid(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Nearest grid value of |x| (saturating), ties to the even code, sign kept; float64."""
    a = np.minimum(np.abs(x), grid[-1])
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    dlo, dhi = a - grid[lo], grid[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.copysign(grid[pick], x)


def _near_tie(scaled: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Elements whose scaled value is within fp32 round-off of a midpoint between grid values."""
    mids = (grid[1:] + grid[:-1]) / 2
    d = np.abs(np.abs(scaled)[..., None] - mids).min(-1)
    return d <= 4e-7 * np.maximum(np.abs(scaled), 1e-30)


def _check(got: torch.Tensor, expected: np.ndarray, exempt: np.ndarray) -> None:
    """Same grid point everywhere but at near-ties; the values then differ only by the fp32
    rounding of the scale and of the product (rtol 5e-7, while one grid step is >= 1e-3)."""
    got = got.double().numpy()
    assert exempt.mean() < 1e-3
    np.testing.assert_allclose(got[~exempt], expected[~exempt], rtol=5e-7, atol=0)


def _sample(*shape: int, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed values over many binades, like trained weights with outliers."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g))


def test_e4m3_and_e2m1_grids_are_the_formats():
    assert E4M3[-1] == 448 and E4M3[1] == 2.0**-9 and len(E4M3) == 127
    assert list(E2M1) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


@pytest.mark.parametrize("grid,fn", [(E4M3, round_e4m3), (E2M1, round_e2m1)])
def test_rounding_matches_reference_on_values_ties_and_overflow(grid, fn):
    mids = (grid[1:] + grid[:-1]) / 2
    x = np.concatenate(
        [
            grid,
            mids,
            -mids,
            [grid[-1] * 3, -1e9],
            np.random.default_rng(0).normal(0, grid[-1] / 4, 4096),
        ]
    )
    got = fn(torch.tensor(x, dtype=torch.float64)).numpy()
    np.testing.assert_array_equal(got, _round_to_grid(x, grid))


def _int_reference(x: np.ndarray, bits: int, group: int, symmetric: bool) -> tuple:
    g = x.reshape(x.shape[0], -1, group if group > 0 else x.shape[1])
    levels = 2**bits - 1
    if symmetric:
        scale = np.abs(g).max(-1, keepdims=True) / (2 ** (bits - 1) - 1)
        scaled = g / scale
        q = np.clip(np.round(scaled), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        return (q * scale).reshape(x.shape), scaled.reshape(x.shape)
    high, low = np.maximum(g.max(-1, keepdims=True), 0), np.minimum(g.min(-1, keepdims=True), 0)
    scale = (high - low) / levels
    zero = np.round(-low / scale)
    scaled = g / scale
    q = np.clip(np.round(scaled) + zero, 0, levels)
    return ((q - zero) * scale).reshape(x.shape), scaled.reshape(x.shape)


@pytest.mark.parametrize("bits", [2, 3, 4, 6])
@pytest.mark.parametrize("group,symmetric", [(16, True), (-1, True), (32, False)])
def test_int_matches_reference(bits, group, symmetric):
    x = _sample(24, 64, seed=bits)
    expected, scaled = _int_reference(x.double().numpy(), bits, group, symmetric)
    exempt = _near_tie(scaled, np.arange(2**bits + 1.0))
    _check(fake_int(x, bits, group, symmetric=symmetric), expected, exempt)


def test_symmetric_int_codes_reach_the_largest_magnitude():
    codes, scale, zero = int_quantize(_sample(8, 64), 4, 16)
    assert zero is None and codes.min() == -7 and codes.max() == 7
    assert scale.shape == (8, 4, 1)


@pytest.mark.parametrize("per_row", [False, True])
def test_fp8_matches_reference(per_row):
    x = _sample(16, 48, seed=5)
    xd = x.double().numpy()
    amax = np.abs(xd).max(-1, keepdims=True) if per_row else np.abs(xd).max()
    scale = amax / 448
    scaled = xd / scale
    expected = _round_to_grid(scaled, E4M3) * scale
    _check(fake_fp8(x, per_row=per_row), expected, _near_tie(scaled, E4M3))


def test_nvfp4_matches_reference():
    x = _sample(8, 64, seed=9)
    g = x.double().numpy().reshape(8, 4, 16)
    tensor_scale = np.abs(g).max() / (6 * 448)
    block_raw = np.abs(g).max(-1, keepdims=True) / (6 * tensor_scale)
    block = _round_to_grid(block_raw, E4M3)
    scaled = g / (block * tensor_scale)
    expected = (_round_to_grid(scaled, E2M1) * block * tensor_scale).reshape(8, 64)
    exempt = (_near_tie(scaled, E2M1) | _near_tie(block_raw, E4M3)).reshape(8, 64)
    _check(fake_nvfp4(x), expected, exempt)


def test_zero_groups_stay_zero():
    x = torch.zeros(4, 32)
    for y in (fake_int(x, 4, 16), fake_fp8(x, per_row=True), fake_nvfp4(x)):
        assert torch.equal(y, x)


@pytest.mark.parametrize(
    "fn",
    [lambda x: fake_int(x, 3, 16), lambda x: fake_fp8(x, per_row=False), fake_nvfp4],
    ids=["int3", "fp8", "nvfp4"],
)
def test_straight_through_gradient_is_the_identity(fn):
    x = _sample(4, 32).requires_grad_()
    upstream = _sample(4, 32, seed=1)
    y = fn(x)
    assert not torch.equal(y, x)  # the forward value is quantized...
    y.backward(upstream)
    assert torch.equal(x.grad, upstream)  # ...the gradient passes through unchanged
