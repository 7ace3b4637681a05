"""Extra time of a distillation step over a cross-entropy step, in one process.

    python bench/bench_distill_step.py [--logits runs/demo/logits] [--rounds 7] [--device cuda]
        [--results-dir bench/results]

A training step differs only in its loss (the rest of the model is the same): the fused output
layer + loss with ``alpha=0`` and no teacher (cross-entropy) against ``alpha=0.9`` with the
teacher's top-k (the sparse KL correction at k ids per token), forward + backward, plus reading
one step's teacher targets from a store (decode; in training this overlaps the previous step in a
background thread). The two losses alternate round by round, so load from other processes hits
both alike. Shapes on CPU (fp32): the demo student (hidden 64) and the CPU shape of the kernel
benchmark (2048 tokens, hidden 512), V = 131072, k = 64 and 256. On CUDA (bf16): one micro-batch
of 8 x 2048 tokens at the hidden sizes of the Apertus-v1.1 0.5B, 1.5B and 4B students, k = 256.
Both add ``sampled`` rows: a sampled store's targets (``--sampling random``), 12 distinct ids per
token with weights count / 32 summing to 1, and no tail term.
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
from _common import RESULTS, write_results  # noqa: E402

from megatron.apertus.ops.sparse_kl import fused_linear_sparse_kd

VOCAB = 131072
SHAPES = {  # tokens, hidden, k (a sampled store's rows: 12 distinct ids of 32 draws, k=12)
    "cpu": [
        (2048, 64, 64),
        (2048, 64, 256),
        (2048, 64, "sampled"),
        (2048, 512, 256),
        (2048, 512, "sampled"),
    ],
    "cuda": [
        (16384, 1024, 256),
        (16384, 1024, "sampled"),
        (16384, 2048, 256),
        (16384, 2048, "sampled"),
        (16384, 3072, 256),
        (16384, 3072, "sampled"),
    ],
}
SAMPLED_DISTINCT, SAMPLED_DRAWS = 12, 32
DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}


def peaked_teacher(tokens: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random ids per row and a decaying top-k distribution with 0.9 of the mass."""
    ids = torch.cat(
        [
            torch.rand(min(1024, tokens - start), VOCAB, device=device).topk(k).indices
            for start in range(0, tokens, 1024)
        ]
    )
    probs = torch.softmax(-torch.arange(k, dtype=torch.float32, device=device) / 8, 0) * 0.9
    return ids, probs.expand(tokens, k).contiguous()


def sampled_teacher(tokens: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as a sampled store returns them: SAMPLED_DISTINCT distinct ids per row with weights
    count / SAMPLED_DRAWS (counts >= 1, summing to the draws)."""
    ids, _ = peaked_teacher(tokens, SAMPLED_DISTINCT, device)
    extra = torch.multinomial(
        torch.ones(tokens, SAMPLED_DISTINCT, device=device),
        SAMPLED_DRAWS - SAMPLED_DISTINCT,
        replacement=True,
    )
    counts = 1 + torch.zeros(tokens, SAMPLED_DISTINCT, device=device).scatter_add_(
        1, extra, torch.ones_like(extra, dtype=torch.float32)
    )
    return ids, counts / SAMPLED_DRAWS


def loss_step(x, weight, labels, mask, teacher) -> float:
    """Forward + backward of the fused loss; seconds."""
    x.grad = weight.grad = None
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    ids, probs, alpha, tail = teacher if teacher is not None else (None, None, 0.0, "label")
    loss, _ = fused_linear_sparse_kd(x, weight, ids, probs, labels, mask, alpha=alpha, tail=tail)
    loss.backward()
    sync()
    return time.perf_counter() - start


def compare(tokens: int, hidden: int, k: int | str, rounds: int, device: str) -> dict:
    dtype = DTYPES[device]
    x = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    weight = (torch.randn(VOCAB, hidden, device=device) * 0.02).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (tokens,), device=device)
    mask = torch.ones(tokens, device=device)
    if k == "sampled":  # no tail: the weights sum to 1 (targets.TeacherLogits.tail)
        teacher = (*sampled_teacher(tokens, device), 0.9, "ignore")
    else:
        teacher = (*peaked_teacher(tokens, k, device), 0.9, "label")
    cases = {"cross_entropy": None, "distillation": teacher}
    times = {name: [] for name in cases}
    for round_ in range(rounds + 1):  # round 0 warms up
        for name, teacher in cases.items():
            seconds = loss_step(x, weight, labels, mask, teacher)
            if round_:
                times[name].append(seconds)
    ce, kd = (statistics.median(times[n]) for n in cases)
    store = f"sampled ({SAMPLED_DISTINCT} of {SAMPLED_DRAWS} draws)" if k == "sampled" else "topk"
    return {
        "tokens": tokens,
        "hidden": hidden,
        "vocab": VOCAB,
        "store": store,
        "k": SAMPLED_DISTINCT if k == "sampled" else k,
        "dtype": str(dtype),
        "cross_entropy_ms": 1e3 * ce,
        "distillation_ms": 1e3 * kd,
        "extra_ms": 1e3 * (kd - ce),
        "extra_fraction": kd / ce - 1,
    }


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
    return {
        "store": str(logits),
        "kind": h.kind,
        "k": h.k,
        "samples": samples,
        "tokens": samples * h.seq_length,
        "read_ms": 1e3 * statistics.median(times),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logits", type=Path, default=Path("runs/demo/logits"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=sorted(SHAPES), default="cpu")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="where the JSON goes")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    torch.manual_seed(0)
    rows = []
    for tokens, hidden, k in SHAPES[args.device]:
        row = compare(tokens, hidden, k, args.rounds, args.device)
        rows.append(row)
        print(
            f"N={tokens} H={hidden} {row['store']} k={row['k']}: "
            f"CE {row['cross_entropy_ms']:.0f} ms, distillation "
            f"{row['distillation_ms']:.0f} ms ({100 * row['extra_fraction']:+.1f}%)"
        )
    extra = {"load_average_1_5_15min": os.getloadavg()}
    if (args.logits / "index.bin").is_file():
        extra["teacher_targets_read"] = read_step(args.logits, 16, args.rounds)
        print(f"reading one step's targets: {extra['teacher_targets_read']['read_ms']:.1f} ms")
    print(write_results("distill_step", rows, extra, args.results_dir))


if __name__ == "__main__":
    main()
