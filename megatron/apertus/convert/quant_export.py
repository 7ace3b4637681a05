"""A QAD (or any full-precision) checkpoint as a compressed-tensors Hugging Face directory, the
format vLLM and llm-compressor serve and ``transformers`` loads (``quant_method:
compressed-tensors``).

Weight-only integer formats (``pack-quantized``): each decoder projection holds
``weight_packed`` (the integer codes, packed into int32 by compressed-tensors' own packer),
``weight_scale`` (one per group) and ``weight_shape``; symmetric formats only. The codes and
scales are those of the fake quantizer (:func:`megatron.apertus.quant.formats.int_quantize`),
so the loaded model computes what our fake-quantized model computes. The dense part
(embeddings, norms, xIELU, output layer) is the ordinary HF export of
:func:`megatron.apertus.convert.hf_io.export_checkpoint`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from safetensors.torch import save_file

from megatron.apertus.convert.hf import ConversionError
from megatron.apertus.convert.hf_io import SAFETENSORS, export_checkpoint, read_hf_tensors
from megatron.apertus.quant.config import QuantConfig
from megatron.apertus.quant.formats import int_quantize

HF_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.up_proj", "mlp.down_proj")  # fmt: skip
"""The HF names of the decoder linears our fake quantizer covers (QKV is split into three;
its groups run along the input dimension, so the split keeps every group whole)."""


def quantization_config(quant: QuantConfig) -> dict:
    """compressed-tensors' ``quantization_config`` of an integer weight-only format."""
    per_channel = quant.quant_group_size == -1
    weights = {
        "num_bits": quant.int_bits,
        "type": "int",
        "symmetric": quant.quant_symmetric,
        "strategy": "channel" if per_channel else "group",
        "group_size": None if per_channel else quant.quant_group_size,
        "dynamic": False,
        "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                        "output_activations": None}  # fmt: skip
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def _compress(weight: torch.Tensor, quant: QuantConfig) -> dict[str, torch.Tensor]:
    """compressed-tensors' tensors of one symmetric integer weight."""
    codes, scale, _ = int_quantize(weight, quant.int_bits, quant.quant_group_size)
    return {
        "weight_packed": pack_to_int32(codes.reshape(weight.shape).to(torch.int8), quant.int_bits),
        "weight_scale": scale[..., 0].to(weight.dtype),
        "weight_shape": torch.tensor(weight.shape),
    }


def export_quantized(
    load: str | os.PathLike,
    output: str | os.PathLike,
    quant: QuantConfig,
    *,
    tokenizer: str | os.PathLike | None = None,
) -> Path:
    """Write ``output`` from checkpoint ``load`` with its decoder projections quantized per
    ``quant`` (written to ``output.tmp`` and renamed when complete)."""
    if quant.int_bits is None:
        raise ConversionError(f"--quant-format {quant.quant_format}: the compressed-tensors "
                              "export writes the int* formats")  # fmt: skip
    if not quant.quant_symmetric:
        # compressed-tensors 0.20 builds the empty model with unpacked zero points but writes
        # and reads them packed, so transformers re-initializes them: refuse instead.
        raise ConversionError("--no-quant-symmetric: the compressed-tensors export writes "
                              "symmetric formats")  # fmt: skip
    output = Path(output)
    if output.exists():
        raise FileExistsError(f"--output {output} already exists; refusing to overwrite it")
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    export_checkpoint(load, tmp, tokenizer=tokenizer, dtype=torch.float32)
    tensors = read_hf_tensors(tmp)
    for name in [n for n in tensors if n.endswith(".weight") and n[:-7].endswith(HF_PROJECTIONS)]:
        for suffix, tensor in _compress(tensors.pop(name), quant).items():
            tensors[name[: -len("weight")] + suffix] = tensor.contiguous()
    save_file(tensors, str(tmp / SAFETENSORS), metadata={"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    config["quantization_config"] = quantization_config(quant)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, output)
    return output
