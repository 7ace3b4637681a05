"""CUDA graphs of the transformer layers: Megatron-LM's ``--cuda-graph-impl``,
``--cuda-graph-scope`` and ``--cuda-graph-warmup-steps``, with their names and meanings.

A graph replays a layer's recorded kernels with one launch, so the host no longer queues each
kernel: what is left of a step's idle GPU time once the host waits are gone is launch overhead
(docs/gpu.md). megatron-core captures the graphs; this module decides and checks which, and the
training loop drives the capture (:mod:`megatron.apertus.training.cuda_graphs`).

* ``local``: megatron-core's ``CudaGraphManager`` in every transformer layer. The first step runs
  eagerly and records each layer's calls; at its end megatron-core's schedule captures them
  (``create_cudagraphs``), each graph after ``--cuda-graph-warmup-steps`` eager runs of its own;
  later steps replay. Whole layers only (megatron-core's local graphs of a dense layer cover it
  whole; Megatron-LM gives the other scopes to ``transformer_engine``).
* ``transformer_engine``: Transformer Engine's ``make_graphed_callables`` through megatron-core's
  ``TECudaGraphHelper``, called by the loop after ``--cuda-graph-warmup-steps`` eager steps of
  the job; ``--cuda-graph-scope attn`` or ``mlp`` graphs that part of each layer, the rest runs
  eagerly.

Invariants a graph needs, refused here before anything is built, each in one line: a CUDA
device and Transformer Engine (its RNG tracker is the graph-safe one megatron-core accepts for
both implementations); the same shapes at every replay, so no packed documents (their
``cu_seqlens`` change every batch) where the graph covers attention, a fixed number of
micro-batches under pipeline parallelism, and Transformer Engine's graphs only in bf16
(megatron-core captures them from bf16 sample inputs); a layer's precision fixed at capture, so
no ``--bf16-layers`` or FP8-guard switch under FP8; no Python hooks inside a layer
(``--log-intermediate-metrics``); megatron-core's own rules (no full recomputation outside
whole-iteration graphs). Whole-iteration graphs (``full_iteration``) copy dict batches into
static buffers; our batches are dataclasses moved inside the forward step, so that scope is
refused too. This module imports no torch or megatron-core: ``--help`` and the refusals start at
once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Literal

from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help

IMPLS = ("none", "local", "transformer_engine")
LAYER_SCOPES = ("attn", "mlp")
"""Parts of a dense transformer layer Transformer Engine's graphs can cover (none: all of it)."""
OTHER_SCOPES = ("moe", "moe_router", "moe_preprocess", "mamba")
"""Megatron-LM's scopes of layers the Apertus model does not have."""
FULL_ITERATION = "full_iteration"


@dataclass(kw_only=True, frozen=True)
class CudaGraphConfig:
    """CUDA graphs of the transformer layers (Megatron-LM's flags and meanings)."""

    cuda_graph_impl: Literal["none", "local", "transformer_engine"] = flag_help(
        "CUDA graph capture of the transformer layers: none; local (megatron-core's "
        "CudaGraphManager, captured at the end of the first step); transformer_engine (TE's "
        "make_graphed_callables, captured after --cuda-graph-warmup-steps steps). Needs a CUDA "
        "device and Transformer Engine",
        "none",
    )
    cuda_graph_scope: list[str] = flag_help(
        "what each layer's graph covers with --cuda-graph-impl transformer_engine: attn, mlp "
        "(the rest runs eagerly); none given: the whole layer (local: always the whole layer)",
        default_factory=list,
    )
    cuda_graph_warmup_steps: int = flag_help(
        "CUDA graph warmup steps: transformer_engine: eager training steps before the capture; "
        "local: eager runs of each graph before its capture",
        3,
    )

    def __post_init__(self) -> None:
        if self.cuda_graph_impl not in IMPLS:
            raise ConfigError(
                f"--cuda-graph-impl must be one of {', '.join(IMPLS)}, got {self.cuda_graph_impl!r}"
            )
        object.__setattr__(self, "cuda_graph_scope", list(self.cuda_graph_scope))
        if self.cuda_graph_warmup_steps < 0:
            raise ConfigError(
                f"--cuda-graph-warmup-steps must be >= 0, got {self.cuda_graph_warmup_steps}"
            )
        line = _scope_problem(self.cuda_graph_impl, self.cuda_graph_scope)
        if line:
            raise ConfigError(line)

    @property
    def enabled(self) -> bool:
        return self.cuda_graph_impl != "none"

    @property
    def covers_attention(self) -> bool:
        """Whether a graph holds the layers' attention (the whole layer, or ``attn``)."""
        return self.enabled and (not self.cuda_graph_scope or "attn" in self.cuda_graph_scope)

    def transformer_config_fields(self) -> dict[str, Any]:
        """The TransformerConfig fields that carry these choices (megatron-core's spelling of
        the scope differs between its lines: :func:`megatron.apertus.mcore_compat`)."""
        from megatron.apertus.mcore_compat import cuda_graph_fields

        fields = cuda_graph_fields(
            self.cuda_graph_impl, self.cuda_graph_scope, self.cuda_graph_warmup_steps
        )
        if self.enabled:
            fields["use_te_rng_tracker"] = True
        return fields


