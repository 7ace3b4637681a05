"""A QAD (or any full-precision) checkpoint as a compressed-tensors Hugging Face directory, the
format vLLM and llm-compressor serve and ``transformers`` loads (``quant_method:
compressed-tensors``). docs/quantization.md ("Export") has the mapping of every format.

* int2/3/4/6 (``pack-quantized``, weight-only): ``weight_packed`` (the integer codes, packed
  into int32 by compressed-tensors' packer), ``weight_scale`` (one per group), ``weight_shape``;
  symmetric formats only.
* fp8 (``float-quantized``): ``weight`` (e4m3) and ``weight_scale`` (per tensor or per output
  channel); the inputs are quantized dynamically (per tensor or per token), as ours are.
* nvfp4 (``nvfp4-pack-quantized``): ``weight_packed`` (e2m1 pairs in uint8),
  ``weight_scale`` (e4m3, one per 16 inputs), ``weight_global_scale`` and ``input_global_scale``
  (compressed-tensors' global scale is the reciprocal of our tensor scale). The input's global
  scale is static there, dynamic in our fake quantizer: it is calibrated as the largest input
  our fake-quantized model feeds the layer over calibration documents.

The codes and scales are those of the fake quantizer (:mod:`megatron.apertus.quant.formats`):
the float formats hand compressed-tensors' compressors our fake-quantized weight and its
scales, and values already on the grid quantize to themselves. Where one of our tensors is
split into several HF tensors (the fused QKV), its per-tensor maximum is shared by the parts.
The dense part (embeddings, norms, xIELU, output layer) is the ordinary HF export of
:func:`megatron.apertus.convert.hf_io.export_checkpoint`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import generate_gparam
from torch import Tensor

from megatron.apertus.checkpoint import load_model, load_model_config
from megatron.apertus.cli import atomic_directory
from megatron.apertus.convert.hf import ConversionError
from megatron.apertus.convert.hf_io import (
    SAFETENSORS,
    make_world_readable,
    read_hf_tensors,
    single_process,
    write_hf_directory,
    write_safetensors,
)
from megatron.apertus.convert.quant_io import check_divisible
from megatron.apertus.data.datasets import check_prefixes
from megatron.apertus.errors import ConfigError
from megatron.apertus.model.config import ApertusConfig
from megatron.apertus.quant.config import QuantConfig
from megatron.apertus.quant.formats import (
    fp8_scale,
    int_quantize,
    nvfp4_quantize,
    round_e4m3,
)
from megatron.apertus.quant.layers import decoder_linears

HF_PROJECTIONS = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.up_proj",),
    "mlp.linear_fc2": ("mlp.down_proj",),
}
"""Our decoder linears (under ``decoder.layers.{i}.``) and the HF linears they become (under
``model.layers.{i}.``): QKV is split into three along the output dimension, so every group,
block and output channel stays whole; only a per-tensor maximum spans the parts."""

FORMATS = {
    "fp8": CompressionFormat.float_quantized,
    "nvfp4": CompressionFormat.nvfp4_pack_quantized,
}
"""compressed-tensors' format of each of our float formats (the int* ones: ``pack-quantized``)."""

Amax = Callable[[Tensor], Tensor]


def quantization_scheme(quant: QuantConfig) -> QuantizationScheme:
    """compressed-tensors' scheme of the decoder linears under ``quant``."""
    if quant.int_bits is not None:
        per_channel = quant.quant_group_size == -1
        weights = QuantizationArgs(
            num_bits=quant.int_bits,
            type="int",
            symmetric=True,
            strategy="channel" if per_channel else "group",
            group_size=None if per_channel else quant.quant_group_size,
            dynamic=False,
            observer="minmax",
        )
        return QuantizationScheme(targets=["Linear"], weights=weights)
    if quant.quant_format == "fp8":
        per_channel = quant.quant_fp8_scaling == "channel"
        weights = QuantizationArgs(
            num_bits=8,
            type="float",
            symmetric=True,
            dynamic=False,
            strategy="channel" if per_channel else "tensor",
        )
        inputs = QuantizationArgs(
            num_bits=8,
            type="float",
            symmetric=True,
            dynamic=True,
            strategy="token" if per_channel else "tensor",
        )
        return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    return preset_name_to_scheme("NVFP4", ["Linear"])


