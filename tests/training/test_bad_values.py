"""Pathological flag values end in one line naming the flag and exit code 2, never a traceback
(``pretrain_gpt.py`` and the teacher-logit generator).

The cases are what ``bench/sweep_bad_flags.py`` (every flag of ``pretrain_gpt.py`` with zero,
negative, huge, non-finite, empty and path values) found answered otherwise; each is refused
where the flag's config is built, or, for sizes that only fail to allocate, where the model or
the sample index is built. In this process: a refusal costs the flags' parsing (or the start of
the run), not an interpreter.
"""

from __future__ import annotations

import importlib.util
import signal
import typing
from pathlib import Path

import pytest

import pretrain_gpt
from megatron.apertus.checkpoint_files import MODEL_CONFIG
from megatron.apertus.cli import run
from megatron.apertus.model.config import preset
from megatron.apertus.ops.xielu import XIELU_IMPLS
from megatron.apertus.training.loop_config import TrainingConfig
from tests.conftest import REPO, SMALL_TOKENIZER_FLAGS, SMALL_VOCABULARY

TINY = (
    "--model-preset tiny --mock-data --train-iters 2 --eval-iters 0 --global-batch-size 2 "
    "--micro-batch-size 2"
).split() + SMALL_VOCABULARY
ERROR = ": error: "
"""After the program's name, which is argparse's ``prog`` (``sys.argv[0]``) or ``cli.run``'s."""
HUGE = str(2**40)
GENERATE = REPO / "tools" / "generate_teacher_logits.py"


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ERROR in line]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0].split(ERROR, 1)[1]


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1, got 0"),
        (["--init-method-std", "-1"], "--init-method-std must be a finite number >= 0, got -1.0"),
        (["--init-method-std", "nan"], "--init-method-std must be a finite number >= 0, got nan"),
        (["--norm-epsilon", "-1"], "--norm-epsilon must be a finite number >= 0, got -1.0"),
        (["--rotary-base", "0"], "--rotary-base must be positive, got 0"),
        (["--rope-scaling-factor", "0"], "--rope-scaling-factor must be a finite number > 0"),
        (["--xielu-beta", "inf"], "--xielu-beta must be a finite number, got inf"),
        (["--distributed-timeout-minutes", HUGE], "--distributed-timeout-minutes must be in [1, "),
        (["--lr-warmup-init", "nan"], "--lr-warmup-init must be a finite number >= 0, got nan"),
        (["--num-workers", HUGE], "--num-workers must be in [0, 1024], got 1099511627776"),
        (["--seed", "-1"], "--seed must be in [0, 4294967295], got -1"),
        (["--seed", HUGE], f"--seed must be in [0, 4294967295], got {HUGE}"),
        (["--recompute-granularity", ""], "argument --recompute-granularity: invalid choice: ''"),
        (["--recompute-method", "x"], "argument --recompute-method: invalid choice: 'x'"),
        (["--xielu-impl", "x"], "argument --xielu-impl: invalid choice: 'x'"),
    ],
)
def test_a_bad_value_is_refused_when_the_flags_are_read(flags, line, capsys):
    with pytest.raises(SystemExit) as exited:
        pretrain_gpt.parse_args(TINY + flags)
    assert exited.value.code == 2
    assert _one_line(capsys).startswith(line)


def test_the_xielu_impl_choices_are_the_kernels_dispatch():
    hint = typing.get_type_hints(TrainingConfig)["xielu_impl"]
    assert typing.get_args(hint) == XIELU_IMPLS


