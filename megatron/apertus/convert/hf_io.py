"""Our torch_dist checkpoints <-> Hugging Face model directories (config.json + safetensors).

Both directions run in one CPU process on a TP=1/PP=1 model: ``dist_checkpointing`` reshards
a checkpoint saved with any TP/PP into it, so the mapping in :mod:`megatron.apertus.convert.hf`
only ever sees whole tensors. Entry points must sit behind ``if __name__ == "__main__":``
because checkpoint saving spawns helpers that re-import the main script.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig

from megatron.apertus import parallel
from megatron.apertus.checkpoint import (
    load_model,
    load_model_config,
    resolve_checkpoint,
    save_model,
)
from megatron.apertus.checkpoint_files import final_losses, read_run_info
from megatron.apertus.cli import atomic_directory
from megatron.apertus.convert.hf import (
    ConversionError,
    apertus_config_from_hf,
    dtype_name,
    from_hf_state_dict,
    hf_config,
    to_hf_state_dict,
)
from megatron.apertus.convert.hf_tokenizer import tokenizer_source, write_hf_tokenizer
from megatron.apertus.convert.model_card import DEFAULT_LICENSE, model_card
from megatron.apertus.model.config import ApertusConfig
from megatron.apertus.quant.config import QuantConfig

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def single_process(
    model: ApertusConfig, quant: QuantConfig | None = None
) -> contextlib.AbstractContextManager[torch.nn.Module]:
    """A fp32 TP=1/PP=1 CPU model of ``model`` for a conversion
    (:func:`megatron.apertus.parallel.single_process_model`)."""
    return parallel.single_process_model(model, job="HF conversion", quant=quant)


def model_tensors(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors by name without megatron-core's ``_extra_state`` placeholders."""
    return {k: v for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}


def export_checkpoint(
    load: str | os.PathLike,
    output: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    command: Sequence[str] | None = None,
    license: str = DEFAULT_LICENSE,
) -> Path:
    """Write the Hugging Face directory ``output`` from checkpoint ``load``
    (:func:`write_hf_directory`), in a fresh temporary directory beside it renamed when
    complete: a crash, a full disk or an interruption never leaves a directory that looks
    finished, nor a temporary one. It is world-readable as a Hugging Face download is."""
    output = Path(output)
    if output.exists():
        raise FileExistsError(f"--output {output} already exists; refusing to overwrite it")
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(output) as tmp:
        write_hf_directory(
            load,
            tmp,
            name=output.name,
            tokenizer=tokenizer,
            dtype=dtype,
            command=command,
            license=license,
        )
        make_world_readable(tmp)
    return output


def write_hf_directory(
    load: str | os.PathLike,
    dest: Path,
    *,
    name: str,
    tokenizer: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    command: Sequence[str] | None = None,
    license: str = DEFAULT_LICENSE,
) -> None:
    """Fill the empty directory ``dest`` with the Hugging Face model ``name`` of checkpoint
    ``load``: config.json, generation_config.json, model.safetensors, the tokenizer (the one
    the training run recorded, or ``tokenizer`` when given) and a README.md model card naming
    ``command``. Every refusal (no tokenizer known) comes before the model loads."""
    checkpoint = resolve_checkpoint(load)
    run_info = read_run_info(checkpoint)
    source = tokenizer_source(checkpoint, run_info, None if tokenizer is None else str(tokenizer))
    model = load_model_config(checkpoint)
    token_ids = write_hf_tokenizer(
        source, dest, model_max_length=model.max_position_embeddings, vocab_size=model.vocab_size
    )
    _write_model(checkpoint, model, dtype, dest)
    config = hf_config(model, dtype, token_ids)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    GenerationConfig(
        bos_token_id=token_ids.bos, eos_token_id=token_ids.eos, pad_token_id=token_ids.pad
    ).save_pretrained(str(dest))
    card = model_card(
        name=name,
        model=model,
        checkpoint=checkpoint.resolve(),
        run_info=run_info,
        tokenizer=f"{source.describe()}, from {source.origin}",
        dtype=dtype_name(dtype),
        export_command=command,
        losses=final_losses(checkpoint),
        license=license,
    )
    (dest / "README.md").write_text(card, encoding="utf-8")


def _write_model(checkpoint: Path, model: ApertusConfig, dtype: torch.dtype, dest: Path) -> None:
    """model.safetensors: the checkpoint resharded into one TP=1/PP=1 model, HF names."""
    with single_process(model) as chunk:
        load_model(checkpoint, [chunk])
        tensors = to_hf_state_dict(model_tensors(chunk), model, dtype)
    write_safetensors(tensors, dest / SAFETENSORS)


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' ``save_file``, whose I/O failures (a full disk) are its own error type with
    the errno only in the text: raised as the ``OSError`` naming ``path`` that every entry
    point reports in one line."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as err:
        code = re.search(r"os error (\d+)", str(err))
        if code is None:
            raise
        errno = int(code.group(1))
        raise OSError(errno, os.strerror(errno), str(path)) from None


def make_world_readable(root: Path) -> None:
    """0755 directories and 0644 files under ``root`` (safetensors writes 0600, mkdtemp 0700)."""
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o644)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; ``ConversionError`` naming it when it is missing,
    empty or damaged (safetensors' own error names neither the file nor the remedy)."""
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise ConversionError(f"{path}: no such file (named by {SAFETENSORS_INDEX})") from None
    except SafetensorError as err:
        raise ConversionError(
            f"{path}: not a readable safetensors file ({err}); copy or download it again"
        ) from None


def read_hf_json(path: Path) -> dict:
    """A JSON file of an HF directory; ``ConversionError`` naming it when it is not JSON (a
    download cut short), where ``json`` would name neither the file nor the remedy."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConversionError(
            f"{path}: not valid JSON ({err}); copy or download it again"
        ) from None


def read_hf_tensors(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory: ``model.safetensors`` or all shards named by its index."""
    hf_dir = Path(hf_dir)
    index = hf_dir / SAFETENSORS_INDEX
    if index.is_file():
        shards = sorted(set(read_hf_json(index)["weight_map"].values()))
    elif (hf_dir / SAFETENSORS).is_file():
        shards = [SAFETENSORS]
    else:
        raise ConversionError(f"{hf_dir} has neither {SAFETENSORS} nor {SAFETENSORS_INDEX}")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = read_safetensors(hf_dir / shard)
        repeated = sorted(set(part) & set(tensors))
        if repeated:
            raise ConversionError(f"{shard} repeats tensors of another shard: {repeated[:8]}")
        tensors.update(part)
    return tensors


def import_hf(hf_dir: str | os.PathLike, save: str | os.PathLike, *, iteration: int = 0) -> Path:
    """Save the HF model in ``hf_dir`` as our checkpoint ``save/iter_<iteration>`` (fp32)."""
    hf_dir = Path(hf_dir)
    model = apertus_config_from_hf(read_hf_json(hf_dir / "config.json"))
    state = from_hf_state_dict(read_hf_tensors(hf_dir), model)
    with single_process(model) as chunk:
        params = dict(chunk.named_parameters())
        if set(params) != set(state):
            raise ConversionError(
                f"built model and converted tensors disagree: {sorted(set(params) ^ set(state))[:8]}"
            )
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state[name])  # shapes were checked against the config
        return save_model(save, iteration, [chunk], model)
