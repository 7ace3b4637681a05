"""Checkpoint side of the quantization tools: norm fusion, weight averaging and PTQ (RTN, GPTQ)
of torch_dist checkpoints, in one CPU process.

As for the HF conversion, ``dist_checkpointing`` reshards a checkpoint of any TP/PP layout into
a TP=1/PP=1 model, the transform sees whole tensors, and the result is saved as a checkpoint
that loads into any layout. Entry points must sit behind ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from megatron.apertus.checkpoint import (
    load_model,
    load_model_config,
    resolve_checkpoint,
    save_model,
)
from megatron.apertus.convert.hf_io import model_tensors, single_process
from megatron.apertus.distill.logit_store import LogitStoreReader, sample_key
from megatron.apertus.distill.targets import sample_tokens
from megatron.apertus.errors import ConfigError
from megatron.apertus.model.config import ApertusConfig
from megatron.apertus.quant.config import QuantConfig
from megatron.apertus.quant.formats import NVFP4_BLOCK, fake_fp8, fake_nvfp4
from megatron.apertus.quant.gptq import column_grid, gptq_grid, hessian, rtn
from megatron.apertus.quant.layers import decoder_linears
from megatron.apertus.quant.transforms import average_states, fuse_norms

ITERATION_DIR = re.compile(r"iter_(\d{7})$")


def read_state(chunk: torch.nn.Module, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The whole tensors of checkpoint ``path`` (any layout), loaded through ``chunk``."""
    load_model(path, [chunk])
    return {k: v.detach().clone() for k, v in model_tensors(chunk).items()}


def write_state(
    chunk: torch.nn.Module,
    state: dict[str, torch.Tensor],
    save: str | os.PathLike,
    iteration: int,
    model: ApertusConfig,
) -> Path:
    """Save ``state`` as iteration ``iteration`` of ``save`` (a weights-only checkpoint)."""
    with torch.no_grad():
        for name, tensor in model_tensors(chunk).items():
            tensor.copy_(state[name])
    return save_model(save, iteration, [chunk], model)


def iteration_of(path: str | os.PathLike) -> int:
    match = ITERATION_DIR.search(resolve_checkpoint(path).name)
    return int(match.group(1)) if match else 0


def fuse_norms_checkpoint(load: str | os.PathLike, save: str | os.PathLike) -> Path:
    """Norm fusion of checkpoint ``load``, saved at the same iteration under ``save``."""
    model = load_model_config(load)
    with single_process(model) as chunk:
        state = fuse_norms(read_state(chunk, load), model.num_layers)
        return write_state(chunk, state, save, iteration_of(load), model)


def last_checkpoints(save_dir: str | os.PathLike, n: int) -> list[Path]:
    """The ``n`` newest ``iter_*`` directories of ``save_dir``, oldest first."""
    found = sorted(p for p in Path(save_dir).iterdir() if ITERATION_DIR.search(p.name))
    if len(found) < n:
        raise ConfigError(f"--last {n}: {save_dir} holds {len(found)} checkpoints")
    return found[-n:]


def average_checkpoints(paths: Sequence[str | os.PathLike], save: str | os.PathLike) -> Path:
    """The element-wise mean of the checkpoints ``paths`` (any layouts, the same architecture),
    saved at the newest one's iteration."""
    model = load_model_config(paths[0])
    for path in paths[1:]:
        if load_model_config(path) != model:
            raise ConfigError(f"{path} is another architecture than {paths[0]}")
    with single_process(model) as chunk:
        states = [read_state(chunk, path) for path in paths]
        iteration = max(iteration_of(p) for p in paths)
        return write_state(chunk, average_states(states), save, iteration, model)


@dataclass(frozen=True)
class PTQSettings:
    method: str  # rtn or gptq
    quant: QuantConfig
    damp: float = 0.01


def rtn_weight(weight: torch.Tensor, quant: QuantConfig) -> torch.Tensor:
    """Round-to-nearest of one weight in ``quant``'s format (weights only)."""
    if quant.int_bits is not None:
        return rtn(weight, quant.int_bits, quant.quant_group_size, symmetric=quant.quant_symmetric)
    if quant.quant_format == "fp8":
        return fake_fp8(weight, per_row=quant.quant_fp8_scaling == "channel").detach()
    return fake_nvfp4(weight).detach()


