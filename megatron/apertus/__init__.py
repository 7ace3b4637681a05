"""Apertus on megatron-core: model, data, optimizer, distillation and training driver.

Layering (arrows point down only): tools and entry scripts -> training -> model, data,
optim, distill -> ops. ``cpu_compat`` is the one module that teaches megatron-core to run
on CPU.
"""

__version__ = "0.1.0"
