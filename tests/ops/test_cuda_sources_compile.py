"""Every ``csrc/**/*.cu`` compiles with nvcc against torch's headers (compile only, sm_90), so the
CUDA kernels cannot rot on machines without a GPU. Skipped, with the reason, when nvcc is absent.

The flags are the ones setup.py's CUDAExtension build uses (torch's defines included); only the
code generation is narrowed to one target (sm_90, the H100) to keep the check fast.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils import cpp_extension

REPO = Path(__file__).resolve().parents[2]
CUDA_SOURCES = sorted((REPO / "csrc").glob("**/*.cu"))
NVCC = shutil.which("nvcc") or (
    str(Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc") if cpp_extension.CUDA_HOME else None
)


def nvcc_command(source: Path, output: Path) -> list[str]:
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    return [NVCC, "-std=c++17", "-O3", "--use_fast_math", *cpp_extension.COMMON_NVCC_FLAGS,
            "-gencode", "arch=compute_90,code=sm_90", *(f"-I{path}" for path in includes),
            "-c", str(source), "-o", str(output)]  # fmt: skip


def test_there_are_cuda_sources():
    assert CUDA_SOURCES, "no csrc/**/*.cu found: the glob or the layout changed"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (neither on PATH nor in CUDA_HOME)")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_cuda_source_compiles(source, tmp_path):
    proc = subprocess.run(nvcc_command(source, tmp_path / f"{source.stem}.o"),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"nvcc failed on {source}:\n{proc.stderr[-6000:]}"
