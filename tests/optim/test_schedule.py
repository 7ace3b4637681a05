"""The schedule (megatron-core's scheduler as configured by ScheduleConfig): WSD values at the key
steps of each cooldown shape, iteration/sample equivalence, a batch-size ramp-up, resume, the
weight decay's rise (--weight-decay-incr-style) and --lr-warmup-fraction.

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


WD_RISE = {
    "linear": lambda r: r,
    "cosine": lambda r: 0.5 * (math.cos(math.pi * (1 - r)) + 1),
}
"""Megatron-LM's --weight-decay-incr-style: the share of the rise done at run fraction r."""


@pytest.mark.parametrize("style", sorted(WD_RISE))
def test_weight_decay_rises_over_the_run_not_the_lr_decay(style):
    """From --start-weight-decay to --end-weight-decay over the run's 400 samples, although the
    lr decays over 50 iterations; groups without decay stay at 0."""
    schedule = dict(
        lr_decay_style="linear",
        lr_decay_iters=50,
        weight_decay_incr_style=style,
        start_weight_decay=0.02,
        end_weight_decay=0.3,
    )
    for samples in (0, 40, 100, 200, 300, 399, 400, 480):
        scheduler = _scheduler(schedule)
        _lr_at(scheduler, samples)
        expected = 0.02 + 0.28 * WD_RISE[style](min(samples, 400) / 400)
        decayed, undecayed = (g["weight_decay"] for g in scheduler.optimizer.param_groups)
        assert decayed == pytest.approx(expected, rel=1e-12) and undecayed == 0.0


def test_constant_weight_decay_is_weight_decay():
    scheduler = _scheduler(dict(ITER_SCHEDULE, weight_decay_incr_style="constant"))
    assert (scheduler.start_wd, scheduler.end_wd, scheduler.wd_incr_style) == (WD, WD, "constant")
    _lr_at(scheduler, 200)
    assert scheduler.optimizer.param_groups[0]["weight_decay"] == WD


@pytest.mark.parametrize(
    "fraction, warmup",
    [(0.1, dict(lr_warmup_iters=10)), (0.25, dict(lr_warmup_samples=100)), (0.0, {})],
)
def test_warmup_fraction_is_the_same_schedule_as_its_length(fraction, warmup):
    """--lr-warmup-fraction F warms up over F of the schedule's 400 samples: the same lr at
    every step as the equivalent --lr-warmup-iters/-samples (0: no warmup)."""
    base = dict(lr_decay_style="cosine")
    by_fraction = _scheduler(dict(base, lr_warmup_fraction=fraction))
    by_length = _scheduler(dict(base, **warmup))
    assert by_fraction.lr_warmup_steps == by_length.lr_warmup_steps
    for _ in range(ITERS + 2):
        assert _lr_at(by_fraction, GBS) == _lr_at(by_length, GBS)


def test_warmup_fraction_is_of_the_lr_decay_length():
    """Megatron-LM: the fraction of --lr-decay-iters (here 50 iterations, 200 samples), not of
    the run; sample-based runs likewise."""
    by_iters = _scheduler(dict(lr_decay_iters=50, lr_warmup_fraction=0.2))
    by_samples = _scheduler(
        dict(lr_decay_samples=200, lr_warmup_fraction=0.2), train_samples=ITERS * GBS
    )
    assert by_iters.lr_warmup_steps == by_samples.lr_warmup_steps == pytest.approx(40)
    assert _lr_at(by_iters, 20) == pytest.approx(MAX_LR / 2)


@pytest.mark.parametrize(
    "schedule, message",
    [
        (
            dict(lr_warmup_fraction=0.1, lr_warmup_iters=2),
            "--lr-warmup-fraction or --lr-warmup-iters",
        ),
        (
            dict(lr_warmup_fraction=0.1, lr_warmup_samples=8),
            "--lr-warmup-fraction or --lr-warmup-samples",
        ),
        (dict(lr_warmup_fraction=1.0), r"--lr-warmup-fraction must be in \[0, 1\)"),
        (dict(start_weight_decay=0.1), "--start-weight-decay needs --weight-decay-incr-style"),
        (dict(end_weight_decay=0.1), "--end-weight-decay needs --weight-decay-incr-style"),
        (
            dict(weight_decay_incr_style="linear", start_weight_decay=0.1),
            "linear needs --start-weight-decay and --end-weight-decay",
        ),
        (
            dict(weight_decay_incr_style="cosine", start_weight_decay=0.2, end_weight_decay=0.1),
            "--end-weight-decay must be >= --start-weight-decay 0.2",
        ),
        (
            dict(weight_decay_incr_style="linear", start_weight_decay=-0.1, end_weight_decay=0.1),
            "--start-weight-decay must be >= 0",
        ),
    ],
)
def test_invalid_warmup_and_weight_decay_settings_are_refused(schedule, message):
    with pytest.raises(ValueError, match=message):
        ScheduleConfig(**schedule)


def test_weight_decay_schedule_resumes_and_a_changed_one_is_refused():
    """The rise continues from the checkpoint's step; another end is refused unless
    overridden; a constant weight decay resumes whatever length it was saved with."""
    rising = dict(weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.4)
    original = _scheduler(rising)
    _lr_at(original, 100)
    resumed = _scheduler(rising)
    resumed.load_state_dict(original.state_dict())
    assert resumed.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.1)
    with pytest.raises(AssertionError, match="end weight decay"):
        _scheduler(dict(rising, end_weight_decay=0.5)).load_state_dict(original.state_dict())
    constant = _scheduler({})
    state = {**constant.state_dict(), "wd_incr_steps": 123}
    again = _scheduler({})
    again.load_state_dict(state)
    assert again.wd_incr_steps == ITERS * GBS
