"""Training throughput of the implementations side by side, and FP8 against bf16 loss.

    python bench/bench_train_step.py                        # every config, both models
    python bench/bench_train_step.py --models apertus-v1.1-0.5b --configs te-bf16 te-fp8-delayed
    python bench/bench_train_step.py --loss-steps 300       # + bf16 vs FP8 validation loss
    python bench/bench_train_step.py --models apertus-8b-layers --configs te-bf16-packed \
        te-fp8-tensorwise-packed te-fp8-blockwise-packed-bf16-ends     # the 8B's layer shapes

Each configuration runs in its own process (a fresh CUDA context, no allocator or FP8 state
carried over) through the real trainer (``pretrain_gpt.py``'s arguments, megatron-core's
schedules, AdamW, the fused output-layer loss, the embedded corpus with the tekken tokenizer),
and times full optimizer steps after warm-up. Configurations:

* ``local`` / ``local-packed``: our layers; packed documents through varlen flash attention;
* ``te-bf16`` / ``te-bf16-packed``: Transformer Engine layers; packed through THD cu_seqlens;
* ``te-fp8-{tensorwise,delayed,blockwise}-packed``: TE with FP8 (hybrid; blockwise: e4m3, the
  recipe's only format) GEMMs, and ``...-bf16-ends`` with ``--first-last-layers-bf16``;
* ``...-deterministic``: with ``--deterministic-mode``; ``...-metrics``: with
  ``--log-intermediate-metrics`` hooked on every step (its cost per measured step);
* ``...-sdpa``: TE's linears with PyTorch's flash / varlen attention
  (``--attention-backend local``);
* ``...-graphs-mlp``, ``te-bf16-graphs``, ``te-bf16-graphs-local``: CUDA graphs (``GRAPH_PAIRS``
  pairs each with its configuration without graphs): TE's graphs of the MLPs (packed), of whole
  layers (unpacked), and megatron-core's own of whole layers (unpacked, weight gradients unfused).

Models: the presets, and ``apertus-8b-layers``: the 8B's layer shapes (hidden 4096, FFN 21504, 32
heads / 8 groups) with as many layers as one 80 GB GPU holds (``layers_that_fit``).

"packed" is the recipe's setting: ``--reset-attention-mask --reset-position-ids``, documents
never attend to each other. MFU counts the dense causal attention FLOPs for every config (as
Megatron-LM does), so packed and unpacked runs compare by the same yardstick as tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from _common import RESULTS, write_results  # noqa: E402

from megatron.apertus.launch.memory import fp8_weight_cache_bytes  # noqa: E402
from megatron.apertus.launch.planner import Cluster, plan, run_from_args  # noqa: E402
from megatron.apertus.model.config import PRESETS  # noqa: E402

PACKED = ["--reset-attention-mask", "--reset-position-ids", "--use-packed-seq-params"]
TE = ["--transformer-impl", "transformer_engine"]
FP8 = {
    "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "delayed": [
        "--fp8-format",
        "hybrid",
        "--fp8-recipe",
        "delayed",
        "--fp8-amax-history-len",
        "1024",
        "--fp8-amax-compute-algo",
        "max",
    ],
    "blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
}
BF16_ENDS = ["--first-last-layers-bf16"]
"""One layer at each end (Megatron-LM's default); not with delayed scaling, whose single FP8
autocast around the whole block megatron-core cannot interrupt."""
CONFIGS = {
    "local": ["--transformer-impl", "local"],
    "local-packed": ["--transformer-impl", "local", *PACKED],
    "te-bf16": TE,
    "te-bf16-packed": [*TE, *PACKED],
    **{f"te-fp8-{recipe}-packed": [*TE, *PACKED, *flags] for recipe, flags in FP8.items()},
    **{
        f"te-fp8-{recipe}-packed-bf16-ends": [*TE, *PACKED, *flags, *BF16_ENDS]
        for recipe, flags in FP8.items()
        if recipe != "delayed"
    },
}
DETERMINISTIC = ["--deterministic-mode"]
METRICS = [
    "--log-intermediate-metrics",
    "mean",
    "rms",
    "kurtosis",
    "underflow",
    "overflow",
    "--log-intermediate-metrics-interval",
    "1",
]
for _name in ("te-bf16-packed", "te-fp8-delayed-packed"):
    CONFIGS[f"{_name}-deterministic"] = [*CONFIGS[_name], *DETERMINISTIC]
    CONFIGS[f"{_name}-metrics"] = [*CONFIGS[_name], *METRICS]
SDPA = ["--attention-backend", "local"]  # TE's linears with PyTorch flash / varlen attention
CONFIGS.update(
    {
        f"{name}-sdpa": [*flags, *SDPA]
        for name, flags in list(CONFIGS.items())
        if name.startswith("te-")
    }
)

GRAPHS_TE = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-warmup-steps", "1"]
"""Transformer Engine's per-layer CUDA graphs, captured before the second step (the warm-up
steps of a row then include the capture and one replay)."""
GRAPHS_MLP = [*GRAPHS_TE, "--cuda-graph-scope", "mlp"]
"""Graphs of the MLPs only: attention, whose packed cu_seqlens change every batch, runs eagerly."""
GRAPHS_LOCAL = [
    "--cuda-graph-impl",
    "local",
    "--cuda-graph-warmup-steps",
    "1",
    "--no-gradient-accumulation-fusion",
]
"""megatron-core's own graphs of whole layers, captured at the end of the first step (they need
the weight gradients unfused: docs/gpu.md)."""
for _name in ("te-bf16-packed", "te-fp8-delayed-packed"):
    for _variant in ("", "-sdpa"):
        CONFIGS[f"{_name}-graphs-mlp{_variant}"] = [*CONFIGS[_name + _variant], *GRAPHS_MLP]
CONFIGS["te-bf16-graphs"] = [*TE, *GRAPHS_TE]
CONFIGS["te-bf16-nofusion"] = [*TE, "--no-gradient-accumulation-fusion"]
CONFIGS["te-bf16-graphs-local"] = [*TE, *GRAPHS_LOCAL]
GRAPH_PAIRS = [
    ("te-bf16-packed", "te-bf16-packed-graphs-mlp"),
    ("te-fp8-delayed-packed", "te-fp8-delayed-packed-graphs-mlp"),
    ("te-bf16", "te-bf16-graphs"),
    ("te-bf16-nofusion", "te-bf16-graphs-local"),
]
"""Each CUDA-graph configuration beside the same one without graphs. Whole-layer graphs hold
attention and take unpacked documents (``te-bf16-graphs`` keeps TE's attention: megatron-core
replays an all-zero mask that only TE's causal attention ignores)."""

EIGHT_B_LAYERS = "apertus-8b-layers"
"""The 8B's layer shapes, cut to the layers one 80 GB GPU holds."""
GPU_80GB_GIB = 79.18
"""An 80 GB H100's memory as torch reports it: the 8B layer count is the same on larger GPUs,
so that rows of different machines compare."""
MICRO_BATCH = {"apertus-v1.1-0.5b": 4, "apertus-v1.1-1.5b": 2, EIGHT_B_LAYERS: 1}
SMALL_MODELS = ["apertus-v1.1-0.5b", "apertus-v1.1-1.5b"]
DEFAULT_CONFIGS = [
    "local",
    "local-packed",
    "te-bf16",
    "te-bf16-packed",
    "te-fp8-tensorwise-packed",
    "te-fp8-delayed-packed",
]
GLOBAL_BATCH = 16
RESULT_PREFIX = "BENCH_RESULT "


def model_args(model: str, seq: int) -> list[str]:
    """``--model-preset`` and, for the 8B layer shapes, ``--num-layers``."""
    if model == EIGHT_B_LAYERS:
        return ["--model-preset", "apertus-8b", "--num-layers", str(layers_that_fit(seq))]
    return ["--model-preset", model]


def layers_that_fit(seq: int, gpu_gib: float = GPU_80GB_GIB) -> int:
    """The most 8B-shaped layers whose training state (the launch planner's memory model, micro
    batch 1, bf16, Adam, no recomputation) plus FP8's weight copies fits the planner's usable share
    of one GPU, with at least the three layers ``--first-last-layers-bf16`` needs."""
    cluster = Cluster(gpus=1, gpus_per_node=1, gpu_memory_gib=gpu_gib)
    usable = gpu_gib * cluster.usable_fraction * 2**30
    fits = 0
    for layers in range(1, PRESETS["apertus-8b"].num_layers + 1):
        argv = run_args(
            EIGHT_B_LAYERS,
            "te-bf16",
            seq=seq,
            steps=1,
            micro=MICRO_BATCH[EIGHT_B_LAYERS],
            global_batch=GLOBAL_BATCH,
            extra=[],
            layers=layers,
        )
        result = plan(run_from_args(argv), cluster)
        if not result.ok or result.peak.total + fp8_weight_cache_bytes(result.run.model) > usable:
            break
        fits = layers
    if fits < 3:
        raise ValueError(f"no 3 layers of the 8B's shape fit {gpu_gib} GiB at seq {seq}")
    return fits


def run_args(
    model: str,
    config: str,
    *,
    seq: int,
    steps: int,
    micro: int,
    global_batch: int,
    extra: list[str],
    layers: int | None = None,
) -> list[str]:
    """``pretrain_gpt.py``'s flags for one configuration (``layers`` overrides the layer count)."""
    models = (
        model_args(model, seq)
        if layers is None
        else [
            "--model-preset",
            "apertus-8b" if model == EIGHT_B_LAYERS else model,
            "--num-layers",
            str(layers),
        ]
    )
    return [
        *models,
        "--device",
        "cuda",
        "--precision",
        "bf16",
        "--seq-length",
        str(seq),
        "--max-position-embeddings",
        str(seq),
        "--micro-batch-size",
        str(micro),
        "--global-batch-size",
        str(global_batch),
        "--train-iters",
        str(steps),
        "--seed",
        "1234",
        # the Apertus launch arrays' optimizer: its buffer layout also aligns every main_grad
        # for TE's gradient-accumulation fusion
        "--use-distributed-optimizer",
        *CONFIGS[config],
        *extra,
    ]


THROUGHPUT = [
    "--lr",
    "3e-4",
    "--lr-warmup-iters",
    "2",
    "--log-interval",
    "1000000",
    "--eval-iters",
    "0",
]


# -- one configuration (child process) ------------------------------------------------------------

KERNEL_CATEGORIES = [
    ("attention", r"flash|fmha|attn|attention|sdpa"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|wgmma|aten::(mm|addmm|bmm)$"),
    ("fp8 cast / transpose / amax", r"cast|quantiz|amax|transpose|fp8|float8"),
    ("xielu", r"xielu"),
    ("fused loss (non-GEMM)", r"sparse_kl"),
    ("norm", r"norm"),
    ("optimizer", r"adam|multi_tensor"),
    ("communication", r"nccl"),
]
"""Kernel-name patterns, first match wins (an FP8 GEMM's or attention kernel's name may say
``fp8`` or ``e4m3``: those come first). Names come from cuBLAS, CUTLASS, TE, cuDNN and our
kernels (``xielu::``, ``sparse_kl::``); the output layer's GEMMs inside the fused loss count as
``gemm``."""


def time_by_category(averages: list, device: str) -> dict[str, float]:
    """Milliseconds of self time per ``KERNEL_CATEGORIES`` entry (``other``: the rest) in a
    profiler's ``key_averages()``: device kernels on CUDA, operators on CPU."""
    from torch.autograd import DeviceType

    kind = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
    totals: dict[str, float] = {}
    for event in averages:
        if event.device_type != kind:
            continue
        us = event.self_device_time_total if device == "cuda" else event.self_cpu_time_total
        name = next(
            (
                label
                for label, pattern in KERNEL_CATEGORIES
                if re.search(pattern, event.key, re.IGNORECASE)
            ),
            "other",
        )
        totals[name] = totals.get(name, 0.0) + us / 1e3
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def profile_step(trainer) -> dict:
    """Kernel time of one more optimizer step by category, its 25 longest kernels, and the
    profiled step's wall time: where it exceeds the kernels' sum, the GPU waited on the host
    (launch overhead, what CUDA graphs remove)."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        trainer.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    averages = prof.key_averages()
    kernels = sorted(
        (e for e in averages if e.self_device_time_total > 0),
        key=lambda e: -e.self_device_time_total,
    )
    by_category = time_by_category(averages, "cuda")
    return {
        "profiled_step_wall_ms": wall_ms,
        "kernel_ms_total": sum(by_category.values()),
        "kernel_launches": sum(e.count for e in kernels),
        "host_waits": {
            e.key: e.count for e in averages if re.match(r"cuda\w*(Synchronize|Memcpy)", e.key)
        },
        "kernel_ms_by_category": by_category,
        "top_kernels_ms": {e.key[:160]: e.self_device_time_total / 1e3 for e in kernels[:25]},
    }


def measure(argv: list[str], warmup: int, timed: int, profile: bool = False) -> dict:
    """Step times of a real Trainer; runs in the child process."""
    import torch

    from megatron.apertus.model.flops import flops_per_token
    from megatron.apertus.training.loop import Trainer
    from megatron.apertus.training.metrics import device_peak_tflops
    from pretrain_gpt import parse_args

    cfg = parse_args(argv)
    trainer = Trainer(cfg)
    seconds, losses = [], []
    for i in range(warmup + timed):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = trainer.step()
        torch.cuda.synchronize()
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
        losses.append(result.loss)
    step = statistics.median(seconds)
    tokens = cfg.training.global_batch_size * cfg.model.seq_length
    tokens_s = tokens / step
    tflops = tokens_s * flops_per_token(cfg.model) / 1e12
    peak = torch.cuda.max_memory_allocated() / 2**30
    return {
        "transformer_impl": trainer.runtime.transformer_impl,
        "step_s_median": step,
        "step_s_min": min(seconds),
        "tokens_per_s_per_gpu": tokens_s,
        "tflops_per_gpu": tflops,
        "mfu": tflops / device_peak_tflops(),
        "peak_memory_gib": peak,
        "losses": losses,
        "cuda_graphs": trainer.graphs.count,
        **(profile_step(trainer) if profile else {}),
    }


def child(args: argparse.Namespace) -> None:
    argv = json.loads(args.child)
    result = measure(argv, args.warmup, args.steps, args.profile)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of CUDA/NCCL state


def run_child(argv: list[str], warmup: int, steps: int, profile: bool = False) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        json.dumps(argv),
        "--warmup",
        str(warmup),
        "--steps",
        str(steps),
        *(["--profile"] if profile else []),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", cwd=REPO)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = (proc.stdout + proc.stderr)[-3000:]
    return {"error": f"exit {proc.returncode}: {tail}"}


# -- bf16 against FP8 loss ------------------------------------------------------------------------


LOSS_METRICS = [
    "--log-intermediate-metrics",
    "mean",
    "rms",
    "kurtosis",
    "underflow",
    "overflow",
    "--log-intermediate-metrics-interval",
    "10",
]
"""Both loss runs record the GEMM-input statistics: what an FP8 run looks like beside bf16."""


def loss_argv(model: str, config: str, steps: int, log_json: Path) -> list[str]:
    """Flags of one loss-comparison run (same data, seed and schedule for every config)."""
    schedule = [
        "--lr",
        "6e-4",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "30",
        "--eval-iters",
        "8",
        "--log-interval",
        "50",
        "--log-json",
        str(log_json),
        *LOSS_METRICS,
    ]
    return run_args(
        model,
        config,
        seq=4096,
        steps=steps,
        micro=MICRO_BATCH[model],
        global_batch=8,
        extra=schedule,
    )


def loss_run(argv: list[str], log_json: Path, label: dict) -> dict:
    """A full ``pretrain_gpt.py`` run: its last losses and the history of its ``--log-json``
    (losses and ``intermediate/...`` statistics), labelled with ``label``."""
    from megatron.apertus.training.metrics import read_history

    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(REPO / "pretrain_gpt.py"), *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        errors="replace",
    )
    print(proc.stdout[-2500:], proc.stderr[-1500:] if proc.returncode else "", flush=True)
    if proc.returncode:
        return {**label, "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    history = read_history(log_json)
    return {
        **label,
        "valid_loss": history["valid/loss"][-1][1],
        "train_loss_last": history["train/loss"][-1][1],
        "wall_s": time.perf_counter() - start,
        "history": {
            name: points
            for name, points in history.items()
            if name in ("train/loss", "valid/loss") or name.startswith("intermediate/")
        },
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=SMALL_MODELS, choices=list(MICRO_BATCH))
    parser.add_argument(
        "--configs",
        nargs="*",
        default=DEFAULT_CONFIGS,
        choices=list(CONFIGS),
        help="throughput configurations (none: only the loss comparison)",
    )
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    parser.add_argument(
        "--micro-batch", type=int, help="micro-batch size (default: the model's, MICRO_BATCH)"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--loss-steps",
        type=int,
        default=0,
        help="also train bf16 and FP8 this many steps and compare validation loss",
    )
    parser.add_argument("--loss-model", default="apertus-v1.1-0.5b", choices=list(MICRO_BATCH))
    parser.add_argument(
        "--loss-configs",
        nargs="+",
        choices=list(CONFIGS),
        default=["te-bf16-packed", "te-fp8-tensorwise-packed"],
    )
    parser.add_argument("--name", default="train_step", help="results file stem")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_train_step")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, profile one more: kernel time by category "
        "(GEMMs, FP8 casts and amax, attention, xIELU, loss, ...)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def micro_batch(args: argparse.Namespace, model: str) -> int:
    return args.micro_batch or MICRO_BATCH[model]


def throughput_argv(args: argparse.Namespace, model: str, config: str) -> list[str]:
    """The trainer flags of one throughput row (one step more when profiled)."""
    steps = args.warmup + args.steps + int(args.profile)
    return run_args(
        model,
        config,
        seq=args.seq_length,
        steps=steps,
        micro=micro_batch(args, model),
        global_batch=args.global_batch,
        extra=THROUGHPUT,
    )


def loss_log_json(args: argparse.Namespace, config: str) -> Path:
    return args.out / f"loss_{args.loss_model}_{config}.json"


def planned_trainer_argvs(args: argparse.Namespace) -> list[list[str]]:
    """Every trainer command line this invocation runs, in order (for checks without a GPU)."""
    rows = [throughput_argv(args, m, c) for m in args.models for c in args.configs]
    losses = [
        loss_argv(args.loss_model, c, args.loss_steps, loss_log_json(args, c))
        for c in (args.loss_configs if args.loss_steps else [])
    ]
    return rows + losses


def main() -> None:
    args = build_parser().parse_args()
    if args.child:
        return child(args)

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_train_step.py: error: needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models:
        for config in args.configs:
            argv = throughput_argv(args, model, config)
            row = {
                "model": model,
                "config": config,
                "seq_length": args.seq_length,
                "micro_batch": micro_batch(args, model),
                "global_batch": args.global_batch,
                "argv": argv,
                **run_child(argv, args.warmup, args.steps, args.profile),
            }
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
            # after every row: a cut-short run keeps its figures
            write_results(args.name, rows, directory=args.results_dir)
    losses = []
    for config in args.loss_configs if args.loss_steps else []:
        log_json = loss_log_json(args, config)
        argv = loss_argv(args.loss_model, config, args.loss_steps, log_json)
        label = {"model": args.loss_model, "config": config, "steps": args.loss_steps}
        losses.append(loss_run(argv, log_json, label))
        print(json.dumps({k: v for k, v in losses[-1].items() if k != "history"}), flush=True)
        write_results(args.name, rows, {"loss_comparison": losses}, directory=args.results_dir)
    extra = {"loss_comparison": losses} if losses else None
    print(f"wrote {write_results(args.name, rows, extra, directory=args.results_dir)}")


if __name__ == "__main__":
    main()
