"""Parallel-layout planner: is a layout possible on a cluster, and what does each GPU hold?

For a run's flags (the same names as ``pretrain_gpt.py``'s, parsed by the same generated
parser) and a cluster (GPUs, GPUs per node, memory per GPU) it checks, naming the failing
constraint:

* the model split (``validate_layout``: heads, query groups, MLP columns and vocabulary over TP;
  layers over PP x virtual stages; GPUs over TP x PP x CP);
* the batch: global batch (and every ramp-up batch) divisible by micro-batch x DP; with virtual
  stages, micro-batches per step divisible by PP (megatron-core's interleaved schedule);
* the placement: a TP group inside one node; the sequence over TP with sequence parallelism;
* context parallelism: the trainer's rule (``context_parallel_problems``: the sequence into
  2 x CP chunks, hierarchical sizes, per-layer lists, heads and query groups of a TP rank over
  an all-to-all), each rank's share over TP with sequence parallelism;
* memory: the fullest pipeline stage (``memory.stage_memory``) within the usable share of a GPU.

It reports the per-GPU memory (weights, gradients, optimizer states, activations with the
chosen recomputation and the alternatives), model FLOPs per step (``flops_per_token``, the
same count the training log uses for MFU) and, with CP, the bytes each GPU sends per step for
attention (``cp_traffic_bytes``), and how much of it waits on links between nodes (where
hierarchical ``a2a+p2p`` pays). ``sweep`` plans one run at several sequence lengths and CP
sizes with the tokens per step held fixed (the long-context table).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field, replace
from typing import NoReturn

import torch

from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import given_destinations
from megatron.apertus.launch import memory
from megatron.apertus.launch.memory import Recompute, Shape, StageMemory, Workload
from megatron.apertus.model.config import (
    ApertusConfig,
    ParallelConfig,
    context_parallel_problems,
    validate_layout,
)
from megatron.apertus.model.engine import EngineConfig
from megatron.apertus.model.flops import flops_per_token
from megatron.apertus.optim.builder import OptimizerSettings
from megatron.apertus.parallel import resolve_device
from megatron.apertus.training.config import RunConfig, add_run_arguments, groups_from_arguments
from megatron.apertus.training.loop_config import TrainingConfig
from megatron.apertus.training.objectives import output_loss_fused

GIB = 2**30
FORWARD_ONLY_ENTRIES = ("tools/generate_teacher_logits.py",)
"""Entry points that run the model without backward (no gradients or optimizer states)."""


@dataclass(kw_only=True, frozen=True)
class Cluster:
    gpus: int
    """Processes of the job, one per GPU (nodes x tasks per node)."""
    gpus_per_node: int
    gpu_memory_gib: float | None = None
    """Memory of one GPU; None (CPU runs) skips the fit check."""
    usable_fraction: float = 0.9
    """Share of a GPU's memory the estimate may fill; the rest is for what it does not model
    (CUDA context, NCCL buffers, temporaries, allocator fragmentation)."""

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ConfigError(
                f"--gpus ({self.gpus}) and --gpus-per-node ({self.gpus_per_node}) must be >= 1"
            )
        if self.gpu_memory_gib is not None and not self.gpu_memory_gib > 0:
            raise ConfigError(
                f"--gpu-memory-gib ({self.gpu_memory_gib:g}) must be positive (leave it out to "
                "skip the memory check)"
            )
        if not 0 < self.usable_fraction <= 1:
            raise ConfigError(f"--usable-fraction ({self.usable_fraction:g}) must be in (0, 1]")
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise ConfigError(
                f"--gpus ({self.gpus}) is not a multiple of --gpus-per-node ({self.gpus_per_node})"
            )

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)


@dataclass(kw_only=True, frozen=True)
class Run:
    """The settings of a run that its layout depends on (parsed from its flags)."""

    model: ApertusConfig
    parallel: ParallelConfig
    training: TrainingConfig
    optimizer: OptimizerSettings
    engine: EngineConfig
    forward_only: bool = False

    @property
    def recompute(self) -> Recompute:
        t = self.training
        return Recompute(
            granularity=t.recompute_granularity,
            method=t.recompute_method,
            num_layers=t.recompute_num_layers,
        )


@dataclass(kw_only=True, frozen=True)
class Plan:
    run: Run
    cluster: Cluster
    problems: list[str] = field(default_factory=list)
    """Every constraint the layout breaks; empty when it can be submitted."""
    data_parallel: int | None = None
    microbatches: int | None = None
    stages: list[StageMemory] = field(default_factory=list)
    """Per pipeline stage, with the run's recomputation."""
    recompute_alternatives: dict[str, float] = field(default_factory=dict)
    """Total bytes of the fullest stage for each recomputation choice."""
    flops_per_step: float | None = None
    train_iters: int | None = None
    cp_traffic_per_step: float = 0.0
    """Bytes each GPU sends per step for context-parallel attention (``cp_traffic_bytes``)."""
    cp_inter_node_per_step: float = 0.0
    """Of those, the bytes whose transfers wait on links between nodes."""

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def peak(self) -> StageMemory | None:
        return max(self.stages, key=lambda s: s.total) if self.stages else None


