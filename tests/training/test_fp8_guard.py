"""``--fp8-guard``: its decisions on given figures, and in real tiny runs on the CPU where one
hidden channel of one layer's fc2 input is made an outlier from a chosen step on."""

from __future__ import annotations

import contextlib
import json
import logging
import math
from typing import Iterator

import pytest
import torch
from megatron.core import dist_checkpointing

import pretrain_gpt
from megatron.apertus import checkpoint
from megatron.apertus.checkpoint_files import NON_PERSISTENT_DIR
from megatron.apertus.training import step as step_module
from megatron.apertus.training.fp8_guard import (
    DECISIONS_FILE,
    Fp8Guard,
    Fp8GuardConfig,
    GuardedRun,
    decisions_at,
)
from megatron.apertus.training.loop import TrainingStopped, train
from megatron.apertus.training.metrics import Metrics
from megatron.apertus.training.step import StepResult
from tests.conftest import PRETRAIN, SMALL_VOCABULARY, after_backward, read_json, run_script, series

# -- the decisions ---------------------------------------------------------------------------


def guard(**thresholds) -> Fp8Guard:
    return Fp8Guard(Fp8GuardConfig(fp8_guard=True, **thresholds))


def feed(g: Fp8Guard, iteration: int, **figures):
    figures = {"loss": 2.0, "grad_norm": 1.0, "skipped": False, **figures}
    return g.observe(iteration, **figures)


def test_kurtosis_alarms_after_the_given_consecutive_measurements():
    g = guard(fp8_guard_kurtosis=100.0, fp8_guard_intervals=3)
    high = {"layer002/fc2/kurtosis": 250.0, "layer001/fc2/kurtosis": 20.0}
    assert feed(g, 10, gemm_inputs=high) == []
    assert feed(g, 11) == [], "a step without measurement neither counts nor resets"
    assert feed(g, 20, gemm_inputs=high) == []
    (alarm,) = feed(g, 30, gemm_inputs=high)
    assert (alarm.layer, alarm.gemm, alarm.figure) == ("layer002", "fc2", "kurtosis")
    assert (alarm.value, alarm.threshold, alarm.iteration) == (250.0, 100.0, 30)
    assert alarm.name == "fp8_guard/layer002/fc2/kurtosis"
    assert "layer002 fc2 kurtosis 250 > 100" in alarm.describe()


def test_a_measurement_below_the_bound_starts_the_count_over():
    g = guard(fp8_guard_kurtosis=100.0, fp8_guard_intervals=2)
    key = "layer003/qkv/kurtosis"
    assert feed(g, 1, gemm_inputs={key: 150.0}) == []
    assert feed(g, 2, gemm_inputs={key: 50.0}) == []
    assert feed(g, 3, gemm_inputs={key: 150.0}) == []
    assert len(feed(g, 4, gemm_inputs={key: 150.0})) == 1


def test_underflow_overflow_and_nan_statistics():
    g = guard(fp8_guard_underflow=0.001, fp8_guard_overflow=1e-4, fp8_guard_intervals=1)
    alarms = feed(
        g,
        5,
        gemm_inputs={
            "layer001/fc2/underflow": 0.0014,
            "layer001/fc1/underflow": 0.0004,
            "layer001/proj/overflow": 2e-4,
            "layer001/qkv/kurtosis": math.nan,
            "layer001/qkv/mean": 1e9,  # not watched
        },
    )
    assert sorted(a.name for a in alarms) == [
        "fp8_guard/layer001/fc2/underflow",
        "fp8_guard/layer001/proj/overflow",
        "fp8_guard/layer001/qkv/kurtosis",
    ]


def test_a_bound_of_zero_is_off():
    g = guard(fp8_guard_kurtosis=0.0, fp8_guard_intervals=1)
    assert feed(g, 1, gemm_inputs={"layer001/fc2/kurtosis": 1e6}) == []