def test_good_values_still_parse():
    """The negative control: the bounds refuse only what cannot work."""
    config = pretrain_gpt.parse_args(
        TINY
        + ["--init-method-std", "0", "--norm-epsilon", "0", "--xielu-impl", "torch"]
        + ["--distributed-timeout-minutes", "153722", "--recompute-granularity", "full"]
    )
    assert config.model.init_method_std == 0 and config.training.xielu_impl == "torch"


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--hidden-size", HUGE], "the model does not fit in memory: "),
        (["--num-layers", HUGE], "the model does not fit in memory: "),
        (["--train-iters", HUGE], f"the sample indices of {2**41} training and 0 validation "),
        (["--eval-iters", HUGE], "the sample indices of 4 training and "),
        (["--lr-warmup-init", "1"], "--lr-warmup-init (1.0) exceeds --lr (0.001): "),
    ],
)
def test_a_value_refused_as_the_run_starts_names_its_flag(flags, line, capsys):
    """Sizes that only fail to allocate, and a warmup start above the peak lr, which only the
    scheduler sees beside the optimizer's settings."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exited:
            run(lambda: pretrain_gpt.main(TINY + flags), prog="pretrain_gpt.py")
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert exited.value.code == 2
    refusal = _one_line(capsys)
    assert refusal.startswith(line), refusal
    assert flags[0] in refusal


@pytest.mark.parametrize("split", [".", "0,0,0", "1,2,3,4", "data/train"])
def test_a_split_megatron_core_cannot_read_is_refused(split, capsys):
    with pytest.raises(SystemExit) as exited:
        pretrain_gpt.parse_args([a for a in TINY if a != "--mock-data"] + ["--split", split])
    assert exited.value.code == 2
    assert _one_line(capsys).startswith(f"--split {split!r}: give up to three shares of ")


@pytest.mark.parametrize("split", ["969,30,1", "99/1", "1", "0.9, 0.1"])
def test_megatron_lm_splits_still_parse(split):
    config = pretrain_gpt.parse_args([a for a in TINY if a != "--mock-data"] + ["--split", split])
    assert config.dataset.split == split


# -- the teacher-logit generator (tools/generate_teacher_logits.py) ---------------------------


def _generator():
    spec = importlib.util.spec_from_file_location("generate_teacher_logits", GENERATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def config_only_teacher(tmp_path) -> Path:
    """A teacher checkpoint holding its config and no weights: what the flags are checked
    against; a refusal that came after loading weights would be another error."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / MODEL_CONFIG).write_text(preset("tiny").to_json())
    return teacher


STUDENT = "--global-batch-size 2 --micro-batch-size 2 --train-iters 2 --eval-iters 0".split()


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--device", ""], "argument --device: invalid choice: ''"),
        (["--train-iters", "0"], "--train-iters/--train-samples: the student's run has no "),
        (["--micro-batch-size", HUGE], "--global-batch-size (2) is not a multiple of "),
    ],
)
def test_the_generator_refuses_a_bad_value_when_the_flags_are_read(
    flags, line, config_only_teacher, tmp_path, capsys
):
    argv = ["--load", str(config_only_teacher), "--logits-dir", str(tmp_path / "store")]
    with pytest.raises(SystemExit) as exited:
        _generator().parse_args(argv + STUDENT + SMALL_TOKENIZER_FLAGS + flags)
    assert exited.value.code == 2
    assert _one_line(capsys).startswith(line)


def test_the_generator_refuses_an_empty_load(tmp_path, capsys):
    argv = ["--load", "", "--logits-dir", str(tmp_path / "store"), *STUDENT]
    with pytest.raises(SystemExit) as exited:
        _generator().parse_args(argv + SMALL_TOKENIZER_FLAGS)
    assert exited.value.code == 2
    assert _one_line(capsys).startswith("--load is empty: give the teacher's save directory")


def test_a_generation_refused_after_the_store_check_leaves_no_store(
    config_only_teacher, tmp_path, capsys
):
    store = tmp_path / "out" / "store"
    argv = ["--load", str(config_only_teacher), "--logits-dir", str(store), *STUDENT]
    argv += [*SMALL_TOKENIZER_FLAGS, "--data-path", str(tmp_path / "none")]
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exited:
            run(lambda: _generator().main(argv), prog="generate_teacher_logits.py")
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert exited.value.code == 2
    assert _one_line(capsys).startswith("--data-path: neither ")
    assert not (tmp_path / "out").exists()
