"""Apertus on megatron-core.

Our code lives in the ``megatron.apertus`` namespace subpackage; ``megatron`` itself is a
namespace shared with the installed ``megatron.core`` and must never get an ``__init__.py``.
"""

from setuptools import find_namespace_packages, setup

setup(
    name="megatron-apertus",
    version="0.1.0",
    description="Apertus pretraining and sparse-logit distillation on megatron-core",
    packages=find_namespace_packages(include=["megatron.apertus", "megatron.apertus.*"]),
    python_requires=">=3.10",
    install_requires=[
        # Tested with torch 2.13.0 and megatron-core 0.16.1 (the newest for Python 3.11).
        "torch>=2.6",
        "megatron-core>=0.16.0,<0.17",
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
    ],
    extras_require={
        "wandb": ["wandb"],
        "test": ["pytest", "pytest-timeout"],
    },
)
