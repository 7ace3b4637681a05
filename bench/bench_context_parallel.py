"""Context parallelism on CPU: step time and peak memory per rank against CP=1 at the same global
sequence length.

    python bench/bench_context_parallel.py                       # 1024 tokens, CP 1 and 2
    python bench/bench_context_parallel.py --seq-length 4096 --cp 1 2 4

Each configuration is a real training run (``pretrain_gpt.py`` under torchrun, gloo, one thread
per rank, the tiny model in fp32 on the embedded corpus, one sequence per step) timed over its
steps after ``--warmup``. Peak memory per rank is each worker process's largest resident set,
sampled every 20 ms (the largest rank is reported; CP ranks hold equal shares). On a machine with fewer cores than ranks the ranks share cores, so the
step time measures contention as much as CP; the memory per rank is what CP is for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from _common import write_results  # noqa: E402


def _peak_rss_per_worker(proc: subprocess.Popen) -> dict[int, int]:
    """Largest resident set of each training process started under ``proc`` (torchrun)."""
    launcher = psutil.Process(proc.pid)
    peaks: dict[int, int] = {}
    while proc.poll() is None:
        for child in launcher.children(recursive=True):
            try:
                if "pretrain_gpt.py" in " ".join(child.cmdline()) and child.pid != proc.pid:
                    peaks[child.pid] = max(peaks.get(child.pid, 0), child.memory_info().rss)
            except psutil.Error:  # exited between listing and reading
                continue
        time.sleep(0.02)
    return peaks


def run(seq_length: int, cp: int, comm: str, steps: int) -> dict:
    """One configuration's step times (seconds), losses and per-rank peak memory (bytes)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(cp),
            "--standalone",
            str(REPO / "pretrain_gpt.py"),
            "--model-preset",
            "tiny",
            "--seq-length",
            str(seq_length),
            "--max-position-embeddings",
            str(seq_length),
            "--global-batch-size",
            "1",
            "--micro-batch-size",
            "1",
            "--train-iters",
            str(steps),
            "--eval-iters",
            "0",
            "--log-interval",
            "1",
            "--device",
            "cpu",
            "--seed",
            "3",
            "--context-parallel-size",
            str(cp),
            "--cp-comm-type",
            comm,
            "--log-json",
            str(log),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(Path(tmp) / "out.txt", "w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
            peaks = _peak_rss_per_worker(proc)
        if proc.returncode != 0:
            raise SystemExit((Path(tmp) / "out.txt").read_text()[-4000:])
        records = [json.loads(line) for line in log.read_text().splitlines()]
    seconds = [r["train/step_seconds"] for r in records if "train/step_seconds" in r]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    return {"step_seconds": seconds, "losses": losses, "peak_rss": sorted(peaks.values())}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--comm", nargs="+", default=["p2p", "a2a"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    rows = []
    for cp in args.cp:
        for comm in args.comm if cp > 1 else ["p2p"]:
            result = run(args.seq_length, cp, comm, args.steps)
            timed = result["step_seconds"][args.warmup :]
            row = {
                "seq_length": args.seq_length,
                "cp": cp,
                "cp_comm_type": comm,
                "step_ms_p50": 1e3 * statistics.median(timed),
                "peak_memory_gib_per_rank": max(result["peak_rss"]) / 2**30,
                "peak_memory_gib_each_rank": [b / 2**30 for b in result["peak_rss"]],
                "losses": result["losses"],
            }
            rows.append(row)
            print(json.dumps(row))
    base = rows[0]
    for row in rows:
        row["step_time_vs_cp1"] = row["step_ms_p50"] / base["step_ms_p50"]
        row["memory_vs_cp1"] = row["peak_memory_gib_per_rank"] / base["peak_memory_gib_per_rank"]
    path = write_results(
        "context_parallel", rows, {"warmup_steps": args.warmup, "model": "tiny", "dtype": "fp32"}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
