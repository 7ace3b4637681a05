"""Our torch_dist checkpoints <-> Hugging Face model directories (config.json + safetensors).

Both directions run in one CPU process on a TP=1/PP=1 model: ``dist_checkpointing`` reshards
a checkpoint saved with any TP/PP into it, so the mapping in :mod:`megatron.apertus.convert.hf`
only ever sees whole tensors. Entry points must sit behind ``if __name__ == "__main__":``
because checkpoint saving spawns helpers that re-import the main script.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megatron.apertus import parallel
from megatron.apertus.convert.hf import (
    ConversionError,
    apertus_config_from_hf,
    from_hf_state_dict,
    hf_config,
    to_hf_state_dict,
)
from megatron.apertus.data.chat import CHAT_TEMPLATE, CONTROL_TOKENS
from megatron.apertus.model.builder import build_model, transformer_config
from megatron.apertus.model.config import ApertusConfig, ParallelConfig
from megatron.apertus.training.checkpoint import load_model, load_model_config, save_model

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _single_process_model(model: ApertusConfig):
    """A fp32 TP=1/PP=1 model on CPU; its random init is skipped since every weight is replaced."""
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ConversionError("HF conversion runs in one process; do not start it with torchrun")
    layout = ParallelConfig()
    parallel.initialize(layout, device="cpu", seed=0, model=model)
    config = transformer_config(
        model, layout, use_cpu_initialization=True, perform_initialization=False
    )
    (chunk,) = build_model(model, config)
    return chunk


def _parameters(chunk) -> dict[str, torch.Tensor]:
    """The model's tensors by name without megatron-core's ``_extra_state`` placeholders."""
    return {k: v for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}


def copy_tokenizer(source: str | os.PathLike, dest: Path) -> None:
    """Write HF tokenizer files: convert a tekken JSON, or copy them from an HF tokenizer dir."""
    source = Path(source)
    if source.is_file():
        from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

        convert_tekken_tokenizer(str(source)).save_pretrained(str(dest))
        add_apertus_chat_format(dest)
        return
    present = [name for name in HF_TOKENIZER_FILES if (source / name).is_file()]
    if "tokenizer.json" not in present:
        raise FileNotFoundError(
            f"--tokenizer {source}: expected a tekken JSON file or a directory with tokenizer.json"
        )
    for name in present:
        shutil.copy2(source / name, dest / name)


def add_apertus_chat_format(directory: Path) -> None:
    """Name the reserved slots 61..72 of a converted tekken tokenizer with the Apertus control
    tokens and install the Apertus chat template (:mod:`megatron.apertus.data.chat`), so that
    ``apply_chat_template`` gives the ids training used."""
    path = directory / "tokenizer.json"
    spec = json.loads(path.read_text())
    names = {f"<SPECIAL_{token_id}>": name for name, token_id in CONTROL_TOKENS.items()}
    for token in spec["added_tokens"]:
        token["content"] = names.get(token["content"], token["content"])
    vocab = spec["model"]["vocab"]
    for old, new in names.items():
        if old in vocab:
            vocab[new] = vocab.pop(old)
    path.write_text(json.dumps(spec, ensure_ascii=False))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def export_checkpoint(
    load: str | os.PathLike,
    output: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``output`` (config.json, model.safetensors, tokenizer files) from checkpoint ``load``.

    Everything goes to ``output.tmp`` first and is renamed when complete, so a crash never
    leaves a directory that looks like a finished export.
    """
    output = Path(output)
    if output.exists():
        raise FileExistsError(f"--output {output} already exists; refusing to overwrite it")
    model = load_model_config(load)
    chunk = _single_process_model(model)
    try:
        load_model(load, [chunk])
        tensors = to_hf_state_dict(_parameters(chunk), model, dtype)
    finally:
        parallel.shutdown()
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(hf_config(model, dtype), indent=2) + "\n")
    save_file(tensors, str(tmp / SAFETENSORS), metadata={"format": "pt"})
    if tokenizer is not None:
        copy_tokenizer(tokenizer, tmp)
    os.replace(tmp, output)
    return output


def read_hf_tensors(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory: ``model.safetensors`` or all shards named by its index."""
    hf_dir = Path(hf_dir)
    index = hf_dir / SAFETENSORS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / SAFETENSORS).is_file():
        shards = [SAFETENSORS]
    else:
        raise FileNotFoundError(f"{hf_dir} has neither {SAFETENSORS} nor {SAFETENSORS_INDEX}")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(str(hf_dir / shard))
        repeated = sorted(set(part) & set(tensors))
        if repeated:
            raise ConversionError(f"{shard} repeats tensors of another shard: {repeated[:8]}")
        tensors.update(part)
    return tensors


def import_hf(hf_dir: str | os.PathLike, save: str | os.PathLike, *, iteration: int = 0) -> Path:
    """Save the HF model in ``hf_dir`` as our checkpoint ``save/iter_<iteration>`` (fp32)."""
    hf_dir = Path(hf_dir)
    model = apertus_config_from_hf(json.loads((hf_dir / "config.json").read_text()))
    state = from_hf_state_dict(read_hf_tensors(hf_dir), model)
    chunk = _single_process_model(model)
    try:
        params = dict(chunk.named_parameters())
        if set(params) != set(state):
            raise ConversionError(
                f"built model and converted tensors disagree: {sorted(set(params) ^ set(state))[:8]}"
            )
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state[name])  # shapes were checked against the config
        return save_model(save, iteration, [chunk], model)
    finally:
        parallel.shutdown()