def test_loss_and_grad_norm_spikes_after_the_window():
    g = guard(fp8_guard_window=20, fp8_guard_loss_z=6.0, fp8_guard_grad_norm_z=6.0)
    for i in range(1, 40):  # a slowly falling, slightly noisy loss raises nothing
        figures = dict(loss=3.0 - 0.01 * i + 0.02 * (-1) ** i, grad_norm=1.0 + 0.05 * (i % 3))
        assert feed(g, i, **figures) == []
    alarms = feed(g, 40, loss=5.0, grad_norm=30.0)
    assert [a.figure for a in alarms] == ["loss_spike", "grad_norm_spike"]
    assert alarms[0].value == 5.0 and 2.7 < alarms[0].threshold < 3.5


def test_no_spike_alarm_before_the_window_is_full():
    g = guard(fp8_guard_window=20)
    for i in range(1, 10):
        feed(g, i, loss=3.0)
    assert feed(g, 10, loss=300.0, grad_norm=1e6) == []


def test_skipped_steps_alarm_at_the_given_count_in_a_row():
    g = guard(fp8_guard_skipped=2)
    assert feed(g, 1, loss=math.nan, grad_norm=math.nan, skipped=True) == []
    (alarm,) = feed(g, 2, loss=math.nan, grad_norm=math.nan, skipped=True)
    assert alarm.figure == "skipped_steps" and alarm.value == 2
    assert feed(g, 3) == []
    assert feed(g, 4, skipped=True) == [], "the count starts over after a good step"


