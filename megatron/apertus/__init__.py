"""Apertus on megatron-core: model, data, optimizer, distillation and training driver.

Layering: imports point down only, in the order ``LAYERS`` of ``tests/test_layering.py``
states and checks. ``cpu_compat`` is the one module that teaches megatron-core to run on CPU.

Importing this package hides megatron-core's import-time notices that Transformer Engine or
Apex is absent: megatron-core then uses its PyTorch fallbacks, which are this package's default
CPU path, so the notices say nothing a user can act on. Only those messages are matched, and
only from megatron-core; every subpackage imports this file before megatron-core. Likewise
torch's CUDA build on a machine without a GPU logs "No CUDA runtime is found" when megatron-core
imports ``torch.utils.cpp_extension``: CPU runs need no CUDA runtime, so that one line is hidden.
megatron-core 0.19 warns at import that its multimodal ``MimoModelConfig`` is experimental, a
model this package never builds.
"""

import logging
import warnings

__version__ = "0.1.0"

warnings.filterwarnings(
    "ignore",
    message=r"(Transformer Engine and Apex are|Apex is) not installed\. Falling back",
    category=UserWarning,
    module=r"megatron\.core\.",
)
warnings.filterwarnings(
    "ignore",
    message=r"MimoModelConfig is experimental",
    category=UserWarning,
    module=r"megatron\.core\.models\.mimo\.",
)


def _not_missing_cuda_runtime(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("No CUDA runtime is found")


logging.getLogger("torch.utils.cpp_extension").addFilter(_not_missing_cuda_runtime)
