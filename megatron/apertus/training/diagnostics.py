"""What a run may log beside its loss: parameter norms and memory use; and Megatron-LM's
scheduled garbage collection.

Parameter norms are of the whole model whatever the layout: each tensor-parallel shard counts
once, a parameter replicated over the tensor-parallel ranks counts once (its TP rank 0 copy),
and a parameter that is a copy of another (the output layer tied to the embedding on the last
pipeline stage) is left out, as Megatron-LM's ``calc_params_l2_norm`` does. Data- and
context-parallel ranks hold the same weights and are not summed over. The norms are of the model
parameters (bf16 in a bf16 run; Megatron-LM reads the fp32 main copies), accumulated in fp32.

Garbage collection: Python's automatic collector pauses a rank at moments that differ between
ranks, and every other rank waits for it at the next collective; ``--manual-gc`` turns it off
and collects on all ranks at the same iterations instead.
"""

from __future__ import annotations

import gc
import re
import resource

import psutil
import torch
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron.apertus.model.builder import chunk_groups

LAYER = re.compile(r"(?<=\blayers\.)(\d+)(?=\.)")


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP and Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _global_names(chunk: torch.nn.Module) -> dict[str, str]:
    """Parameter names of ``chunk`` with each transformer layer's global index (a pipeline
    stage numbers its layers from 0), so every layout names a parameter alike."""
    model = _unwrap(chunk)
    offsets = {
        str(i): str(layer.layer_number - 1)
        for i, layer in enumerate(getattr(getattr(model, "decoder", None), "layers", ()))
    }
    return {
        name: LAYER.sub(lambda m: offsets.get(m.group(1), m.group(1)), name)
        for name, _ in model.named_parameters()
    }


def _squared_norms(chunks) -> dict[str, torch.Tensor]:
    """This rank's share of each parameter's squared norm (zero for a TP duplicate); copies of
    another parameter are left out."""
    squares = {}
    for chunk in chunks:
        names = _global_names(chunk)
        for name, param in _unwrap(chunk).named_parameters():
            if not param_is_not_shared(param):
                continue
            value = param.detach().float().square().sum()
            squares[names[name]] = (
                value if param_is_not_tensor_parallel_duplicate(param) else 0 * value
            )
    return squares


def params_norms(chunks, *, per_param: bool) -> tuple[float, dict[str, float]]:
    """L2 norm of all parameters and, with ``per_param``, of each (a collective: all ranks
    call it, over the groups the chunks were built with; every rank gets the same numbers)."""
    groups = chunk_groups(chunks[0])
    squares = _squared_norms(chunks)
    values = torch.stack(list(squares.values()))
    torch.distributed.all_reduce(values, group=groups.tp)
    total = values.sum().double().reshape(1)
    torch.distributed.all_reduce(total, group=groups.pp)
    if not per_param:
        return total.sqrt().item(), {}
    stages = [None] * groups.pp.size()
    torch.distributed.all_gather_object(
        stages, dict(zip(squares, values.sqrt().tolist())), group=groups.pp
    )
    return total.sqrt().item(), {k: v for stage in stages for k, v in stage.items()}


def max_attention_logit(chunks) -> float:
    """Megatron-LM's --log-max-attention-logit: the largest pre-softmax attention logit of the
    step's training passes over every layer and head of the whole model (all ranks: a
    collective), read from each core attention's ``current_max_attn_logits``, which starts over.
    Megatron-LM reduces over the data- and context-parallel ranks only, so its last rank logs
    its own pipeline stage and tensor-parallel heads; here no layer or head is left out."""
    largest = torch.tensor(float("-inf"), device=next(chunks[0].parameters()).device)
    for chunk in chunks:
        for layer in getattr(_unwrap(chunk).decoder, "layers", ()):
            attention = layer.self_attention.core_attention
            if attention.current_max_attn_logits is not None:
                largest = torch.max(largest, attention.current_max_attn_logits.max().float())
                attention.current_max_attn_logits = None
    torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
    return largest.item()


def memory_stats(device: torch.device) -> dict[str, float]:
    """Megatron-LM's allocator statistics on a GPU; the process's resident memory on a CPU."""
    if device.type == "cuda":
        return {
            "memory/allocated_bytes": torch.cuda.memory_allocated(device),
            "memory/max_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "memory/reserved_bytes": torch.cuda.memory_reserved(device),
        }
    return {"memory/rss_bytes": psutil.Process().memory_info().rss}


def memory_line(device: torch.device, device_used: bool = False) -> str:
    """Megatron-LM's memory report (``report_memory``), in MB: on a GPU the allocator's
    allocated, max allocated, reserved and max reserved memory; on a CPU, which has no such
    allocator, the process's resident memory and its peak. ``device_used``
    (--log-device-memory-used): then the memory every process uses on the device, NVML's on a
    GPU, the host's on a CPU."""
    if device.type == "cuda":
        fields = {
            "allocated": torch.cuda.memory_allocated(device),
            "max allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
            "max reserved": torch.cuda.max_memory_reserved(device),
        }
    else:
        resident = psutil.Process().memory_info().rss
        # The kernel's peak (KiB on Linux) is updated lazily: it may lag the current size.
        peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, resident)
        fields = {"resident": resident, "max resident": peak}
    if device_used:
        fields["total device memory used"] = (
            torch.cuda.device_memory_used(device)
            if device.type == "cuda"
            else psutil.virtual_memory().used
        )
    return "memory (MB)" + "".join(
        f" | {name}: {value / 2**20:.2f}" for name, value in fields.items()
    )


def peak_memory_gib(device: torch.device) -> float:
    """The log line's memory: the allocator's peak on a GPU, the resident memory on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return psutil.Process().memory_info().rss / 2**30


class ManualGC:
    """Megatron-LM's ``--manual-gc``: no automatic collection; a full one at start, every
    ``interval`` iterations (0: never), around checkpoint saves and (unless ``around_eval`` is
    off) around validation."""

    def __init__(self, enabled: bool, interval: int, *, around_eval: bool = True) -> None:
        self.enabled = enabled
        self.interval = interval
        self.around_eval = around_eval
        self.was_enabled = gc.isenabled()
        if enabled:
            gc.disable()
            gc.collect()

    def step(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    def boundary(self) -> None:
        """Before and after a validation pass or a save."""
        if self.enabled:
            gc.collect()

    def eval_boundary(self) -> None:
        """Before and after a validation pass (Megatron-LM's --manual-gc-eval)."""
        if self.around_eval:
            self.boundary()

    def close(self) -> None:
        """Give the process its automatic collector back (runs in one process, tests)."""
        if self.enabled and self.was_enabled:
            gc.enable()
