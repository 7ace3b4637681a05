"""Whether this CPU multiplies bf16 matrices natively, and the precision that is fast on it.

torch's CPU matrix products (oneDNN) run bf16 at full speed only where the CPU has bf16
instructions: AVX512-BF16 or AMX on x86, the BF16 extension on Arm. Elsewhere bf16 operands are
converted on the fly and a bf16 product runs far slower than fp32 (on an AVX2-only AMD EPYC,
0.5 against 42 GFLOP/s). The choice of precision is made from the CPU's features, never from a
timing, so it is the same on every run of one machine and a run's losses stay reproducible; a
timing only quantifies the warning given when bf16 is asked for anyway.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")


def _arm_has_bf16(cpuinfo: Path = CPUINFO) -> bool:
    """Linux on Arm lists the BF16 extension as ``bf16`` among a core's ``Features``."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    return any(
        line.startswith("Features") and "bf16" in line.split(":", 1)[-1].split()
        for line in text.splitlines()
    )


def native_bf16_matmul() -> bool:
    """True where this CPU has bf16 matrix instructions that torch's CPU kernels use."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686"):
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if machine in ("aarch64", "arm64"):
        return _arm_has_bf16()
    return False


def fast_precision(device: str) -> str:
    """The parameter precision that runs fast on ``device`` ("cpu" or "cuda"): bf16 on GPUs
    and on CPUs with native bf16, fp32 on the others."""
    if device == "cuda" or native_bf16_matmul():
        return "bf16"
    return "fp32"


def cpu_name() -> str:
    """The CPU's model name and the vector capability torch dispatches to, e.g. "AMD EPYC (AVX2)"."""
    model = platform.processor() or platform.machine()
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({torch.backends.cpu.get_cpu_capability()})"


def bf16_slowdown(size: int = 256, repeats: int = 5) -> float:
    """How many times longer a ``size``-square bf16 matrix product takes than an fp32 one here:
    the figure a warning quotes. One thread and the best of ``repeats``, so that other load on
    the machine (threads waiting at a barrier) does not blur the ratio."""

    def best_time(dtype: torch.dtype) -> float:
        a = torch.ones(size, size, dtype=dtype)
        a @ a  # first call: oneDNN picks and prepares its kernel
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - start)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return best_time(torch.bfloat16) / max(best_time(torch.float32), 1e-9)
    finally:
        torch.set_num_threads(threads)


def slow_bf16_warning(precision: str, device: str) -> str | None:
    """One line for a run that asked for bf16 on a CPU without native bf16; None otherwise."""
    if precision != "bf16" or device != "cpu" or native_bf16_matmul():
        return None
    return (
        f"--precision bf16 on a CPU without native bf16 ({cpu_name()}): a bf16 matrix product "
        f"measured {bf16_slowdown():.0f}x slower than fp32 here; --precision fp32 runs faster"
    )
