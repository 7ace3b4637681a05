"""Optimizers and learning-rate schedules on megatron-core (docs/ademamix_wsd.md).

``ademamix`` holds the update (torch only); ``builder`` wraps it in megatron-core's optimizer
stack; ``schedule`` is megatron-core's ``OptimizerParamScheduler`` configured for WSD.
"""

from megatron.apertus.optim.ademamix import AdEMAMix, StepScalars, ademamix_reference_step
from megatron.apertus.optim.builder import AdEMAMixSettings, get_apertus_optimizer
from megatron.apertus.optim.schedule import ParamScheduler, ScheduleConfig, build_scheduler

__all__ = [
    "AdEMAMix",
    "AdEMAMixSettings",
    "ParamScheduler",
    "ScheduleConfig",
    "StepScalars",
    "ademamix_reference_step",
    "build_scheduler",
    "get_apertus_optimizer",
]
