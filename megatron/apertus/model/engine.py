"""Which implementation computes the layers, and in what precision: Megatron-LM's
``--transformer-impl``, FP8 through Transformer Engine, and deterministic kernels.

Everything here is decided and checked *before* anything is allocated, and each refusal names
the flag and what is missing, because a wrong choice found after model construction costs a
cluster job's queue time. Transformer Engine is imported lazily: the CPU build never has it; torch
and megatron-core too, so that the flags of this module cost ``--help`` no start-up time.

Choices:

* ``local``: our own layers (``model/spec.py``): PyTorch SDPA attention, varlen flash attention
  for packed documents on CUDA, exact per-document SDPA on CPU.
* ``transformer_engine``: TE's fused RMSNorm + linear for QKV and fc1, TE row-parallel linears,
  TE RMSNorm for QK-norm, ``TEDotProductAttention`` (THD ``cu_seqlens`` for packed documents);
  our xIELU between fc1 and fc2. The only implementation that can run FP8 GEMMs.

Checkpoints carry the same keys under both (TE's FP8 metadata travels in ``_extra_state``
entries that the other implementation ignores), so a run can switch between them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help, switch

IMPLS = ("local", "transformer_engine")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
AMAX_ALGOS = ("most_recent", "max")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
FP8_MIN_CAPABILITY = (8, 9)
"""FP8 tensor-core GEMMs: Ada (8.9) and Hopper (9.0) onwards."""
MXFP8_MIN_CAPABILITY = (10, 0)
"""MXFP8 block scaling is a Blackwell (10.x) hardware format."""
TE_DETERMINISTIC_FUSED_MIN_CAPABILITY = (9, 0)
"""Transformer Engine's cuDNN attention trains deterministically from Hopper on."""
TE_DETERMINISTIC_PACKED_MIN_CAPABILITY = (10, 0)
"""...and on packed (THD) batches only past Hopper, whose deterministic backward TE turns off
once documents x heads x longest document^2 reaches 2^30 (a cuDNN workspace limit)."""


