"""The promise of every entry point (``megatron/apertus/cli.py``): argument errors in one line,
user errors in one line with exit 2, interruptions in one line, no partial output; and ``--help``
and argument errors of every entry point without torch or megatron-core."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.apertus import cli
from tests.conftest import REPO, SMALL_VOCABULARY

TOOLS = sorted(REPO.glob("tools/*.py")) + sorted(REPO.glob("tools/checkpoint/*.py"))
ENTRY_POINTS = [*TOOLS, REPO / "pretrain_gpt.py"]
"""Their ``--help`` and argument errors import neither torch nor megatron-core: they start in well
under a second (``bench/bench_startup.py`` measures them all)."""


def load_tool(path: Path):
    spec = importlib.util.spec_from_file_location(f"tool_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", ENTRY_POINTS, ids=lambda p: p.stem)
def test_an_unknown_flag_is_one_line_not_the_usage(path, capsys):
    module = load_tool(path)
    with pytest.raises(SystemExit) as exit_:
        (
            module.main(["--no-such-flag"])
            if path.stem != "pretrain_gpt"
            else module.parse_args(["--no-such-flag"])
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert ": error: " in err and err.rstrip().endswith("--help)")


def heavy_modules_after(script: Path, args: list[str]) -> str:
    """The last line a run of ``script`` prints through the probe: which of torch and
    megatron-core the run imported."""
    probe = (
        "import runpy, sys\n"
        f"sys.argv = ['{script.name}', *sys.argv[1:]]\n"
        "try:\n"
        f"    runpy.run_path({str(script)!r}, run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", probe, *args], env=env, capture_output=True, text=True, timeout=300
    )
    return proc.stdout.strip().splitlines()[-1] + proc.stderr[-300:]


@pytest.mark.parametrize("path", ENTRY_POINTS, ids=lambda p: p.stem)
def test_help_and_argument_errors_import_neither_torch_nor_megatron_core(path):
    for args in (["--help"], ["--no-such-flag"]):
        assert heavy_modules_after(path, args).startswith("[]"), args


def test_preprocessing_imports_neither_torch_nor_megatron_core(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "Tokenized without torch."}\n')
    args = ["--input", str(source), "--output-prefix", str(tmp_path / "x")]
    assert heavy_modules_after(REPO / "tools" / "preprocess_data.py", args).startswith("[]")
    assert (tmp_path / "x_text_document.bin").stat().st_size > 0


def test_checkpoint_strictness_choices_match_megatron_core():
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from megatron.apertus.training.megatron_flags import STRICTNESS

    assert STRICTNESS == tuple(s.value for s in StrictHandling)


def test_preference_constants_match_the_library():
    """The preference tool's flags spell these out so that ``--help`` needs no torch."""
    from megatron.apertus.align.losses import OBJECTIVES
    from megatron.apertus.prep import preference_options
    from megatron.apertus.prep.preferences import MIN_REF_REWARDS

    assert tuple(preference_options.OBJECTIVES) == tuple(OBJECTIVES)
    assert preference_options.MIN_REF_REWARDS == MIN_REF_REWARDS


def run_main(main) -> int:
    with pytest.raises(SystemExit) as exit_:
        cli.run(main, prog="tool.py")
    return exit_.value.code


def test_run_turns_user_errors_into_one_line(capsys, tmp_path):
    def config_error():
        raise cli.ConfigError("--flag 3: must be even")

    def unwritable():
        raise PermissionError(13, "Permission denied", str(tmp_path / "out.bin"))

    def interrupted():
        raise KeyboardInterrupt

    assert run_main(config_error) == 2
    assert capsys.readouterr().err == "tool.py: error: --flag 3: must be even\n"
    assert run_main(unwritable) == 2
    assert capsys.readouterr().err == f"tool.py: error: {tmp_path / 'out.bin'}: Permission denied\n"
    assert run_main(interrupted) == 130
    assert capsys.readouterr().err.count("\n") == 1
    assert run_main(lambda: 3) == 3


def test_an_os_error_without_a_file_keeps_its_traceback():
    def bug():
        raise OSError("socket closed")

    with pytest.raises(OSError, match="socket closed"):
        cli.run(bug, prog="tool.py")


def test_atomic_outputs_rename_when_complete_and_remove_on_failure(tmp_path):
    final = tmp_path / "x.bin"
    with pytest.raises(KeyboardInterrupt):
        with cli.atomic_outputs(final) as (temporary,):
            Path(temporary).write_bytes(b"half")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with cli.atomic_outputs(final) as (temporary,):
        assert temporary == str(tmp_path / "x.tmp.bin")
        Path(temporary).write_bytes(b"whole")
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"] and final.read_bytes() == b"whole"


HOLD_LOCK = """
import os, sys, time
from pathlib import Path
from megatron.apertus.cli import exclusive
lock, log, ready = sys.argv[1], sys.argv[2], Path(sys.argv[3])
(ready / str(os.getpid())).touch()
with exclusive(lock):
    with open(log, "a") as out:
        out.write("enter\\n")
    deadline = time.monotonic() + 60
    while len(list(ready.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    with open(log, "a") as out:
        out.write("leave\\n")
"""
"""A process that announces itself, then holds the lock until the other process has announced
itself too (plus 0.3 s), logging when it enters and leaves."""


