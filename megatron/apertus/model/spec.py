"""Megatron-core layer specs of an Apertus decoder layer and block, one per implementation.

Slots: RMSNorm before attention and MLP; fused-QKV column-parallel projection; per-head
RMSNorm on queries and keys (applied by megatron-core before RoPE); core attention;
non-gated MLP ``fc2(xIELU(fc1(x)))`` with the xIELU module built from the spec.

* ``local``: our RMSNorm, megatron-core's parallel linears, SDPA / varlen attention. A run that
  quantizes (``--quant-format``) fills the four linear slots with the fake-quantizing
  subclasses of :mod:`megatron.apertus.quant.layers`.
* ``transformer_engine``: the pre-attention and pre-MLP RMSNorms fused into the QKV and fc1
  linears (``TELayerNormColumnParallelLinear``), TE row-parallel linears, TE RMSNorm for
  QK-norm and the final norm, ``TEDotProductAttention``. Imported only when asked for.

Checkpoint keys are the same for both: the local spec maps its norms to the TE-fused names
(``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from megatron.apertus.errors import ConfigError
from megatron.apertus.model.attention import SDPAttention
from megatron.apertus.model.config import ApertusConfig
from megatron.apertus.model.layers import XIELU, RMSNorm
from megatron.apertus.quant.config import QuantConfig
from megatron.apertus.quant.layers import (
    QuantColumnParallelLinear,
    QuantRowParallelLinear,
    check_divisible,
)


def _xielu_spec(model: ApertusConfig, xielu_impl: str) -> ModuleSpec:
    """``xielu_impl`` picks the xIELU kernel (a backend choice, not part of the model: any
    value computes the same function)."""
    return ModuleSpec(
        module=XIELU,
        params={"beta": model.xielu_beta, "eps": model.xielu_eps, "impl": xielu_impl},
    )


def _linear(module: type, quantized: type, quant: QuantConfig | None):
    """A linear slot: ``module``, or its fake-quantizing subclass when ``quant`` is enabled."""
    if quant is None or not quant.enabled:
        return module
    return ModuleSpec(module=quantized, params={"quant": quant})


def _attention_spec(model: ApertusConfig, *, qkv, core: type, proj, norm: type) -> ModuleSpec:
    """Causal self-attention from one implementation's modules; ``norm`` is the QK-norm."""
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=qkv,
            core_attention=core,
            linear_proj=proj,
            q_layernorm=norm if model.qk_layernorm else None,
            k_layernorm=norm if model.qk_layernorm else None,
        ),
    )


def _mlp_spec(model: ApertusConfig, xielu_impl: str, *, fc1, fc2) -> ModuleSpec:
    """The non-gated MLP ``fc2(xIELU(fc1(x)))``."""
    return ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(
            linear_fc1=fc1, activation_func=_xielu_spec(model, xielu_impl), linear_fc2=fc2
        ),
    )


def apertus_layer_spec(
    model: ApertusConfig,
    *,
    xielu_impl: str = "auto",
    transformer_impl: str = "local",
    attention_backend: AttnBackend = AttnBackend.auto,
    quant: QuantConfig | None = None,
) -> ModuleSpec:
    """One Apertus transformer layer built from ``transformer_impl``'s modules; ``quant``
    fake-quantizes its linears (local layers only: Transformer Engine's do their own matmul)."""
    if transformer_impl == "transformer_engine":
        if quant is not None and quant.enabled:
            raise ConfigError(
                "--quant-format needs --transformer-impl local (the Transformer "
                "Engine linears do their own matmul)"
            )
        return _te_layer_spec(model, xielu_impl, attention_backend)
    if transformer_impl != "local":
        raise ValueError(f"unknown transformer_impl {transformer_impl!r}")
    column, row = ColumnParallelLinear, RowParallelLinear
    quant_column, quant_row = QuantColumnParallelLinear, QuantRowParallelLinear
    attention = _attention_spec(
        model,
        qkv=_linear(column, quant_column, quant),
        core=SDPAttention,
        proj=_linear(row, quant_row, quant),
        norm=RMSNorm,
    )
    mlp = _mlp_spec(
        model,
        xielu_impl,
        fc1=_linear(column, quant_column, quant),
        fc2=_linear(row, quant_row, quant),
    )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def _te_layer_spec(
    model: ApertusConfig, xielu_impl: str, attention_backend: AttnBackend
) -> ModuleSpec:
    """The layer on Transformer Engine modules (their norms follow ``config.normalization``,
    RMSNorm); megatron-core wraps the layers in TE's FP8 autocast when FP8 is configured.
    ``AttnBackend.local`` keeps our SDPA/varlen core attention between TE's linears (for
    machines where TE has no fused or flash attention of its own)."""
    from megatron.core.extensions.transformer_engine import (
        TEDotProductAttention,
        TELayerNormColumnParallelLinear,
        TENorm,
        TERowParallelLinear,
    )

    core = SDPAttention if attention_backend == AttnBackend.local else TEDotProductAttention
    attention = _attention_spec(
        model, qkv=TELayerNormColumnParallelLinear, core=core, proj=TERowParallelLinear, norm=TENorm
    )
    mlp = _mlp_spec(model, xielu_impl, fc1=TELayerNormColumnParallelLinear, fc2=TERowParallelLinear)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _final_norm(transformer_impl: str) -> type:
    if transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return RMSNorm