def calibration_hessians(
    chunk: torch.nn.Module, samples: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``2 X^T X / n`` of every decoder linear's input over the tokens of ``samples`` (one
    forward pass of the unquantized model)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def record(name: str):
        def hook(_module, args) -> None:
            x = args[0].detach()
            rows = x.numel() // x.shape[-1]
            sums[name] = sums.get(name, 0) + hessian(x) * rows
            counts[name] = counts.get(name, 0) + rows

        return hook

    handles = [m.register_forward_pre_hook(record(n)) for n, m in decoder_linears(chunk)]
    chunk.eval()
    try:
        with torch.no_grad():
            for tokens in samples:
                tokens = tokens.reshape(1, -1)
                chunk(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), None)
    finally:
        for h in handles:
            h.remove()
    return {name: sums[name] / counts[name] for name in sums}


def calibration_samples(
    store: str | os.PathLike, count: int, *, dataset, seq_length: int
) -> list[torch.Tensor]:
    """The first ``count`` samples of the run whose teacher logits ``store`` holds (the
    student's training dataset, built from the same flags), checked against the store's keys."""
    reader = LogitStoreReader(store)
    if reader.header.seq_length != seq_length:
        raise ConfigError(
            f"--distill-logits-path {store} holds samples of {reader.header.seq_length} tokens, "
            f"the model takes {seq_length}"
        )
    if count > reader.header.num_samples:
        raise ConfigError(
            f"--calibration-samples {count}: {store} holds " f"{reader.header.num_samples} samples"
        )
    windows = [sample_tokens(dataset[i]) for i in range(count)]
    reader.check_samples(list(range(count)), [sample_key(w) for w in windows])
    return [torch.from_numpy(w[:-1]) for w in windows]


def _input_features(model: ApertusConfig) -> dict[str, int]:
    """Input features of each HF decoder projection (every layer alike)."""
    attention = model.num_attention_heads * model.kv_channels
    return {
        "self_attn.q_proj": model.hidden_size,
        "self_attn.k_proj": model.hidden_size,
        "self_attn.v_proj": model.hidden_size,
        "self_attn.o_proj": attention,
        "mlp.up_proj": model.hidden_size,
        "mlp.down_proj": model.ffn_hidden_size,
    }


def check_divisible(model: ApertusConfig, quant: QuantConfig) -> None:
    """The groups (or NVFP4 blocks) must tile every projection's rows: said in one line naming
    the flag, before anything is read or written (``tools/quantize.py`` and the quantized
    export)."""
    if quant.int_bits is not None and quant.quant_group_size > 0:
        group, what = quant.quant_group_size, f"--quant-group-size {quant.quant_group_size}"
    elif quant.quant_format == "nvfp4":
        group, what = NVFP4_BLOCK, f"--quant-format nvfp4 (blocks of {NVFP4_BLOCK})"
    else:
        return
    for name, features in _input_features(model).items():
        if features % group:
            raise ConfigError(
                f"{what} does not divide the {features} input features of " f"model.layers.*.{name}"
            )


def quantize_checkpoint(
    load: str | os.PathLike,
    save: str | os.PathLike,
    settings: PTQSettings,
    samples: Optional[Callable[[], Sequence[torch.Tensor]]] = None,
) -> Path:
    """PTQ of the decoder linears of checkpoint ``load``: their weights are replaced by their
    quantized values (still stored in the checkpoint's dtype); everything else is kept. fp8 and
    nvfp4 checkpoints are evaluated with ``--quant-format F --quant-activations-only``.
    ``samples`` gives GPTQ's calibration samples; it is called once the process group exists
    (megatron-core's dataset builder needs one)."""
    quant = settings.quant
    if quant.quant_activations_only:
        raise ConfigError(
            "--quant-activations-only is for evaluating a quantized checkpoint "
            "(pretrain_gpt.py); tools/quantize.py quantizes weights"
        )
    model = load_model_config(load)
    check_divisible(model, quant)
    with single_process(model) as chunk:
        state = read_state(chunk, load)
        hessians = calibration_hessians(chunk, samples()) if settings.method == "gptq" else {}
        for name, _ in decoder_linears(chunk):
            key = f"{name}.weight"
            if settings.method == "rtn":
                state[key] = rtn_weight(state[key], quant)
            else:
                grid = column_grid(state[key], quant)
                state[key] = gptq_grid(state[key], hessians[name], grid, damp=settings.damp)
        return write_state(chunk, state, save, iteration_of(load), model)
