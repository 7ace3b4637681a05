"""Megatron-LM's DDP, pipeline, recomputation, timeout, logging and signal flags, each by its
effect on a tiny run of the real command line: the DDP config and buckets megatron-core builds
(--ddp-num-buckets, --ddp-average-in-collective, --no-gradient-reduce-div-fusion), the parts of
each layer run twice in a step (--recompute-modules), the process groups' timeout after the
first step (--distributed-timeout-seconds-after-init), the memory line
(--log-device-memory-used), the interleaved schedule's options in gloo processes
(--no-overlap-p2p-communication, --microbatch-group-size-per-virtual-pipeline-stage), a stopped
run's exit (--exit-signal-handler-for-training), validation batches of other sizes
(--eval-micro-batch-size, --eval-global-batch-size), what wandb is given (--wandb-entity,
--wandb-save-dir; wandb itself is an optional extra); the switches that only change how a step runs
leave its losses and gradient norms as they are. Bad values: one line, exit 2."""

from __future__ import annotations

import logging
import os
import signal
import sys
import types

import numpy as np
import pytest
import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

import pretrain_gpt
from megatron.apertus.errors import ConfigError
from megatron.apertus.model.config import ParallelConfig
from megatron.apertus.training.loop import train
from megatron.apertus.training.metrics import Metrics, wandb_dir
from megatron.apertus.training.startup import check_batch_sizes
from megatron.apertus.training.step import wrap_ddp
from tests.conftest import PRETRAIN, SMALL_VOCABULARY, after_backward, read_json, run_entry, series
from tests.test_apertus_launch_args import error_lines
from tests.test_cli import start_training
from tests.training.test_step_timers import Records
from tests.training.test_validation_sets import _run as validation_run
from tests.training.test_validation_sets import corpora  # noqa: F401 (a fixture)

BASE = (
    "--model-preset tiny --mock-data --global-batch-size 4 --micro-batch-size 2 --eval-iters 0 "
    "--log-interval 1 --lr 3e-3 --seed 5 --train-iters 2 --device cpu"
).split() + SMALL_VOCABULARY
MICRO_BATCHES, LAYERS = 2, 4
"""Micro-batches per step and layers of BASE's runs."""
RTOL = 2e-6
"""Relative tolerance of losses across process layouts (as in tests/parallel)."""