def _check_quantizable(model: ApertusConfig, tp: int, quant: QuantConfig) -> None:
    """Each quantized linear's input features per tensor-parallel rank split into ``quant``'s
    groups; refused in one line before megatron-core builds anything."""
    inputs = {
        "linear_qkv": model.hidden_size,
        "linear_proj": model.num_attention_heads * model.kv_channels // tp,
        "linear_fc1": model.hidden_size,
        "linear_fc2": model.ffn_hidden_size // tp,
    }
    for slot, features in inputs.items():
        check_divisible(slot, features, quant)


def _with_comm_type(core: type, kind: str) -> Callable:
    """``core`` (a core-attention class) built with the context-parallel comm type ``kind``
    whatever megatron-core passes it (see :func:`apertus_block_spec`)."""

    def build(*args, cp_comm_type=None, **kwargs):
        return core(*args, cp_comm_type=kind, **kwargs)

    return build


def _layer_with_comm_type(layer: ModuleSpec, kind: str) -> ModuleSpec:
    """``layer`` whose core attention runs context parallelism as ``kind``."""
    attention = layer.submodules.self_attention
    core = _with_comm_type(attention.submodules.core_attention, kind)
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, core_attention=core)
    )
    submodules = dataclasses.replace(layer.submodules, self_attention=attention)
    return dataclasses.replace(layer, submodules=submodules)


def apertus_block_spec(
    model: ApertusConfig,
    config: TransformerConfig,
    vp_stage: Optional[int] = None,
    *,
    xielu_impl: str = "auto",
    quant: QuantConfig | None = None,
    cp_comm_types: list[str] | None = None,
) -> TransformerBlockSubmodules:
    """The layers of this pipeline (virtual) stage plus the final RMSNorm, built from the
    implementation named by ``config.transformer_impl``.

    ``cp_comm_types``: Megatron-LM's per-layer ``--cp-comm-type`` list, one entry per layer of
    the whole model. megatron-core 0.16.1's ``TransformerLayer`` picks a layer's entry as
    ``cp_comm_type[layer_number]`` with its 1-based layer number (every layer gets the next
    layer's entry and the last one indexes past the list), so the builder leaves
    ``config.cp_comm_type`` unset for a list and each layer's core attention gets entry
    ``offset + i`` here (docs/megatron_core_changes.md).
    """
    impl = config.transformer_impl
    if quant is not None and quant.enabled:
        _check_quantizable(model, config.tensor_model_parallel_size, quant)
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    layer = apertus_layer_spec(
        model,
        xielu_impl=xielu_impl,
        transformer_impl=impl,
        attention_backend=config.attention_backend,
        quant=quant,
    )
    specs = [layer] * layers
    if cp_comm_types is not None:
        offset = get_transformer_layer_offset(config, vp_stage)
        specs = [_layer_with_comm_type(layer, cp_comm_types[offset + i]) for i in range(layers)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=_final_norm(impl))
