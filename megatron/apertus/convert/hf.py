"""Pure mappings between our full (TP=1, PP=1) state dict and Hugging Face's Apertus format.

Nothing here touches files, processes or megatron-core: the functions take and return plain
dicts of tensors and config values, so they can be tested in isolation and reused by any
driver (see :mod:`megatron.apertus.convert.hf_io` for the checkpoint <-> directory tools).

Two layouts differ beyond renaming:

* attention: megatron-core fuses Q, K and V into one ``linear_qkv`` weight laid out per query
  group as ``[q heads of the group..., k, v]`` (each block ``kv_channels`` rows), so that a
  contiguous split over tensor-parallel ranks keeps whole groups; Hugging Face keeps separate
  ``q_proj``/``k_proj``/``v_proj`` with heads in order.
* xIELU: HF's ``XIELUActivation`` stores ``beta`` and ``eps`` as buffers and reads them in its
  forward; transformers leaves them uninitialised if the checkpoint lacks them, so an export
  writes them and an import checks them against our fixed values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from megatron.apertus.errors import ConfigError
from megatron.apertus.model.config import ApertusConfig
from megatron.apertus.ops.xielu import XIELU_BETA, XIELU_EPS

Tensor = torch.Tensor

# llama3 RoPE scaling constants that megatron-core's RotaryEmbedding hard-codes (only the
# factor is configurable there), so an HF config with other values cannot be represented.
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_MAX_POSITIONS = 8192


@dataclass(frozen=True)
class SpecialTokenIds:
    """The ids ``config.json`` and ``generation_config.json`` name: those of the tokenizer."""

    bos: int
    eos: int
    pad: int


APERTUS_TOKEN_IDS = SpecialTokenIds(bos=1, eos=2, pad=3)
"""Those of the published Apertus tokenizer (docs/recipe.md)."""

# Per-layer tensors that only change name: ours (under decoder.layers.{i}.) -> HF (under model.layers.{i}.).
_LAYER_RENAMES = {
    "input_layernorm.weight": "attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "feedforward_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.up_proj.weight",
    "mlp.activation_func.alpha_p": "mlp.act_fn.alpha_p",
    "mlp.activation_func.alpha_n": "mlp.act_fn.alpha_n",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_GLOBAL_RENAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
}
_OUTPUT = ("output_layer.weight", "lm_head.weight")
_QKV = "self_attention.linear_qkv.weight"
_HF_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_HF_XIELU_CONSTANTS = ("mlp.act_fn.beta", "mlp.act_fn.eps")


class ConversionError(ConfigError):
    """A state dict or config that cannot be converted; the message names the key or field.

    A :class:`ConfigError`: the input is the user's to fix, so a tool reports it in one line."""


def _ours_layer(i: int, name: str) -> str:
    return f"decoder.layers.{i}.{name}"


def _hf_layer(i: int, name: str) -> str:
    return f"model.layers.{i}.{name}"


def our_parameter_names(model: ApertusConfig) -> set[str]:
    """Every parameter of our TP=1/PP=1 model, so that conversions can refuse partial input."""
    names = set(_GLOBAL_RENAMES)
    if model.untie_embeddings_and_output_weights:
        names.add(_OUTPUT[0])
    for i in range(model.num_layers):
        names.update(_ours_layer(i, n) for n in (*_LAYER_RENAMES, _QKV))
    return names


