"""One AdEMAMix optimizer step: the multi-tensor (foreach) update, in its default chunks and in
one batch, vs the per-tensor reference, with torch's foreach AdamW (two moments instead of three)
as context, in one run, over the parameter shapes of an Apertus model (many 1-D norms and
shape-[1] xIELU alphas, large matrices).

    python bench/bench_ademamix.py                  # CUDA if available, else CPU
    python bench/bench_ademamix.py --device cpu

Writes ``bench/results/ademamix_<device>.json``. Settings as in the Apertus recipe mid-warmup
(weight decay 0.1 on matrices, alpha and beta3 warming up). Bytes moved per element by the
foreach update with weight decay: 31 x 4 (each multi-tensor op reads and writes whole fp32
tensors); a fully fused kernel would need 9 x 4 (read p, g, m1, m2, v; write p, m1, m2, v). On a
GPU each rate is compared with the H100 SXM HBM3 peak (3.35 TB/s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import peak_memory_bytes, time_fn, write_results  # noqa: E402

from megatron.apertus.model import ApertusConfig, preset
from megatron.apertus.optim import AdEMAMix

HBM_PEAK_BYTES_PER_S = 3.35e12
FOREACH_BYTES_PER_ELEMENT = 31 * 4
CASES = {
    # CPU: the 0.5B layer shapes, 4 of its 20 layers and a quarter of its vocabulary (~94M
    # parameters, 2.6 GB with gradients, states and temporaries).
    "cpu": [("apertus-v1.1-0.5b", dict(num_layers=4, vocab_size=32768))],
    "cuda": [("apertus-v1.1-0.5b", {}), ("apertus-v1.1-1.5b", {})],
}
HYPER = dict(
    lr=6e-4,
    betas=(0.9, 0.999, 0.9999),
    alpha=8.0,
    alpha_warmup=100_000,
    beta3_warmup=100_000,
    eps=1e-8,
    weight_decay=0.1,
)


def parameter_shapes(config: ApertusConfig) -> list[tuple[int, ...]]:
    """The unsharded model's parameter shapes, in megatron-core's order."""
    h, f, kv = config.hidden_size, config.ffn_hidden_size, config.kv_channels
    qkv = kv * (config.num_attention_heads + 2 * config.num_query_groups)
    layer = [
        (h,),
        (qkv, h),
        (kv,),
        (kv,),
        (h, config.num_attention_heads * kv),
        (h,),
        (f, h),
        (1,),
        (1,),
        (h, f),
    ]
    shapes = [(config.vocab_size, h), *layer * config.num_layers, (h,)]
    if config.untie_embeddings_and_output_weights:
        shapes.append((config.vocab_size, h))
    return shapes


def parameter_groups(shapes: list[tuple[int, ...]], device: str) -> list[dict]:
    """Random parameters with gradients; no weight decay on 1-D ones (megatron-core's rule)."""
    params = [torch.randn(s, device=device) * 0.01 for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return [
        {"params": [p for p in params if p.ndim > 1]},
        {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0},
    ]


def interleaved_times(steps: dict[str, Callable], device: str, rounds: int) -> dict[str, dict]:
    """p20/p50/p80 ms per implementation, one step of each in turn per round (after a warm-up
    round), so that other work on a shared machine slows every implementation alike."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for round_index in range(rounds + 1):
        for name, step in steps.items():
            elapsed = time_fn(step, device=device, warmup=0, repeat=1)["p50_ms"]
            if round_index:
                samples[name].append(elapsed)
    result = {}
    for name, times in samples.items():
        q = statistics.quantiles(times, n=10)
        result[name] = {"p20_ms": q[1], "p50_ms": statistics.median(times), "p80_ms": q[7]}
    return result


def run_case(name: str, overrides: dict, device: str, rounds: int) -> list[dict]:
    config = preset(name, **overrides)
    shapes = parameter_shapes(config)
    numel = sum(torch.Size(s).numel() for s in shapes)
    assert numel == config.num_parameters(), "shapes disagree with the model's parameter count"
    groups = parameter_groups(shapes, device)
    ademamix = AdEMAMix(groups, **HYPER)
    adamw = torch.optim.AdamW(
        [{k: g[k] for k in ("params", "weight_decay") if k in g} for g in groups],
        lr=HYPER["lr"],
        weight_decay=HYPER["weight_decay"],
        foreach=True,
    )

    def ademamix_step(foreach: bool, chunk_numel: int | None = None) -> Callable[[], None]:
        def step() -> None:
            ademamix.foreach, ademamix.chunk_numel = foreach, chunk_numel
            ademamix.step()

        return step

    steps = {
        "ademamix-reference": ademamix_step(False),
        "ademamix-foreach": ademamix_step(True),
        "ademamix-foreach-unchunked": ademamix_step(True, numel),
        "torch-adamw-foreach": adamw.step,
    }
    times = interleaved_times(steps, device, rounds)
    base = {"preset": name, "overrides": overrides, "tensors": len(shapes), "parameters": numel}
    rows = []
    for impl, step in steps.items():
        row = {**base, "impl": impl, **times[impl]}
        row["peak_memory_bytes"] = peak_memory_bytes(step, device=device)
        row["speedup_vs_reference"] = times["ademamix-reference"]["p50_ms"] / row["p50_ms"]
        if impl.startswith("ademamix-foreach"):
            row["GB_per_s"] = FOREACH_BYTES_PER_ELEMENT * numel / (row["p50_ms"] * 1e-3) / 1e9
            if device == "cuda":
                row["hbm_fraction"] = row["GB_per_s"] * 1e9 / HBM_PEAK_BYTES_PER_S
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=7, help="timed steps per implementation")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (one by default: on a shared 2-core machine two threads spent their "
        "time waiting for each other at every op's barrier)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for name, overrides in CASES[args.device]:
        for row in run_case(name, overrides, args.device, args.rounds):
            rows.append(row)
            print(
                f"{row['preset']:18s} {row['parameters'] / 1e6:7.1f}M params {row['tensors']:4d} "
                f"tensors  {row['impl']:26s} p50 {row['p50_ms']:9.2f} ms  "
                f"x{row['speedup_vs_reference']:.2f} vs reference"
            )
    # Other processes on a shared machine slow both sides of the comparison: record how busy.
    extra = {"hyperparameters": HYPER, "load_average_1_5_15min": os.getloadavg()}
    print(write_results("ademamix", rows, extra))


if __name__ == "__main__":
    main()
