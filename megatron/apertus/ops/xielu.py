"""xIELU activation (Huang & Schlag 2024, arXiv 2411.13010).

    alpha_p = softplus(a_p)          alpha_n = beta + softplus(a_n)
    y = alpha_p * x^2 + beta * x                          for x > 0
    y = alpha_n * (expm1(min(x, eps)) - x) + beta * x     for x <= 0

``a_p`` and ``a_n`` are learnable raw scalars of shape [1] (the same parametrisation and names,
``alpha_p``/``alpha_n``, as Hugging Face's ``XIELUActivation``). ``beta`` and ``eps`` are fixed
Python floats: keeping them as device tensors costs a host sync per call in some backends.
``min(x, eps)`` keeps the unused branch finite so that gradients never see ``inf * 0``.

Implementations (``impl``):

* ``"torch"``: :func:`xielu_reference`, eager PyTorch (about ten passes over memory).
* ``"cpu"`` / ``"cuda"``: our kernels (``csrc/xielu/``), one pass forward and one backward, fp32
  math for fp32/bf16/fp16 inputs, deterministic scalar gradients. They are the torch.library
  custom ops ``apertus::xielu_fwd`` / ``apertus::xielu_bwd`` with fake (meta) implementations and
  autograd, so they run in eager mode and inside ``torch.compile`` graphs.
* ``"auto"``: the kernel of the input's device if it is built and supports the dtype, else the
  reference (with one warning per device when the extension is not built).

The extensions ``megatron.apertus.ops._xielu_cpu`` / ``_xielu_cuda`` are pybind11 modules built by
``setup.py`` and imported lazily, on first use.
"""

from __future__ import annotations

import importlib
import math
import warnings
from types import ModuleType

import torch
import torch.nn.functional as F

from megatron.apertus.ops.constants import XIELU_BETA, XIELU_EPS

XIELU_ALPHA_P_INIT = 0.8
XIELU_ALPHA_N_INIT = 0.8

XIELU_IMPLS = ("auto", "cuda", "cpu", "torch")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BUILD_HINT = (
    "build it with `pip install --no-build-isolation -e .` (or `APERTUS_OPS=xielu python setup.py "
    "build_ext --inplace`) with torch importable; the CUDA extension also needs nvcc and a CUDA "
    "build of torch (see csrc/README.md), or use impl='torch'"
)
_extensions: dict[str, ModuleType | str] = {}
_warned: set[str] = set()


def inverse_softplus(y: float) -> float:
    """The raw parameter value whose softplus is ``y``."""
    return math.log(math.expm1(y))


def xielu_reference(
    x: torch.Tensor,
    alpha_p: torch.Tensor,
    alpha_n: torch.Tensor,
    beta: float = XIELU_BETA,
    eps: float = XIELU_EPS,
) -> torch.Tensor:
    """Eager PyTorch xIELU; autograd gives dx and the two raw-parameter gradients.

    Computes in at least fp32 (fp64 stays fp64, for gradcheck) and returns ``x.dtype``.
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    a_p = F.softplus(alpha_p.to(compute))
    a_n = beta + F.softplus(alpha_n.to(compute))
    xf = x.to(compute)
    positive = a_p * xf * xf + beta * xf
    negative = a_n * (torch.expm1(torch.clamp(xf, max=eps)) - xf) + beta * xf
    return torch.where(xf > 0, positive, negative).to(x.dtype)


def _load(device_type: str) -> ModuleType | str:
    """The compiled extension for ``device_type``, or why it cannot be imported (cached)."""
    if device_type not in _extensions:
        name = f"megatron.apertus.ops._xielu_{device_type}"
        try:
            _extensions[device_type] = importlib.import_module(name)
        except ImportError as error:
            _extensions[device_type] = f"{name} is not importable ({error})"
    return _extensions[device_type]


def _extension(device_type: str) -> ModuleType:
    """The extension that must run on ``device_type``; a clear error if it is missing."""
    if device_type not in ("cpu", "cuda"):
        raise RuntimeError(f"xielu has no compiled kernel for device type {device_type!r}")
    loaded = _load(device_type)
    if isinstance(loaded, str):
        raise RuntimeError(f"xielu impl={device_type!r}: {loaded}; {_BUILD_HINT}")
    return loaded


# The two checks below run while torch.compile traces (importing is not traceable) and are
# constants of the compiled graph.
@torch.compiler.assume_constant_result
def _require_kernel(device_type: str) -> bool:
    """Raise the build hint unless ``device_type``'s extension imports."""
    _extension(device_type)
    return True