@dataclass(kw_only=True, frozen=True)
class EngineConfig:
    """Implementation and precision of the transformer layers (Megatron-LM's flags and meanings)."""

    transformer_impl: Optional[str] = flag_help(
        "local or transformer_engine (default: transformer_engine when it imports and the device "
        "is CUDA, else local)",
        None,
    )
    use_packed_seq_params: bool = flag_help(
        "packed documents travel as THD cu_seqlens (always so here with --reset-attention-mask; "
        "accepted for Megatron-LM compatibility)",
        False,
    )
    attention_backend: str = flag_help(
        "core attention: auto, flash, fused or unfused pick Transformer Engine's backend (auto: TE "
        "chooses); local is PyTorch's flash SDPA and varlen attention (the local implementation's "
        "only one)",
        "auto",
    )
    fp8_format: Optional[str] = flag_help(
        "train the transformer layers' GEMMs in FP8: e4m3, or hybrid (e4m3 forward, e5m2 "
        "gradients); needs --transformer-impl transformer_engine",
        None,
    )
    fp8_recipe: str = flag_help("FP8 scaling: delayed, tensorwise, blockwise or mxfp8", "delayed")
    fp8_margin: int = flag_help("delayed scaling: scale down by 2^margin", 0)
    fp8_amax_history_len: int = flag_help("delayed scaling: amax history length", 1)
    fp8_amax_compute_algo: str = flag_help(
        "delayed scaling: most_recent or max of the history", "most_recent"
    )
    no_fp8_wgrad: bool = switch(
        "FP8 runs compute the weight-gradient GEMMs in the higher precision (Transformer "
        "Engine's DelayedScaling override_linear_precision); megatron-core applies it under "
        "--fp8-recipe delayed only. Without --fp8-format nothing is FP8: no change"
    )
    fp8_param_gather: bool = flag_help(
        "keep the FP8 copy of the weights as the parameters (all-gathered in FP8)", False
    )
    first_last_layers_bf16: bool = flag_help(
        "keep the first and last transformer layers in bf16 under FP8", False
    )
    num_layers_at_start_in_bf16: int = flag_help("layers at the start kept in bf16", 1)
    num_layers_at_end_in_bf16: int = flag_help("layers at the end kept in bf16", 1)
    bf16_layers: Optional[list[int]] = flag_help(
        "transformer layers (numbered from 1) whose GEMMs stay in --precision under FP8, e.g. "
        "--bf16-layers 3 7: any set, under any --fp8-recipe (delayed too); without --fp8-format "
        "every layer is already there; the FP8 guard's bf16-layers action adds to it "
        "(docs/gpu.md)",
        None,
        ours=True,
    )
    deterministic_mode: bool = flag_help(
        "bitwise-reproducible GPU runs: deterministic kernels only (slower; docs/gpu.md)", False
    )
    rope_fusion: bool = flag_help(
        "Transformer Engine's fused rotary-embedding kernel (sbhd and THD); --no-rope-fusion "
        "applies RoPE with megatron-core's unfused PyTorch code (the local implementation "
        "always does)",
        True,
    )
    gradient_accumulation_fusion: bool = flag_help(
        "Transformer Engine's weight-gradient GEMMs accumulate straight into the fp32 main_grad "
        "(no bf16 gradient, no separate add per micro-batch); --no-gradient-accumulation-fusion "
        "keeps the add (the local implementation always does)",
        True,
    )

    def __post_init__(self) -> None:
        choices = (
            ("--transformer-impl", self.transformer_impl, IMPLS + (None,)),
            ("--fp8-format", self.fp8_format, FP8_FORMATS + (None,)),
            ("--fp8-recipe", self.fp8_recipe, FP8_RECIPES),
            ("--fp8-amax-compute-algo", self.fp8_amax_compute_algo, AMAX_ALGOS),
            ("--attention-backend", self.attention_backend, ATTENTION_BACKENDS),
        )
        for flag, value, allowed in choices:
            if value not in allowed:
                names = ", ".join(a for a in allowed if a is not None)
                raise ConfigError(f"{flag} must be one of {names}, got {value!r}")
        if self.fp8_amax_history_len < 1:
            raise ConfigError(
                f"--fp8-amax-history-len must be >= 1, got {self.fp8_amax_history_len}"
            )
        for flag in ("fp8_param_gather", "first_last_layers_bf16"):
            if getattr(self, flag) and self.fp8_format is None:
                raise ConfigError(f"--{flag.replace('_', '-')} needs --fp8-format")
        if self.bf16_layers and self.fp8_param_gather:
            raise ConfigError(
                "--bf16-layers needs the weights in --precision: --fp8-param-gather keeps them "
                "in FP8 only"
            )
        if self.no_fp8_wgrad and self.fp8 and self.fp8_recipe != "delayed":
            raise ConfigError(
                f"--no-fp8-wgrad: megatron-core keeps the weight gradients in FP8 under "
                f"--fp8-recipe {self.fp8_recipe} (its override is DelayedScaling's): use delayed"
            )
        if self.first_last_layers_bf16 and self.fp8_recipe == "delayed":
            # megatron-core wraps the whole block in one FP8 autocast under delayed scaling
            raise ConfigError(
                "--first-last-layers-bf16 does not work with --fp8-recipe delayed (one FP8 "
                "region spans every layer): use tensorwise or blockwise"
            )

    @property
    def fp8(self) -> bool:
        return self.fp8_format is not None


# -- what this machine has ------------------------------------------------------------------------


