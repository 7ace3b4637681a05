"""The WSD schedule (megatron-core's scheduler as configured by ScheduleConfig): values at the key
steps of each cooldown shape, iteration/sample equivalence, a batch-size ramp-up, and resume.

The run: global batch 4, 100 iterations (400 samples), warmup 10 iterations (40 samples),
cooldown the last 20 iterations (80 samples, from sample 320). Values are exact formulas.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from megatron.core.optimizer import OptimizerConfig

from megatron.apertus.optim import ScheduleConfig, build_scheduler

MAX_LR, MIN_LR, WD = 1e-3, 1e-5, 0.1
GBS, ITERS = 4, 100
ITER_SCHEDULE = dict(lr_decay_style="WSD", lr_warmup_iters=10, lr_wsd_decay_iters=20)
SAMPLE_SCHEDULE = dict(lr_decay_style="WSD", lr_warmup_samples=40, lr_wsd_decay_samples=80)
COOLDOWN = {
    "1-sqrt": lambda r: 1 - math.sqrt(r),
    "linear": lambda r: 1 - r,
    "cosine": lambda r: 0.5 * (1 + math.cos(math.pi * r)),
    "exponential": lambda r: 2 * 0.5**r - 1,
}


def _optimizer() -> SimpleNamespace:
    """What the scheduler touches: param groups, one decayed and one not (megatron-core's keys)."""
    return SimpleNamespace(param_groups=[{"wd_mult": 1.0}, {"wd_mult": 0.0}])


def _scheduler(schedule: dict, *, train_iters=ITERS, train_samples=None, optimizer=None, **config):
    return build_scheduler(
        optimizer or _optimizer(),
        ScheduleConfig(**schedule, **config),
        OptimizerConfig(lr=MAX_LR, min_lr=MIN_LR, weight_decay=WD),
        global_batch_size=GBS,
        train_iters=None if train_samples else train_iters,
        train_samples=train_samples,
    )


def _lr_at(scheduler, samples: int) -> float:
    """The lr after ``samples`` more samples (advance in one call: the schedule is a function
    of the consumed samples only)."""
    scheduler.step(increment=samples)
    return scheduler.optimizer.param_groups[0]["lr"]


def _expected(samples: int, shape: str) -> float:
    if samples <= 40:
        return MAX_LR * samples / 40
    if samples <= 320:
        return MAX_LR
    if samples >= 400:
        return MIN_LR
    return MIN_LR + (MAX_LR - MIN_LR) * COOLDOWN[shape]((samples - 320) / 80)


@pytest.mark.parametrize("shape", sorted(COOLDOWN))
def test_values_at_key_steps(shape):
    for samples in (0, 20, 40, 41, 200, 320, 340, 360, 380, 399, 400, 480):
        scheduler = _scheduler(ITER_SCHEDULE, lr_wsd_decay_style=shape)
        assert _lr_at(scheduler, samples) == pytest.approx(_expected(samples, shape), rel=1e-12)


def test_default_cooldown_is_one_minus_sqrt():
    scheduler = _scheduler(ITER_SCHEDULE)
    assert scheduler.lr_wsd_decay_style == "minus_sqrt"
    # A quarter into the cooldown 1 - sqrt(1/4) = 1/2 of the range is left.
    assert _lr_at(scheduler, 340) == pytest.approx(MIN_LR + 0.5 * (MAX_LR - MIN_LR), rel=1e-12)


def test_weight_decay_follows_wd_mult():
    optimizer = _optimizer()
    _scheduler(ITER_SCHEDULE, optimizer=optimizer)  # sets step-0 values at construction
    assert [g["weight_decay"] for g in optimizer.param_groups] == [WD, 0.0]


def test_iteration_and_sample_settings_are_the_same_schedule():
    by_iters = _scheduler(ITER_SCHEDULE)
    by_samples = _scheduler(SAMPLE_SCHEDULE, train_samples=ITERS * GBS)
    for _ in range(ITERS + 5):
        assert _lr_at(by_iters, GBS) == _lr_at(by_samples, GBS)


def test_batch_size_ramp_up_follows_consumed_samples():
    """Growing batches (1, 2, 3, 4 samples per step) walk the same curve by samples consumed."""
    ramped = _scheduler(SAMPLE_SCHEDULE, train_samples=ITERS * GBS)
    consumed = 0
    for increment in [1] * 10 + [2] * 10 + [3] * 10 + [4] * 100:
        consumed += increment
        assert _lr_at(ramped, increment) == pytest.approx(_expected(consumed, "1-sqrt"), rel=1e-12)


def test_state_round_trip_continues_identically():
    original = _scheduler(ITER_SCHEDULE, lr_wsd_decay_style="cosine")
    _lr_at(original, 330)
    state = original.state_dict()
    assert state["wsd_decay_steps"] == 80 and state["lr_wsd_decay_style"] == "cosine"
    resumed = _scheduler(ITER_SCHEDULE, lr_wsd_decay_style="cosine")
    resumed.load_state_dict(state)
    assert resumed.num_steps == 330
    for _ in range(30):
        assert _lr_at(resumed, GBS) == _lr_at(original, GBS)


def test_override_takes_the_new_schedule_and_keeps_the_step():
    """--override-opt_param-scheduler: a longer cooldown decided at resume time applies."""
    original = _scheduler(ITER_SCHEDULE)
    _lr_at(original, 300)
    longer = dict(ITER_SCHEDULE, lr_wsd_decay_iters=40)  # cooldown from sample 240
    resumed = _scheduler(longer, override_opt_param_scheduler=True)
    resumed.load_state_dict(original.state_dict())
    assert resumed.num_steps == 300 and resumed.wsd_decay_steps == 160
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(
        MIN_LR + (MAX_LR - MIN_LR) * (1 - math.sqrt(60 / 160)), rel=1e-12
    )


def test_checkpoint_schedule_wins_when_asked_and_mismatch_fails_otherwise():
    original = _scheduler(ITER_SCHEDULE)
    _lr_at(original, 300)
    longer = dict(ITER_SCHEDULE, lr_wsd_decay_iters=40)
    from_checkpoint = _scheduler(longer, use_checkpoint_opt_param_scheduler=True)
    from_checkpoint.load_state_dict(original.state_dict())
    assert from_checkpoint.wsd_decay_steps == 80
    assert _lr_at(from_checkpoint, 40) == pytest.approx(_expected(340, "1-sqrt"), rel=1e-12)
    with pytest.raises(AssertionError, match="WSD decay steps"):
        _scheduler(longer).load_state_dict(original.state_dict())


def test_wsd_without_cooldown_keeps_the_peak_to_the_end():
    """``--lr-wsd-decay-iters 0`` (the Apertus long-context stages): Megatron-LM's WSD with no
    cooldown, the linear warmup then the peak lr up to the last step."""
    scheduler = _scheduler(dict(lr_decay_style="WSD", lr_warmup_iters=10, lr_wsd_decay_iters=0))
    assert _lr_at(scheduler, 20) == pytest.approx(MAX_LR / 2)
    assert _lr_at(scheduler, 20) == MAX_LR
    assert _lr_at(scheduler, 360) == MAX_LR  # sample 400, the end of the run


@pytest.mark.parametrize(
    "schedule, message",
    [
        (dict(lr_decay_style="WSD"), "needs --lr-wsd-decay-iters"),
        (dict(lr_decay_style="step"), "--lr-decay-style must be"),
        (dict(lr_wsd_decay_style="sqrt"), "--lr-wsd-decay-style must be"),
        (dict(lr_warmup_iters=1, lr_warmup_samples=4), "not both"),
        (
            dict(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True),
            "not both",
        ),
    ],
)
def test_invalid_configs_are_refused(schedule, message):
    with pytest.raises(ValueError, match=message):
        ScheduleConfig(**schedule)


def test_lengths_must_fit_the_run():
    with pytest.raises(ValueError, match="shorter than the schedule"):
        _scheduler(dict(lr_warmup_iters=ITERS))
    with pytest.raises(ValueError, match="exceed the schedule"):
        _scheduler(dict(ITER_SCHEDULE, lr_wsd_decay_iters=95))
