"""Training throughput of the implementations side by side, and FP8 against bf16 loss.

    python bench/bench_train_step.py                        # every config, both models
    python bench/bench_train_step.py --models apertus-v1.1-0.5b --configs te-bf16 te-fp8-delayed
    python bench/bench_train_step.py --loss-steps 300       # + bf16 vs FP8 validation loss

Each configuration runs in its own process (a fresh CUDA context, no allocator or FP8 state
carried over) through the real trainer (``pretrain_gpt.py``'s arguments, megatron-core's
schedules, AdamW, the fused output-layer loss, the embedded corpus with the tekken tokenizer),
and times full optimizer steps after warm-up. Configurations:

* ``local`` / ``local-packed``: our layers; packed documents through varlen flash attention;
* ``te-bf16`` / ``te-bf16-packed``: Transformer Engine layers; packed through THD cu_seqlens;
* ``te-fp8-tensorwise-packed`` / ``te-fp8-delayed-packed``: TE with FP8 (hybrid) GEMMs.

"packed" is the recipe's setting: ``--reset-attention-mask --reset-position-ids``, documents
never attend to each other. MFU counts the dense causal attention FLOPs for every config (as
Megatron-LM does), so packed and unpacked runs compare by the same yardstick as tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

PACKED = ["--reset-attention-mask", "--reset-position-ids", "--use-packed-seq-params"]
TE = ["--transformer-impl", "transformer_engine"]
CONFIGS = {
    "local": ["--transformer-impl", "local"],
    "local-packed": ["--transformer-impl", "local", *PACKED],
    "te-bf16": TE,
    "te-bf16-packed": [*TE, *PACKED],
    "te-fp8-tensorwise-packed": [*TE, *PACKED, "--fp8-format", "hybrid", "--fp8-recipe",
                                 "tensorwise"],
    "te-fp8-delayed-packed": [*TE, *PACKED, "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                              "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max"],
}  # fmt: skip
SDPA = ["--attention-backend", "local"]  # TE's linears with PyTorch flash / varlen attention
CONFIGS.update({f"{name}-sdpa": [*flags, *SDPA] for name, flags in list(CONFIGS.items())
                if name.startswith("te-")})  # fmt: skip
MICRO_BATCH = {"apertus-v1.1-0.5b": 4, "apertus-v1.1-1.5b": 2}
GLOBAL_BATCH = 16
RESULT_PREFIX = "BENCH_RESULT "


def run_args(
    model: str,
    config: str,
    *,
    seq: int,
    steps: int,
    micro: int,
    global_batch: int,
    extra: list[str],
) -> list[str]:
    return [
        "--model-preset", model, "--device", "cuda", "--precision", "bf16",
        "--seq-length", str(seq), "--max-position-embeddings", str(seq),
        "--micro-batch-size", str(micro), "--global-batch-size", str(global_batch),
        "--train-iters", str(steps), "--seed", "1234", *CONFIGS[config], *extra,
    ]  # fmt: skip


THROUGHPUT = ["--lr", "3e-4", "--lr-warmup-iters", "2", "--log-interval", "1000000",
              "--eval-iters", "0"]  # fmt: skip


# -- one configuration (child process) ------------------------------------------------------------


def measure(argv: list[str], warmup: int, timed: int) -> dict:
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
    return {
        "transformer_impl": trainer.transformer_impl,
        "step_s_median": step,
        "step_s_min": min(seconds),
        "tokens_per_s_per_gpu": tokens_s,
        "tflops_per_gpu": tflops,
        "mfu": tflops / device_peak_tflops(),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "losses": losses,
    }


def child(args: argparse.Namespace) -> None:
    argv = json.loads(args.child)
    print(RESULT_PREFIX + json.dumps(measure(argv, args.warmup, args.steps)), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of CUDA/NCCL state


def run_child(argv: list[str], warmup: int, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(argv), "--warmup", str(warmup),
           "--steps", str(steps)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", cwd=REPO)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = (proc.stdout + proc.stderr)[-3000:]
    return {"error": f"exit {proc.returncode}: {tail}"}


# -- bf16 against FP8 loss ------------------------------------------------------------------------


def loss_run(model: str, config: str, steps: int, out: Path) -> dict:
    """A full ``pretrain_gpt.py`` run; its validation loss at the end (same data and seed)."""
    from megatron.apertus.training.metrics import read_history

    log_json = out / f"loss_{model}_{config}.json"
    schedule = ["--lr", "6e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "30",
                "--eval-iters", "8", "--log-interval", "50", "--log-json", str(log_json)]  # fmt: skip
    argv = run_args(model, config, seq=4096, steps=steps, micro=MICRO_BATCH[model],
                    global_batch=8, extra=schedule)  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *argv], cwd=REPO,
                          capture_output=True, text=True, errors="replace")  # fmt: skip
    print(proc.stdout[-2500:], proc.stderr[-1500:] if proc.returncode else "", flush=True)
    if proc.returncode:
        return {"config": config, "error": f"exit {proc.returncode}"}
    history = read_history(log_json)
    return {
        "model": model,
        "config": config,
        "steps": steps,
        "valid_loss": history["valid/loss"][-1][1],
        "train_loss_last": history["train/loss"][-1][1],
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MICRO_BATCH))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--loss-steps",
        type=int,
        default=0,
        help="also train bf16 and FP8 this many steps and compare validation loss",
    )
    parser.add_argument("--loss-model", default="apertus-v1.1-0.5b")
    parser.add_argument(
        "--loss-configs",
        nargs="+",
        choices=list(CONFIGS),
        default=["te-bf16-packed", "te-fp8-tensorwise-packed"],
    )
    parser.add_argument("--name", default="train_step", help="results file stem")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_train_step")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    import torch
    from _common import write_results

    if not torch.cuda.is_available():
        sys.exit("bench_train_step.py: error: needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models:
        for config in args.configs:
            argv = run_args(model, config, seq=args.seq_length, steps=args.warmup + args.steps,
                            micro=MICRO_BATCH[model], global_batch=GLOBAL_BATCH,
                            extra=THROUGHPUT)  # fmt: skip
            row = {"model": model, "config": config, "seq_length": args.seq_length,
                   "micro_batch": MICRO_BATCH[model], "global_batch": GLOBAL_BATCH,
                   **run_child(argv, args.warmup, args.steps)}  # fmt: skip
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
            write_results(args.name, rows)  # after every row: a cut-short run keeps its figures
    losses = []
    for config in args.loss_configs if args.loss_steps else []:
        losses.append(loss_run(args.loss_model, config, args.loss_steps, args.out))
        print(json.dumps(losses[-1]), flush=True)
        write_results(args.name, rows, {"loss_comparison": losses})
    print(
        f"wrote {write_results(args.name, rows, {'loss_comparison': losses} if losses else None)}"
    )


if __name__ == "__main__":
    main()
