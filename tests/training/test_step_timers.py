"""Megatron-LM's step timers on tiny runs of the real command line: --timing-log-level picks the
phases (level 0 none, and no timer or barrier at all), --timing-log-option how the ranks' times
are printed (min and max across two pipeline stages in real gloo processes), --log-timers-to-tensorboard writes the
slowest rank's times, --no-barrier-with-level-1-timing drops the timers' barriers; with them
--log-memory-interval, --log-world-size-to-tensorboard, --logging-level and
--empty-unused-memory-level."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from megatron.core import timers as core_timers
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import pretrain_gpt
from megatron.apertus.training.loop import train
from megatron.apertus.training.run_log import configure_logging
from megatron.apertus.training.step_timers import LEVEL_1, LEVEL_2
from tests.conftest import PRETRAIN, SMALL_VOCABULARY, run_entry
from tests.training.test_first_hour import refused

BASE = (
    "--model-preset tiny --mock-data --global-batch-size 4 --micro-batch-size 2 --eval-iters 0 "
    "--log-interval 2 --lr 3e-3 --seed 5 --train-iters 4"
).split() + SMALL_VOCABULARY
RUNS = {
    "level0": ["--log-timers-to-tensorboard"],
    "level1": ["--timing-log-level", "1", "--timing-log-option", "max"]
    + ["--no-barrier-with-level-1-timing"],
    "level2": ["--timing-log-level", "2", "--timing-log-option", "all"]
    + ["--log-timers-to-tensorboard", "--log-world-size-to-tensorboard"]
    + ["--log-memory-interval", "2", "--empty-unused-memory-level", "2"],
}
"""Runs that differ only in these flags (each with its own --tensorboard-dir)."""
TIMES = {
    "max": re.compile(r"^    (\S+) \.+: ([\d.]+)$", re.M),
    "minmax": re.compile(r"^    (\S+) \.+: \(([\d.]+), ([\d.]+)\)$", re.M),
    "all": re.compile(r"^  (\S+):\n     rank  0: ([\d.]+)$", re.M),
}
"""A timer's line in each --timing-log-option: its name, then its times in ms."""


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _counting(mp: pytest.MonkeyPatch, owner, name: str, counts: dict) -> None:
    """Count the calls of ``owner.name``, which still runs."""
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    mp.setattr(owner, name, counted)