def hf_parameter_shapes(model: ApertusConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF Apertus checkpoint of ``model`` holds (tied: no ``lm_head.weight``)."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.kv_channels
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    shapes = {"model.embed_tokens.weight": (model.vocab_size, h), "model.norm.weight": (h,)}
    if model.untie_embeddings_and_output_weights:
        shapes[_OUTPUT[1]] = (model.vocab_size, h)
    per_layer = {
        "attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "self_attn.o_proj.weight": (h, q),
        "feedforward_layernorm.weight": (h,),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
        "mlp.act_fn.alpha_p": (1,),
        "mlp.act_fn.alpha_n": (1,),
        "mlp.act_fn.beta": (),
        "mlp.act_fn.eps": (),
    }
    for i in range(model.num_layers):
        shapes.update({_hf_layer(i, name): shape for name, shape in per_layer.items()})
    return shapes


def _check_names(given: set[str], expected: set[str], what: str) -> None:
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise ConversionError(
            f"{what} does not match the model config: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}"
        )


def split_qkv(qkv: Tensor, model: ApertusConfig) -> tuple[Tensor, Tensor, Tensor]:
    """megatron-core's fused ``[q..., k, v]``-per-group weight -> HF's q, k, v projections."""
    groups, d = model.num_query_groups, model.kv_channels
    per_group = model.num_attention_heads // groups
    blocks = qkv.reshape(groups, per_group + 2, d, -1)
    q = blocks[:, :per_group].reshape(model.num_attention_heads * d, -1)
    k = blocks[:, per_group].reshape(groups * d, -1)
    v = blocks[:, per_group + 1].reshape(groups * d, -1)
    return q, k, v


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, model: ApertusConfig) -> Tensor:
    """Inverse of :func:`split_qkv`."""
    groups, d = model.num_query_groups, model.kv_channels
    per_group = model.num_attention_heads // groups
    hidden = q.shape[-1]
    blocks = torch.cat(
        [
            q.reshape(groups, per_group, d, hidden),
            k.reshape(groups, 1, d, hidden),
            v.reshape(groups, 1, d, hidden),
        ],
        dim=1,
    )
    return blocks.reshape(-1, hidden)


