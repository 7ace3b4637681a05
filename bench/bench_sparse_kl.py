"""Benchmark: fused output layer + sparse top-k distillation loss, forward + backward.

Compares, in the same run and on the same inputs (V=131072, K=256, alpha=0.9, default tail):
  ours      fused_linear_sparse_kd (impl="auto": the device's kernel), default chunking;
  naive     the reference: full [N, V] logits, log_softmax, gather, autograd;
  compiled  the reference applied chunk by chunk under torch.compile, backward per chunk
            (memory-bounded like ours; Inductor fuses the softmax passes);
plus the three GEMMs of our loop alone (gemm_floor: what the passes add shows against it) and
ours at explicit chunk sizes (the sweep behind ``default_chunk_rows``). Reports p20/p50/p80
time, peak memory, and TFLOP/s counting 6*N*H*V for the forward and backward GEMMs (against the
989 TFLOP/s dense bf16 peak of an H100 on GPU). Writes bench/results/sparse_kl_<device>.json.

    python bench/bench_sparse_kl.py  # CPU: N=2048, H=512, fp32; GPU: N=4096, 16384, H=4096, bf16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from bench._common import peak_memory_bytes, time_fn, write_results  # noqa: E402
from megatron.apertus.ops import sparse_kl  # noqa: E402

VOCAB = 131072
TOP_K = 256
H100_BF16_PEAK_TFLOPS = 989.0

Inputs = tuple[torch.Tensor, ...]


def make_inputs(n: int, hidden: int, dtype: torch.dtype, device: str, seed: int = 0) -> Inputs:
    """Student-like scales (logit std ~1) and a peaked teacher over distinct top-K ids."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, hidden, generator=gen).to(device, dtype)
    weight = (torch.randn(VOCAB, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    # Distinct ids per row without an [N, V] sort: one random K-subset, shifted per row.
    base = torch.randperm(VOCAB, generator=gen)[:TOP_K]
    ids = (base[None, :] + torch.randint(0, VOCAB, (n, 1), generator=gen)) % VOCAB
    probs = torch.softmax(2.0 * torch.randn(n, TOP_K, generator=gen), dim=1) * 0.97
    labels = ids[:, 0].clone()
    mask = torch.ones(n, dtype=torch.bool)
    return tuple(t.to(device) for t in (x, weight, ids, probs, labels, mask))


def ours(inputs: Inputs, chunk_size: int | None) -> Callable[[], object]:
    x, weight, ids, probs, labels, mask = inputs
    xg, wg = x.requires_grad_(), weight.requires_grad_()

    def step() -> object:
        loss, _ = sparse_kl.fused_linear_sparse_kd(
            xg, wg, ids, probs, labels, mask, chunk_size=chunk_size
        )
        return torch.autograd.grad(loss, (xg, wg))

    return step


def naive(inputs: Inputs) -> Callable[[], object]:
    x, weight, ids, probs, labels, mask = inputs
    xg, wg = x.requires_grad_(), weight.requires_grad_()

    def step() -> object:
        loss, _ = sparse_kl.sparse_kd_reference(xg, wg, ids, probs, labels, mask)
        return torch.autograd.grad(loss, (xg, wg))

    return step


def compiled_chunked(inputs: Inputs, chunk_rows: int) -> Callable[[], object]:
    x, weight, ids, probs, labels, mask = inputs
    wg = weight.requires_grad_()
    chunk_loss = torch.compile(sparse_kl.sparse_kd_reference, dynamic=False)

    def step() -> object:
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_x = torch.empty_like(x)
        for start in range(0, x.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            x_chunk = x[rows].detach().requires_grad_()
            loss, _ = chunk_loss(x_chunk, wg, ids[rows], probs[rows], labels[rows], mask[rows])
            gx, gw = torch.autograd.grad(loss, (x_chunk, wg))
            grad_x[rows] = gx
            grad_w += gw
        return grad_x, grad_w

    return step


def gemm_floor(inputs: Inputs, chunk_rows: int) -> Callable[[], object]:
    """Only the three GEMMs of our chunk loop, dW accumulated as ours does: the floor under ours."""
    x, weight = inputs[0].detach(), inputs[1].detach()
    accumulate = torch.float32 if x.shape[0] > chunk_rows else weight.dtype

    def step() -> object:
        grad_w = torch.empty(weight.shape, dtype=accumulate, device=weight.device)
        grad_x = torch.empty_like(x)
        for start in range(0, x.shape[0], chunk_rows):
            x_chunk = x[start : start + chunk_rows]
            logits = x_chunk @ weight.T if x.is_cuda else (weight @ x_chunk.T).T  # ours' layout
            torch.mm(logits, weight, out=grad_x[start : start + chunk_rows])
            sparse_kl._add_weight_grad(grad_w, logits, x_chunk, first=start == 0)
        return grad_x, grad_w.to(weight.dtype)

    return step


def measure_all(
    steps: dict[str, Callable[[], object]], *, n: int, hidden: int, device: str, repeat: int
) -> list[dict]:
    """Timed in interleaved rounds (one run of every method per round), so that a machine whose
    speed drifts (shared CPUs) slows all methods alike; then each method's peak memory."""
    for step in steps.values():
        step()  # warm-up; compiles the torch.compile variant
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeat):
        for name, step in steps.items():
            times[name].append(time_fn(step, device=device, warmup=0, repeat=1)["p50_ms"])
    rows = []
    for name, step in steps.items():
        q = (
            statistics.quantiles(times[name], n=10, method="inclusive")
            if repeat > 1
            else times[name] * 9
        )
        median = statistics.median(times[name])
        tflops = 6 * n * hidden * VOCAB / (median * 1e-3) / 1e12
        row = {"method": name, "N": n, "H": hidden, "V": VOCAB, "K": TOP_K}
        row.update({"p20_ms": q[1], "p50_ms": median, "p80_ms": q[7], "tflops": round(tflops, 2)})
        row["peak_mem_bytes"] = peak_memory_bytes(step, device=device)
        if device == "cuda":
            row["frac_of_bf16_peak"] = round(tflops / H100_BF16_PEAK_TFLOPS, 3)
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        rows.append(row)
    return rows


def bench_case(
    n: int, hidden: int, dtype: torch.dtype, device: str, sweep: list[int], repeat: int
) -> list[dict]:
    inputs = make_inputs(n, hidden, dtype, device)
    chunk = sparse_kl.default_chunk_rows(n, VOCAB, dtype, torch.device(device))
    steps = {
        "naive": naive(inputs),
        f"ours(chunk={chunk})": ours(inputs, None),
        f"compiled(chunk={chunk})": compiled_chunked(inputs, chunk),
        f"gemm_floor(chunk={chunk})": gemm_floor(inputs, chunk),
    }
    steps.update({f"ours(chunk={c})": ours(inputs, c) for c in sweep if c != chunk})
    rows = measure_all(steps, n=n, hidden=hidden, device=device, repeat=repeat)
    base = rows[0]
    for row in rows:
        row["speedup_vs_naive"] = round(base["p50_ms"] / row["p50_ms"], 3)
        if base["peak_mem_bytes"] and row["peak_mem_bytes"]:
            row["mem_fraction_of_naive"] = round(row["peak_mem_bytes"] / base["peak_mem_bytes"], 4)
        row["dtype"] = str(dtype).removeprefix("torch.")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=None, help="timed runs per method")
    parser.add_argument("--no-sweep", action="store_true", help="skip the chunk-size sweep")
    args = parser.parse_args()
    torch.manual_seed(0)
    if torch.cuda.is_available():
        sweep = [] if args.no_sweep else [1024, 2048, 4096, 8192]
        cases = [
            (4096, 4096, torch.bfloat16, "cuda", []),
            (16384, 4096, torch.bfloat16, "cuda", sweep),
        ]
        repeat = args.repeat or 5
    else:
        sweep = [] if args.no_sweep else [64, 128, 256, 512, 1024]
        cases = [(2048, 512, torch.float32, "cpu", sweep)]
        repeat = args.repeat or 4
    rows = [row for case in cases for row in bench_case(*case, repeat=repeat)]
    kernels = {kind: sparse_kl._load_extension(kind)[0] is not None for kind in ("cpu", "cuda")}
    path = write_results(
        "sparse_kl", rows, {"kernels_built": kernels, "tail": sparse_kl.DEFAULT_TAIL}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
