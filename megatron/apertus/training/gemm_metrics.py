"""FP8 stability diagnostics: statistics of the input of every transformer GEMM, per layer.

FP8 training of Apertus diverged where a few activation channels grew into outliers (FOG,
arXiv 2505.20524), which the authors watched through the kurtosis of the GEMM inputs. At a
logging interval this module hooks the four GEMMs of every layer this rank holds (QKV, the
attention projection, fc1, fc2) for one training step and reports, per GEMM input:

* ``mean`` and ``rms``: of all elements;
* ``kurtosis``: the fourth standardised moment of each token's vector, averaged over tokens
  (3 for a Gaussian; outlier channels drive it up);
* ``underflow``: the share of non-zero elements that the FP8 (e4m3) cast flushes to zero;
* ``overflow``: the share that saturates at the e4m3 maximum (448): scaled beyond 464, the
  midpoint to the next power step, below which the cast merely rounds to 448 (under current
  scaling the amax element itself lands an ulp either side of 448 and is not counted).

The last two use the scale the FP8 cast uses: under delayed scaling the module's own scale
(from the amax history), otherwise per-tensor current scaling (``448 / amax``, what the
tensorwise recipe does). They are computed in bf16 runs too, as a forecast of what FP8 would
do to the same tensors. For a fused RMSNorm + linear (Transformer Engine) the GEMM input is
the normalised tensor, so the norm is applied here before measuring.

Row-parallel GEMMs see their tensor-parallel shard of the input; the statistics are those of
the shard on tensor-parallel rank 0. Other steps run without hooks: no overhead.
"""

from __future__ import annotations

from typing import Iterable

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.apertus.model.builder import chunk_groups

E4M3_MAX = 448.0
E4M3_SATURATES = 464.0
"""Scaled magnitudes above this lose more to the cast's clamp than to rounding (448 and 480,
the step e4m3fn lacks, are 32 apart)."""
GEMMS = {
    "qkv": ("self_attention", "linear_qkv"),
    "proj": ("self_attention", "linear_proj"),
    "fc1": ("mlp", "linear_fc1"),
    "fc2": ("mlp", "linear_fc2"),
}
ROWS_PER_CHUNK = 4096
"""Rows measured at a time: bounds the fp32 working copy of a large activation."""


def _gemm_modules(
    chunks: Iterable[torch.nn.Module],
) -> dict[str, tuple[torch.nn.Module, TransformerLayer]]:
    """``layer{N}/{gemm}`` (N: the global 1-based layer number) -> (module, its layer)."""
    found = {}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TransformerLayer):
                for gemm, (block, linear) in GEMMS.items():
                    found[f"layer{module.layer_number:03d}/{gemm}"] = (
                        getattr(getattr(module, block), linear),
                        module,
                    )
    return found


def _fused_norm_input(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The GEMM input of a TE LayerNormLinear: RMSNorm(x) with the module's own weight."""
    weight = getattr(module, "layer_norm_weight", None)
    if weight is None:
        return x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)
    return (normed * weight.float()).to(x.dtype)


def _delayed_scale(module: torch.nn.Module) -> torch.Tensor | None:
    """The input scale of a TE module under delayed scaling (slot 0 of its forward meta)."""
    meta = getattr(module, "fp8_meta", None)
    state = meta.get("scaling_fwd") if isinstance(meta, dict) else None
    scale = getattr(state, "scale", None)
    return None if scale is None else scale[0].float()


def input_statistics(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[mean, rms, kurtosis, underflow, overflow] of ``x`` ([..., hidden]) as one fp32 tensor.

    ``scale``: the FP8 cast's multiplier; None means current scaling, ``448 / amax(x)``.
    """
    rows = x.detach().reshape(-1, x.shape[-1])
    if scale is None:
        scale = E4M3_MAX / rows.abs().amax().float().clamp_min(torch.finfo(torch.float32).tiny)
    sums = torch.zeros(5, dtype=torch.float64, device=x.device)
    for start in range(0, rows.shape[0], ROWS_PER_CHUNK):
        part = rows[start : start + ROWS_PER_CHUNK].float()
        centered = part - part.mean(-1, keepdim=True)
        variance = centered.pow(2).mean(-1)
        sums[0] += part.sum(dtype=torch.float64)
        sums[1] += part.pow(2).sum(dtype=torch.float64)
        sums[2] += (centered.pow(4).mean(-1) / variance.pow(2).clamp_min(1e-30)).sum()
        scaled = part * scale
        cast = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
        sums[3] += ((cast == 0) & (part != 0)).sum()
        sums[4] += (scaled.abs() > E4M3_SATURATES).sum()
    elements = rows.numel()
    return torch.stack(
        [
            sums[0] / elements,
            (sums[1] / elements).sqrt(),
            sums[2] / rows.shape[0],
            sums[3] / elements,
            sums[4] / elements,
        ]
    ).float()


STATISTICS = ("mean", "rms", "kurtosis", "underflow", "overflow")


class GemmInputMonitor:
    """Hooks the GEMM inputs of one training step and gathers the statistics for reporting
    over the pipeline-parallel group the chunks were built with."""

    def __init__(
        self, chunks: Iterable[torch.nn.Module], *, names: Iterable[str], delayed_scaling: bool
    ) -> None:
        chunks = list(chunks)
        self.pp_group = chunk_groups(chunks[0]).pp
        self.modules = _gemm_modules(chunks)
        self.names = tuple(names)
        self.delayed_scaling = delayed_scaling
        self.handles: list = []
        self.measured: dict[str, torch.Tensor] = {}

    def attach(self) -> None:
        self.measured = {}
        for key, (module, layer) in self.modules.items():
            self.handles.append(module.register_forward_pre_hook(self._hook(key, layer)))

    def _hook(self, key: str, layer: TransformerLayer):
        """A layer kept out of FP8 (``in_bf16``) has no live FP8 scale: its figures are the
        forecast under current scaling, as in a bf16 run."""

        def measure(module: torch.nn.Module, args: tuple) -> None:
            if key in self.measured:  # the first micro-batch (recomputation re-runs forwards)
                return
            with torch.no_grad():
                x = _fused_norm_input(module, args[0])
                delayed = self.delayed_scaling and not getattr(layer, "in_bf16", False)
                scale = _delayed_scale(module) if delayed else None
                self.measured[key] = input_statistics(x, scale)

        return measure

    def detach(self) -> dict[str, float]:
        """Remove the hooks; every stage's statistics, on the pipeline's ranks (a collective
        over the pipeline-parallel group)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        local = {
            f"{key}/{name}": value
            for key, stats in self.measured.items()
            for name, value in zip(STATISTICS, stats.tolist())
            if name in self.names
        }
        gathered: list = [None] * self.pp_group.size()
        torch.distributed.all_gather_object(gathered, local, group=self.pp_group)
        return {k: v for stage in gathered for k, v in stage.items()}