def _scope_problem(impl: str, scope: list[str]) -> str | None:
    """The scope against the implementation: Megatron-LM's rules, and the layers we have."""
    given = " ".join(scope)
    known = LAYER_SCOPES + OTHER_SCOPES + (FULL_ITERATION,)
    unknown = [s for s in scope if s not in known]
    if unknown:
        return f"--cuda-graph-scope must name {', '.join(LAYER_SCOPES)}, got {unknown[0]!r}"
    other = [s for s in scope if s in OTHER_SCOPES]
    if other:
        return f"--cuda-graph-scope {other[0]}: the Apertus model has no MoE or Mamba layers"
    if FULL_ITERATION in scope:
        return (
            f"--cuda-graph-scope {FULL_ITERATION}: megatron-core's whole-iteration graph copies "
            "dict batches into static buffers, which this trainer's batches are not; use "
            "per-layer graphs (no --cuda-graph-scope)"
        )
    if scope and impl == "none":
        return f"--cuda-graph-scope {given} needs --cuda-graph-impl transformer_engine"
    if scope and impl == "local":
        return (
            f"--cuda-graph-scope {given}: megatron-core's local graphs cover whole layers; "
            "use --cuda-graph-impl transformer_engine for attn or mlp"
        )
    return None


@dataclass(frozen=True)
class GraphedRun:
    """What of the rest of the run a graph depends on (the facts :func:`cuda_graph_problems`
    checks, gathered from the other config groups)."""

    device: str
    precision: str
    transformer_impl: str
    attention_backend: str
    packed_documents: bool
    pipeline_parallel: int
    context_parallel: int
    rampup: bool
    recompute_granularity: str | None
    fp8: bool
    bf16_layers: bool
    fp8_guard_switches: bool
    intermediate_metrics: bool
    gradient_accumulation_fusion: bool


def cuda_graph_problems(
    graphs: CudaGraphConfig, run: GraphedRun, te_error: Callable[[], str | None]
) -> list[str]:
    """Every reason ``graphs`` cannot run with the rest of ``run``, one line each (empty without
    graphs). ``te_error``: why Transformer Engine cannot be used here (None: it imports)."""
    if not graphs.enabled:
        return []
    flag = f"--cuda-graph-impl {graphs.cuda_graph_impl}"
    if run.device != "cuda":
        return [f"{flag} needs a CUDA device (this run is on {run.device})"]
    missing = te_error()
    if missing:
        return [f"{flag}: {missing} (its RNG tracker is the graph-safe one megatron-core takes)"]
    problems = _shape_problems(graphs, run, flag) + _precision_problems(run, flag)
    if run.intermediate_metrics:
        problems.append(
            f"{flag}: --log-intermediate-metrics reads GEMM inputs in Python hooks, which a "
            "graph's replay does not run; log them in a run without graphs"
        )
    if run.recompute_granularity == "full":
        problems.append(
            f"{flag}: --recompute-granularity full runs only under megatron-core's whole-iteration "
            "graphs; use selective or no recomputation"
        )
    if graphs.cuda_graph_impl == "transformer_engine":
        problems += _te_problems(graphs, run, flag)
    elif run.transformer_impl == "transformer_engine" and run.gradient_accumulation_fusion:
        problems.append(
            f"{flag}: megatron-core's local graphs keep DDP's bookkeeping of TE's fused "
            "weight-gradient accumulation only under TransformerConfig's "
            "gradient_accumulation_fusion, which this trainer leaves off (it fuses TE's modules "
            "alone); give --no-gradient-accumulation-fusion"
        )
    problems += _allocator_problems(flag)
    return problems