def _run(flags: list[str], folder) -> dict:
    """One in-process run: its log messages, its TensorBoard scalars, how many megatron-core
    timers started and how many barriers ran."""
    counts, records = {"start": 0, "barrier": 0}, Records()
    apertus = logging.getLogger("apertus")
    level = apertus.level
    apertus.setLevel(logging.INFO)
    apertus.addHandler(records)
    try:
        with pytest.MonkeyPatch.context() as mp:
            _counting(mp, core_timers.Timer, "start", counts)
            _counting(mp, torch.distributed, "barrier", counts)
            train(pretrain_gpt.parse_args(BASE + flags + ["--tensorboard-dir", str(folder)]))
    finally:
        apertus.removeHandler(records)
        apertus.setLevel(level)
    events = EventAccumulator(str(folder)).Reload()
    scalars = {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    return {"messages": records.messages, "scalars": scalars, **counts}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("timers")
    return {name: _run(flags, root / name) for name, flags in RUNS.items()}


def _timer_blocks(messages: list[str], header: str) -> list[str]:
    return [m for m in messages if m.startswith(header)]


def test_level_0_times_nothing_and_adds_no_barrier(runs):
    """No timer starts (megatron-core finds none in its configs), nothing is printed or
    written, though --log-timers-to-tensorboard asks; level 1 without its barriers adds none
    either, with them it does."""
    zero, one, two = runs["level0"], runs["level1"], runs["level2"]
    assert zero["start"] == 0 and one["start"] > 0 and two["start"] > 0
    assert not [m for m in zero["messages"] if "time across ranks" in m or "times across" in m]
    assert not [tag for tag in zero["scalars"] if tag.endswith("-time") and tag != "iteration-time"]
    assert one["barrier"] == zero["barrier"], "--no-barrier-with-level-1-timing"
    assert two["barrier"] > zero["barrier"], "a level-1 timer starts with a barrier by default"


def test_level_1_logs_the_once_a_step_phases_at_each_line(runs):
    blocks = _timer_blocks(runs["level1"]["messages"], "max time across ranks (ms):")
    assert len(blocks) == 3, "the job's first iteration, then iterations 2 and 4"
    for block in blocks:
        times = dict(TIMES["max"].findall(block))
        assert {"forward-backward", "all-grads-sync", "optimizer", "optimizer-inner-step"} <= set(
            times
        )
        assert set(times) <= set(LEVEL_1), "no level-2 phase"
        assert all(float(ms) >= 0 for ms in times.values())
        assert float(times["optimizer"]) >= float(times["optimizer-inner-step"])


def test_level_2_adds_the_per_micro_batch_phases_and_writes_tensorboard(runs):
    run = runs["level2"]
    blocks = _timer_blocks(run["messages"], "times across ranks (ms):")
    assert len(blocks) == 3
    last = dict(TIMES["all"].findall(blocks[-1]))
    assert {"batch-generator", "forward-compute", "backward-compute"} <= set(last)
    assert set(last) <= set(LEVEL_1 + LEVEL_2) and "forward-backward" in last
    scalars = run["scalars"]
    for name in ("forward-backward", "optimizer", "batch-generator", "forward-compute"):
        written = scalars[f"{name}-time"]
        assert [step for step, _ in written] == [1, 2, 4]
        assert all(seconds >= 0 for _, seconds in written)
    # TensorBoard gets seconds per iteration, the line milliseconds: the same measurement.
    seconds = scalars["forward-backward-time"][-1][1]
    assert 1000 * seconds == pytest.approx(float(last["forward-backward"]), abs=0.01)


def test_world_size_and_memory_lines(runs):
    run = runs["level2"]
    assert run["scalars"]["world-size"] == [(it, 1.0) for it in (1, 2, 3, 4)]
    assert "world-size" not in runs["level0"]["scalars"], "only with the flag"
    memory = [m for m in run["messages"] if "memory (MB)" in m]
    assert [re.match(r"\[Rank 0\] \(after (\d+) iterations\)", m).group(1) for m in memory] == [
        "2",
        "4",
    ]
    resident = re.search(r"\| resident: ([\d.]+) \| max resident: ([\d.]+)$", memory[0])
    assert 0 < float(resident.group(1)) <= float(resident.group(2))
    assert not [m for m in runs["level0"]["messages"] if "memory (MB)" in m]


def test_two_pipeline_stages_print_min_and_max_across_ranks():
    """Two gloo processes, one pipeline stage each: one block per line, from the reporting
    rank, each phase's fastest and slowest rank, the stages' sends and receives among them."""
    flags = ["--timing-log-level", "2", "--pipeline-model-parallel-size", "2"]
    flags += ["--micro-batch-size", "1", "--train-iters", "2"]
    proc = run_entry(PRETRAIN, BASE + flags, nproc=2)
    output = proc.stdout
    blocks = output.split("(min, max) time across ranks (ms):")[1:]
    assert len(blocks) == 2, output[-3000:]
    assert "all_gather_into_tensor" not in proc.stderr, "torch's notice on the gathering"
    for block in blocks:
        names = {name for name, *_ in TIMES["minmax"].findall(block)}
        assert {"forward-backward", "all-grads-sync", "optimizer", "batch-generator"} <= names
        assert {"forward-recv", "backward-send"} <= names, "the pipeline's messages"
    times = [(float(low), float(high)) for _, low, high in TIMES["minmax"].findall(output)]
    assert all(0 <= low <= high for low, high in times)
    assert any(low < high for low, high in times), "two ranks, not one rank twice"


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--timing-log-level", "3"],
            "argument --timing-log-level: invalid choice: 3 (choose from 0, 1, 2)",
        ),
        (
            ["--timing-log-option", "mean"],
            "argument --timing-log-option: invalid choice: 'mean' (choose from 'max', 'minmax', "
            "'all')",
        ),
        (
            ["--empty-unused-memory-level", "3"],
            "argument --empty-unused-memory-level: invalid choice: 3 (choose from 0, 1, 2)",
        ),
        (
            ["--log-interval", "2", "--log-memory-interval", "3"],
            "--log-memory-interval must be a multiple of --log-interval (2), got 3",
        ),
        (["--log-memory-interval", "0"], "--log-memory-interval must be >= 1, got 0"),
        (["--logging-level", "-1"], "--logging-level must be >= 0, got -1"),
    ],
)
def test_bad_values_are_refused_in_one_line(flags, line):
    assert refused(flags) == line


def test_logging_level_sets_what_reaches_the_console():
    """Our lines are INFO records: --logging-level 30 keeps warnings only; by default INFO."""
    root = logging.getLogger()
    level = root.level
    try:
        configure_logging(None, logging.WARNING)
        ours = logging.getLogger("apertus")
        assert not ours.isEnabledFor(logging.INFO) and ours.isEnabledFor(logging.WARNING)
        configure_logging(None)
        assert ours.isEnabledFor(logging.INFO)
    finally:
        for handler in [h for h in root.handlers if getattr(h, "apertus", False)]:
            root.removeHandler(handler)
        root.setLevel(level)