# -- reading a run's flags -------------------------------------------------------------------


PLANNED_GROUPS = ("model", "parallel", "training", "optimizer", "engine")
"""The config groups of ``pretrain_gpt.py``'s command line that a layout depends on."""
OBJECTIVE_GROUPS = ("align",)
"""Groups read only to decide the output loss as the run does (``output_loss_fused``)."""


def _parser() -> argparse.ArgumentParser:
    """The layout-relevant part of ``pretrain_gpt.py``'s command line (same generated flags)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_run_arguments(parser, PLANNED_GROUPS + OBJECTIVE_GROUPS)
    return parser


def run_from_args(argv: list[str], *, forward_only: bool = False) -> Run:
    """The run described by an entry point's flags; flags the planner does not need are ignored.
    Its output loss is the one the run itself chooses for its objective."""
    parser = _parser()
    args, _ = parser.parse_known_args(argv)
    try:
        groups = groups_from_arguments(args, PLANNED_GROUPS + OBJECTIVE_GROUPS)
        align = groups.pop("align")
        fused = output_loss_fused(groups["training"], align, given_destinations(parser, argv))
    except ValueError as err:  # ConfigError is a ValueError
        raise ConfigError(str(err)) from err
    groups["training"] = replace(groups["training"], fused_output_loss=fused)
    return Run(**groups, forward_only=forward_only)


def run_from_config(config: RunConfig) -> Run:
    """The layout-relevant groups of a run an entry point has already parsed and checked."""
    return Run(**{name: getattr(config, name) for name in PLANNED_GROUPS})


def run_from_command(command: list[str]) -> Run:
    """The run of ``[entry_script, *flags]`` as a launcher starts it."""
    entry, *argv = command
    return run_from_args(argv, forward_only=entry.endswith(FORWARD_ONLY_ENTRIES))


# -- checks ----------------------------------------------------------------------------------


def _batch_problems(run: Run, dp: int) -> list[str]:
    t, pp = run.training, run.parallel.pipeline_model_parallel_size
    interleaved = run.parallel.virtual_pipeline_model_parallel_size is not None
    unit = t.micro_batch_size * dp
    sizes = [("--global-batch-size", t.global_batch_size)]
    if t.rampup_batch_size:
        start, increment, _ = t.rampup_batch_size
        sizes += [
            ("--rampup-batch-size START", start),
            ("--rampup-batch-size INCREMENT", increment),
        ]
        if start > t.global_batch_size or (t.global_batch_size - start) % increment:
            return [
                f"--rampup-batch-size {start} {increment}: the ramp from {start} must reach "
                f"--global-batch-size {t.global_batch_size} in whole increments"
            ]
    problems = []
    for name, size in sizes:
        if size % unit:
            problems.append(
                f"{name} ({size}) is not divisible by --micro-batch-size ({t.micro_batch_size}) "
                f"x data-parallel size ({dp}) = {unit}"
            )
        elif interleaved and (size // unit) % pp:
            problems.append(
                f"{name} ({size}) gives {size // unit} micro-batches per step, not a multiple of "
                f"--pipeline-model-parallel-size ({pp}) as the interleaved schedule needs"
            )
    return problems


def _context_problems(run: Run) -> list[str]:
    """The sequence and heads over context-parallel ranks (the trainer's rule, under the
    implementation the run would get on a GPU), and sequence parallelism's split of each
    rank's tokens."""
    par, model = run.parallel, run.model
    cp, tp, seq = par.context_parallel_size, par.tensor_model_parallel_size, model.seq_length
    problems = context_parallel_problems(
        model, par, run.engine.transformer_impl or "transformer_engine"
    )
    if cp > 1 and not seq % (2 * cp) and par.sequence_parallel and (seq // cp) % tp:
        problems.append(
            f"--seq-length ({seq}) / --context-parallel-size ({cp}) = {seq // cp} tokens per "
            f"rank is not divisible by --tensor-model-parallel-size ({tp}), which "
            "--sequence-parallel splits them over"
        )
    return problems


def _placement_problems(run: Run, cluster: Cluster) -> list[str]:
    tp = run.parallel.tensor_model_parallel_size
    problems = _context_problems(run)
    if cluster.gpus_per_node % tp and cluster.gpus > cluster.gpus_per_node:
        problems.append(
            f"--tensor-model-parallel-size ({tp}) does not divide GPUs per node "
            f"({cluster.gpus_per_node}): tensor-parallel groups would span nodes"
        )
    if (
        run.parallel.context_parallel_size == 1
        and run.parallel.sequence_parallel
        and (run.model.seq_length % tp)
    ):
        problems.append(
            f"--seq-length ({run.model.seq_length}) is not divisible by "
            f"--tensor-model-parallel-size ({tp}), which --sequence-parallel splits it over"
        )
    return problems


def _memory_problem(plan: Plan) -> list[str]:
    gib = plan.cluster.gpu_memory_gib
    peak = plan.peak
    if gib is None or peak is None:
        return []
    usable = gib * plan.cluster.usable_fraction
    if peak.total / GIB <= usable:
        return []
    hint = (
        "; --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
        f"would need {plan.recompute_alternatives['full uniform 1'] / GIB:.1f} GiB"
        if plan.run.training.recompute_granularity != "full" and not plan.run.forward_only
        else ""
    )
    return [
        f"pipeline stage {peak.pipeline_rank} needs {peak.total / GIB:.1f} GiB per GPU, more than "
        f"the {usable:.1f} GiB usable ({plan.cluster.usable_fraction:.0%} of {gib:g} GiB){hint}"
    ]


# -- the plan --------------------------------------------------------------------------------


def _shape(run: Run) -> Shape:
    return Shape(
        seq_length=run.model.seq_length,
        micro_batch_size=run.training.micro_batch_size,
        tp=run.parallel.tensor_model_parallel_size,
        sequence_parallel=run.parallel.sequence_parallel,
        dtype_bytes=memory.DTYPE_BYTES[run.training.precision],
        device="cpu" if run.training.device == "cpu" else "cuda",
        context_parallel=run.parallel.context_parallel_size,
        cp_comm_type=_comm_type(run.parallel),
        a2a_size=run.parallel.a2a_level_size,
        transformer_impl=_planned_impl(run),
    )


def _comm_type(parallel: ParallelConfig) -> str | tuple[str, ...]:
    kinds = parallel.cp_comm_type
    return tuple(kinds) if isinstance(kinds, list) else kinds


def _comm_label(parallel: ParallelConfig) -> str:
    """The comm type as the report names it: ``a2a+p2p 2x4``, or the per-layer mix."""
    sizes = parallel.hierarchical_context_parallel_sizes
    split = f" {'x'.join(map(str, sizes))}" if sizes else ""
    kinds = parallel.cp_comm_type
    if not isinstance(kinds, list):
        return kinds + (split if kinds == "a2a+p2p" else "")
    counts = ", ".join(f"{kinds.count(k)} {k}" for k in parallel.cp_comm_types)
    return f"per layer: {counts}{split}"


def _planned_impl(run: Run) -> str:
    """The layers whose activations the plan counts: Transformer Engine's only when the run names
    them. Left to choose, a run falls back to the local layers where TE does not import, and
    those save more; the plan allows for that."""
    named = run.engine.transformer_impl
    return "transformer_engine" if named == "transformer_engine" else "local"


def _stages(run: Run, dp: int, microbatches: int, recompute: Recompute) -> list[StageMemory]:
    workload = Workload(
        precision=run.training.precision,
        optimizer=run.optimizer.optimizer,
        distributed_optimizer=run.optimizer.use_distributed_optimizer,
        data_parallel=dp * run.parallel.context_parallel_size,
        microbatches=microbatches,
        recompute=recompute,
        forward_only=run.forward_only,
        fused_loss=run.training.fused_output_loss,
    )
    return [
        memory.stage_memory(run.model, run.parallel, _shape(run), workload, r)
        for r in range(run.parallel.pipeline_model_parallel_size)
    ]


def _hardware_flops(run: Run, tokens: int) -> float:
    """Model FLOPs plus the forward passes that recomputation repeats."""
    m, recompute = run.model, run.recompute
    model = flops_per_token(m) * tokens
    attention_forward = 2 * m.seq_length * m.hidden_size * tokens  # per layer
    if recompute.granularity == "selective":
        return model + m.num_layers * attention_forward
    if recompute.granularity != "full":
        return model
    layers = m.num_layers
    if recompute.method == "block":  # the first num_layers of every model chunk
        chunks = run.parallel.pipeline_model_parallel_size * (
            run.parallel.virtual_pipeline_model_parallel_size or 1
        )
        layers = min(layers, recompute.num_layers * chunks)
    return model + layers * (2 * memory.layer_parameters(m, 1) * tokens + attention_forward)


def cp_traffic_bytes(run: Run, microbatches: int, cluster: Cluster | None = None) -> float:
    """Bytes one GPU sends per step for context-parallel attention, summed over its layers
    (``memory.cp_layer_traffic`` per layer and micro-batch, by the layer's comm type; a
    per-layer list averaged over the pipeline stages). Recomputation that repeats core
    attention (selective, full) repeats the forward's. With ``cluster``: only the bytes whose
    transfers wait on links between nodes (``memory.cp_layer_inter_node_traffic``).
    """
    if run.parallel.context_parallel_size == 1:
        return 0.0
    shape, model, recompute, par = _shape(run), run.model, run.recompute, run.parallel
    pp = par.pipeline_model_parallel_size
    vp = par.virtual_pipeline_model_parallel_size or 1
    layers = model.num_layers // pp
    recomputed = 0  # layers whose forward (and its communication) runs twice
    if recompute.granularity == "selective" or (
        recompute.granularity == "full" and recompute.method == "uniform"
    ):
        recomputed = layers
    elif recompute.granularity == "full":  # the first num_layers of each of the vp model chunks
        recomputed = min(recompute.num_layers, layers // vp) * vp
    total = 0.0
    for layer in range(model.num_layers):
        kind = par.layer_cp_comm_type(layer)
        forward, backward = memory.cp_layer_traffic(model, shape, kind)
        if cluster is not None:
            per_node = max(1, cluster.gpus_per_node // par.tensor_model_parallel_size)
            slow = memory.cp_layer_inter_node_traffic(model, shape, kind, per_node)
            forward, backward = (slow * part / (forward + backward) for part in (forward, backward))
        total += forward * (1 + recomputed / layers) + backward
    return total / pp * microbatches


def plan(run: Run, cluster: Cluster) -> Plan:
    """Check ``run``'s layout on ``cluster`` and estimate its per-GPU memory and FLOPs."""
    try:
        dp = validate_layout(run.model, run.parallel, cluster.gpus)
        recompute = run.recompute
    except ValueError as err:
        return Plan(run=run, cluster=cluster, problems=[str(err)])
    problems = _batch_problems(run, dp) + _placement_problems(run, cluster)
    t = run.training
    microbatches = max(1, t.global_batch_size // (t.micro_batch_size * dp))
    alternatives = [
        Recompute(),
        Recompute(granularity="selective"),
        Recompute(granularity="full", method="uniform", num_layers=1),
    ]
    result = Plan(
        run=run,
        cluster=cluster,
        data_parallel=dp,
        microbatches=microbatches,
        stages=_stages(run, dp, microbatches, recompute),
        recompute_alternatives={
            _recompute_name(choice): max(s.total for s in _stages(run, dp, microbatches, choice))
            for choice in alternatives
        },
        flops_per_step=flops_per_token(run.model) * t.global_batch_size * run.model.seq_length,
        train_iters=t.total_iterations(dp) if not problems else None,
        cp_traffic_per_step=cp_traffic_bytes(run, microbatches),
        cp_inter_node_per_step=cp_traffic_bytes(run, microbatches, cluster),
    )
    return replace(result, problems=problems + _memory_problem(result))


# -- the report ------------------------------------------------------------------------------


def _recompute_name(recompute: Recompute) -> str:
    if recompute.granularity != "full":
        return recompute.granularity or "none"
    return f"full {recompute.method} {recompute.num_layers}"


def _gib(value: float) -> str:
    return f"{value / GIB:8.2f} GiB"


def format_plan(p: Plan, *, name: str = "") -> str:
    """A human-readable report; refused layouts list every problem."""
    run, cluster = p.run, p.cluster
    par, t = run.parallel, run.training
    device = "CPU processes" if run.training.device == "cpu" else "GPUs"
    memory_text = f"{cluster.gpu_memory_gib:g} GiB" if cluster.gpu_memory_gib else "not checked"
    lines = [
        f"layout plan: {name or 'model'} ({run.model.num_parameters() / 1e9:.3g} B parameters) on "
        f"{cluster.gpus} {device} = {cluster.nodes} nodes x {cluster.gpus_per_node}, memory per "
        f"device {memory_text}"
    ]
    if p.data_parallel is not None:
        tokens = t.global_batch_size * run.model.seq_length
        context = (
            f" x CP {par.context_parallel_size} ({_comm_label(par)})"
            if par.context_parallel_size > 1
            else ""
        )
        lines += [
            f"  parallelism  TP {par.tensor_model_parallel_size} x PP "
            f"{par.pipeline_model_parallel_size} (virtual stages "
            f"{par.virtual_pipeline_model_parallel_size or 1}){context} x DP {p.data_parallel}; "
            f"sequence parallel {'on' if par.sequence_parallel else 'off'}",
            f"  batch        micro-batch {t.micro_batch_size} x {p.microbatches} micro-batches x DP "
            f"{p.data_parallel} = global batch {t.global_batch_size} x {run.model.seq_length} "
            f"tokens = {tokens / 1e6:.2f} M tokens per step"
            + (f"; ramp-up {t.rampup_batch_size}" if t.rampup_batch_size else ""),
        ]
    if p.stages:
        lines += _memory_lines(p)
        tokens = t.global_batch_size * run.model.seq_length
        hardware = _hardware_flops(run, tokens)
        lines.append(
            f"  FLOPs/step   model {p.flops_per_step:.3e} ({p.flops_per_step / cluster.gpus:.3e} per "
            f"GPU); with recomputation {hardware:.3e}"
        )
        if par.context_parallel_size > 1:
            lines.append(
                f"  CP traffic   {p.cp_traffic_per_step / GIB:.2f} GiB sent per GPU per "
                f"step ({_comm_label(par)}, attention inputs and their gradients), "
                f"{p.cp_inter_node_per_step / GIB:.2f} GiB of it waiting on links between nodes"
            )
            lines += _traffic_lines(p)
        if p.train_iters is not None:
            lines.append(
                f"  run          {p.train_iters} steps, "
                f"{p.flops_per_step * p.train_iters:.3e} model FLOPs"
            )
    if p.problems:
        lines.append("REFUSED:")
        lines += [f"  - {problem}" for problem in p.problems]
    else:
        lines.append("OK: the layout is valid" + (" and fits" if cluster.gpu_memory_gib else ""))
    return "\n".join(lines)


def _memory_lines(p: Plan) -> list[str]:
    run, peak = p.run, p.peak
    moments = memory.OPTIMIZER_MOMENTS[run.optimizer.optimizer]
    master = "fp32 master + " if run.training.precision != "fp32" else ""
    cp = run.parallel.context_parallel_size
    shards = f"DP x CP {p.data_parallel * cp}" if cp > 1 else f"DP {p.data_parallel}"
    sharding = f" / {shards}" if run.optimizer.use_distributed_optimizer else ""
    rows = [
        (f"weights ({run.training.precision})", peak.weights),
        ("gradients (fp32 DDP buffer)", peak.gradients),
        (
            f"optimizer ({master}{moments} {run.optimizer.optimizer} moments{sharding})",
            peak.optimizer,
        ),
        (f"activations (recompute {_recompute_name(run.recompute)})", peak.activations),
        (
            (
                "fused output layer + loss (dX, dW, a chunk of logits)"
                if run.training.fused_output_loss
                else "unfused output layer + loss (logits, fp32 softmax)"
            ),
            peak.loss_buffers,
        ),
        *(
            [(f"context-parallel {_comm_label(run.parallel)} buffers (one layer)", peak.cp_buffers)]
            if run.parallel.context_parallel_size > 1
            else []
        ),
        ("total", peak.total),
    ]
    stages = ", ".join(
        f"stage {s.pipeline_rank} {s.parameters / 1e6:.1f} M" for s in _few(p.stages)
    )
    lines = [
        f"  parameters   per GPU: {stages}",
        f"  memory per GPU, fullest pipeline stage ({peak.pipeline_rank}):",
    ]
    lines += [f"    {label:<56}{_gib(value)}" for label, value in rows]
    if not run.forward_only:
        lines.append(
            "    total by recomputation: "
            + ", ".join(
                f"{name} {value / GIB:.2f} GiB" for name, value in p.recompute_alternatives.items()
            )
        )
    return lines


def _traffic_lines(p: Plan) -> list[str]:
    """Where a2a+p2p's traffic goes (all-to-all level, ring level), beside flat p2p and a2a."""
    par = p.run.parallel
    if "a2a+p2p" not in par.cp_comm_types or par.hierarchical_context_parallel_sizes is None:
        return []
    a2a, ring = par.hierarchical_context_parallel_sizes
    shape, model, mib = _shape(p.run), p.run.model, 2**20
    exchange, ring_bytes = memory.hierarchical_layer_traffic(model, shape)
    flat = {k: sum(memory.cp_layer_traffic(model, shape, k)) for k in ("p2p", "a2a")}
    return [
        f"               per layer and micro-batch: {2 * exchange / mib:.1f} MiB all-to-all "
        f"within {a2a} ranks + {3 * ring_bytes / mib:.1f} MiB in {ring - 1} ring steps over "
        f"{ring} groups, forward and backward (p2p: {flat['p2p'] / mib:.1f} MiB in "
        f"{par.context_parallel_size - 1} ring steps; a2a: {flat['a2a'] / mib:.1f} MiB over "
        f"{par.context_parallel_size} ranks)"
    ]


def _few(stages: list[StageMemory]) -> list[StageMemory]:
    """First, second and last stage (the middle ones repeat the second)."""
    return stages if len(stages) <= 3 else [stages[0], stages[1], stages[-1]]


def _processes() -> tuple[int, int]:
    """(processes, processes per node) this command runs as: torchrun's, else Slurm's, else 1."""
    env = os.environ
    if "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return world, int(env.get("LOCAL_WORLD_SIZE", world))
    if "SLURM_NTASKS" in env:
        world = int(env["SLURM_NTASKS"])
        per_node = env.get("SLURM_NTASKS_PER_NODE", str(world)).split("(")[0]
        return world, int(per_node)
    return 1, 1


def dry_run(config: RunConfig) -> NoReturn:
    """Print the plan of the parsed run ``config`` for the processes this command runs as, on
    its ``--device``, and exit: 0 when it can run, 1 when not (rank 0 prints under torchrun).
    The plan reads the configs the run would train with, not the command line again."""
    gpus, per_node = _processes()
    on_gpu = resolve_device(config.training.device) == "cuda"
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if on_gpu else None
    result = plan(
        run_from_config(config),
        Cluster(gpus=gpus, gpus_per_node=per_node, gpu_memory_gib=gib),
    )
    if os.environ.get("RANK", "0") == "0":
        print(format_plan(result, name="dry run"))
    sys.exit(0 if result.ok else 1)


# -- the long-context table ------------------------------------------------------------------


@dataclass(frozen=True)
class SweepRow:
    seq_length: int
    context_parallel: int
    plan: Plan
    a2a_traffic_per_step: float | None
    """The same layout's traffic with ``--cp-comm-type a2a``; None where a2a cannot split it."""
    hierarchical: Plan | None = None
    """The same layout with ``--cp-comm-type a2a+p2p`` split as :func:`hierarchical_split`
    chooses; None where no split has an all-to-all level inside a node."""


def hierarchical_split(run: Run, cluster: Cluster) -> tuple[int, int] | None:
    """The ``--hierarchical-context-parallel-sizes A P`` that keeps the all-to-all inside a node:
    the largest A (1 < A < CP, dividing CP) of at most the CP ranks a node holds (GPUs per node
    / TP) whose heads split under the run's rule; None where there is none."""
    par, cp = run.parallel, run.parallel.context_parallel_size
    per_node = cluster.gpus_per_node // par.tensor_model_parallel_size
    impl = run.engine.transformer_impl or "transformer_engine"
    for a2a in range(min(per_node, cp - 1), 1, -1):
        layout = replace(
            par, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[a2a, cp // a2a]
        )
        if not cp % a2a and not context_parallel_problems(run.model, layout, impl):
            return a2a, cp // a2a
    return None


def sweep(
    flags: list[str], cluster: Cluster, seq_lengths: list[int], cp_sizes: list[int]
) -> list[SweepRow]:
    """``flags``' run planned at each sequence length and CP size, with the tokens per step of
    ``flags`` kept: the global batch becomes tokens / sequence length (Apertus keeps its global
    batch in tokens through the long-context phase)."""
    base = run_from_args(flags)
    tokens = base.training.global_batch_size * base.model.seq_length
    rows = []
    for seq in seq_lengths:
        for cp in cp_sizes:
            if tokens % seq:
                raise ConfigError(
                    f"--seq-length {seq} does not divide the {tokens} tokens per step "
                    "of --global-batch-size x --seq-length"
                )
            varied = flags + [
                "--seq-length",
                str(seq),
                "--max-position-embeddings",
                str(seq),
                "--global-batch-size",
                str(tokens // seq),
                "--context-parallel-size",
                str(cp),
            ]
            result = plan(run_from_args(varied), cluster)
            a2a = _variant_plan(varied + ["--cp-comm-type", "a2a"], cluster)
            split = hierarchical_split(result.run, cluster) if cp > 1 else None
            sizes = ["--hierarchical-context-parallel-sizes", *map(str, split or ())]
            hierarchical = (
                _variant_plan(varied + ["--cp-comm-type", "a2a+p2p", *sizes], cluster)
                if split
                else None
            )
            rows.append(
                SweepRow(
                    seq_length=seq,
                    context_parallel=cp,
                    plan=result,
                    a2a_traffic_per_step=a2a.cp_traffic_per_step if a2a else None,
                    hierarchical=hierarchical,
                )
            )
    return rows


def _variant_plan(flags: list[str], cluster: Cluster) -> Plan | None:
    """The plan of a comm-type variant of a sweep's row; None where its heads do not split."""
    try:
        result = plan(run_from_args(flags), cluster)
    except ConfigError:
        return None
    return None if any("--cp-comm-type" in problem for problem in result.problems) else result


def _verdict(p: Plan) -> str:
    """Every broken constraint of a table row, shortened to fit a cell."""
    if p.ok:
        return "fits"
    reasons = []
    for problem in p.problems:
        if "GiB per GPU" in problem:
            usable = p.cluster.gpu_memory_gib * p.cluster.usable_fraction
            full = p.recompute_alternatives.get("full uniform 1", float("inf")) / GIB
            reasons.append(
                f"needs {p.peak.total / GIB:.0f} GiB > {usable:.1f} usable"
                + ("; fits with full recomputation" if full <= usable else "")
            )
        elif problem.startswith("--global-batch-size") and "data-parallel size" in problem:
            t = p.run.training
            reasons.append(
                f"global batch {t.global_batch_size} not a multiple of micro-batch x DP "
                f"{t.micro_batch_size * p.data_parallel}"
            )
        else:
            reasons.append(problem)
    return "refused: " + "; ".join(reasons)


def format_sweep(rows: list[SweepRow], *, name: str = "") -> str:
    """The sweep as a Markdown table (memory of the fullest stage per GPU, traffic per GPU)."""
    first = rows[0].plan
    par = first.run.parallel
    lines = [
        f"{name or 'model'}: TP {par.tensor_model_parallel_size} x PP "
        f"{par.pipeline_model_parallel_size}, {first.cluster.gpus} GPUs of "
        f"{first.cluster.gpu_memory_gib:g} GiB ({first.cluster.gpus_per_node} per node), "
        f"{first.run.training.global_batch_size * first.run.model.seq_length / 2**20:.0f} Mi "
        f"tokens per step, recompute {_recompute_name(first.run.recompute)}",
        "",
        "| seq | CP | DP | micro-batches | activations GiB | CP buffers GiB | total GiB | "
        "total, full recompute GiB | CP traffic/step p2p GiB | a2a GiB | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        p = row.plan
        if p.peak is None:
            lines.append(
                f"| {row.seq_length // 1024}k | {row.context_parallel} | | | | | | | | | "
                f"{_verdict(p)} |"
            )
            continue
        a2a = "n/a" if row.a2a_traffic_per_step is None else f"{row.a2a_traffic_per_step / GIB:.2f}"
        full = p.recompute_alternatives["full uniform 1"] / GIB
        lines.append(
            f"| {row.seq_length // 1024}k | {row.context_parallel} | {p.data_parallel} | "
            f"{p.microbatches} | {p.peak.activations / GIB:.1f} | {p.peak.cp_buffers / GIB:.2f} | "
            f"{p.peak.total / GIB:.1f} | {full:.1f} | {p.cp_traffic_per_step / GIB:.2f} | {a2a} | "
            f"{_verdict(p)} |"
        )
    return "\n".join(lines)


def format_hierarchical_sweep(rows: list[SweepRow], *, name: str = "") -> str:
    """The sweep as a Markdown table of flat p2p against a2a+p2p (all-to-all inside a node):
    memory of the fullest stage per GPU, traffic per GPU and step, and the part of it that waits
    on links between nodes."""
    first = rows[0].plan
    par = first.run.parallel
    lines = [
        f"{name or 'model'}: TP {par.tensor_model_parallel_size} x PP "
        f"{par.pipeline_model_parallel_size}, {first.cluster.gpus} GPUs of "
        f"{first.cluster.gpu_memory_gib:g} GiB ({first.cluster.gpus_per_node} per node), "
        f"{first.run.training.global_batch_size * first.run.model.seq_length / 2**20:.0f} Mi "
        f"tokens per step",
        "",
        "| seq | CP | a2a+p2p split | TP | recompute | memory/GPU GiB p2p | a2a+p2p | "
        "CP traffic/step GiB p2p | a2a+p2p | between nodes GiB p2p | a2a+p2p | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        p, h = row.plan, row.hierarchical
        tp = p.run.parallel.tensor_model_parallel_size
        cells = [
            f"{row.seq_length // 1024}k",
            str(row.context_parallel),
            "x".join(map(str, h.run.parallel.hierarchical_context_parallel_sizes)) if h else "-",
            str(tp),
            _recompute_name(p.run.recompute),
        ]
        for get in (
            lambda x: x.peak.total if x.peak else None,
            lambda x: x.cp_traffic_per_step,
            lambda x: x.cp_inter_node_per_step,
        ):
            cells += [_cell(get(p)), _cell(get(h) if h else None)]
        cells.append(_hierarchical_verdict(p, h))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.1f}"


def _hierarchical_verdict(flat: Plan, hierarchical: Plan | None) -> str:
    if not flat.ok:
        return _verdict(flat)
    if hierarchical is None or not hierarchical.ok:
        return "fits; p2p (no all-to-all level inside a node)"
    if hierarchical.cp_inter_node_per_step < flat.cp_inter_node_per_step:
        saved = 1 - hierarchical.cp_inter_node_per_step / flat.cp_inter_node_per_step
        return f"fits; a2a+p2p pays: {saved:.0%} less between nodes"
    return "fits; p2p (a2a+p2p sends no less between nodes)"