def quantization_config(quant: QuantConfig) -> dict:
    """The ``quantization_config`` entry of config.json."""
    fmt = FORMATS.get(quant.quant_format, CompressionFormat.pack_quantized)
    config = QuantizationConfig(
        config_groups={"group_0": quantization_scheme(quant)},
        format=fmt.value,
        quantization_status="compressed",
        ignore=["lm_head"],
    )
    return config.model_dump(mode="json")


def _int_tensors(weight: Tensor, quant: QuantConfig) -> dict[str, Tensor]:
    codes, scale, _ = int_quantize(weight, quant.int_bits, quant.quant_group_size)
    return {
        "weight_packed": pack_to_int32(codes.reshape(weight.shape).to(torch.int8), quant.int_bits),
        "weight_scale": scale[..., 0].to(weight.dtype),
        "weight_shape": torch.tensor(weight.shape),
    }


def _fp8_tensors(weight: Tensor, scheme: QuantizationScheme, amax: Amax) -> dict[str, Tensor]:
    per_row = scheme.weights.strategy == "channel"
    scale = fp8_scale(weight, per_row=per_row, reduce=_identity if per_row else amax)
    fake = round_e4m3(weight.float() / scale) * scale
    state = {"weight": fake, "weight_scale": scale.reshape(-1, 1) if per_row else scale.reshape(1)}
    return FloatQuantizationCompressor.compress(state, scheme)


def _nvfp4_tensors(weight: Tensor, scheme: QuantizationScheme, amax: Amax) -> dict[str, Tensor]:
    values, block_scale, tensor_scale = nvfp4_quantize(weight, reduce_tensor=amax)
    state = {
        "weight": (values * block_scale * tensor_scale).reshape(weight.shape),
        "weight_scale": block_scale[..., 0],
        "weight_global_scale": 1 / tensor_scale,
    }
    return NVFP4PackedCompressor.compress(state, scheme)


def _identity(t: Tensor) -> Tensor:
    return t


def _shared_max(parts: Sequence[Tensor]) -> Amax:
    """The per-tensor maximum of our fused tensor, whichever of its ``parts`` is quantized."""
    whole = torch.stack([p.detach().float().abs().amax() for p in parts]).amax()
    return lambda local: torch.maximum(local, whole.reshape(local.shape))


def _compress(
    weight: Tensor, quant: QuantConfig, scheme: QuantizationScheme, amax: Amax
) -> dict[str, Tensor]:
    """compressed-tensors' tensors of one decoder projection (``amax``: the per-tensor maximum
    of the whole tensor of ours it belongs to)."""
    if quant.int_bits is not None:
        return _int_tensors(weight, quant)
    if quant.quant_format == "fp8":
        return _fp8_tensors(weight, scheme, amax)
    return _nvfp4_tensors(weight, scheme, amax)


