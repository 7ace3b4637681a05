"""The one place where megatron-core learns to run on CPU.

megatron-core assumes CUDA in ~110 places: ``device="cuda"`` literals, ``.cuda()`` calls,
``torch.cuda.current_device()``, the CUDA RNG tracker, and ``param.type() ==
'torch.cuda.FloatTensor'`` checks in the optimizer and gradient clipping. Patching each
call site would be fragile, so :func:`enable` installs three things, and only when no GPU
is used:

1. a global :class:`torch.overrides.TorchFunctionMode` that rewrites CUDA device arguments
   (``device="cuda"``, ``device=0``, ``.cuda()``, ``.to("cuda")``, ``pin_memory=True``) to
   CPU and reports CPU float tensors as their ``torch.cuda.*Tensor`` type names;
2. CPU stand-ins for the handful of ``torch.cuda`` functions megatron-core calls outright
   (``current_device``, ``set_device``, ``synchronize``, ``current_stream``, RNG state,
   memory statistics);
3. the CUDA RNG tracker's state accessors redirected to the CPU generator, so that
   ``get_cuda_rng_tracker().fork()`` keeps its semantics (a separate, restorable stream).

Invariants: nothing here is imported or activated when CUDA is used; numerics on CPU are
those of plain PyTorch; the mode is process-wide and idempotent.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
_mode: "_CudaToCpuMode | None" = None


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _map_device(device: Any) -> Any:
    return torch.device("cpu") if _is_cuda_device(device) else device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to CPU for every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def _cpu_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, *_args, **_kwargs) -> None:
    torch.set_rng_state(state)


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda *_a, **_k: None
    cuda.synchronize = lambda *_a, **_k: None
    cuda.get_rng_state = _cpu_rng_state
    cuda.set_rng_state = _set_cpu_rng_state
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, which must stay untouched.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed)) and None
    cuda.memory_allocated = lambda *_a, **_k: 0
    cuda.max_memory_allocated = lambda *_a, **_k: 0
    cuda.reset_peak_memory_stats = lambda *_a, **_k: None
    cuda.empty_cache = lambda: None
    # megatron-core 0.19 asks for the current stream before every gradient reduction (to wait
    # on CUDA-graph events that never exist on CPU); torch's CPU stream is the no-op stand-in.
    cuda.current_stream = torch.cpu.current_stream


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state

    # The tracker warns when the CPU generator moves inside a fork; on CPU that generator *is*
    # the forked stream, so the warning would fire on every dropout call and mean nothing.
    class _SameStreamFilter(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "CPU RNG state changed within GPU RNG context" not in record.getMessage()

    logging.getLogger(mcore_random.__name__).addFilter(_SameStreamFilter())


def enable() -> None:
    """Make megatron-core usable on CPU for the rest of this process.

    Call it only for a CPU run (see :func:`megatron.apertus.parallel.resolve_device`): it
    replaces ``torch.cuda`` functions process-wide, so CUDA is unusable afterwards.
    """
    global _mode
    if _mode is not None:
        return
    _patch_torch_cuda()
    _patch_rng_tracker()
    _mode = _CudaToCpuMode()
    _mode.__enter__()


def is_enabled() -> bool:
    return _mode is not None