def _owned(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A contiguous copy in ``dtype``: safetensors refuses views and tensors sharing storage."""
    return t.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def to_hf_state_dict(
    state: Mapping[str, Tensor], model: ApertusConfig, dtype: torch.dtype
) -> dict[str, Tensor]:
    """Our full state dict (``_extra_state`` entries dropped) -> HF Apertus tensors in ``dtype``."""
    _check_hf_representable(model)
    _check_names(set(state), our_parameter_names(model), "our state dict")
    hf = {theirs: _owned(state[ours], dtype) for ours, theirs in _GLOBAL_RENAMES.items()}
    if model.untie_embeddings_and_output_weights:
        hf[_OUTPUT[1]] = _owned(state[_OUTPUT[0]], dtype)
    for i in range(model.num_layers):
        for ours, theirs in _LAYER_RENAMES.items():
            hf[_hf_layer(i, theirs)] = _owned(state[_ours_layer(i, ours)], dtype)
        for name, t in zip(_HF_QKV, split_qkv(state[_ours_layer(i, _QKV)], model)):
            hf[_hf_layer(i, name)] = _owned(t, dtype)
        beta, eps = _HF_XIELU_CONSTANTS
        hf[_hf_layer(i, beta)] = torch.tensor(model.xielu_beta, dtype=dtype)
        hf[_hf_layer(i, eps)] = torch.tensor(model.xielu_eps, dtype=dtype)
    return hf


def _check_xielu_constant(name: str, t: Tensor, expected: float) -> None:
    """``t`` must hold ``expected`` as rounded to its own dtype (bf16 cannot hold -1e-6 exactly)."""
    if not torch.equal(t, torch.tensor(expected, dtype=t.dtype)):
        raise ConversionError(
            f"{name} is {t.item()}, but our xIELU has the fixed value {expected}; "
            "a checkpoint trained with another value cannot be represented"
        )


def from_hf_state_dict(hf: Mapping[str, Tensor], model: ApertusConfig) -> dict[str, Tensor]:
    """HF Apertus tensors -> our full state dict (dtypes kept; the caller casts on copy).

    A tied checkpoint may still carry ``lm_head.weight``; it is accepted only if it equals the
    embedding, since our tied model has no separate output matrix to put it in.
    """
    hf = dict(hf)
    embedding = hf.get(_GLOBAL_RENAMES["embedding.word_embeddings.weight"])
    if not model.untie_embeddings_and_output_weights and _OUTPUT[1] in hf:
        head = hf.pop(_OUTPUT[1])
        if embedding is not None and not torch.equal(head, embedding):
            raise ConversionError(
                "tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight"
            )
    shapes = hf_parameter_shapes(model)
    _check_names(set(hf), set(shapes), "the HF checkpoint")
    for name, shape in shapes.items():
        if tuple(hf[name].shape) != shape:
            raise ConversionError(
                f"{name} has shape {tuple(hf[name].shape)}, the model config implies {shape}"
            )
    state = {ours: hf[theirs] for ours, theirs in _GLOBAL_RENAMES.items()}
    if model.untie_embeddings_and_output_weights:
        state[_OUTPUT[0]] = hf[_OUTPUT[1]]
    for i in range(model.num_layers):
        beta, eps = (_hf_layer(i, n) for n in _HF_XIELU_CONSTANTS)
        _check_xielu_constant(beta, hf[beta], model.xielu_beta)
        _check_xielu_constant(eps, hf[eps], model.xielu_eps)
        for ours, theirs in _LAYER_RENAMES.items():
            state[_ours_layer(i, ours)] = hf[_hf_layer(i, theirs)]
        q, k, v = (hf[_hf_layer(i, n)] for n in _HF_QKV)
        state[_ours_layer(i, _QKV)] = fuse_qkv(q, k, v, model)
    return state


def _check_hf_representable(model: ApertusConfig) -> None:
    """HF's Apertus always has QK-norm and builds xIELU with the standard beta/eps."""
    if not model.qk_layernorm:
        raise ConversionError("qk_layernorm is false, but HF Apertus always applies QK-norm")
    for name, standard in (("xielu_beta", XIELU_BETA), ("xielu_eps", XIELU_EPS)):
        if getattr(model, name) != standard:
            raise ConversionError(
                f"{name}={getattr(model, name)}; HF Apertus's xIELU uses {standard}"
            )


def _rope_parameters(model: ApertusConfig) -> dict[str, Any]:
    if not model.rope_scaling:
        return {"rope_type": "default", "rope_theta": float(model.rotary_base)}
    return {
        "rope_type": "llama3",
        "rope_theta": float(model.rotary_base),
        "factor": float(model.rope_scaling_factor),
        "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITIONS,
    }


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as config.json spells it."""
    return str(dtype).removeprefix("torch.")


def hf_config(
    model: ApertusConfig,
    torch_dtype: torch.dtype,
    token_ids: SpecialTokenIds = APERTUS_TOKEN_IDS,
) -> dict[str, Any]:
    """config.json of an ``ApertusForCausalLM`` equivalent to ``model``.

    ``rope_parameters`` is explicit because HF ApertusConfig's default theta (12,000,000, the
    long-context checkpoints) is not ours. ``rope_theta`` is repeated at the top level for
    transformers 4.x, which reads only that (and defaults to the same llama3 scaling).
    """
    _check_hf_representable(model)
    return {
        "architectures": ["ApertusForCausalLM"],
        "model_type": "apertus",
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "hidden_act": "xielu",
        "max_position_embeddings": model.max_position_embeddings,
        "initializer_range": model.init_method_std,
        "rms_norm_eps": model.norm_epsilon,
        "rope_parameters": _rope_parameters(model),
        "rope_theta": float(model.rotary_base),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "bos_token_id": token_ids.bos,
        "eos_token_id": token_ids.eos,
        "pad_token_id": token_ids.pad,
        "use_cache": True,
        "dtype": dtype_name(torch_dtype),
    }


def _require(config: Mapping[str, Any], field: str, ok: bool, expected: str) -> None:
    if not ok:
        raise ConversionError(
            f"config.json field {field}={config.get(field)!r} cannot be represented: expected {expected}"
        )


def _hf_rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5) or the legacy ``rope_scaling`` + ``rope_theta``."""
    rope = config.get("rope_parameters")
    if rope is None:
        if "rope_theta" not in config:
            raise ConversionError(
                "config.json has neither rope_parameters nor rope_theta; HF's default depends on "
                "the transformers version, so the RoPE base must be explicit"
            )
        rope = {"rope_type": "default", **(config.get("rope_scaling") or {})}
        rope.setdefault("rope_theta", config["rope_theta"])
        rope["rope_type"] = rope.pop("type", rope["rope_type"])
    elif "rope_theta" in config and config["rope_theta"] != rope.get("rope_theta"):
        raise ConversionError(
            f"config.json field rope_theta={config['rope_theta']} contradicts "
            f"rope_parameters.rope_theta={rope.get('rope_theta')}"
        )
    return dict(rope)


