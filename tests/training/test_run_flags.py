"""Megatron-LM's run flags: --finetune, --no-load-optim, --no-load-rng, --manual-gc,
--num-workers, --num-dataset-builder-threads, --log-progress,
--log-params-norm (and the Apertus fork's per-parameter norms), --log-memory-to-tensorboard,
--decrease-batch-size-if-needed, --profile; each checked by its effect on a tiny run."""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import json
import logging
import re
from datetime import datetime
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron.apertus import checkpoint
from megatron.apertus.checkpoint_files import read_run_info
from megatron.apertus.model.flops import flops_per_token
from megatron.apertus.training.loop import Trainer, train
from tests.conftest import (
    PRETRAIN,
    SMALL_TOKENIZER,
    SMALL_VOCABULARY,
    after_backward,
    cpu_models,
    read_json,
    run_entry,
    series,
)
from tests.training.test_first_hour import refused

BASE = (
    "--model-preset tiny --global-batch-size 4 --micro-batch-size 2 --eval-iters 1 "
    "--log-interval 1 --lr 3e-3 --seed 5"
).split() + SMALL_VOCABULARY


LOG_NORMS = "--log-params-norm --log-params-norm-per-param"


def _rng_hook(iteration: int, model) -> None:
    """Draw from the torch RNG, so that the saved RNG state differs from a fresh start's."""
    torch.rand(3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint after 3 iterations (its RNG advanced by the hook), the torch RNG state it
    saved, and the losses of the uninterrupted run of 5 iterations."""
    root = tmp_path_factory.mktemp("flags")
    with after_backward(_rng_hook):
        train(
            pretrain_gpt.parse_args(
                BASE + ["--train-iters", "5", "--exit-interval", "3", "--save", str(root / "ckpt")]
            )
        )
    saved_rng = torch.get_rng_state()
    ckpt, log = root / "ckpt", root / "full.json"
    run_entry(
        PRETRAIN, BASE + f"--train-iters 5 --save {ckpt} --load {ckpt} --log-json {log}".split()
    )
    return root, saved_rng, series(read_json(root / "full.json"), "train/loss")


@contextlib.contextmanager
def _loaded(save) -> Iterator[torch.nn.Module]:
    """The model of checkpoint ``save``, loaded into one CPU process."""
    with cpu_models() as models:
        yield models.build(load=save)


def _weights_only(source, target) -> None:
    """Save the weights of ``source`` as a step-0 checkpoint without optimizer or RNG states."""
    with _loaded(source) as chunk:
        checkpoint.save_model(target, 0, [chunk], checkpoint.load_model_config(source))


def test_finetune_starts_at_iteration_1_from_the_weights_only(trained, tmp_path):
    """--finetune from a training checkpoint is a start from its weights alone: the same losses
    as a run from a weights-only copy, other losses than the run from scratch."""
    root, _, (_, scratch) = trained
    ckpt = root / "ckpt" / "iter_0000003"
    _weights_only(ckpt, tmp_path / "weights")
    runs, logs = {}, {}
    for name, extra in (
        ("finetune", ["--load", str(ckpt), "--finetune"]),
        ("weights", ["--load", str(tmp_path / "weights")]),
    ):
        logs[name] = run_entry(
            PRETRAIN,
            BASE + ["--train-iters", "2", "--log-json", str(tmp_path / f"{name}.json")] + extra,
        ).stdout
        runs[name] = series(read_json(tmp_path / f"{name}.json"), "train/loss")
    assert "--finetune: weights loaded from" in logs["finetune"]
    assert re.search(r"iteration +1/ +2 \| consumed samples: +4 \|", logs["finetune"])
    assert runs["finetune"][0] == [1, 2]
    assert runs["finetune"] == runs["weights"]
    assert runs["finetune"][1][0] < scratch[0]


def test_a_training_checkpoint_records_its_run(trained):
    """``apertus_run.json``: the tokenizer, the data, the tokens seen and the command."""
    root, _, _ = trained
    info = read_run_info(checkpoint.find_checkpoint(root / "ckpt"))
    assert info["tokenizer"] == {"type": "HuggingFaceTokenizer", "model": str(SMALL_TOKENIZER)}
    assert info["data_path"] == []  # the embedded corpus
    assert (info["iteration"], info["consumed_samples"]) == (5, 20)
    assert info["consumed_tokens"] == 20 * checkpoint.load_model_config(root / "ckpt").seq_length
    assert info["fused_output_loss"] is True
    assert info["command"][0].endswith("pretrain_gpt.py") and "--save" in info["command"]
    assert info["version"] == importlib.metadata.version("megatron-apertus")


def test_reader_workers_and_builder_threads_change_no_loss(trained, tmp_path):
    """--num-workers 2 and --num-dataset-builder-threads 2 train on the same batches."""
    _, _, (steps, losses) = trained
    log = tmp_path / "workers.json"
    run_entry(
        PRETRAIN,
        BASE
        + [
            "--train-iters",
            "5",
            "--num-workers",
            "2",
            "--num-dataset-builder-threads",
            "2",
            "--log-json",
            str(log),
        ],
    )
    assert series(read_json(log), "train/loss") == (steps, losses)


def _progress_lines(path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()]


def test_log_progress_writes_megatron_progress_file(tmp_path):
    """Two jobs of one run: Megatron-LM's progress.txt lines, FLOPs and tokens of the samples
    consumed so far."""
    save = tmp_path / "ckpt"
    flags = BASE + [
        "--train-iters",
        "4",
        "--save",
        str(save),
        "--load",
        str(save),
        "--save-interval",
        "2",
        "--log-progress",
    ]
    run_entry(PRETRAIN, flags + ["--exit-interval", "2"])
    run_entry(PRETRAIN, flags)
    lines = _progress_lines(save / "progress.txt")
    assert [line[3] for line in lines] == ["Starting job", "Saved checkpoint"] * 2
    model = checkpoint.load_model_config(save)
    for line, iteration in zip(lines[1::2], (2, 4)):
        datetime.strptime(line[0], "%Y-%m-%d %H:%M:%S")
        assert line[1:3] == ["Job ID: ", "# GPUs: 1"]
        tokens = iteration * 4 * model.seq_length
        assert line[4] == f"Iteration: {iteration}"
        assert re.fullmatch(r"Job throughput: \d+\.\d TFLOP/s/GPU", line[5])
        assert re.fullmatch(r"Cumulative throughput: \d+\.\d TFLOP/s/GPU", line[6])
        assert line[7] == f"Floating-point operations: {tokens * flops_per_token(model):.2e}"
        assert line[8] == f"Tokens (in billions): {tokens / 1e9:.2f}"


def test_no_load_optim_keeps_the_iteration_and_restarts_the_optimizer(trained):
    root, _, (_, full) = trained
    save = root / "ckpt" / "iter_0000003"
    log = root / "no-optim.json"
    proc = run_entry(
        PRETRAIN, BASE + f"--train-iters 5 --load {save} --no-load-optim --log-json {log}".split()
    )
    assert "--no-load-optim: optimizer and learning-rate schedule start fresh" in proc.stdout
    steps, losses = series(read_json(root / "no-optim.json"), "train/loss")
    assert steps == [1, 2, 3, 4, 5]  # the history the checkpoint holds, continued
    assert losses[:3] == full[:3]
    assert losses[3] == full[3], "the same weights see the same batch"
    assert losses[4] != full[4], "a fresh Adam takes another step"


@pytest.mark.parametrize("flags, restored", [([], True), (["--no-load-rng"], False)])
def test_no_load_rng_keeps_the_seeded_rng_states(trained, flags, restored):
    root, saved_rng, _ = trained
    fresh = Trainer(pretrain_gpt.parse_args(BASE + ["--train-iters", "5"]))
    seeded = torch.get_rng_state()
    fresh.shutdown()
    resumed = Trainer(
        pretrain_gpt.parse_args(
            BASE + ["--train-iters", "5", "--load", str(root / "ckpt" / "iter_0000003")] + flags
        )
    )
    state = torch.get_rng_state()
    resumed.shutdown()
    assert not torch.equal(saved_rng, seeded)
    assert torch.equal(state, saved_rng if restored else seeded)


@pytest.mark.parametrize("eval_flag, final_collections", [([], 2), (["--no-manual-gc-eval"], 0)])
def test_manual_gc_disables_the_collector_and_collects_at_the_interval(
    eval_flag, final_collections
):
    events = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            events.append("gc")

    def on_step(iteration: int, model) -> None:
        events.append(f"it{iteration}" + ("" if gc.isenabled() else " (gc off)"))

    cfg = pretrain_gpt.parse_args(
        BASE + ["--train-iters", "5", "--manual-gc", "--manual-gc-interval", "2"] + eval_flag
    )
    gc.callbacks.append(on_gc)
    try:
        with after_backward(on_step):
            train(cfg)
    finally:
        gc.callbacks.remove(on_gc)
    first, last = events.index("it1 (gc off)"), events.index("it5 (gc off)")
    assert events[first - 1] == "gc", "a collection at the start"
    expected = "it1 (gc off)|it2 (gc off)|gc|it3 (gc off)|it4 (gc off)|gc|it5 (gc off)"
    assert events[first : last + 1] == expected.split("|")
    assert events[last + 1 :].count("gc") == final_collections, "around the final validation"
    assert gc.isenabled()


def _direct_norms(save) -> dict[str, float]:
    with _loaded(save) as chunk:
        return {name: p.detach().double().norm().item() for name, p in chunk.named_parameters()}


@pytest.fixture(scope="module")
def norms(tmp_path_factory):
    """A 1-process run of one step logging the norms (and TensorBoard scalars, not profiled),
    and the norms of its saved weights."""
    root = tmp_path_factory.mktemp("norms")
    flags = (
        f"--train-iters 1 --save {root / 'ckpt'} {LOG_NORMS} --log-memory-to-tensorboard "
        f"--tensorboard-dir {root / 'tb'}"
    )
    history = train(pretrain_gpt.parse_args(BASE + flags.split()))
    return root, history, _direct_norms(root / "ckpt")


def test_params_norm_is_the_norm_of_the_weights(norms):
    _, history, direct = norms
    (logged,) = [value for _, value in history["train/params_norm"]]
    assert logged == pytest.approx(np.sqrt(sum(v * v for v in direct.values())), rel=1e-6)
    per_param = {
        k.removeprefix("params-norm/"): v[0][1]
        for k, v in history.items()
        if k.startswith("params-norm/")
    }
    assert per_param.keys() == direct.keys()
    for name, value in direct.items():
        assert per_param[name] == pytest.approx(value, rel=1e-6), name


@pytest.mark.parametrize(
    "layout", [["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]]
)
def test_params_norm_is_the_same_in_every_layout(norms, layout):
    """The 1-process checkpoint under TP=2 or PP=2 (lr 0: the step changes nothing) logs the
    same norm, and each parameter's under the same name."""
    root, history, _ = norms
    log = root / f"{layout[0]}.json"
    flags = f"--train-iters 1 --load {root / 'ckpt'} --finetune --lr 0 --weight-decay 0 {LOG_NORMS}"
    run_entry(PRETRAIN, BASE + layout + flags.split() + ["--log-json", str(log)], nproc=2)
    theirs = read_json(log)
    ours = {k: v for k, v in history.items() if "norm" in k and "grad" not in k}
    assert {k for k in theirs if "norm" in k and "grad" not in k} == ours.keys()
    for key, [[_, value]] in ours.items():
        assert theirs[key][0][1] == pytest.approx(value, rel=1e-6), key


def test_memory_is_logged(norms):
    _, history, _ = norms
    (rss,) = [value for _, value in history["memory/rss_bytes"]]
    assert rss > 100 * 2**20


def test_decrease_batch_size_if_needed(caplog):
    """megatron-core runs the largest multiple of micro-batch x data-parallel size; without the
    switch, and below one micro-batch, the global batch is refused."""
    flags = BASE + ["--global-batch-size", "5", "--train-iters", "2"]
    assert refused(flags, base=[]).startswith("--global-batch-size (5) is not divisible")
    too_small = ["--global-batch-size", "1", "--decrease-batch-size-if-needed"]
    assert refused(flags + too_small, base=[]).startswith(
        "--global-batch-size (1) is smaller than --micro-batch-size (2)"
    )
    with caplog.at_level(logging.INFO, logger="apertus"):
        train(pretrain_gpt.parse_args(flags + ["--decrease-batch-size-if-needed"]))
    assert "--decrease-batch-size-if-needed: global batch 4 instead of 5" in caplog.text
    assert re.search(r"consumed samples: +8 \| .* \| global batch size: +4 \|", caplog.text)


# -- profiling ---------------------------------------------------------------------------------


def _traces(board: Path) -> list[Path]:
    return sorted(board.glob("*.pt.trace.json"))


def test_pytorch_profiler_traces_the_profiled_iterations(tmp_path):
    """Megatron-LM's window: iterations START to END-1 (here 2), after a warm-up iteration (1)
    that is not in the trace, nor is iteration 3; the step's matrix products are."""
    board = tmp_path / "tb"
    flags = "--train-iters 3 --profile --use-pytorch-profiler --profile-step-start 2 "
    train(
        pretrain_gpt.parse_args(
            BASE + (flags + f"--profile-step-end 3 --tensorboard-dir {board}").split()
        )
    )
    (trace,) = _traces(board)
    names = {str(event.get("name")) for event in json.loads(trace.read_text())["traceEvents"]}
    assert {name for name in names if name.startswith("ProfilerStep#")} == {"ProfilerStep#2"}
    assert {"aten::mm", "aten::matmul"} <= names


def test_no_trace_without_profile(norms):
    root, _, _ = norms
    assert list((root / "tb").glob("events.out.tfevents.*"))
    assert not _traces(root / "tb")


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            "--profile --use-pytorch-profiler",
            "--use-pytorch-profiler writes its trace to --tensorboard-dir: give one",
        ),
        (
            "--profile-step-start 3 --profile-step-end 3",
            "--profile-step-end (3) must be greater than --profile-step-start (3)",
        ),
        ("--profile", "--profile without --use-pytorch-profiler uses the CUDA profiler API"),
        ("--record-memory-history", "--record-memory-history records the CUDA caching allocator"),
    ],
)
def test_profiling_refusals(flags, line):
    """What a CPU run or the flags themselves cannot honour (the last two on a GPU work)."""
    argv = BASE + ["--train-iters", "1", "--device", "cpu", *flags.split()]
    assert refused(argv, base=[]).startswith(line)
