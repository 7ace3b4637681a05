"""The mistakes of a first hour with the trainer: each is said in one line and exit code 2.

Every test runs the real entry point. A refusal prints exactly one ``pretrain_gpt.py: error:``
line naming the flag or file, and no traceback; a restartable job (``--save X --load X``)
whose directory holds no checkpoint yet starts from scratch and says so, as Megatron-LM does.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.apertus import checkpoint
from tests import warm_interpreter
from tests.conftest import PRETRAIN, REPO, run_entry, run_script

BASE = [
    "--model-preset",
    "tiny",
    "--global-batch-size",
    "2",
    "--micro-batch-size",
    "1",
    "--eval-iters",
    "0",
]
TINY = BASE + ["--train-iters", "1"]
ERROR = "pretrain_gpt.py: error: "
HINT = " (see pretrain_gpt.py --help)"


def run(script: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def refused(args: list[str], base: list[str] = TINY) -> str:
    """The one error line of a run that must stop at a user mistake (forked from the warm
    interpreter: the refusal, not torch's import, is what is tested)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_script(PRETRAIN, base + args, env=env, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith(ERROR)]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return errors[0].removeprefix(ERROR).removesuffix(HINT)


@pytest.mark.parametrize("script", [PRETRAIN, REPO / "tools" / "generate_teacher_logits.py"])
def test_start_without_notices_of_absent_transformer_engine_or_apex(script):
    proc = run(script, ["--help"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    for notice in ("Transformer Engine and Apex are not installed", "Apex is not installed"):
        assert notice not in proc.stderr


# -- --load and --save -------------------------------------------------------------------------


@pytest.mark.parametrize("before", ["missing", "empty", "killed during its first save"])
def test_a_job_with_no_checkpoint_yet_starts_from_scratch(tmp_path, before):
    save = tmp_path / "save"
    if before == "empty":
        save.mkdir()
    elif before == "killed during its first save":
        (save / "iter_0000001.tmp").mkdir(parents=True)
    proc = run_entry(PRETRAIN, TINY + ["--save", str(save), "--load", str(save)])
    assert f"no checkpoint found at {save}: starting from scratch" in proc.stdout
    assert checkpoint.latest_iteration(save) == 1
    assert not list(save.glob("iter_*.tmp"))


def test_load_of_a_directory_without_a_checkpoint_warns_and_starts_from_scratch(tmp_path):
    (tmp_path / "README").write_text("not a checkpoint")
    proc = run_entry(PRETRAIN, TINY + ["--load", str(tmp_path)])
    assert (
        f"--load {tmp_path} holds no checkpoint (no latest_checkpointed_iteration.txt, "
        "no apertus_model.json): starting from scratch"
    ) in proc.stdout
    assert "iteration        1/" in proc.stdout


def test_load_of_a_file_is_refused(tmp_path):
    path = tmp_path / "model.pt"
    path.write_text("")
    assert refused(["--load", str(path)]) == f"{path} is a file, not a checkpoint directory"


def test_a_tracker_naming_no_checkpoint_is_refused(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5\n")
    assert refused(["--load", str(tmp_path)]) == (
        f"{tmp_path}/latest_checkpointed_iteration.txt names iteration 5, but "
        f"{tmp_path}/iter_0000005 is not a complete Apertus checkpoint (no apertus_model.json)"
    )


def test_save_under_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    save = tmp_path / "file" / "checkpoints"
    assert (
        refused(["--save", str(save)])
        == f"--save {save}: {tmp_path}/file is a file, not a directory"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_save_is_refused_before_training(tmp_path):
    tmp_path.chmod(0o555)
    try:
        message = refused(["--save", str(tmp_path)])
    finally:
        tmp_path.chmod(0o755)
    assert message == f"--save {tmp_path}: cannot write there (Permission denied)"


@pytest.fixture(scope="module")
def narrow_checkpoint(tmp_path_factory) -> Path:
    """A one-step run of the tiny model with --hidden-size 32 (the preset has 64)."""
    save = tmp_path_factory.mktemp("narrow")
    run_entry(PRETRAIN, TINY + ["--hidden-size", "32", "--save", str(save)])
    return save


def test_load_of_another_architecture_names_the_tensor_and_both_shapes(narrow_checkpoint):
    assert refused(["--load", str(narrow_checkpoint)]) == (
        f"{narrow_checkpoint}/iter_0000001 holds another architecture: "
        "embedding.word_embeddings.weight is [131072, 32] there, [131072, 64] in this model; "
        "its apertus_model.json differs in --hidden-size 32 there, 64 here"
    )


def test_resume_with_another_schedule_names_the_switches(narrow_checkpoint):
    message = refused(
        ["--load", str(narrow_checkpoint), "--hidden-size", "32", "--train-iters", "2"]
    )
    assert message.startswith(
        f"{narrow_checkpoint}/iter_0000001 was saved with another " "learning-rate schedule ("
    )
    assert "--override-opt_param-scheduler" in message


# -- data and batch sizes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "files, flag, expected",
    [
        ({"part.bin": b""}, "--data-path", "{p}.idx is missing ({p}.bin is there)"),
        (
            {"part.idx": b"MMIDIDX\x00\x00"},
            "--train-data-path",
            "{p}.bin is missing ({p}.idx is there)",
        ),
        (
            {"part.bin": b"", "part.idx": b""},
            "--data-path",
            "{p}.idx is not a Megatron index file (wrong header: truncated or another format)",
        ),
    ],
    ids=["only the .bin", "only the .idx", "an index of another format"],
)
def test_a_missing_or_broken_half_of_a_dataset_is_named(tmp_path, files, flag, expected):
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    prefix = tmp_path / "part"
    assert refused([flag, "1.0", str(prefix)]).startswith(f"{flag}: " + expected.format(p=prefix))


def test_a_global_batch_that_does_not_split_into_micro_batches_is_refused():
    assert refused(["--global-batch-size", "5", "--micro-batch-size", "2"]) == (
        "--global-batch-size (5) is not divisible by --micro-batch-size (2) x data-parallel size "
        "(1 = world size 1 / (--tensor-model-parallel-size 1 x --pipeline-model-parallel-size 1 "
        "x --context-parallel-size 1))"
    )


def test_a_ramp_up_that_does_not_split_into_micro_batches_is_refused():
    message = refused(
        [
            "--train-samples",
            "20",
            "--global-batch-size",
            "8",
            "--micro-batch-size",
            "2",
            "--rampup-batch-size",
            "3",
            "1",
            "8",
        ],
        base=BASE,
    )
    assert message.startswith(
        "--rampup-batch-size START (3) is not divisible by --micro-batch-size"
    )


def test_interleaved_micro_batches_not_a_multiple_of_the_stages_are_refused():
    """PP=2 with virtual stages runs a step's micro-batches in groups of one per stage: 3 of them
    would stop megatron-core's interleaved schedule in the first step (both ranks say it)."""
    interleaved = ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size"]
    args = TINY + interleaved + ["2", "--global-batch-size", "6", "--micro-batch-size", "2"]
    proc = run_script(PRETRAIN, args, nproc=2, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    # Each rank writes the line, and the two may share a line of the output.
    assert (
        ERROR + "--global-batch-size (6) gives 3 micro-batches per step, not a multiple of "
        "--pipeline-model-parallel-size (2) as the interleaved schedule needs"
    ) in proc.stderr, proc.stderr[-4000:]


def test_log_progress_without_save_is_refused():
    assert refused(["--log-progress"]) == (
        "--log-progress writes progress.txt beside the checkpoints: it needs --save"
    )


def test_a_hub_tokenizer_name_says_to_pass_a_local_copy():
    line = refused(
        [
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            "swiss-ai/Apertus-8B-2509",
        ]
    )
    assert line.startswith("--tokenizer-model swiss-ai/Apertus-8B-2509: no such file or directory")
    assert "`hf download swiss-ai/Apertus-8B-2509 tokenizer.json tokenizer_config.json`" in line


# -- values, files and outputs, refused when the flags are read (--dry-run too) ---------------


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--lr", "-1"], "--lr must be a finite number >= 0, got -1.0"),
        (["--lr", "nan", "--dry-run"], "--lr must be a finite number >= 0, got nan"),
        (["--adam-beta1", "2"], "--adam-beta1 must be in [0, 1), got 2.0"),
        (["--log-interval", "0"], "--log-interval must be >= 1, got 0"),
        (["--micro-batch-size", "0", "--dry-run"], "--micro-batch-size must be >= 1, got 0"),
    ],
)
def test_a_value_out_of_range_is_refused_with_its_flag(flags, expected):
    assert refused(flags) == expected


def test_the_layout_planner_refuses_a_micro_batch_of_zero_with_its_flag():
    proc = run_script(
        REPO / "tools" / "plan_layout.py",
        ["--gpus", "8", "--", "--model-preset", "apertus-8b", "--micro-batch-size", "0"],
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("plan_layout.py: error: --micro-batch-size must be >= 1, got 0")


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry-run"])
@pytest.mark.parametrize("kind", ["missing", "a directory", "not a tokenizer"])
def test_a_tokenizer_model_that_is_no_tokenizer_is_named(tmp_path, kind, dry_run):
    path = tmp_path / "tekken.json"
    if kind == "a directory":
        path.mkdir()
    elif kind == "not a tokenizer":
        path.write_text('{"vocab": []}')
    expected = {
        "missing": f"--tokenizer-model {path}: no such file or directory",
        "a directory": f"--tokenizer-model {path}: a directory, not a TekkenTokenizer file",
        "not a tokenizer": f"--tokenizer-model {path}: not a TekkenTokenizer file (",
    }[kind]
    assert refused(["--tokenizer-model", str(path), *dry_run]).startswith(expected)


@pytest.mark.parametrize(
    "flag, make, expected",
    [
        ("--log-json", "directory", "{p} is a directory, not a file"),
        ("--loss-plot", "directory", "{p} is a directory, not a file"),
        ("--tensorboard-dir", "file", "{p} is a file, not a directory"),
        ("--data-cache-path", "file", "{p} is a file, not a directory"),
        ("--log-json", "under a file", "{p}: {p.parent} is a file, not a directory"),
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_the_model_is_built(
    tmp_path, flag, make, expected
):
    path = tmp_path / "out"
    if make == "directory":
        path.mkdir()
    elif make == "file":
        path.write_text("")
    else:
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "log.jsonl"
    before = sorted(tmp_path.iterdir())
    assert refused([flag, str(path)]) == f"{flag} " + expected.format(p=path)
    assert sorted(tmp_path.iterdir()) == before, "nothing is written beside it"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
@pytest.mark.parametrize("flag", ["--log-json", "--tensorboard-dir", "--data-cache-path"])
def test_an_output_in_a_read_only_directory_is_refused_before_the_model_is_built(tmp_path, flag):
    (tmp_path / "ro").mkdir(mode=0o555)
    path = tmp_path / "ro" / "out"
    try:
        message = refused([flag, str(path), "--dry-run"])
    finally:
        (tmp_path / "ro").chmod(0o755)
    assert message == f"{flag} {path}: cannot write in {tmp_path / 'ro'} (permission denied)"


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--align-beta", "0.1"], "--align-beta"),
        (["--no-align-length-normalization"], "--align-length-normalization"),
    ],
    ids=["beta", "length-normalization"],
)
def test_an_alignment_flag_at_its_default_without_an_objective_is_refused(flags, named):
    assert refused([*flags, "--dry-run"]) == f"{named} needs --align-objective (dpo or qrpo)"


# -- the launcher's environment ----------------------------------------------------------------


@pytest.mark.parametrize("mistake", ["port taken", "no MASTER_ADDR"])
def test_a_rendezvous_that_cannot_start_is_one_line_naming_its_variables(mistake):
    """Ranks started by a launcher (srun, an mpirun) with ``env://`` variables: rank 0 finds
    MASTER_PORT held by another job on the node, or a variable is missing. torch's traceback
    named neither the variables nor the remedy. ``run_script`` hands its processes no
    rendezvous of the caller's, so the process is forked from the warm interpreter directly with
    these variables (a fresh interpreter where forks are off)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if mistake == "no MASTER_ADDR":
        del env["MASTER_ADDR"]
    args = [*TINY, "--mock-data"]
    cmd = [sys.executable, str(PRETRAIN), *args]
    with holder:
        if warm_interpreter.enabled():
            proc = warm_interpreter.run(cmd, str(PRETRAIN), args, 1, env, 300)
        else:
            proc = subprocess.run(
                cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300
            )
    errors = [line for line in proc.stderr.splitlines() if line.startswith(ERROR)]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    expected = {
        "port taken": (
            f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} RANK=0 WORLD_SIZE=1: the rendezvous "
            "cannot start (address already in use); another job on this node may hold the "
            "port: choose a free MASTER_PORT"
        ),
        "no MASTER_ADDR": f"MASTER_ADDR=(unset) MASTER_PORT={port} RANK=0 WORLD_SIZE=1: ",
    }[mistake]
    assert errors[0].removeprefix(ERROR).startswith(expected), errors[0]
    if mistake == "no MASTER_ADDR":
        assert "MASTER_ADDR expected, but not set" in errors[0]
