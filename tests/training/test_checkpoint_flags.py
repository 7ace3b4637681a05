"""Megatron-LM's checkpoint and evaluation flags: --ckpt-step, --no-save-optim, --no-save-rng,
--exit-on-missing-checkpoint, --skip-train and --pretrained-checkpoint; each checked by its effect
on one saved tiny run (4 steps, checkpoints and validation at 2 and 4)."""

from __future__ import annotations

import logging
import shutil

import pytest
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint import FileSystemReader

import pretrain_gpt
from megatron.apertus import checkpoint
from megatron.apertus.checkpoint_files import NON_PERSISTENT_DIR, read_run_info, saved_iterations
from megatron.apertus.errors import ConfigError
from megatron.apertus.training.checkpoint_config import CheckpointConfig
from megatron.apertus.training.fp8_guard import Fp8GuardConfig
from megatron.apertus.training.loop import train
from tests.conftest import (
    PRETRAIN,
    SMALL_VOCABULARY,
    after_backward,
    read_json,
    run_entry,
    series,
)
from tests.training.test_first_hour import refused

BASE = (
    "--model-preset tiny --global-batch-size 4 --micro-batch-size 2 --eval-iters 1 "
    "--log-interval 1 --lr 3e-3 --seed 5 --train-iters 4 --eval-interval 2"
).split() + SMALL_VOCABULARY


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The run of 4 steps saving at 2 and 4, and its recorded history."""
    root = tmp_path_factory.mktemp("ckptflags")
    log = root / "full.json"
    run_entry(PRETRAIN, BASE + f"--save-interval 2 --save {root / 'full'} --log-json {log}".split())
    return root, read_json(log)


def _saved_parts(directory) -> set[str]:
    """The top-level names of what a checkpoint holds: its sharded tensors and objects
    (``optimizer``, ``rng_state``, the model's) and its common state (``scheduler``)."""
    sharded = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    common = dist_checkpointing.load_common_state_dict(str(directory))
    return {key.split(".")[0].split("/")[0] for key in sharded} | set(common)


def test_ckpt_step_resumes_from_that_iteration_on_the_same_trajectory(saved):
    """--ckpt-step 2 of a directory whose tracker names 4 continues from 2, bitwise as the run
    that went on from there; saving into that directory, it warns that iteration 4 will be
    replaced."""
    root, full = saved
    log, rollback = root / "from2.json", root / "rollback"
    shutil.copytree(root / "full", rollback)
    flags = f"--load {rollback} --save {rollback} --ckpt-step 2 --log-json {log}".split()
    proc = run_entry(PRETRAIN, BASE + flags)
    assert f"resumed from {rollback / 'iter_0000002'} at iteration 2" in proc.stdout
    assert (
        f"--ckpt-step 2: {rollback} also holds iterations 4, which this run leaves: its tracker "
        "names iteration 2 from the start and this run's saves replace them (give another --save "
        "to keep them)"
    ) in proc.stdout
    assert "iteration        3/       4" in proc.stdout
    assert "iteration        1/       4" not in proc.stdout
    # The history up to 2 is the checkpoint's, 3 and 4 are this run's.
    assert series(read_json(log), "train/loss") == series(full, "train/loss"), "bitwise equal"
    assert read_json(log)["valid/loss"][-1] == full["valid/loss"][-1]


def test_ckpt_step_into_its_own_save_names_that_checkpoint_from_the_start(saved, caplog):
    """--ckpt-step 2 into its own --save, whose tracker names 4 (and whose non-persistent
    directory holds a 4 too): once loaded, the tracker names 2 and the non-persistent 4 is
    gone, so the job that dies before its first save is requeued (the same command without
    --ckpt-step) onto iteration 2, not into the history it left, and trains 3 and 4 again as
    the first run did. The persistent 4 stays on disk until a save replaces it."""
    root, full = saved
    rollback = root / "requeued"
    shutil.copytree(root / "full", rollback)
    frequent = rollback / NON_PERSISTENT_DIR
    shutil.copytree(rollback / "iter_0000004", frequent / "iter_0000004")
    (frequent / checkpoint.TRACKER).write_text("4\n")
    flags = BASE + f"--load {rollback} --save {rollback} --non-persistent-ckpt-type global".split()

    def die(passes: int, model) -> None:
        raise RuntimeError("the node failed")

    with pytest.raises(RuntimeError, match="the node failed"), after_backward(die):
        train(pretrain_gpt.parse_args(flags + ["--ckpt-step", "2"]))
    assert checkpoint.latest_iteration(rollback) == 2
    assert saved_iterations(rollback) == [2, 4] and saved_iterations(frequent) == []
    assert checkpoint.latest_iteration(frequent) is None

    log = root / "requeued.json"
    with caplog.at_level(logging.INFO, logger="apertus"):
        history = train(pretrain_gpt.parse_args(flags + ["--log-json", str(log)]))
    assert history["completed"]
    assert f"resumed from {rollback / 'iter_0000002'} at iteration 2" in caplog.text
    iterations, losses = series(read_json(log), "train/loss")
    assert iterations == [1, 2, 3, 4]
    assert losses == pytest.approx(series(full, "train/loss")[1], rel=1e-5)
    assert checkpoint.latest_iteration(rollback) == 4


def test_ckpt_step_without_that_checkpoint_is_refused(saved):
    root, _ = saved
    line = refused(["--load", str(root / "full"), "--ckpt-step", "3"], base=BASE)
    assert line == (
        f"--ckpt-step 3: {root / 'full'} holds no checkpoint of iteration 3; "
        "it holds iterations 2, 4"
    )


@pytest.mark.parametrize("step", [2, None], ids=["ckpt-step-2", "latest"])
def test_skip_train_validates_once_as_the_training_run_did(saved, step, caplog):
    """--skip-train gives the validation loss the training run logged at that iteration, bit
    for bit, logged as Megatron-LM's pass after training; no step, nothing saved. The latest
    checkpoint ends the run, which without --skip-train would have nothing to do."""
    root, full = saved
    eval_save = root / f"eval-{step}"
    flags = BASE + ["--load", str(root / "full"), "--skip-train", "--save", str(eval_save)]
    flags += [] if step is None else ["--ckpt-step", str(step)]
    with caplog.at_level(logging.INFO, logger="apertus"):
        history = train(pretrain_gpt.parse_args(flags))
    iteration = step or 4
    (expected,) = [value for it, value in full["valid/loss"] if it == iteration]
    assert history["valid/loss"] == [[iteration, expected]]
    assert "skipping training (--skip-train is on) ..." in caplog.text
    assert f"validation loss at iteration {iteration} on validation set | lm loss value: " in (
        caplog.text
    )
    assert "iteration        " not in caplog.text, "no training step"
    assert not list(eval_save.glob("iter_*")) and not (eval_save / checkpoint.TRACKER).exists()


def test_override_ckpt_iteration_goes_on_from_that_iterations_data(saved, tmp_path):
    """The checkpoint of iteration 4 (--train-iters 4: finished) taken as iteration 2: steps 3
    and 4 run again, on their samples, from the later weights; the run ends at 16 samples."""
    root, full = saved
    log, save = tmp_path / "again.json", tmp_path / "again"
    flags = f"--load {root / 'full'} --override-ckpt-iteration 2 --save {save} --log-json {log}"
    proc = run_entry(PRETRAIN, BASE + flags.split())
    assert (
        f"resumed from {root / 'full' / 'iter_0000004'} at iteration 2, 8 samples consumed; "
        "--override-ckpt-iteration 2"
    ) in proc.stdout
    assert "iteration        3/       4" in proc.stdout
    again = series(read_json(log), "train/loss")
    assert again[0][-2:] == [3, 4]
    assert again[1][-2:] != series(full, "train/loss")[1][-2:], "the weights of iteration 4"
    info = read_run_info(checkpoint.find_checkpoint(save))
    assert (info["iteration"], info["consumed_samples"]) == (4, 16)


def test_override_ckpt_iteration_needs_the_checkpoints_global_batch(saved):
    root, _ = saved
    flags = ["--load", str(root / "full"), "--override-ckpt-iteration", "2"]
    line = refused(flags + ["--global-batch-size", "8"], base=BASE)
    assert line == (
        f"--override-ckpt-iteration 2: {root / 'full' / 'iter_0000004'} was saved with "
        "--global-batch-size 4, this run's is 8: its iteration x 8 samples is not where that "
        "iteration's data starts"
    )
    assert refused(flags + ["--finetune"], base=BASE) == (
        "--override-ckpt-iteration and --finetune exclude each other: --finetune starts at "
        "iteration 0"
    )


def test_no_initialization_loads_the_same_model(saved, tmp_path):
    """Built without initialising, the model the checkpoint fills trains as the one built
    initialised; without a checkpoint to fill it, the run is refused."""
    root, _ = saved
    logs = {}
    for name, extra in (("initialised", []), ("uninitialised", ["--no-initialization"])):
        logs[name] = tmp_path / f"{name}.json"
        flags = f"--load {root / 'full'} --finetune --train-iters 2 --log-json {logs[name]}"
        run_entry(PRETRAIN, BASE + flags.split() + extra)
    losses = {name: series(read_json(log), "train/loss") for name, log in logs.items()}
    assert losses["uninitialised"] == losses["initialised"], "bitwise equal"
    empty = tmp_path / "empty"
    line = refused(["--no-initialization", "--load", str(empty)], base=BASE)
    assert line == (
        f"--no-initialization: --load {empty} holds no checkpoint, so the weights would stay "
        "uninitialised memory"
    )


def test_use_mp_args_from_checkpoint_args_takes_its_layout(saved, tmp_path):
    """The checkpoint of one process records tensor-parallel size 1: the flag takes it over
    the command line's 2, which one process could not run."""
    root, _ = saved
    flags = (
        BASE + f"--load {root / 'full'} --finetune --train-iters 1 --use-checkpoint-args".split()
    )
    flags += ["--tensor-model-parallel-size", "2"]
    assert refused(flags).startswith("world size (1) is not divisible by --tensor-model-parallel")
    proc = run_entry(PRETRAIN, flags + ["--use-mp-args-from-checkpoint-args"])
    assert (
        "tensor_model_parallel_size, pipeline_model_parallel_size, "
        "virtual_pipeline_model_parallel_size"
    ) in proc.stdout
    assert "iteration        1/       1" in proc.stdout
    line = refused(["--use-mp-args-from-checkpoint-args"], base=BASE)
    assert line.startswith("--use-mp-args-from-checkpoint-args takes effect with --use-checkpoint")


def test_start_eval_at_iter_skips_the_validations_before_it(saved, tmp_path):
    """--eval-interval 2 validates at 0, 2 and 4; from iteration 3 on, at 4 only, the same
    loss."""
    _, full = saved
    log = tmp_path / "late.json"
    run_entry(PRETRAIN, BASE + f"--start-eval-at-iter 3 --log-json {log}".split())
    assert [it for it, _ in full["valid/loss"]] == [0, 2, 4]
    assert read_json(log)["valid/loss"] == [full["valid/loss"][-1]]


@pytest.fixture(scope="module")
def lean(saved):
    """A checkpoint at iteration 2 saved with --no-save-optim --no-save-rng."""
    root, _ = saved
    save = root / "lean"
    run_entry(
        PRETRAIN,
        BASE + f"--train-iters 2 --no-save-optim --no-save-rng --save {save}".split(),
    )
    return checkpoint.find_checkpoint(save)


def test_no_save_optim_and_rng_leave_them_out_and_say_so(saved, lean):
    root, _ = saved
    normal = root / "full" / "iter_0000002"
    assert {"optimizer", "scheduler", "rng_state"} <= _saved_parts(normal)
    assert not {"optimizer", "scheduler", "rng_state"} & _saved_parts(lean)
    assert {"decoder", "embedding", "output_layer"} <= _saved_parts(lean)
    assert not checkpoint.has_optimizer_states(lean)
    assert read_run_info(lean)["saved"] == {"optimizer": False, "rng": False}
    assert read_run_info(normal)["saved"] == {"optimizer": True, "rng": True}


def test_a_checkpoint_without_optimizer_or_rng_is_refused_unless_asked(lean):
    """Loading what was not saved is refused naming the flag to add; with both flags the run
    continues from the checkpoint's iteration."""
    flags = ["--train-iters", "3", "--load", str(lean)]
    assert refused(flags, base=BASE) == (
        f"--load {lean} was saved with --no-save-optim and holds no optimizer or "
        "learning-rate schedule state: add --no-load-optim (or --finetune) to start from it"
    )
    assert refused(flags + ["--no-load-optim"], base=BASE) == (
        f"--load {lean} was saved with --no-save-rng and holds no RNG states: add "
        "--no-load-rng (or --finetune) to start from it"
    )
    proc = run_entry(PRETRAIN, BASE + flags + ["--no-load-optim", "--no-load-rng"])
    assert f"resumed from {lean} at iteration 2" in proc.stdout
    assert "iteration        3/       3" in proc.stdout


def test_exit_on_missing_checkpoint(tmp_path):
    typo = tmp_path / "typo"
    line = refused(["--load", str(typo), "--exit-on-missing-checkpoint"], base=BASE)
    assert line == f"--exit-on-missing-checkpoint: --load {typo} does not exist"


def test_ckpt_step_needs_load():
    with pytest.raises(ConfigError, match="--ckpt-step picks an iteration of the --load directory"):
        CheckpointConfig(ckpt_step=2)
    assert CheckpointConfig(load="ckpt", ckpt_step=2).ckpt_step == 2
    assert CheckpointConfig(pretrained_checkpoint="base", ckpt_step=2).ckpt_step == 2


def test_pretrained_checkpoint_loads_beside_non_persistent_saves(saved, tmp_path):
    """The flags a run loads its base checkpoint with keep this run's own saving flags valid."""
    root, _ = saved
    frequent = dict(non_persistent_ckpt_type="global", non_persistent_save_interval=1)
    config = CheckpointConfig(
        pretrained_checkpoint=str(root / "full"), load=str(tmp_path), save=str(tmp_path), **frequent
    )
    loading = config.loaded()
    assert (loading.load, loading.finetune, loading.from_pretrained()) == (
        str(root / "full"),
        True,
        True,
    )
    assert config.loaded() is not config and config.non_persistent_save_interval == 1


def _weights(tiny_cpu, directory) -> dict:
    chunk = tiny_cpu.build(load=directory)
    return {
        name: tensor.clone() for name, tensor in chunk.state_dict().items() if "extra" not in name
    }


def test_pretrained_checkpoint_starts_from_its_weights_and_a_restart_from_its_own(saved, tiny_cpu):
    """Megatron-LM's continued-pretraining job: --load and --save name the run's own empty
    directory, --pretrained-checkpoint the base model. The first start takes the base model's
    weights only (iteration 0: the schedule, data and optimizer start fresh, as with --load BASE
    --finetune); the same command started again resumes from its own --save, not from the base."""
    root, full = saved
    base, own = root / "full", root / "continued"
    flags = BASE + f"--pretrained-checkpoint {base} --load {own} --save {own}".split()
    flags += f"--exit-interval 2 --log-json {root / 'continued.json'}".split()
    first = run_entry(PRETRAIN, flags)
    assert (
        f"--pretrained-checkpoint: weights loaded from {base / 'iter_0000004'}; iteration, "
        "consumed samples, optimizer, learning-rate schedule and RNG states start fresh"
    ) in first.stdout
    assert "iteration        1/       4" in first.stdout
    assert "iteration        3/       4" not in first.stdout, "--exit-interval 2 stops it at 2"
    requeued = run_entry(PRETRAIN, flags)
    assert f"resumed from {own / 'iter_0000002'} at iteration 2, 8 samples consumed" in (
        requeued.stdout
    )
    assert "--pretrained-checkpoint: weights loaded" not in requeued.stdout
    assert "iteration        3/       4" in requeued.stdout
    # The base model's weights, as --load BASE --finetune takes them: the same trajectory.
    reference = root / "finetuned.json"
    run_entry(PRETRAIN, BASE + f"--load {base} --finetune --log-json {reference}".split())
    continued = series(read_json(root / "continued.json"), "train/loss")
    assert continued == series(read_json(reference), "train/loss"), "bitwise equal"
    assert continued[1][0] != series(full, "train/loss")[1][0], "not the base run's own losses"
    # Its weights at the start are the base checkpoint's, tensor for tensor (a run of 0 steps
    # saves them).
    start = root / "start"
    flags = BASE + f"--pretrained-checkpoint {base} --save {start} --train-iters 0".split()
    run_entry(PRETRAIN, flags)
    started, expected = _weights(tiny_cpu, start), _weights(tiny_cpu, base)
    assert started.keys() == expected.keys()
    assert all(started[name].equal(expected[name]) for name in expected)


def test_pretrained_checkpoint_without_a_checkpoint_is_refused(tmp_path):
    base, own = tmp_path / "base", tmp_path / "own"
    line = refused(["--pretrained-checkpoint", str(base), "--load", str(own)], base=BASE)
    assert (
        line == f"--pretrained-checkpoint {base} holds no checkpoint (and --load {own} none either)"
    )


def test_fp8_guard_that_goes_back_needs_whole_checkpoints():
    guard = Fp8GuardConfig(fp8_guard=True, fp8_guard_action="bf16-layers")
    guard.check_run(save="ckpt", fp8_param_gather=False, saves_left_out=[])
    with pytest.raises(ConfigError, match="drop --no-save-optim and --no-save-rng"):
        guard.check_run(
            save="ckpt", fp8_param_gather=False, saves_left_out=["--no-save-optim", "--no-save-rng"]
        )
