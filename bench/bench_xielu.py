"""xIELU forward+backward: our kernel vs eager PyTorch (the reference formula) vs torch.compile
of the same formula, in one run, at an MLP activation shape (tokens x ffn) and a tiny one.

    python bench/bench_xielu.py                 # CUDA if available, else CPU
    python bench/bench_xielu.py --device cpu

Writes ``bench/results/xielu_<device>.json``. Bytes moved per element: forward reads x and writes
y, backward reads x and dy and writes dx: 5 x element size for forward+backward. On a GPU the
kernel's forward and backward are also timed alone, and each rate is compared with the H100 SXM
HBM3 peak (3.35 TB/s). Targets (reported, not asserted): CPU >= 3x eager and no slower than
torch.compile; GPU >= 80% of HBM bandwidth.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import peak_memory_bytes, time_fn, write_results  # noqa: E402

from megatron.apertus.ops.xielu import inverse_softplus, xielu, xielu_reference

HBM_PEAK_BYTES_PER_S = 3.35e12
CALLS_PER_SAMPLE = {"cpu": 1, "cuda": 10}
CASES = {
    "cpu": [
        ((4, 512, 6144), torch.bfloat16),
        ((4, 512, 6144), torch.float32),
        ((2, 64, 192), torch.float32),
    ],
    "cuda": [((8, 4096, 21504), torch.bfloat16), ((2, 64, 192), torch.bfloat16)],
}


def inputs(shape: tuple, dtype: torch.dtype, device: str) -> tuple:
    x = (torch.randn(shape, device=device, dtype=torch.float32) * 3).to(dtype)
    dy = torch.randn(shape, device=device, dtype=dtype)
    alpha_p = torch.tensor([inverse_softplus(0.8)], device=device, requires_grad=True)
    alpha_n = torch.tensor([inverse_softplus(0.3)], device=device, requires_grad=True)
    return x.requires_grad_(), dy, alpha_p, alpha_n


def forward_backward(fn: Callable, x, dy, alpha_p, alpha_n) -> None:
    y = fn(x, alpha_p, alpha_n)
    torch.autograd.grad(y, (x, alpha_p, alpha_n), dy)


def implementations(device: str) -> dict[str, Callable]:
    """Fresh per case: one compiled graph per shape and dtype, warmed up by time_fn."""
    return {
        "kernel": partial(xielu, impl=device),
        "eager": xielu_reference,
        "compile": torch.compile(xielu_reference, dynamic=False),
    }


def measure(fn: Callable[[], object], device: str, bytes_moved: int, repeat: int) -> dict:
    """Time per call. On a GPU each sample is several back-to-back calls, as in training, so
    the host's launch latency (tens of microseconds through the Python custom op) overlaps with
    the previous call instead of being added to every sample."""
    calls = CALLS_PER_SAMPLE[device]

    def sample() -> None:
        for _ in range(calls):
            fn()

    row = {k: v / calls for k, v in time_fn(sample, device=device, warmup=3, repeat=repeat).items()}
    row["peak_memory_bytes"] = peak_memory_bytes(fn, device=device)
    row["GB_per_s"] = bytes_moved / (row["p50_ms"] * 1e-3) / 1e9
    if device == "cuda":
        row["hbm_fraction"] = row["GB_per_s"] * 1e9 / HBM_PEAK_BYTES_PER_S
    return row


def kernel_alone(device: str, shape: tuple, dtype: torch.dtype, repeat: int) -> list[dict]:
    """The kernel's forward and backward timed separately (GPU bandwidth per pass), next to a
    device-to-device copy of the same tensor: the bandwidth an elementwise kernel can reach."""
    x, dy, alpha_p, alpha_n = inputs(shape, dtype, device)
    x, alpha_p, alpha_n = x.detach(), alpha_p.detach(), alpha_n.detach()
    size, n = x.element_size(), x.numel()
    out = torch.empty_like(x)
    forward = partial(xielu, x, alpha_p, alpha_n, impl=device)
    backward = partial(torch.ops.apertus.xielu_bwd, dy, x, alpha_p, alpha_n, 0.5, -1e-6)
    base = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}

    def row(pass_name: str, impl: str, fn: Callable[[], object], bytes_moved: int) -> dict:
        return {**base, "pass": pass_name, "impl": impl, **measure(fn, device, bytes_moved, repeat)}

    return [
        row("copy", "torch", partial(out.copy_, x), 2 * size * n),
        row("forward", "kernel", forward, 2 * size * n),
        row("backward", "kernel", backward, 3 * size * n),
    ]


def run(device: str, repeat: int) -> list[dict]:
    rows = []
    for shape, dtype in CASES[device]:
        x, dy, alpha_p, alpha_n = inputs(shape, dtype, device)
        bytes_moved = 5 * x.element_size() * x.numel()
        base = {
            "shape": list(shape),
            "dtype": str(dtype).removeprefix("torch."),
            "pass": "forward+backward",
        }
        case = {}
        for name, fn in implementations(device).items():
            call = partial(forward_backward, fn, x, dy, alpha_p, alpha_n)
            case[name] = {**base, "impl": name, **measure(call, device, bytes_moved, repeat)}
        kernel_ms = case["kernel"]["p50_ms"]
        case["kernel"]["speedup_vs_eager"] = case["eager"]["p50_ms"] / kernel_ms
        case["kernel"]["speedup_vs_compile"] = case["compile"]["p50_ms"] / kernel_ms
        rows += case.values()
        if device == "cuda":
            rows += kernel_alone(device, shape, dtype, repeat)
        del x, dy
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"{'shape':>18} {'dtype':>9} {'pass':>17} {'impl':>8} {'p50 ms':>9} {'GB/s':>8} "
        f"{'peak MB':>9} {'vs eager':>9} {'vs compile':>10}"
    )
    for r in rows:
        peak = (
            r["peak_memory_bytes"] / 2**20 if r["peak_memory_bytes"] is not None else float("nan")
        )
        print(
            f"{str(r['shape']):>18} {r['dtype']:>9} {r['pass']:>17} {r['impl']:>8} "
            f"{r['p50_ms']:9.3f} {r['GB_per_s']:8.1f} {peak:9.1f} "
            f"{r.get('speedup_vs_eager', float('nan')):9.2f} "
            f"{r.get('speedup_vs_compile', float('nan')):10.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = run(args.device, args.repeat)
    print_table(rows)
    extra = {"hbm_peak_bytes_per_s": HBM_PEAK_BYTES_PER_S} if args.device == "cuda" else {}
    print("wrote", write_results("xielu", rows, extra))


if __name__ == "__main__":
    main()
