"""Extra time of a distillation step over a cross-entropy step, in one process.

    python bench/bench_distill_step.py [--logits runs/demo/logits] [--rounds 7]

A training step differs only in its loss (the rest of the model is the same): the fused output
layer + loss with ``alpha=0`` and no teacher (cross-entropy) against ``alpha=0.9`` with the
teacher's top-k (the sparse KL correction at k ids per token), forward + backward, plus reading
one step's teacher targets from a store (decode; in training this overlaps the previous step in a
background thread). The two losses alternate round by round, so load from other processes hits
both alike. Shapes: the demo student (16 x 128 tokens, hidden 64) and the CPU shape of the kernel
benchmark (2048 tokens, hidden 512), V = 131072, k = 64 and 256.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402

from megatron.apertus.ops.sparse_kl import fused_linear_sparse_kd

VOCAB = 131072
SHAPES = [(2048, 64, 64), (2048, 64, 256), (2048, 512, 256)]  # tokens, hidden, k


def peaked_teacher(tokens: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct ids per row and a decaying top-k distribution with 0.9 of the mass."""
    ids = torch.stack([torch.randperm(VOCAB)[:k] for _ in range(tokens)])
    probs = torch.softmax(-torch.arange(k, dtype=torch.float32) / 8, 0) * 0.9
    return ids, probs.expand(tokens, k).contiguous()


def loss_step(x, weight, labels, mask, teacher) -> float:
    """Forward + backward of the fused loss; seconds."""
    x.grad = weight.grad = None
    start = time.perf_counter()
    ids, probs, alpha = teacher if teacher is not None else (None, None, 0.0)
    loss, _ = fused_linear_sparse_kd(x, weight, ids, probs, labels, mask, alpha=alpha)
    loss.backward()
    return time.perf_counter() - start


def compare(tokens: int, hidden: int, k: int, rounds: int) -> dict:
    x = torch.randn(tokens, hidden, requires_grad=True)
    weight = (torch.randn(VOCAB, hidden) * 0.02).requires_grad_()
    labels, mask = torch.randint(0, VOCAB, (tokens,)), torch.ones(tokens)
    ids, probs = peaked_teacher(tokens, k)
    cases = {"cross_entropy": None, "distillation": (ids, probs, 0.9)}
    times = {name: [] for name in cases}
    for round_ in range(rounds + 1):  # round 0 warms up
        for name, teacher in cases.items():
            seconds = loss_step(x, weight, labels, mask, teacher)
            if round_:
                times[name].append(seconds)
    ce, kd = (statistics.median(times[n]) for n in cases)
    return {"tokens": tokens, "hidden": hidden, "vocab": VOCAB, "k": k,
            "cross_entropy_ms": 1e3 * ce, "distillation_ms": 1e3 * kd,
            "extra_ms": 1e3 * (kd - ce), "extra_fraction": kd / ce - 1}  # fmt: skip


def read_step(logits: Path, samples: int, rounds: int) -> dict:
    """Median time to decode one step's teacher targets (``samples`` consecutive samples)."""
    from megatron.apertus.distill.logit_store import LogitStoreReader

    reader = LogitStoreReader(logits)
    times = []
    for r in range(rounds):
        start = time.perf_counter()
        reader.read(range(r * samples, (r + 1) * samples))
        times.append(time.perf_counter() - start)
    h = reader.header
    return {"store": str(logits), "k": h.k, "samples": samples, "tokens": samples * h.seq_length,
            "read_ms": 1e3 * statistics.median(times)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logits", type=Path, default=Path("runs/demo/logits"))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for tokens, hidden, k in SHAPES:
        row = compare(tokens, hidden, k, args.rounds)
        rows.append(row)
        print(f"N={tokens} H={hidden} k={k}: CE {row['cross_entropy_ms']:.0f} ms, distillation "
              f"{row['distillation_ms']:.0f} ms (+{100 * row['extra_fraction']:.1f}%)")  # fmt: skip
    extra = {"load_average_1_5_15min": os.getloadavg()}
    if (args.logits / "index.bin").is_file():
        extra["teacher_targets_read"] = read_step(args.logits, 16, args.rounds)
        print(f"reading one step's targets: {extra['teacher_targets_read']['read_ms']:.1f} ms")
    print(write_results("distill_step", rows, extra))


if __name__ == "__main__":
    main()
