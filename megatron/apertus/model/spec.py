"""Megatron-core layer spec of an Apertus decoder layer and block.

Slots: RMSNorm before attention and MLP; fused-QKV column-parallel projection; per-head
RMSNorm on queries and keys (applied by megatron-core before RoPE); SDPA core attention;
non-gated MLP ``fc2(xIELU(fc1(x)))`` with the xIELU module built from the spec.

Checkpoint keys follow megatron-core's local spec, including its map of the layer norms to
the Transformer-Engine names (``self_attention.linear_qkv.layer_norm_weight``), so that
checkpoints are interchangeable with TE-fused layouts.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron.apertus.model.attention import SDPAttention
from megatron.apertus.model.config import ApertusConfig
from megatron.apertus.model.layers import XIELU, RMSNorm


def apertus_layer_spec(model: ApertusConfig, *, xielu_impl: str = "auto") -> ModuleSpec:
    """One Apertus transformer layer; ``xielu_impl`` picks the xIELU kernel (a backend choice,
    not part of the model: any value computes the same function)."""
    xielu = ModuleSpec(
        module=XIELU,
        params={"beta": model.xielu_beta, "eps": model.xielu_eps, "impl": xielu_impl},
    )
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=SDPAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=RMSNorm if model.qk_layernorm else None,
            k_layernorm=RMSNorm if model.qk_layernorm else None,
        ),
    )
    mlp = ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, activation_func=xielu, linear_fc2=RowParallelLinear
        ),
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


def apertus_block_spec(
    model: ApertusConfig,
    config: TransformerConfig,
    vp_stage: Optional[int] = None,
    *,
    xielu_impl: str = "auto",
) -> TransformerBlockSubmodules:
    """The layers of this pipeline (virtual) stage plus the final RMSNorm."""
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    layer = apertus_layer_spec(model, xielu_impl=xielu_impl)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=RMSNorm)