def test_processes_sharing_a_lock_take_turns(tmp_path):
    """Two processes enter the block one after the other; without the lock the second would
    enter while the first waits for it."""
    lock, log, ready = tmp_path / "cache" / "build.lock", tmp_path / "log", tmp_path / "ready"
    ready.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", HOLD_LOCK, str(lock), str(log), str(ready)]
    procs = [subprocess.Popen(command, env=env) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert log.read_text().split() == ["enter", "leave", "enter", "leave"]


STARTING_WORKERS = """
import multiprocessing, signal, sys, time
from megatron.apertus import cli

def stay():
    time.sleep(60)

def main():
    context = multiprocessing.get_context("fork")
    for _ in range(int(sys.argv[1])):
        worker = context.Process(target=stay)
        worker.start()
        worker.terminate()  # SIGTERM while the child may still be starting
        worker.join()
        assert worker.exitcode == -signal.SIGTERM, worker.exitcode

cli.run(main, "probe")
"""


def test_a_worker_stopped_while_starting_ends_quietly():
    """SIGTERM sent to forked workers at once (as a tool's pool does when the tool is stopped)
    ends each silently, wherever its start-up code is: the parent's handler, which raises
    ``cli.Terminated``, never runs in a child."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", STARTING_WORKERS, "200"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]


def _sigint_as_at_a_terminal() -> None:
    """A suite started in the background inherits Ctrl-C ignored; a terminal's job does not."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_training(args: list[str], save: Path) -> subprocess.Popen:
    """A tiny run long enough to be stopped, past its first step once this returns."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        str(REPO / "pretrain_gpt.py"),
        *("--model-preset", "tiny", "--global-batch-size", "2", "--eval-iters", "0"),
        *("--train-iters", "100000", "--log-interval", "1", "--save", str(save), *args),
        *SMALL_VOCABULARY,
    ]
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_as_at_a_terminal,
    )
    for line in proc.stdout:
        if "iteration        1/" in line:
            return proc
    raise AssertionError(f"the run ended before its first step:\n{proc.stderr.read()[-3000:]}")


@pytest.mark.parametrize(
    "signum, line",
    [
        (signal.SIGINT, "pretrain_gpt.py: interrupted; the checkpoints saved before it are kept"),
        (signal.SIGTERM, "pretrain_gpt.py: terminated; the checkpoints saved before it are kept"),
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_a_stopped_training_run_says_so_in_one_line(tmp_path, signum, line):
    proc = start_training([], tmp_path / "save")
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signum, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == line


@pytest.mark.parametrize(
    "flags, signum",
    [([], signal.SIGINT), (["--exit-signal", "SIGUSR1"], signal.SIGUSR1)],
    ids=["ctrl-c", "exit-signal"],
)
def test_a_handled_signal_saves_and_exits_zero(tmp_path, flags, signum):
    from megatron.apertus import checkpoint

    proc = start_training(["--exit-signal-handler", *flags], tmp_path / "save")
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    name = signal.Signals(signum).name
    assert f"exit requested by signal {name}: saving a checkpoint and stopping" in stdout + stderr
    assert checkpoint.latest_iteration(tmp_path / "save") >= 1


def test_atomic_directory_names_the_output_and_leaves_nothing_when_it_fails(tmp_path):
    """A write that fails inside the temporary directory (here the disk is full) is reported
    naming the directory the user asked for; the temporary one is gone either way."""
    final = tmp_path / "hf"

    def full_disk(directory: Path) -> None:
        (directory / "config.json").write_text("{}")
        raise OSError(28, "No space left on device", str(directory / "model.safetensors"))

    with pytest.raises(OSError) as raised:
        with cli.atomic_directory(final) as temporary:
            full_disk(temporary)
    assert raised.value.filename == str(final) and raised.value.errno == 28
    with pytest.raises(KeyboardInterrupt):
        with cli.atomic_directory(final) as temporary:
            (temporary / "config.json").write_text("{}")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with cli.atomic_directory(final) as temporary:
        (temporary / "config.json").write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert [p.name for p in final.iterdir()] == ["config.json"]


STEP = """
import sys
print("step.py: error: --flag: bad", file=sys.stderr)
sys.exit(2)
"""


def test_a_failed_step_ends_its_caller_in_one_line_with_its_status(tmp_path, capsys):
    """An example that runs our tools one after another stops at the first that fails, with
    its exit status and one line after the step's own, instead of CalledProcessError's
    traceback."""
    step = tmp_path / "step.py"
    step.write_text(STEP)
    after = []

    def main() -> None:
        cli.run_step([sys.executable, str(step)])
        after.append("ran")

    assert run_main(main) == 2 and not after
    assert capsys.readouterr().err == (
        "tool.py: error: step.py exited 2 (its error is above); the steps after it did not run\n"
    )


STOPPED_WHILE_EXITING = """
import atexit, os, signal
from megatron.apertus import cli
atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))
parser = cli.ArgumentParser(prog="tool.py")
cli.run(lambda: parser.parse_args(["--no-such-flag"]), prog="tool.py")
"""
"""A rank that refused its flags is stopped by the launcher (torchrun stops the other ranks
of a failed world) while its interpreter shuts down."""


def test_a_rank_stopped_while_exiting_after_a_flag_error_prints_no_traceback():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", STOPPED_WHILE_EXITING],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert proc.stderr == (
        "tool.py: error: unrecognized arguments: --no-such-flag (see tool.py --help)\n"
    )