def _rope_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """Our rotary_base / rope_scaling / rope_scaling_factor from the HF RoPE description."""
    rope = _hf_rope_parameters(config)
    kind, theta = rope.get("rope_type"), rope.get("rope_theta")
    if kind not in ("llama3", "default"):
        raise ConversionError(
            f"config.json field rope_parameters.rope_type={kind!r} cannot be represented: "
            "expected 'llama3' (or 'default' for no scaling)"
        )
    if not isinstance(theta, (int, float)) or theta != int(theta) or theta <= 0:
        raise ConversionError(
            f"config.json field rope_parameters.rope_theta={theta!r} cannot be represented: "
            "expected a positive integer"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConversionError(
            f"config.json field rope_parameters.partial_rotary_factor="
            f"{rope['partial_rotary_factor']} cannot be represented: expected 1.0"
        )
    if kind == "default":
        return {"rotary_base": int(theta), "rope_scaling": False}
    fixed = {
        "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITIONS,
    }
    for key, value in fixed.items():
        if rope.get(key) != value:
            raise ConversionError(
                f"config.json field rope_parameters.{key}={rope.get(key)!r} cannot be represented: "
                f"megatron-core's llama3 scaling fixes it at {value}"
            )
    return {
        "rotary_base": int(theta),
        "rope_scaling": True,
        "rope_scaling_factor": float(rope["factor"]),
    }


def apertus_config_from_hf(config: Mapping[str, Any]) -> ApertusConfig:
    """Our ApertusConfig from an HF config.json dict; refuses what our model cannot express.

    ``seq_length`` (training-only, absent from HF) becomes our default, capped at the
    model's ``max_position_embeddings``.
    """
    _require(config, "model_type", config.get("model_type") == "apertus", "'apertus'")
    _require(config, "hidden_act", config.get("hidden_act", "xielu") == "xielu", "'xielu'")
    _require(config, "attention_bias", not config.get("attention_bias", False), "false")
    _require(config, "mlp_bias", not config.get("mlp_bias", False), "false")
    _require(config, "attention_dropout", not config.get("attention_dropout", 0.0), "0.0")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    _require(config, "head_dim", head_dim * heads == hidden, "hidden_size / num_attention_heads")
    max_positions = config["max_position_embeddings"]
    default_seq_length = ApertusConfig.__dataclass_fields__["seq_length"].default
    fields = {
        "num_layers": config["num_hidden_layers"],
        "hidden_size": hidden,
        "ffn_hidden_size": config["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": config.get("num_key_value_heads") or heads,
        "vocab_size": config["vocab_size"],
        "max_position_embeddings": max_positions,
        "seq_length": min(default_seq_length, max_positions),
        "norm_epsilon": config.get("rms_norm_eps", 1e-5),
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        **_rope_fields(config),
    }
    if "initializer_range" in config:
        fields["init_method_std"] = config["initializer_range"]
    try:
        return ApertusConfig(**fields)
    except ConfigError as err:
        raise ConversionError(f"config.json describes a model we cannot build: {err}") from err


__all__ = [
    "APERTUS_TOKEN_IDS",
    "ConversionError",
    "SpecialTokenIds",
    "apertus_config_from_hf",
    "dtype_name",
    "from_hf_state_dict",
    "fuse_qkv",
    "hf_config",
    "hf_parameter_shapes",
    "our_parameter_names",
    "split_qkv",
    "to_hf_state_dict",
]
