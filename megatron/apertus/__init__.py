"""Apertus on megatron-core: model, data, optimizer, distillation and training driver.

Layering (arrows point down only; ``tests/test_layering.py`` holds the order and checks it):
tools and entry scripts -> convert, launch -> training -> data, distill, optim, parallel ->
model -> cpu_compat -> ops, cli. ``cpu_compat`` is the one module that teaches megatron-core to
run on CPU; ``cli`` (standard library only) gives every entry point its one-line errors.

Importing this package hides megatron-core's import-time notices that Transformer Engine or
Apex is absent: megatron-core then uses its PyTorch fallbacks, which are this package's default
CPU path, so the notices say nothing a user can act on. Only those messages are matched, and
only from megatron-core; every subpackage imports this file before megatron-core.
"""

import warnings

__version__ = "0.1.0"

warnings.filterwarnings(
    "ignore",
    message=r"(Transformer Engine and Apex are|Apex is) not installed\. Falling back",
    category=UserWarning,
    module=r"megatron\.core\.",
)