def _shape_problems(graphs: CudaGraphConfig, run: GraphedRun, flag: str) -> list[str]:
    """A graph replays fixed shapes: batches and micro-batch counts must not change."""
    problems = []
    if run.packed_documents and graphs.covers_attention:
        fix = "--cuda-graph-scope mlp" if graphs.cuda_graph_impl == "transformer_engine" else ""
        problems.append(
            f"{flag}: packed documents (--reset-attention-mask) give attention new cu_seqlens "
            "every batch, which a graph cannot replay; "
            + (f"graph the MLP only ({fix})" if fix else "use --cuda-graph-impl transformer_engine")
            + " or leave the documents unpacked"
        )
    if run.rampup and run.pipeline_parallel > 1:
        problems.append(
            f"{flag}: --rampup-batch-size changes the micro-batches a pipeline stage holds at "
            "once, and megatron-core captures one graph per micro-batch under pipeline parallelism"
        )
    if run.context_parallel > 1 and run.transformer_impl == "local":
        problems.append(
            f"{flag}: the local implementation's context-parallel attention builds its index on "
            "the host at every call, which a graph cannot replay; use --transformer-impl "
            "transformer_engine"
        )
    return problems


def _precision_problems(run: GraphedRun, flag: str) -> list[str]:
    """A layer's FP8 or bf16 is fixed when its graph is captured."""
    if not run.fp8:
        return []
    problems = []
    if run.bf16_layers:
        problems.append(
            f"{flag}: --bf16-layers is read at every forward pass, which a graph does not run; "
            "use --first-last-layers-bf16 (captured per layer) or no graphs"
        )
    if run.fp8_guard_switches:
        problems.append(
            f"{flag}: the FP8 guard's switching actions change a layer's precision in the "
            "running job, after its graph was captured; use --fp8-guard-action warn or stop"
        )
    return problems


def _te_problems(graphs: CudaGraphConfig, run: GraphedRun, flag: str) -> list[str]:
    """megatron-core captures TE's graphs from bf16 sample inputs, and replays graphs of attention
    with an all-zero mask in place of none: only Transformer Engine's own causal attention
    ignores it (ours would attend everywhere)."""
    if run.precision != "bf16":
        return [
            f"{flag} needs --precision bf16: megatron-core captures the layers from bf16 sample "
            f"inputs (this run is {run.precision})"
        ]
    ours = run.transformer_impl == "local" or run.attention_backend == "local"
    if not (graphs.covers_attention and ours):
        return []
    which = (
        "--transformer-impl local"
        if run.transformer_impl == "local"
        else "--attention-backend local"
    )
    return [
        f"{flag} with attention in the graph needs Transformer Engine's attention ({which} "
        "reads the all-zero mask megatron-core replays as 'attend everywhere'); use "
        "--cuda-graph-scope mlp or --cuda-graph-impl local"
    ]


def _allocator_problems(flag: str, environ: dict | None = None) -> list[str]:
    """megatron-core's own assertion, said as a flag refusal."""
    env = os.environ if environ is None else environ
    expandable = "expandable_segments:True" in env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if expandable and env.get("NCCL_GRAPH_REGISTER", "") != "0":
        return [
            f"{flag} with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True needs "
            "NCCL_GRAPH_REGISTER=0 in the environment (illegal memory accesses otherwise)"
        ]
    return []


def captured_graphs(chunks: list) -> int:
    """CUDA graphs the transformer layers of ``chunks`` (wrapped or not) hold: one forward graph
    per local runner that was captured, one callable per micro-batch of Transformer Engine's.
    0 before the capture (or without graphs)."""
    count = 0
    for chunk in chunks:
        for module in chunk.modules():
            manager = getattr(module, "cudagraph_manager", None)
            if manager is not None:
                runners = getattr(manager, "cudagraph_runners", [])
                count += sum(1 for r in runners if getattr(r, "fwd_graph", None) is not None)
            count += len(getattr(module, "cuda_graphs", None) or [])
    return count
