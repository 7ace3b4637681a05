"""Every ``csrc/**/*.cu`` compiles with nvcc against torch's headers (compile only) for Hopper and
Blackwell, so the CUDA kernels cannot rot on machines without a GPU. Skipped, with the reason,
when nvcc is absent.

The flags are the ones setup.py's CUDAExtension build uses (torch's defines included), with the
code generation torch's ``BuildExtension`` derives from ``TORCH_CUDA_ARCH_LIST="9.0;10.0"`` (H100 /
H200 and B200 / GB200); the object's fat binary must hold a cubin for each.
"""

from __future__ import annotations

import os
import runpy
import shutil
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

REPO = Path(__file__).resolve().parents[2]
CUDA_SOURCES = sorted((REPO / "csrc").glob("**/*.cu"))
NVCC = shutil.which("nvcc") or (
    str(Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc") if cpp_extension.CUDA_HOME else None
)


ARCHS = "9.0;10.0"
FATBIN_MAGIC = 0xBA55ED50


def arch_flags(arch_list: str) -> list[str]:
    """The ``-gencode`` flags torch's extension build adds for ``TORCH_CUDA_ARCH_LIST``."""
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    try:
        return cpp_extension._get_cuda_arch_flags()
    finally:
        if saved is None:
            del os.environ["TORCH_CUDA_ARCH_LIST"]
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved


def nvcc_command(source: Path, output: Path) -> list[str]:
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    return [
        NVCC,
        "-std=c++17",
        "-O3",
        "--use_fast_math",
        *cpp_extension.COMMON_NVCC_FLAGS,
        *arch_flags(ARCHS),
        *(f"-I{path}" for path in includes),
        "-c",
        str(source),
        "-o",
        str(output),
    ]


def cubin_archs(obj: Path) -> set[int]:
    """SM numbers of the ELF cubins in an object's ``.nv_fatbin`` section. Fat binary layout:
    containers (u32 magic, u16 version, u16 header size, u64 size of the entries), each entry
    (u16 kind: 2 = cubin, u16 version, u32 header size, u64 payload size, ..., u32 arch at 28)."""
    section = obj.with_suffix(".fatbin")
    subprocess.run(
        ["objcopy", "-O", "binary", "--only-section=.nv_fatbin", str(obj), str(section)], check=True
    )
    data, pos, archs = section.read_bytes(), 0, set()
    while pos + 16 <= len(data):
        magic, _, header, size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8
            continue
        entry, end = pos + header, pos + header + size
        while entry < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            if kind == 2:
                archs.add(struct.unpack_from("<I", data, entry + 28)[0])
            entry += entry_header + payload
        pos = (end + 7) // 8 * 8
    return archs


def test_arch_list_gives_hopper_and_blackwell_targets():
    assert arch_flags(ARCHS) == [
        "-gencode=arch=compute_100,code=sm_100",
        "-gencode=arch=compute_90,code=sm_90",
    ]


def test_there_are_cuda_sources():
    assert CUDA_SOURCES, "no csrc/**/*.cu found: the glob or the layout changed"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (neither on PATH nor in CUDA_HOME)")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_cuda_source_compiles(source, tmp_path):
    obj = tmp_path / f"{source.stem}.o"
    proc = subprocess.run(nvcc_command(source, obj), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"nvcc failed on {source}:\n{proc.stderr[-6000:]}"
    assert cubin_archs(obj) == {90, 100}


def test_setup_leaves_the_targets_to_the_arch_list(monkeypatch):
    """setup.py names no target of its own: torch's build takes ``TORCH_CUDA_ARCH_LIST``, which
    setup.py sets to Hopper (9.0) only when the user has not."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # as if torch were a CUDA build
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(sys, "argv", ["setup.py", "--name"])
    for user_choice, expected in ((None, "9.0"), ("9.0;10.0", "9.0;10.0")):
        if user_choice is None:
            monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
        else:
            monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", user_choice)
        cuda = [
            e
            for e in runpy.run_path(str(REPO / "setup.py"))["ext_modules"]
            if e.name.endswith("_cuda")
        ]
        assert cuda
        for extension in cuda:
            nvcc = extension.extra_compile_args["nvcc"]
            assert not [flag for flag in nvcc if "gencode" in flag or flag.startswith("-arch")]
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == expected