def calibration_documents(prefix: str, count: int, seq_length: int) -> list[Tensor]:
    """The first ``count`` documents of the tokenized dataset ``prefix`` (the ``.bin``/``.idx``
    pair tools/preprocess_data.py writes), each cut to ``seq_length`` tokens."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    check_prefixes("--calibration-data", [prefix])
    dataset = IndexedDataset(prefix)
    if count > len(dataset):
        raise ConfigError(
            f"--calibration-samples {count}: {prefix} holds {len(dataset)} " "documents"
        )
    return [torch.from_numpy(dataset[i][:seq_length].astype("int64")) for i in range(count)]


def calibrate_input_amax(
    load: str | os.PathLike, quant: QuantConfig, samples: Sequence[Tensor]
) -> dict[str, Tensor]:
    """The largest input magnitude each HF decoder projection receives from our fake-quantized
    model (``quant``) over ``samples``: the maximum of the dynamic per-tensor maxima our
    quantizer takes, one forward pass per sample."""
    model = load_model_config(load)
    amax: dict[str, Tensor] = {}

    def record(name: str):
        def hook(_module, args) -> None:
            local = args[0].detach().float().abs().amax()
            amax[name] = torch.maximum(amax[name], local) if name in amax else local

        return hook

    with single_process(model, quant) as chunk:
        load_model(load, [chunk])
        handles = [m.register_forward_pre_hook(record(n)) for n, m in decoder_linears(chunk)]
        with torch.no_grad():
            for tokens in samples:
                tokens = tokens.reshape(1, -1)
                chunk.eval()(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), None)
        for handle in handles:
            handle.remove()
    return {hf: value for name, value in amax.items() for hf in _hf_names(name)}


def _hf_names(ours: str) -> tuple[str, ...]:
    """HF module names of our decoder linear ``ours`` (``decoder.layers.{i}.<linear>``)."""
    _, _, layer, linear = ours.split(".", 3)
    return tuple(f"model.layers.{layer}.{hf}" for hf in HF_PROJECTIONS[linear])


def _projection_groups(num_layers: int) -> list[tuple[str, ...]]:
    """HF module names of the decoder projections, grouped by the tensor of ours they split."""
    return [
        tuple(f"model.layers.{i}.{hf}" for hf in parts)
        for i in range(num_layers)
        for parts in HF_PROJECTIONS.values()
    ]


def export_quantized(
    load: str | os.PathLike,
    output: str | os.PathLike,
    quant: QuantConfig,
    *,
    tokenizer: str | os.PathLike | None = None,
    calibration: Optional[Callable[[int], Sequence[Tensor]]] = None,
) -> Path:
    """Write ``output`` from checkpoint ``load`` with its decoder projections quantized per
    ``quant`` (written to a temporary directory beside it and renamed when complete). nvfp4
    needs ``calibration``: the calibration samples, given the model's sequence length."""
    _check_exportable(quant, calibration)
    output = Path(output)
    if output.exists():
        raise FileExistsError(f"--output {output} already exists; refusing to overwrite it")
    model = load_model_config(load)
    check_divisible(model, quant)
    input_amax = {}
    if quant.quant_format == "nvfp4":
        input_amax = calibrate_input_amax(load, quant, calibration(model.seq_length))
    with atomic_directory(output) as tmp:
        write_hf_directory(load, tmp, name=output.name, tokenizer=tokenizer, dtype=torch.float32)
        _quantize_projections(tmp, model, quant, input_amax)
        make_world_readable(tmp)
    return output


def _quantize_projections(
    hf_dir: Path, model: ApertusConfig, quant: QuantConfig, input_amax: dict
) -> None:
    """Replace the decoder projections of the exported model in ``hf_dir`` by their compressed
    form, and say so in its config.json."""
    tensors = read_hf_tensors(hf_dir)
    scheme = quantization_scheme(quant)
    for group in _projection_groups(model.num_layers):
        amax = _shared_max([tensors[f"{name}.weight"] for name in group])
        for name in group:
            compressed = _compress(tensors.pop(f"{name}.weight"), quant, scheme, amax)
            if name in input_amax:
                a = input_amax[name].reshape(1)
                compressed["input_global_scale"] = generate_gparam(-a, a)
            tensors.update({f"{name}.{k}": v.contiguous() for k, v in compressed.items()})
    write_safetensors(tensors, hf_dir / SAFETENSORS)
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config(quant)
    if quant.quant_format == "nvfp4":
        # compressed-tensors decompresses NVFP4 weights to bfloat16 whatever the model's dtype,
        # so a float32 model fails in its first matmul: a default load (dtype "auto") takes
        # this dtype and runs.
        config["dtype"] = "bfloat16"
    (hf_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _check_exportable(quant: QuantConfig, calibration) -> None:
    if not quant.enabled:
        raise ConversionError("--quant-format is required")
    if quant.int_bits is not None and not quant.quant_symmetric:
        # compressed-tensors 0.20 builds the empty model with unpacked zero points but writes
        # and reads them packed, so transformers re-initializes them: refuse instead.
        raise ConversionError(
            "--no-quant-symmetric: the compressed-tensors export writes " "symmetric formats"
        )
    if quant.quant_format == "nvfp4" and calibration is None:
        raise ConversionError(
            "--quant-format nvfp4 needs --calibration-data (the static input "
            "global scales are calibrated)"
        )
