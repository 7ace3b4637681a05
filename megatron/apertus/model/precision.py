"""Which transformer layers leave FP8: ``--bf16-layers`` and the FP8 guard's decisions.

megatron-core chooses a layer's precision in one place, ``fp8_utils.get_fp8_context``, and can
keep only the first and last layers out of FP8 (``--first-last-layers-bf16``), and only under
recipes that open one FP8 region per layer: under delayed scaling one region spans the whole
block. :class:`PrecisionTransformerLayer` generalises this to any set of layers and every
recipe: a layer in the set runs its forward pass (and, through autograd, its backward) inside
Transformer Engine's ``fp8_autocast(enabled=False)``, which TE lets nest in an enabled region, so
its GEMMs run in the run's ``--precision``. Layers outside the set are megatron-core's own.

Invariants:

* The set is a property of the layer objects (:attr:`PrecisionTransformerLayer.in_bf16`), read
  at every forward pass: :func:`set_bf16_layers` changes it between steps without rebuilding the
  model, which is how the FP8 guard switches layers in a running job.
* Layers are named by megatron-core's global, 1-based ``layer_number`` (the FP8 guard's
  ``layer002``), the same in every pipeline layout.
* A layer in the set takes no FP8 scaling state (TE's ``_extra_state``: amax history, scales)
  from a checkpoint, and TE saves none for a module whose last forward ran without FP8: the
  state of the layer's FP8 past is dropped, not carried into a later run that puts it back.
* Without FP8 (``config.fp8`` unset, every CPU run) the set changes nothing numerically.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Iterable

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer


def fp8_disabled():
    """Transformer Engine's switch that runs the modules inside it without FP8, in an FP8 region
    or not (the function megatron-core opens its FP8 regions with)."""
    from transformer_engine.pytorch import fp8_autocast

    return fp8_autocast(enabled=False)


class PrecisionTransformerLayer(TransformerLayer):
    """megatron-core's transformer layer that can be kept out of FP8 (:attr:`in_bf16`)."""

    in_bf16: bool = False
    """Whether this layer's GEMMs run in ``--precision`` while the run trains in FP8."""

    def forward(self, *args, **kwargs):
        """megatron-core's forward pass, outside FP8 when the layer is in bf16 and the run in FP8."""
        switch = fp8_disabled() if self.in_bf16 and self.config.fp8 else nullcontext()
        with switch:
            return super().forward(*args, **kwargs)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args, **kwargs) -> None:
        """A layer in bf16 leaves the FP8 scaling state of its modules out of a load: the
        ``_extra_state`` entries are taken out of ``state_dict`` (torch's copy) before its
        modules read theirs, so they count as missing, which checkpoint loads allow."""
        if self.in_bf16:
            for key in [k for k in state_dict if k.startswith(prefix) and _is_fp8_state(k)]:
                del state_dict[key]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _is_fp8_state(key: str) -> bool:
    return key.rsplit(".", 1)[-1].startswith("_extra_state")


def precision_layers(chunks: Iterable[torch.nn.Module]) -> list[PrecisionTransformerLayer]:
    """The layers of ``chunks`` (wrapped or not) whose precision can be chosen."""
    return [
        module
        for chunk in chunks
        for module in chunk.modules()
        if isinstance(module, PrecisionTransformerLayer)
    ]


def set_bf16_layers(chunks: Iterable[torch.nn.Module], layers: Iterable[int]) -> None:
    """Keep the layers numbered ``layers`` (global, 1-based) out of FP8 from the next forward
    pass on, and every other layer in it; a number this rank does not hold is ignored (another
    pipeline stage holds it)."""
    wanted = set(layers)
    for layer in precision_layers(chunks):
        layer.in_bf16 = layer.layer_number in wanted


def bf16_layers(chunks: Iterable[torch.nn.Module]) -> list[int]:
    """The numbers of this rank's layers that are kept out of FP8."""
    return sorted(layer.layer_number for layer in precision_layers(chunks) if layer.in_bf16)