@functools.cache
def transformer_engine_error() -> str | None:
    """Why Transformer Engine cannot be used here (None when it imports)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine is not installed"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # TE raises OSError/RuntimeError/ImportError for missing CUDA libs
        first_line = (str(err).splitlines() or [""])[0]
        return f"Transformer Engine does not import ({type(err).__name__}: {first_line})"
    return None


def cuda_capability() -> tuple[int, int] | None:
    """Compute capability of the current GPU (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


# -- choice and validation ------------------------------------------------------------------------


def resolve_transformer_impl(
    engine: EngineConfig, device: str, te_error: Callable[[], str | None] = transformer_engine_error
) -> str:
    """The implementation to build: the requested one, or TE when it imports on CUDA."""
    if engine.transformer_impl is not None:
        return engine.transformer_impl
    if device == "cuda" and te_error() is None:
        return "transformer_engine"
    return "local"


def validate_engine(
    engine: EngineConfig,
    *,
    device: str,
    num_layers: int,
    te_error: Callable[[], str | None] = transformer_engine_error,
    capability: Callable[[], tuple[int, int] | None] = cuda_capability,
) -> str:
    """Check the implementation and precision flags against this machine; return the impl.

    ``te_error`` and ``capability`` probe the machine; they are parameters so that the rules
    for GPUs this machine does not have can be checked too.
    """
    impl = resolve_transformer_impl(engine, device, te_error)
    if impl == "transformer_engine":
        if device != "cuda":
            raise ConfigError(
                "--transformer-impl transformer_engine needs a CUDA device (this run is on "
                f"{device}); use --transformer-impl local"
            )
        missing = te_error()
        if missing:
            raise ConfigError(f"--transformer-impl transformer_engine: {missing}")
    if impl == "local" and engine.attention_backend not in ("auto", "local"):
        raise ConfigError(
            f"--attention-backend {engine.attention_backend} needs --transformer-impl "
            "transformer_engine (the local implementation attends through PyTorch SDPA/varlen)"
        )
    _check_bf16_layers(engine.bf16_layers, num_layers)
    if engine.fp8:
        _validate_fp8(engine, impl, num_layers, capability)
    return impl


def _check_bf16_layers(layers: list[int] | None, num_layers: int) -> None:
    """``--bf16-layers`` names layers of this model (1 to --num-layers)."""
    outside = [n for n in layers or () if not 1 <= n <= num_layers]
    if outside:
        raise ConfigError(
            f"--bf16-layers {outside[0]} is not a layer of this model: layers are numbered 1 to "
            f"--num-layers ({num_layers})"
        )


def _validate_fp8(
    engine: EngineConfig,
    impl: str,
    num_layers: int,
    capability: Callable[[], tuple[int, int] | None],
) -> None:
    if impl != "transformer_engine":
        raise ConfigError(
            f"--fp8-format {engine.fp8_format} needs --transformer-impl transformer_engine "
            "(FP8 GEMMs come from Transformer Engine)"
        )
    cap = capability()
    if cap is None or cap < FP8_MIN_CAPABILITY:
        raise ConfigError(
            f"--fp8-format {engine.fp8_format} needs a GPU of compute capability >= 8.9 "
            f"(Ada, Hopper, Blackwell); this GPU has {_capability_name(cap)}"
        )
    if engine.fp8_recipe == "mxfp8" and cap < MXFP8_MIN_CAPABILITY:
        raise ConfigError(
            "--fp8-recipe mxfp8 needs a Blackwell GPU (compute capability >= 10.0); this GPU has "
            f"{_capability_name(cap)}: use tensorwise, delayed or blockwise"
        )
    if engine.first_last_layers_bf16:
        start, end = engine.num_layers_at_start_in_bf16, engine.num_layers_at_end_in_bf16
        if start < 0 or end < 0 or start + end > num_layers:
            raise ConfigError(
                f"--num-layers-at-start-in-bf16 ({start}) + --num-layers-at-end-in-bf16 ({end}) "
                f"must be between 0 and --num-layers ({num_layers})"
            )


def deterministic_core_attention(
    engine: EngineConfig,
    impl: str,
    *,
    packed_documents: bool,
    capability: Callable[[], tuple[int, int] | None] = cuda_capability,
) -> EngineConfig:
    """``engine`` with ``--attention-backend local`` where ``--deterministic-mode`` would leave
    Transformer Engine nothing but its unfused attention.

    Under ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` TE (2.x) turns its cuDNN attention off before
    Hopper, and on Hopper for packed documents of realistic sizes; flash-attn is not among its
    dependencies. The unfused fallback holds every score matrix (documents x heads x longest
    document^2) and runs out of memory on the 1.5B's packed 4k samples (docs/gpu.md). torch's
    flash and varlen kernels train bitwise reproducibly there and keep TE's linears and FP8.
    An explicitly chosen backend is left alone.
    """
    if not (
        engine.deterministic_mode
        and impl == "transformer_engine"
        and engine.attention_backend == "auto"
    ):
        return engine
    cap = capability()
    if cap is None:
        return engine
    needed = (
        TE_DETERMINISTIC_PACKED_MIN_CAPABILITY
        if packed_documents
        else TE_DETERMINISTIC_FUSED_MIN_CAPABILITY
    )
    return replace(engine, attention_backend="local") if cap < needed else engine


def _capability_name(cap: tuple[int, int] | None) -> str:
    return "none (no CUDA device)" if cap is None else f"{cap[0]}.{cap[1]}"


def transformer_config_fields(engine: EngineConfig, impl: str) -> dict:
    """The TransformerConfig fields that carry these choices."""
    from megatron.core.transformer.enums import AttnBackend

    fields: dict[str, Any] = {
        "transformer_impl": impl,
        "deterministic_mode": engine.deterministic_mode,
        "attention_backend": AttnBackend[engine.attention_backend],
        "apply_rope_fusion": impl == "transformer_engine" and engine.rope_fusion,
    }
    if engine.fp8:
        fields.update(
            fp8=engine.fp8_format,
            fp8_recipe=engine.fp8_recipe,
            fp8_margin=engine.fp8_margin,
            fp8_amax_history_len=engine.fp8_amax_history_len,
            fp8_amax_compute_algo=engine.fp8_amax_compute_algo,
            fp8_param=engine.fp8_param_gather,
            fp8_wgrad=not engine.no_fp8_wgrad,
            first_last_layers_bf16=engine.first_last_layers_bf16,
            num_layers_at_start_in_bf16=engine.num_layers_at_start_in_bf16,
            num_layers_at_end_in_bf16=engine.num_layers_at_end_in_bf16,
        )
    return fields


GEMM_ALIGNMENT_BYTES = 16
"""cuBLAS's FP8 GEMMs need every operand 16-byte aligned; its fast bf16 kernels want the same."""


def fuse_te_wgrad_accumulation(chunk: Any) -> tuple[int, int]:
    """Let the Transformer Engine linears of ``chunk`` write their weight gradients into the
    parameters' fp32 ``main_grad`` (megatron-core DDP's buffer) with the GEMM's accumulate;
    ``(fused, TE linears)``.

    megatron-core's ``gradient_accumulation_fusion`` would also switch the local output layer to
    APEX's ``fused_weight_gradient_mlp_cuda``, which we do not ship; TE reads the switch at each
    forward, so it is set on TE's modules alone, once DDP has made ``main_grad``. Without it each
    micro-batch writes a bf16 weight gradient and DDP's hook adds it to ``main_grad`` in a
    separate pass over every weight (docs/gpu.md: 9-11% of an 8B-shaped step on an H100).

    Only a ``main_grad`` that starts on a :data:`GEMM_ALIGNMENT_BYTES` boundary is written by the
    GEMM: DDP packs parameters back to back unless the distributed optimizer pads them, and
    xIELU's scalar parameters then shift every later weight by 4 bytes, where cuBLAS has no FP8
    kernel and only a slow bf16 one.
    """
    fused = linears = 0
    for module in chunk.modules():
        if not hasattr(module, "fuse_wgrad_accumulation"):
            continue
        linears += 1
        main_grad = getattr(module.weight, "main_grad", None)
        if main_grad is not None and is_gemm_aligned(main_grad):
            module.fuse_wgrad_accumulation = True
            fused += 1
    return fused, linears


def is_gemm_aligned(tensor: Any) -> bool:
    """Whether ``tensor`` starts on a :data:`GEMM_ALIGNMENT_BYTES` boundary."""
    return tensor.data_ptr() % GEMM_ALIGNMENT_BYTES == 0


def enable_deterministic_mode() -> None:
    """Deterministic kernels wherever they exist, and a warning naming any op that has none.

    Must run before the first cuBLAS call and before NCCL starts (the environment is read
    then). Cost: see docs/gpu.md. Our own CUDA kernels reduce in a fixed order and need no
    switch.
    """
    import torch

    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"  # TE attention's backward
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS split-K reductions
    os.environ.setdefault("NCCL_ALGO", "Ring")  # one reduction order across runs
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


TE_ATTENTION_BACKENDS = ("flash", "fused", "unfused")


def select_te_attention_backend(backend: str, impl: str) -> None:
    """Set Transformer Engine's attention switches for ``--attention-backend`` before
    megatron-core builds the model, which asserts them against the backend (a traceback).

    * flash / fused / unfused: that backend on, the others off.
    * TE's attention unused (``--transformer-impl local``, or the ``local`` core attention that
      a deterministic TE run may pick by itself): the switches mean nothing to the run, so values
      a cluster environment exports are dropped instead of stopping it.
    * auto under TE: TE chooses among the backends the environment leaves on, and megatron-core's
      auto allows none to be off; such a switch is refused in one line naming the flag that does
      the same.
    """
    switches = [f"NVTE_{name.upper()}_ATTN" for name in TE_ATTENTION_BACKENDS]
    if backend in TE_ATTENTION_BACKENDS:
        for name, switch in zip(TE_ATTENTION_BACKENDS, switches):
            os.environ[switch] = "1" if name == backend else "0"
    elif impl != "transformer_engine" or backend == "local":
        for switch in switches:
            os.environ.pop(switch, None)
    else:
        off = [
            f"{switch}={os.environ[switch]}"
            for switch in switches
            if os.environ.get(switch, "1") != "1"
        ]
        if off:
            raise ConfigError(
                f"{', '.join(off)} in the environment turns a Transformer Engine attention "
                "backend off, which --attention-backend auto does not allow (megatron-core); "
                "unset it, or name the backend with --attention-backend flash|fused|unfused"
            )
