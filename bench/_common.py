"""Shared benchmark plumbing: timing, peak memory, and JSON results tagged with the machine.

Every benchmark compares against its baseline *in the same run* and writes
``bench/results/<name>_<device>.json`` holding the machine, versions, git commit and rows.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch

from megatron.apertus.ops.cpu_capability import cpu_name, native_bf16_matmul

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """Where the numbers come from: the CPU's model and vector capability, and whether it
    multiplies bf16 natively (CPU figures differ by that far more than by core count)."""
    info = {
        "cpu": cpu_name(),
        "cpu_native_bf16": native_bf16_matmul(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_tag() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "-")
    return f"cpu{os.cpu_count()}"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], *, device: str, warmup: int = 3, repeat: int = 10) -> dict:
    """p20/p50/p80 wall time in milliseconds of ``fn`` (synchronised on GPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    q = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
    return {"p20_ms": q[1], "p50_ms": statistics.median(times), "p80_ms": q[7]}


def peak_memory_bytes(fn: Callable[[], object], *, device: str) -> int | None:
    """Peak memory of one call: CUDA allocator peak on GPU, tracked RSS growth on CPU."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return _cpu_peak(fn)


def _cpu_peak(fn: Callable[[], object]) -> int:
    """Peak resident-memory growth during ``fn``, sampled every 0.5 ms by a background thread.

    Large tensors are mmap'd by the allocator and returned to the OS when freed, so RSS follows
    them; allocations shorter-lived than the sampling period can be missed.
    """
    import threading

    import psutil

    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = base
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.0005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(peak, proc.memory_info().rss) - base


def write_results(
    name: str, rows: list[dict], extra: dict | None = None, directory: Path = RESULTS
) -> Path:
    """``<directory>/<name>_<device>.json``, written under a temporary name and renamed."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}_{device_tag()}.json"
    payload = {
        "benchmark": name,
        "machine": machine(),
        "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rows": rows,
        **(extra or {}),
    }
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps(payload, indent=2))
    partial.replace(path)
    return path
