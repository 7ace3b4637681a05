"""Apertus on megatron-core: model, data, optimizer, distillation and training driver.

Layering (arrows point down only; ``tests/test_layering.py`` holds the order and checks it):
tools and entry scripts -> convert, launch -> training -> data, distill, optim, parallel ->
model -> cpu_compat -> ops. ``cpu_compat`` is the one module that teaches megatron-core to run
on CPU.
"""

__version__ = "0.1.0"
