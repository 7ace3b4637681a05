"""The precision chosen for a CPU is fast on it, and asking for a slow one says so in one line."""

from __future__ import annotations

import logging
import platform

import pytest
import torch

from megatron.apertus.ops import cpu_capability
from megatron.apertus.ops.cpu_capability import (
    bf16_slowdown,
    fast_precision,
    native_bf16_matmul,
    slow_bf16_warning,
)
from megatron.apertus.training.run_log import warn_if_slow_precision

X86 = platform.machine().lower() in ("x86_64", "amd64")
AVX2_ONLY = X86 and torch.backends.cpu.get_cpu_capability() == "AVX2"


def test_bf16_is_chosen_only_where_it_is_fast():
    """The feature check agrees with a measurement on the machine at hand."""
    if native_bf16_matmul():
        assert fast_precision("cpu") == "bf16"
        assert bf16_slowdown() < 2.0
    else:
        assert fast_precision("cpu") == "fp32"
        if AVX2_ONLY:  # oneDNN converts bf16 on the fly: tens of times slower
            assert bf16_slowdown() > 5.0


def test_gpus_train_in_bf16():
    assert fast_precision("cuda") == "bf16"


@pytest.mark.parametrize(
    "features, expected",
    [
        ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp bf16 i8mm sve", True),
        ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp", False),
    ],
)
def test_arm_bf16_read_from_cpuinfo_features(tmp_path, features, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: {features}\n\n")
    assert cpu_capability._arm_has_bf16(cpuinfo) is expected


def test_unreadable_cpuinfo_means_no_native_bf16(tmp_path):
    assert cpu_capability._arm_has_bf16(tmp_path / "missing") is False


@pytest.mark.skipif(native_bf16_matmul(), reason="this CPU multiplies bf16 natively")
def test_bf16_on_a_slow_cpu_warns_once_with_the_measured_factor(caplog):
    line = slow_bf16_warning("bf16", "cpu")
    assert line.startswith("--precision bf16 on a CPU without native bf16")
    assert "x slower than fp32 here; --precision fp32 runs faster" in line
    with caplog.at_level(logging.WARNING):
        warn_if_slow_precision("bf16", "cpu")
    assert [r.getMessage().split(" measured")[0] for r in caplog.records] == [
        line.split(" measured")[0]
    ]


def test_no_warning_for_fast_precisions():
    assert slow_bf16_warning("fp32", "cpu") is None
    assert slow_bf16_warning("bf16", "cuda") is None
