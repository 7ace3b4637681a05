"""Apertus on megatron-core.

Our code lives in the ``megatron.apertus`` namespace subpackage; ``megatron`` itself is a
namespace shared with the installed ``megatron.core`` and must never get an ``__init__.py``.

Kernels: every ``csrc/<op>/`` directory builds
  * ``megatron.apertus.ops._<op>_cpu`` from ``csrc/<op>/*_cpu.cpp`` (always, OpenMP), and
  * ``megatron.apertus.ops._<op>_cuda`` from ``csrc/<op>/*.cu`` + ``*_cuda.cpp`` when torch is a
    CUDA build and nvcc is found (set ``APERTUS_SKIP_CUDA=1`` to skip), for the GPU architectures
    of ``TORCH_CUDA_ARCH_LIST`` (default ``9.0``, Hopper; ``"9.0;10.0"`` adds Blackwell B200/GB200,
    ``10.0a`` its arch-specific code, ``+PTX`` a JIT fallback), as torch's ``BuildExtension``
    reads it.
torch must be importable while building: install with ``pip install --no-build-isolation``.
"""

import os
import sys
from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).resolve().parent
MIN_TORCH = "2.6"
MCORE_REQUIREMENT = "megatron-core>=0.16.0,!=0.17.*,!=0.18.*,<0.20"
"""0.16.x and 0.19.x (megatron/apertus/mcore_compat.py holds their differences)."""


def _check_environment() -> None:
    """Refuse, in one line each, an installed torch or megatron-core outside our ranges.

    Inside these ranges pip keeps what the environment has (a cluster container's own builds);
    outside them pip would silently replace a site's torch or megatron-core with a PyPI wheel,
    so the build stops and says which package to change. Absent packages are simply installed.
    """
    from importlib import metadata

    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:  # no packaging to compare with: leave the choice to pip
        return
    wanted = {
        "torch": Requirement(f"torch>={MIN_TORCH}"),
        "megatron-core": Requirement(MCORE_REQUIREMENT),
    }
    problems = []
    for name, requirement in wanted.items():
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            problems.append(f"{name} {installed} (supported: {requirement.specifier})")
    if problems:
        sys.exit(
            "setup.py: this environment has " + "; ".join(problems) + ". Install a supported "
            "version first (docs/install.md), or set APERTUS_REPLACE_ENV=1 to let pip replace it."
        )


DEFAULT_CUDA_ARCHS = "9.0"
"""Without ``TORCH_CUDA_ARCH_LIST`` torch would build for the GPU of the build machine (or, with
none, every architecture it knows): name Hopper instead, the GPUs the kernels are tuned for."""


def _extensions() -> tuple[list, dict]:
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        print(
            "setup.py: torch is not importable; building no kernels (the PyTorch references "
            "still work). Install torch first and use --no-build-isolation.",
            file=sys.stderr,
        )
        return [], {}
    # torch guesses CUDA_HOME from the first nvcc on PATH (a wrapper script in /usr/local/bin
    # gives /usr/local): a toolkit is a directory with nvcc and the CUDA runtime headers.
    toolkit = Path(CUDA_HOME or "/nonexistent")
    has_toolkit = (toolkit / "bin" / "nvcc").is_file() and (
        toolkit / "include" / "cuda_runtime_api.h"
    ).is_file()
    want_cuda = torch.version.cuda is not None and has_toolkit
    want_cuda = want_cuda and os.environ.get("APERTUS_SKIP_CUDA") != "1"
    if not want_cuda:
        print(
            f"setup.py: building the CPU kernels only (torch {torch.__version__}, CUDA_HOME="
            f"{CUDA_HOME}: {'a' if has_toolkit else 'no'} CUDA toolkit); to build the CUDA "
            f"kernels set CUDA_HOME to a toolkit matching torch's CUDA {torch.version.cuda}.",
            file=sys.stderr,
        )
    if want_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        print(
            f"setup.py: CUDA kernels for {os.environ['TORCH_CUDA_ARCH_LIST']} "
            "(TORCH_CUDA_ARCH_LIST)",
            file=sys.stderr,
        )
    cxx = ["-O3", "-fopenmp", "-std=c++17"]
    extensions = []
    only = set(filter(None, os.environ.get("APERTUS_OPS", "").split(",")))  # e.g. "xielu"
    for op_dir in sorted(p for p in (ROOT / "csrc").glob("*") if p.is_dir()):
        op = op_dir.name
        if only and op not in only:
            continue
        rel = lambda paths: [str(p.relative_to(ROOT)) for p in sorted(paths)]  # noqa: E731
        headers = rel(list(op_dir.glob("*.h")) + list(op_dir.glob("*.cuh")))  # rebuild on edits
        cpu_sources = rel(op_dir.glob("*_cpu.cpp"))
        if cpu_sources:
            extensions.append(
                CppExtension(
                    f"megatron.apertus.ops._{op}_cpu",
                    cpu_sources,
                    depends=headers,
                    extra_compile_args=cxx,
                    extra_link_args=["-fopenmp"],
                )
            )
        cuda_sources = rel(op_dir.glob("*.cu")) + rel(op_dir.glob("*_cuda.cpp"))
        if want_cuda and cuda_sources:
            extensions.append(
                CUDAExtension(
                    f"megatron.apertus.ops._{op}_cuda",
                    cuda_sources,
                    depends=headers,
                    extra_compile_args={
                        "cxx": ["-O3", "-std=c++17"],
                        "nvcc": ["-O3", "-std=c++17", "--use_fast_math"],
                    },
                )
            )
    return extensions, {"build_ext": BuildExtension.with_options(use_ninja=False)}


if os.environ.get("APERTUS_REPLACE_ENV") != "1":
    _check_environment()
ext_modules, cmdclass = _extensions()

setup(
    name="megatron-apertus",
    version="0.1.0",
    description="Apertus pretraining and sparse-logit distillation on megatron-core",
    packages=find_namespace_packages(include=["megatron.apertus", "megatron.apertus.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.10",
    install_requires=[
        # Two tested lines (docs/install.md): megatron-core 0.16.x (Python 3.11; the newest
        # release for it) and 0.19.x (Python >= 3.12), each with torch 2.13.0. pip keeps an
        # environment's copies inside these ranges; _check_environment refuses others.
        f"torch>={MIN_TORCH}",
        MCORE_REQUIREMENT,
        "huggingface_hub",  # --tokenizer-model ORG/NAME from the local cache
        "numpy",
        "packaging",
        "psutil",  # megatron-core's dist_checkpointing needs it but does not declare it
        "pybind11",
        "sentencepiece",
        "safetensors",
        "tokenizers",
        "transformers>=4.56",  # ApertusForCausalLM
        "mistral-common",  # ships the 131072-token tekken tokenizer used offline
        "tensorboard",
        "tqdm",
        "einops",
        "zstandard",  # .zst inputs of tools/preprocess_data.py
        "datatrove",  # tools/tokenize_corpus.py: local and Slurm executors, completion markers
        "pyarrow",  # Parquet inputs of tools/tokenize_corpus.py
        "matplotlib",  # the loss plot
        "compressed-tensors>=0.20",  # tools/checkpoint/export_quantized_hf.py
    ],
    extras_require={
        "wandb": ["wandb"],
        "test": [
            "pytest",
            "pytest-timeout",
            "pytest-xdist",  # make test: two workers share the CPU's cores
            "black==26.10.1",  # .ci/run checks the formatting: one black, one layout
            "isort==9.0.2",  # and the order of the imports
            "lm-eval[hf]",
            "nltk",
        ],  # nltk: --split-sentences
    },
)