def _calls_per_module(model) -> dict:
    """Forward-hook counters on each layer's core attention, MLP and pre-attention norm."""
    counts = {"core_attn": 0, "mlp": 0, "layernorm": 0}

    def count(name: str):
        return lambda *_: counts.__setitem__(name, counts[name] + 1)

    layers = [m for chunk in model for m in chunk.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.self_attention.core_attention.register_forward_hook(count("core_attn"))
        layer.mlp.register_forward_hook(count("mlp"))
        layer.input_layernorm.register_forward_hook(count("layernorm"))
    return counts


def _run(flags: list[str]) -> dict:
    """One in-process run of BASE + ``flags``: its losses and gradient norms, its log
    messages, and, seen after the backward passes, the DDP config and bucket count, each
    layer's calls in step 2 per micro-batch and layer, and the process groups' timeouts."""
    seen, records = {"timeouts": []}, Records()

    def hook(n: int, model) -> None:
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
        seen["timeouts"].append(group._get_backend(torch.device("cpu")).options._timeout)
        if n == 1:
            seen["ddp_config"] = model[0].ddp_config
            seen["buckets"] = sum(len(buffer.buckets) for buffer in model[0].buffers)
            seen["parameters"] = sum(p.numel() for p in model[0].parameters())
            seen["counts"] = _calls_per_module(model)
        else:
            seen["calls"] = {k: v / (MICRO_BATCHES * LAYERS) for k, v in seen["counts"].items()}

    apertus = logging.getLogger("apertus")
    level = apertus.level
    apertus.setLevel(logging.INFO)
    apertus.addHandler(records)
    try:
        with after_backward(hook):
            history = train(pretrain_gpt.parse_args(BASE + flags))
    finally:
        apertus.removeHandler(records)
        apertus.setLevel(level)
    return {**seen, "history": history, "messages": records.messages}


RUNS = {
    "plain": [],
    "buckets": ["--overlap-grad-reduce", "--ddp-num-buckets", "3"]
    + ["--no-gradient-reduce-div-fusion", "--distributed-timeout-seconds-after-init", "77"],
    "selective": ["--recompute-activations"],
    "modules": ["--recompute-granularity", "selective", "--recompute-modules", "mlp"]
    + ["--log-memory-interval", "1", "--log-device-memory-used"],
}
"""In-process runs that differ only in these flags."""


@pytest.fixture(scope="module")
def runs() -> dict:
    return {name: _run(flags) for name, flags in RUNS.items()}


@pytest.mark.parametrize("name", sorted(set(RUNS) - {"plain"}))
def test_how_a_step_runs_leaves_its_losses_and_gradients(runs, name):
    for metric in ("train/loss", "train/grad_norm"):
        steps, values = series(runs[name]["history"], metric)
        assert steps == [1, 2]
        assert values == series(runs["plain"]["history"], metric)[1], metric


def test_ddp_num_buckets_splits_the_gradients_and_reaches_megatron_core(runs):
    plain, split = runs["plain"], runs["buckets"]
    assert plain["buckets"] == 1 and plain["ddp_config"].bucket_size is None
    # Buckets end at parameter boundaries: their count is about, not exactly, the one asked for.
    assert split["ddp_config"].bucket_size == split["parameters"] // 3
    assert split["buckets"] > 1
    assert split["ddp_config"].gradient_reduce_div_fusion is False
    assert plain["ddp_config"].gradient_reduce_div_fusion is True
    assert not split["ddp_config"].average_in_collective


def test_ddp_average_in_collective_reaches_megatron_core(tiny_cpu):
    """The CPU cannot run it (gloo has no AVG): the config DDP builds is checked here."""
    chunk = tiny_cpu.build()
    (ddp,) = wrap_ddp(
        [chunk], chunk.config, use_distributed_optimizer=False, average_in_collective=True
    )
    assert ddp.ddp_config.average_in_collective
    assert all(bucket.gradient_scaling_factor == 1.0 for bucket in ddp.buffers[0].buckets)


def test_the_timeout_changes_after_the_first_step(runs):
    before, after = runs["buckets"]["timeouts"]
    assert after.total_seconds() == 77 and before.total_seconds() != 77
    assert {t.total_seconds() for t in runs["plain"]["timeouts"]} == {before.total_seconds()}


@pytest.mark.parametrize(
    "name, twice",
    [("plain", set()), ("selective", {"core_attn"}), ("modules", {"mlp"})],
)
def test_recompute_modules_run_the_chosen_parts_again(runs, name, twice):
    calls = runs[name]["calls"]
    assert {part for part, n in calls.items() if n == 2} == twice
    assert {part for part, n in calls.items() if n == 1} == set(calls) - twice


def test_device_memory_used_ends_the_memory_line(runs):
    lines = [m for m in runs["modules"]["messages"] if "memory (MB)" in m]
    assert len(lines) == 2
    assert all(" | total device memory used: " in line for line in lines)
    assert not [m for m in runs["plain"]["messages"] if "memory (MB)" in m]


PIPELINE_RUNS = {
    4: ["--micro-batch-size", "1"],
    6: ["--micro-batch-size", "1", "--global-batch-size", "6"],
}
"""Per layer count, the flags of the pipeline runs: one micro-batch per pipeline stage and
virtual stage, a multiple of the stages in a step."""


def _pipeline_args(layers: int, root, out: str) -> list[str]:
    """Training from the same initial weights (``root/init<layers>``): every layout its own
    initialisation otherwise."""
    flags = ["--num-layers", str(layers), *PIPELINE_RUNS[layers]]
    return BASE + flags + ["--load", str(root / f"init{layers}"), "--log-json", str(root / out)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple:
    """One-process losses of the 4-layer and the 6-layer model, per layer count."""
    root, losses = tmp_path_factory.mktemp("pipeline"), {}
    for layers, flags in PIPELINE_RUNS.items():
        init = ["--num-layers", str(layers), *flags, "--save", str(root / f"init{layers}")]
        run_entry(PRETRAIN, BASE + init + ["--train-iters", "0"])
        run_entry(PRETRAIN, _pipeline_args(layers, root, f"reference{layers}.json"))
        losses[layers] = series(read_json(root / f"reference{layers}.json"), "train/loss")[1]
    return root, losses


@pytest.mark.parametrize(
    "layers, pp, flags",
    [
        (4, 2, ["--microbatch-group-size-per-virtual-pipeline-stage", "4"]),
        (6, 3, ["--no-overlap-p2p-communication"]),
    ],
    ids=["microbatch-group", "no-overlap"],
)
def test_interleaved_schedule_options_keep_the_losses(reference, layers, pp, flags):
    root, losses = reference
    layout = ["--pipeline-model-parallel-size", str(pp), "--virtual-pipeline-model-parallel-size"]
    run_entry(PRETRAIN, _pipeline_args(layers, root, "pp.json") + layout + ["2"] + flags, nproc=pp)
    got = series(read_json(root / "pp.json"), "train/loss")[1]
    np.testing.assert_allclose(got, losses[layers], rtol=RTOL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_exit_signal_handler_for_training_stops_at_once_with_exit_zero(tmp_path, signum):
    """Without the flag such a run exits 143 or 130 (tests/test_cli.py)."""
    proc = start_training(["--exit-signal-handler-for-training"], tmp_path / "save")
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    line = "pretrain_gpt.py: termination requested; the checkpoints saved before it are kept"
    assert stderr.strip().splitlines()[-1] == line
    assert not (tmp_path / "save" / "latest_checkpointed_iteration.txt").exists()


PIPELINE = ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--ddp-num-buckets", "0"], "--ddp-num-buckets must be >= 1, got 0"),
        (
            ["--ddp-num-buckets", "2", "--ddp-bucket-size", "1000"],
            "--ddp-num-buckets and --ddp-bucket-size exclude each other",
        ),
        (
            ["--ddp-average-in-collective"],
            "--ddp-average-in-collective needs a GPU: gloo, the CPU backend, has no AVG reduction",
        ),
        (
            ["--ddp-average-in-collective", "--calculate-per-token-loss"],
            "--ddp-average-in-collective and --calculate-per-token-loss exclude each other",
        ),
        (
            ["--microbatch-group-size-per-virtual-pipeline-stage", "2"],
            "--microbatch-group-size-per-virtual-pipeline-stage needs virtual pipeline stages",
        ),
        (
            PIPELINE + ["--microbatch-group-size-per-virtual-pipeline-stage", "1"],
            "--microbatch-group-size-per-virtual-pipeline-stage must be >= "
            "--pipeline-model-parallel-size (2), got 1",
        ),
        (
            PIPELINE + ["--no-overlap-p2p-communication"],
            "--no-overlap-p2p-communication with virtual pipeline stages needs "
            "--pipeline-model-parallel-size > 2 (got 2)",
        ),
        (
            ["--recompute-modules", "mlp"],
            "--recompute-modules chooses what selective recomputation recomputes",
        ),
        (
            ["--recompute-activations", "--recompute-modules", "mlp", "moe"],
            "--recompute-modules moe: the model has no mixture-of-experts layers",
        ),
        (
            ["--recompute-activations", "--recompute-modules", "mla_up_proj"],
            "--recompute-modules mla_up_proj: the attention is grouped-query attention, not "
            "multi-latent attention",
        ),
        (
            ["--recompute-activations", "--recompute-modules", "attention"],
            "--recompute-modules attention: choose among core_attn, layernorm, mlp",
        ),
        (
            ["--recompute-activations", "--recompute-modules", "layernorm"],
            "--recompute-modules layernorm needs Transformer Engine",
        ),
        (["--eval-micro-batch-size", "0"], "--eval-micro-batch-size must be >= 1, got 0"),
        (["--eval-global-batch-size", "0"], "--eval-global-batch-size must be >= 1, got 0"),
        (
            ["--distributed-timeout-seconds-after-init", "0"],
            "--distributed-timeout-seconds-after-init must be in [1, ",
        ),
        (
            ["--exit-signal-handler", "--exit-signal-handler-for-training"],
            "--exit-signal-handler and --exit-signal-handler-for-training exclude each other",
        ),
    ],
)
def test_bad_values_are_refused_in_one_line(flags, line, capsys):
    (refusal,) = error_lines(capsys, BASE + flags)
    assert refusal.startswith(line)


@pytest.mark.parametrize(
    "group, batch, line",
    [
        (8, 4, "(8) does not fit the 4 micro-batches per step of --global-batch-size (4)"),
        (3, 4, "(3) does not fit the 4 micro-batches per step of --global-batch-size (4)"),
        (4, 8, None),
        (3, 6, None),
    ],
)
def test_microbatch_group_fits_the_step(group, batch, line):
    """At most the step's micro-batches, the last group empty or of at least one per stage."""
    cfg = pretrain_gpt.parse_args(
        BASE + ["--global-batch-size", str(batch), "--micro-batch-size", "1"]
    )
    layout = ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    if line is None:
        check_batch_sizes(cfg.training, layout, 1, group)
        return
    with pytest.raises(ConfigError) as err:
        check_batch_sizes(cfg.training, layout, 1, group)
    assert line in str(err.value)


def test_eval_batch_sizes_cut_the_validation_data_not_its_full_loss(corpora):
    """A pass at the end of the starting weights (lr 0): over each set whole the per-token
    loss is the same for any validation batch sizes; over one batch it is not (the sizes are
    used), and training is untouched by them."""
    sets = ("--multiple-validation-sets", "--train-iters", "1", "--lr", "0", "--eval-interval", "0")
    runs = {}
    for name, flags in {
        "step": ("--full-validation",),
        "5x1": (
            "--full-validation",
            "--eval-global-batch-size",
            "5",
            "--eval-micro-batch-size",
            "1",
        ),
        "6x3": (
            "--full-validation",
            "--eval-global-batch-size",
            "6",
            "--eval-micro-batch-size",
            "3",
        ),
        "one-4": ("--eval-iters", "1"),
        "one-2": ("--eval-iters", "1", "--eval-global-batch-size", "2"),
    }.items():
        runs[name] = validation_run(corpora, "short-a", "short-b", flags=sets + flags)
    for name in ("5x1", "6x3"):
        for i in (0, 1):
            (step,), (other,) = runs["step"][f"valid/loss-{i}"], runs[name][f"valid/loss-{i}"]
            assert other[1] == pytest.approx(step[1], rel=1e-6)
        assert runs[name]["train/loss"] == runs["step"]["train/loss"]
    assert runs["one-2"]["valid/loss-0"] != runs["one-4"]["valid/loss-0"]


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--eval-global-batch-size", "5", "--eval-micro-batch-size", "2"],
            "--eval-global-batch-size (5) is not divisible by the validation micro-batch (2) x "
            "data-parallel size (1)",
        ),
        (
            ["--eval-micro-batch-size", "3"],
            "--global-batch-size (4) is not divisible by the validation micro-batch (3) x "
            "data-parallel size (1)",
        ),
        (["--eval-global-batch-size", "4", "--eval-micro-batch-size", "4"], None),
    ],
)
def test_eval_batch_sizes_split_into_whole_micro_batches(flags, line):
    cfg = pretrain_gpt.parse_args(BASE + flags)
    if line is None:
        check_batch_sizes(cfg.training, cfg.parallel, 1)
        return
    with pytest.raises(ConfigError) as err:
        check_batch_sizes(cfg.training, cfg.parallel, 1)
    assert str(err.value) == line


class RecordingWandb(types.ModuleType):
    """Stands in for the optional wandb package (not installed here): records ``init``."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict] = []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self


@pytest.mark.parametrize(
    "save_dir, save, folder",
    [("wb", "ckpt", "wb"), (None, "ckpt", "ckpt/wandb"), (None, None, None)],
    ids=["wandb-save-dir", "save", "neither"],
)
def test_wandb_gets_the_entity_and_megatron_lms_folder(
    tmp_path, monkeypatch, save_dir, save, folder
):
    fake = RecordingWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.chdir(tmp_path)
    Metrics(
        tensorboard_dir=None,
        wandb_project="apertus",
        wandb_exp_name="run",
        wandb_entity="team",
        wandb_dir=wandb_dir(save_dir, save),
        config={},
    )
    (init,) = fake.inits
    assert init["entity"] == "team" and init["project"] == "apertus"
    assert init["dir"] == (None if folder is None else os.path.join(*folder.split("/")))
    assert folder is None or (tmp_path / folder).is_dir()