def test_state_round_trip_keeps_counts_moments_and_alarms():
    cfg = Fp8GuardConfig(fp8_guard=True, fp8_guard_kurtosis=100.0, fp8_guard_intervals=2)
    g = Fp8Guard(cfg)
    for i in range(1, 6):
        feed(g, i, loss=3.0 + 0.1 * i)
    feed(g, 6, gemm_inputs={"layer001/fc2/kurtosis": 300.0})
    g.stopped_at = 6
    resumed = Fp8Guard(cfg, state=g.state())
    assert resumed.state() == g.state()
    # the resumed guard goes on counting: one more measurement above the bound is the second
    (alarm,) = feed(resumed, 8, gemm_inputs={"layer001/fc2/kurtosis": 300.0})
    assert alarm.detail == "2 measurement(s) in a row"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fp8-guard-kurtosis", "-1"], "--fp8-guard-kurtosis must be >= 0, got -1.0"),
        (["--fp8-guard-underflow", "1.5"], "--fp8-guard-underflow is a share: it must be < 1"),
        (["--fp8-guard-intervals", "0"], "--fp8-guard-intervals must be >= 1, got 0"),
        (["--fp8-guard-window", "1"], "--fp8-guard-window must be >= 2, got 1"),
        (["--fp8-guard-loss-z", "nan"], "--fp8-guard-loss-z must be >= 0, got nan"),
        (["--fp8-guard-action", "panic"], "--fp8-guard-action must be one of warn, stop"),
        (["--fp8-guard-action", "bf16-layers"], "bf16-layers goes back to the last checkpoint "),
        (["--fp8-guard-action", "bf16"], "--fp8-guard-action bf16 goes back to the last "),
        (["--bf16-layers", "5"], "--bf16-layers 5 is not a layer of this model: layers are "),
        (["--bf16-layers", "2", "0"], "--bf16-layers 0 is not a layer of this model"),
    ],
)
def test_bad_thresholds_are_refused_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        pretrain_gpt.parse_args(
            ["--model-preset", "tiny", "--train-iters", "2", "--fp8-guard", *flags]
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_bad_threshold_exits_2_from_the_command_line():
    proc = run_script(PRETRAIN, ["--train-iters", "2", "--fp8-guard-intervals", "0"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --fp8-guard-intervals must be >= 1, got 0 "
        "(see pretrain_gpt.py --help)"
    ]


# -- switching layers out of FP8 ----------------------------------------------------------------


def guarded(action: str, tmp_path, **thresholds) -> GuardedRun:
    cfg = Fp8GuardConfig(fp8_guard=True, fp8_guard_action=action, **thresholds)
    metrics = Metrics(tensorboard_dir=None, wandb_project=None, wandb_exp_name=None, config={})
    return GuardedRun(cfg, reporting=True, metrics=metrics, save_dir=str(tmp_path), num_layers=4)


def step(loss: float = 2.0) -> StepResult:
    return StepResult(loss=loss, num_tokens=512, grad_norm=1.0, skipped=False)


def test_bf16_layers_names_the_alarmed_layers_and_bf16_every_layer(tmp_path):
    high = {"layer002/fc2/kurtosis": 181.0, "layer003/qkv/kurtosis": 12.0}
    run = guarded("bf16-layers", tmp_path, fp8_guard_kurtosis=60.0, fp8_guard_intervals=1)
    switch = run.after_step(4, step(), high)
    assert (switch.action, switch.layers, switch.iteration) == ("bf16-layers", (2,), 4)
    assert "layer002 fc2 kurtosis 181 > 60" in switch.why and switch.resumed_from is None
    run = guarded("bf16", tmp_path, fp8_guard_kurtosis=60.0, fp8_guard_intervals=1)
    assert run.after_step(4, step(), high).layers == (1, 2, 3, 4)


def test_a_spike_switches_the_layers_above_their_bounds_else_every_layer(tmp_path):
    run = guarded("bf16-layers", tmp_path, fp8_guard_kurtosis=60.0, fp8_guard_intervals=3)
    run.guard.exempt_layers([4])
    for i in range(1, 101):
        assert run.after_step(i, step(2.0 + 0.01 * (-1) ** i), None) is None
    assert run.after_step(101, step(2.0), {"layer003/fc1/kurtosis": 90.0}) is None  # 1 of 3
    switch = run.after_step(102, step(50.0), None)
    assert switch.layers == (3,) and "loss_spike" in switch.why
    run.guard.above = {}
    assert run.after_step(103, step(500.0), None).layers == (1, 2, 3), "all but the bf16 one"


def test_layers_in_bf16_raise_no_gemm_alarm_and_a_commit_is_kept(tmp_path):
    run = guarded("bf16-layers", tmp_path, fp8_guard_kurtosis=60.0, fp8_guard_intervals=1)
    switch = run.after_step(4, step(), {"layer002/fc2/kurtosis": 181.0})
    taken = run.commit(switch, tmp_path / "iter_0000002")
    assert taken.resumed_from == 2 and run.bf16_layers == {2}
    assert run.after_step(6, step(), {"layer002/fc2/kurtosis": 190.0}) is None
    assert run.guard.state()["decisions"] == [taken.record()]
    assert json.loads((tmp_path / DECISIONS_FILE).read_text()) == [taken.record()]
    run.resumed({"above": {"layer001/qkv/kurtosis": 1}, "fired": []})
    assert run.bf16_layers == {2} and run.guard.decisions == [taken.record()]
    assert run.guard.above == {"layer001/qkv/kurtosis": 1}, "counts as the checkpoint had them"


def test_with_every_layer_in_bf16_an_alarm_is_only_warned(tmp_path, caplog):
    run = guarded("bf16", tmp_path, fp8_guard_window=2)
    run.guard.exempt_layers([1, 2, 3, 4])
    run.after_step(1, step(2.0), None)
    run.after_step(2, step(2.1), None)
    with caplog.at_level(logging.INFO, logger="apertus"):
        assert run.after_step(3, step(90.0), None) is None
    assert "every layer is in bf16 already" in caplog.text


# -- real tiny runs --------------------------------------------------------------------------

BASE = [
    "--model-preset",
    "tiny",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--eval-iters",
    "1",
    "--log-interval",
    "2",
    "--lr",
    "3e-3",
    "--device",
    "cpu",
    "--log-intermediate-metrics-interval",
    "2",
    *SMALL_VOCABULARY,
]
GUARD = ["--fp8-guard", "--fp8-guard-kurtosis", "60", "--fp8-guard-intervals", "1"]
"""The tiny model's fc2 input is 192 wide (kurtosis at most ~190; 3-20 when healthy), so the
kurtosis bound is lowered from the default for it, and one measurement suffices."""
OUTLIER_LAYER, OUTLIER_CHANNEL, OUTLIER_SIZE = 2, 7, 100.0


def add_outlier(module, args):
    """Adds ``OUTLIER_SIZE`` times the input's RMS to channel ``OUTLIER_CHANNEL``. Added, not
    multiplied: training cannot shrink it away, so it stays an outlier at every measurement."""
    x = args[0].clone()
    x[..., OUTLIER_CHANNEL] += OUTLIER_SIZE * x.detach().pow(2).mean().sqrt()
    return (x, *args[1:])


@contextlib.contextmanager
def outlier_after(passes: int) -> Iterator[None]:
    """Within the block, from the forward pass that follows the ``passes``-th training backward
    pass on (0: from the first), layer ``OUTLIER_LAYER``'s fc2 input carries the outlier of
    :func:`add_outlier` (a forward pre-hook on that GEMM, ahead of the monitor's). It stays for
    the rest of the run, a go-back to an earlier checkpoint included: the outlier persists."""
    original, done, hooked = step_module.run_microbatches, 0, False

    def hook(model) -> None:
        nonlocal hooked
        if not hooked and done >= passes:
            fc2 = model[0].module.decoder.layers[OUTLIER_LAYER - 1].mlp.linear_fc2
            fc2.register_forward_pre_hook(add_outlier)
            hooked = True

    def with_outlier(model, data_iterators, shape, *, forward_only: bool, **objective):
        nonlocal done
        hook(model)  # the first step's (0 passes)
        losses = original(model, data_iterators, shape, forward_only=forward_only, **objective)
        done += not forward_only
        hook(model)  # after a backward pass: ahead of the next step's statistics hooks
        return losses

    step_module.run_microbatches = with_outlier
    try:
        yield
    finally:
        step_module.run_microbatches = original


def guard_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("FP8 guard")]


def test_an_injected_outlier_is_warned_within_one_interval(tmp_path, caplog):
    log = tmp_path / "h.json"
    cfg = pretrain_gpt.parse_args(BASE + GUARD + ["--train-iters", "6", "--log-json", str(log)])
    with caplog.at_level(logging.INFO, logger="apertus"), outlier_after(2):
        history = train(cfg)
    assert history["completed"], "warn lets the run go on"
    lines = guard_lines(caplog)
    assert lines and lines[0].startswith("FP8 guard: iteration 4: layer002 fc2 kurtosis "), lines
    assert not [line for line in lines if "layer002 fc2" not in line and "spike" not in line]
    steps, kurtosis = series(read_json(log), "fp8_guard/layer002/fc2/kurtosis")
    assert steps == [4, 6] and min(kurtosis) > 60, (steps, kurtosis)
    assert series(read_json(log), "fp8_guard/layer002/fc2/kurtosis_threshold")[1] == [60.0] * 2
    before = dict(history["intermediate/layer002/fc2/kurtosis"])
    assert before[2] < 30, "the clean steps are well below the bound"


def test_stop_saves_and_exits_with_one_line(tmp_path):
    save = tmp_path / "ckpt"
    cfg = pretrain_gpt.parse_args(
        BASE + GUARD + ["--fp8-guard-action", "stop", "--train-iters", "8", "--save", str(save)]
    )
    with pytest.raises(TrainingStopped) as err, outlier_after(2):
        train(cfg)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("the FP8 guard stopped the run at iteration 4: layer002 fc2 kurtosis ")
    assert f"resume with --load {save}" in line and "--fp8-guard-action warn" in line
    assert checkpoint.latest_iteration(save) == 4
    common = dist_checkpointing.load_common_state_dict(str(checkpoint.find_checkpoint(save)))
    kept = common["training_state"]["extra"]["fp8_guard"]
    assert kept["stopped_at"] == 4 and kept["above"]["layer002/fc2/kurtosis"] == 1
    assert kept["fired"][0]["name"] == "fp8_guard/layer002/fc2/kurtosis"


def test_a_resumed_run_keeps_the_guard_state(tmp_path, caplog):
    """Stopped at the first alarm, resumed with warn: the counts come from the checkpoint, so
    the next measurement is the second in a row (a fresh guard would say 1)."""
    save = tmp_path / "ckpt"
    flags = BASE + GUARD + ["--save", str(save), "--load", str(save), "--train-iters", "8"]
    stop = pretrain_gpt.parse_args(flags + ["--fp8-guard-action", "stop"])
    with pytest.raises(TrainingStopped), outlier_after(2):
        train(stop)
    caplog.clear()
    go_on = pretrain_gpt.parse_args(flags)
    with caplog.at_level(logging.INFO, logger="apertus"), outlier_after(1):
        train(go_on)
    lines = guard_lines(caplog)
    assert "FP8 guard: this run was stopped by it at iteration 4" in lines[0], lines
    assert any(
        line.startswith("FP8 guard: iteration 6: layer002 fc2 kurtosis")
        and "2 measurement(s) in a row" in line
        for line in lines
    ), lines


def test_with_the_guard_off_the_same_outlier_goes_unsaid(tmp_path, caplog):
    log = tmp_path / "h.json"
    cfg = pretrain_gpt.parse_args(
        BASE
        + ["--log-intermediate-metrics", "kurtosis", "--train-iters", "6"]
        + ["--log-json", str(log)]
    )
    with caplog.at_level(logging.INFO, logger="apertus"), outlier_after(2):
        history = train(cfg)
    assert history["completed"]
    assert guard_lines(caplog) == []
    history = read_json(log)
    assert not [name for name in history if name.startswith("fp8_guard")]
    assert dict(history["intermediate/layer002/fc2/kurtosis"])[4] > 60, "the outlier is there"


def test_a_clean_run_raises_no_alarm(tmp_path, caplog):
    """Default bounds, each alarming at its first measurement."""
    log = tmp_path / "h.json"
    cfg = pretrain_gpt.parse_args(
        BASE
        + ["--fp8-guard", "--fp8-guard-intervals", "1"]
        + ["--train-iters", "6", "--log-json", str(log)]
    )
    with caplog.at_level(logging.INFO, logger="apertus"):
        history = train(cfg)
    assert history["completed"] and guard_lines(caplog) == []
    recorded = read_json(log)
    assert not [name for name in recorded if name.startswith("fp8_guard")]
    measured = {k for k in recorded if k.startswith("intermediate/")}
    assert "intermediate/layer004/qkv/underflow" in measured, "the guard turned its statistics on"
    assert max(v for _, v in recorded["intermediate/layer004/fc2/kurtosis"]) < 60
    assert torch.isfinite(torch.tensor(series(recorded, "train/loss")[1])).all()


CLEAN_STEPS = 300


@pytest.mark.slow
def test_a_long_clean_run_raises_no_false_alarm(tmp_path, caplog):
    """The false-alarm rate on a clean run: 300 steps measured at every step with the injected
    runs' sensitivity (kurtosis bound 60, one measurement suffices) and the default loss and
    gradient-norm spike bounds, which judge the last 200 steps after their 100-step window."""
    log = tmp_path / "h.json"
    measured_every_step = ["--log-intermediate-metrics-interval", "1", "--log-interval", "1"]
    cfg = pretrain_gpt.parse_args(
        BASE
        + GUARD
        + measured_every_step
        + ["--train-iters", str(CLEAN_STEPS), "--log-json", str(log)]
    )
    with caplog.at_level(logging.INFO, logger="apertus"):
        history = train(cfg)
    assert history["completed"] and guard_lines(caplog) == []
    recorded = read_json(log)
    assert not [name for name in recorded if name.startswith("fp8_guard")]
    kurtosis = [v for _, v in recorded["intermediate/layer002/fc2/kurtosis"]]
    assert len(kurtosis) == CLEAN_STEPS, "measured at every step"
    losses = series(recorded, "train/loss")[1]
    assert losses[-1] < losses[0] - 1.0, "the run learns"


def train_losses(history: dict, after: int) -> dict[int, float]:
    return {it: loss for it, loss in history["train/loss"] if it > after}


def from_checkpoint(save, iteration: int, flags: list[str]) -> dict:
    """The losses of a run started from ``save``'s checkpoint of ``iteration`` with ``flags``,
    the outlier there from its first step, without the guard: what a switch must reproduce."""
    load = ["--load", str(checkpoint.iteration_dir(save, iteration)), "--train-iters", "6"]
    with outlier_after(0):
        return train_losses(train(pretrain_gpt.parse_args(BASE + load + flags)), iteration)


def switching(action: str, save, log=None) -> list[str]:
    """The injected run of 6 steps saving every 2 whose guard acts with ``action``."""
    logged = ["--log-json", str(log)] if log else []
    flags = ["--fp8-guard-action", action, "--save", str(save), "--load", str(save)]
    return BASE + GUARD + flags + ["--save-interval", "2", "--train-iters", "6", *logged]


def test_bf16_layers_goes_back_to_the_checkpoint_before_the_alarm_and_keeps_the_layer(
    tmp_path, caplog
):
    """The outlier from step 3 is caught at step 4, before that step's save: the run goes back
    to the checkpoint of step 2 with layer 2 in bf16, and from there trains exactly as a run
    started from that checkpoint with --bf16-layers 2."""
    save, log = tmp_path / "ckpt", tmp_path / "h.json"
    with caplog.at_level(logging.INFO, logger="apertus"), outlier_after(2):
        history = train(pretrain_gpt.parse_args(switching("bf16-layers", save, log)))
    assert history["completed"]
    lines = guard_lines(caplog)
    assert lines[0].startswith("FP8 guard: iteration 4: layer002 fc2 kurtosis "), lines
    assert lines[1].startswith("FP8 guard: bf16-layers at iteration 4 (layer002 fc2 kurtosis ")
    assert lines[1].endswith("layer 2 continue in bf16 from the checkpoint of iteration 2")
    assert len(lines) == 2, "layer 2 is in bf16 now: its outlier raises no further alarm"
    assert f"resumed from {checkpoint.iteration_dir(save, 2)} at iteration 2" in caplog.text
    kurtosis = dict(history["intermediate/layer002/fc2/kurtosis"])
    assert kurtosis[6] > 60, "still measured after the switch"
    (decision,) = json.loads((save / DECISIONS_FILE).read_text())
    assert (decision["action"], decision["layers"]) == ("bf16-layers", [2])
    assert (decision["iteration"], decision["resumed_from"]) == (4, 2)
    last = checkpoint.find_checkpoint(save)
    assert last.name == "iter_0000006" and decisions_at(last) == [decision]
    assert series(read_json(log), "fp8_guard/bf16-layers/resumed_from") == ([4], [2.0])

    reference = from_checkpoint(save, 2, ["--bf16-layers", "2"])
    assert list(reference) == [3, 4, 5, 6]
    assert train_losses(history, after=2) == reference


def test_bf16_layers_goes_back_to_a_newer_non_persistent_checkpoint(tmp_path, caplog):
    """Persistent checkpoints every 2 steps and a non-persistent one at step 3: the alarm at step
    4 goes back to that one, the newer of the two kinds (as a --load of --save takes it), so
    only step 4 is trained twice, and the run from there trains exactly as one started from
    that checkpoint with --bf16-layers 2. The decision is also written beside it, where a job
    requeued onto it finds it."""
    save = tmp_path / "ckpt"
    frequent = save / NON_PERSISTENT_DIR
    flags = switching("bf16-layers", save)
    flags += ["--non-persistent-ckpt-type", "global", "--non-persistent-save-interval", "3"]
    passes = []
    with caplog.at_level(logging.INFO, logger="apertus"), outlier_after(2):
        with after_backward(lambda n, model: passes.append(n)):
            history = train(pretrain_gpt.parse_args(flags))
    assert history["completed"]
    lines = guard_lines(caplog)
    assert lines[1].endswith("layer 2 continue in bf16 from the checkpoint of iteration 3")
    assert f"resumed from {frequent / 'iter_0000003'} at iteration 3" in caplog.text
    assert len(passes) == 7, "steps 1 to 6 and step 4 again"
    (decision,) = json.loads((save / DECISIONS_FILE).read_text())
    assert decision["resumed_from"] == 3
    assert decisions_at(frequent / "iter_0000003") == [decision]

    reference = from_checkpoint(frequent, 3, ["--bf16-layers", "2"])
    assert list(reference) == [4, 5, 6]
    assert train_losses(history, after=3) == reference


def test_a_go_back_after_ckpt_step_stays_in_this_runs_history(tmp_path, caplog):
    """A run of 6 steps saving every 2, restarted from its own --save with --ckpt-step 2 and no
    save due before 6: the alarm at step 4 goes back to the checkpoint of step 2 that the run
    was loaded from, never forward to 6 (or to 4) of the history it left."""
    save = tmp_path / "ckpt"
    first = BASE + ["--save", str(save), "--save-interval", "2", "--train-iters", "6"]
    train(pretrain_gpt.parse_args(first))
    flags = switching("bf16-layers", save) + ["--ckpt-step", "2", "--save-interval", "10"]
    passes = []
    with caplog.at_level(logging.INFO, logger="apertus"), outlier_after(0):
        with after_backward(lambda n, model: passes.append(n)):
            history = train(pretrain_gpt.parse_args(flags))
    assert history["completed"]
    lines = guard_lines(caplog)
    assert lines[1].startswith("FP8 guard: bf16-layers at iteration 4 "), lines
    assert lines[1].endswith("layer 2 continue in bf16 from the checkpoint of iteration 2")
    resumed = f"resumed from {checkpoint.iteration_dir(save, 2)} at iteration 2"
    assert caplog.text.count(resumed) == 2, "loaded, then gone back to"
    assert len(passes) == 6, "steps 3 and 4, then 3 to 6 again"
    (decision,) = json.loads((save / DECISIONS_FILE).read_text())
    assert (decision["iteration"], decision["resumed_from"]) == (4, 2)


def test_bf16_decision_outlives_a_job_that_ends_before_its_next_save(tmp_path, caplog):
    """bf16: every layer leaves FP8, back at the checkpoint of step 2. The job dies at its next
    step; its requeued job (the same command) starts from that checkpoint, the newest, with
    the decision from the save directory, and trains as a run started there without FP8."""
    save = tmp_path / "ckpt"

    def die(passes: int, model) -> None:
        if passes == 5:  # the first step after going back: iteration 3 again
            raise RuntimeError("the node failed")

    flags = switching("bf16", save)
    with pytest.raises(RuntimeError), outlier_after(2), after_backward(die):
        train(pretrain_gpt.parse_args(flags))
    assert checkpoint.latest_iteration(save) == 2
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="apertus"), outlier_after(0):
        history = train(pretrain_gpt.parse_args(flags))
    lines = guard_lines(caplog)
    assert lines[0].startswith("FP8 guard: bf16 at iteration 4 (layer002 fc2 kurtosis "), lines
    assert lines[0].endswith(
        "layers 1, 2, 3, 4 continue in bf16 from the checkpoint of iteration 2"
    )
    assert len(lines) == 1, "every layer is in bf16: no alarm, no second switch"
    assert "(layers 1, 2, 3, 4: no FP8 in this run: no change)" in caplog.text
    decisions = decisions_at(checkpoint.find_checkpoint(save))
    assert [d["layers"] for d in decisions] == [[1, 2, 3, 4]]
    assert train_losses(history, after=2) == from_checkpoint(save, 2, [])


def test_an_alarm_before_the_first_checkpoint_stops_naming_the_layers(tmp_path):
    save = tmp_path / "ckpt"
    flags = switching("bf16-layers", save) + ["--save-interval", "10"]
    with pytest.raises(TrainingStopped) as err, outlier_after(2):
        train(pretrain_gpt.parse_args(flags))
    line = str(err.value)
    assert line.startswith("the FP8 guard's bf16-layers at iteration 4 (layer002 fc2 kurtosis ")
    assert f"{save} holds none yet; restart the run with --bf16-layers 2 " in line
    assert checkpoint.latest_iteration(save) is None and not (save / DECISIONS_FILE).exists()