@torch.compiler.assume_constant_result
def _auto_uses_kernel(device_type: str) -> bool:
    """Whether ``impl="auto"`` has a kernel on ``device_type``; warns once when it has not."""
    if device_type not in ("cpu", "cuda"):
        return False
    loaded = _load(device_type)
    if isinstance(loaded, str) and device_type not in _warned:
        _warned.add(device_type)
        warnings.warn(
            f"xielu: using the PyTorch reference on {device_type}: {loaded}; " f"{_BUILD_HINT}",
            stacklevel=3,
        )
    return not isinstance(loaded, str)


@torch.library.custom_op("apertus::xielu_fwd", mutates_args=())
def _xielu_fwd(
    x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: float, eps: float
) -> torch.Tensor:
    """y of the same shape and dtype as ``x``, from the kernel of ``x``'s device."""
    return _extension(x.device.type).forward(x.contiguous(), alpha_p, alpha_n, beta, eps)


@_xielu_fwd.register_fake
def _xielu_fwd_fake(
    x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: float, eps: float
) -> torch.Tensor:
    return x.new_empty(x.shape)  # the kernels return contiguous tensors


@torch.library.custom_op("apertus::xielu_bwd", mutates_args=())
def _xielu_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    alpha_p: torch.Tensor,
    alpha_n: torch.Tensor,
    beta: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx and the gradients of the raw ``alpha_p``/``alpha_n`` (their shapes and dtype)."""
    ext = _extension(x.device.type)
    dx, d_alpha_p, d_alpha_n = ext.backward(
        dy.contiguous(), x.contiguous(), alpha_p, alpha_n, beta, eps
    )
    return dx, d_alpha_p, d_alpha_n


@_xielu_bwd.register_fake
def _xielu_bwd_fake(
    dy: torch.Tensor,
    x: torch.Tensor,
    alpha_p: torch.Tensor,
    alpha_n: torch.Tensor,
    beta: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), alpha_p.new_empty(alpha_p.shape), alpha_n.new_empty(alpha_n.shape)


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, alpha_p, alpha_n, beta, eps = inputs
    ctx.save_for_backward(x, alpha_p, alpha_n)
    ctx.beta, ctx.eps = beta, eps


def _backward(ctx, dy: torch.Tensor) -> tuple:
    x, alpha_p, alpha_n = ctx.saved_tensors
    dx, d_alpha_p, d_alpha_n = _xielu_bwd(dy, x, alpha_p, alpha_n, ctx.beta, ctx.eps)
    return dx, d_alpha_p, d_alpha_n, None, None


_xielu_fwd.register_autograd(_backward, setup_context=_setup_context)


def xielu(
    x: torch.Tensor,
    alpha_p: torch.Tensor,
    alpha_n: torch.Tensor,
    beta: float = XIELU_BETA,
    eps: float = XIELU_EPS,
    impl: str = "auto",
) -> torch.Tensor:
    """xIELU of ``x`` with raw parameters ``alpha_p``/``alpha_n`` (shape [1]); see the module doc.

    ``impl="cpu"``/``"cuda"`` insist on that kernel (an error says how to build it when it is
    missing); ``"auto"`` uses the kernel of ``x``'s device when there is one for ``x.dtype``.
    """
    if impl not in XIELU_IMPLS:
        raise ValueError(f"xielu impl must be one of {XIELU_IMPLS}, got {impl!r}")
    device_type = x.device.type
    if impl in ("cpu", "cuda"):
        _require_kernel(impl)
        if device_type != impl:
            raise ValueError(f"xielu impl={impl!r} needs a {impl} tensor, got one on {x.device}")
        if x.dtype not in KERNEL_DTYPES:
            raise TypeError(f"xielu impl={impl!r} supports {KERNEL_DTYPES}, got {x.dtype}")
    elif impl == "torch" or x.dtype not in KERNEL_DTYPES or not _auto_uses_kernel(device_type):
        return xielu_reference(x, alpha_p, alpha_n, beta, eps)
    return _xielu_fwd(x, alpha_p, alpha_n, float(beta), float(eps))
