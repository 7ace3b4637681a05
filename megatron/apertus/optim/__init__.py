"""Optimizers and learning-rate schedules on megatron-core (docs/ademamix_wsd.md).

``ademamix`` holds the update (torch only); ``builder`` holds the optimizer's flags and wraps
the update in megatron-core's optimizer stack; ``schedule`` holds the schedule's flags and ``param_scheduler`` megatron-core's
``OptimizerParamScheduler`` configured for WSD. Each name loads its module on first use: the
flags' dataclasses serve ``--help``, which must not import torch or megatron-core.
"""

import importlib

_MODULES = {
    "AdEMAMix": "ademamix",
    "StepScalars": "ademamix",
    "ademamix_reference_step": "ademamix",
    "AdEMAMixSettings": "builder",
    "OptimizerSettings": "builder",
    "get_apertus_optimizer": "builder",
    "ScheduleConfig": "schedule",
    "ParamScheduler": "param_scheduler",
    "build_scheduler": "param_scheduler",
}

__all__ = sorted(_MODULES)


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
