"""Function-preserving checkpoint transforms of the Apertus family-expansion recipe: norm
fusion and weight averaging. Both act on a whole (TP=1) state dict of ``megatron-core``
parameter names."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

NORM_FUSIONS = (
    ("self_attention.linear_qkv.weight", "input_layernorm.weight"),
    ("mlp.linear_fc1.weight", "pre_mlp_layernorm.weight"),
)
"""(linear, the RMSNorm whose output is the linear's input) within each decoder layer."""


def column_scales(weight: Tensor) -> Tensor:
    """Per-input-column factors that give every column of ``weight`` the same L2 norm, the root
    mean square of the original column norms (so the Frobenius norm is unchanged); a zero
    column keeps factor 1."""
    norms = weight.double().norm(dim=0)
    target = norms.pow(2).mean().sqrt()
    return torch.where(norms > 0, target / norms, torch.ones_like(norms))


def fuse_norms(state: Mapping[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """Norm fusion: scale the input columns of QKV and of the MLP's up projection to equal norms
    and divide the preceding RMSNorm's weight by the same factors.

    ``RMSNorm(x) = g * n(x)`` feeds ``W``; ``W diag(c)`` and ``g / c`` give the same product
    ``W diag(g) n(x)``, so the model's function is unchanged up to float round-off (the scaling
    is done in float64 and rounded once to the checkpoint's dtype).
    """
    fused = dict(state)
    for layer in range(num_layers):
        prefix = f"decoder.layers.{layer}."
        for linear, norm in NORM_FUSIONS:
            w, g = state[prefix + linear], state[prefix + norm]
            c = column_scales(w)
            fused[prefix + linear] = (w.double() * c).to(w.dtype)
            fused[prefix + norm] = (g.double() / c).to(g.dtype)
    return fused


def average_states(states: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """The element-wise mean of every tensor over ``states`` (summed in float64, rounded once
    to the tensor's dtype); all states must have the same names and shapes."""
    names = set(states[0])
    for i, state in enumerate(states[1:], start=1):
        if set(state) != names:
            differ = sorted(names ^ set(state))[:3]
            raise ValueError(f"checkpoint {i} has other tensors than checkpoint 0: {differ}")
    averaged = {}
    for name in states[0]:
        tensors = [s[name] for s in states]
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1:
            raise ValueError(f"{name} has shapes {sorted(shapes)} in the checkpoints")
        total = torch.stack([t.double() for t in tensors]).sum(0)
        averaged[name] = (total / len(tensors)).to(tensors[0].dtype)
    return averaged
