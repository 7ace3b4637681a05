"""What a run leaves while it runs: the README's smallest run prints its first iteration line
early, in Megatron-LM's form; a run killed with SIGKILL keeps its JSON log up to the kill and
its loss plot as of its last checkpoint."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys

import psutil

from megatron.apertus.training.metrics import read_history
from tests.conftest import PRETRAIN, REPO, SMALL_VOCABULARY

ITERATION_LINE = re.compile(
    r"iteration +(\d+)/ +(\d+) \| consumed samples: +\d+ \| elapsed time per iteration \(ms\): "
    r"[\d.]+ \| throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \| learning rate: [\d.E+-]+ \| "
    r"global batch size: +\d+ \| lm loss: [\d.E+-]+ \| loss scale: [\d.]+ \| grad norm: [\d.]+ \| "
    r"number of skipped iterations: +\d+ \| number of nan iterations: +\d+ \| "
    r"tokens per second per device: \d+ \| memory \(GiB\): [\d.]+ \|"
)


def _readme_smallest_run() -> list[str]:
    """The README's smallest ``pretrain_gpt.py`` command, as words."""
    text = (REPO / "README.md").read_text()
    command = re.search(
        r"\.venv/bin/python (pretrain_gpt\.py --model-preset tiny .*?)\n```", text, re.S
    ).group(1)
    return shlex.split(command.replace("\\\n", " "))[1:]


def _start(args: list[str], cwd) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, str(PRETRAIN), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_first_iteration_line_of_the_smallest_run_comes_within_15_lines(tmp_path):
    """Only our lines and warnings reach the console; megatron-core's parameter lists and
    configs go to SAVE/debug.log."""
    proc = _start(_readme_smallest_run(), cwd=tmp_path)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if ITERATION_LINE.search(line):
            break
    proc.kill()
    proc.wait()
    assert ITERATION_LINE.search(lines[-1]) and len(lines) <= 15, "".join(lines[-40:])
    assert re.search(r"iteration +1/ +20 \|", lines[-1])
    assert "Params for bucket" in (tmp_path / "runs" / "tiny" / "debug.log").read_text()


QUEUE_FROM_A_THREAD = """
import threading, time
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.apertus import checkpoint
if __name__ == "__main__":
    starter = threading.Thread(target=checkpoint._use_write_results_queue, args=(True,))
    starter.start()
    starter.join()
    queue = filesystem_async._results_queue
    queue.put("served")
    print(queue.get(), flush=True)
    time.sleep(600)
"""


def test_checkpoint_results_queue_outlives_its_thread_not_its_process(tmp_path):
    """The first save may come from any thread: the queue's server stays while the trainer
    lives, and ends when the trainer is killed."""
    script = tmp_path / "queue_from_a_thread.py"
    script.write_text(QUEUE_FROM_A_THREAD)
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    servers = []
    try:
        assert proc.stdout.readline().strip() == "served"
        servers = psutil.Process(proc.pid).children(recursive=True)
        assert servers
    finally:
        proc.kill()
        proc.wait()
    _, left = psutil.wait_procs(servers, timeout=30)
    assert not left, f"processes outlived the killed trainer: {left}"


def test_a_killed_run_keeps_its_json_log_and_plot(tmp_path):
    save, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    proc = _start(
        [
            "--model-preset",
            "tiny",
            "--train-iters",
            "200",
            "--global-batch-size",
            "2",
            "--log-interval",
            "2",
            "--save",
            str(save),
            "--save-interval",
            "2",
            "--async-save",
            "--log-json",
            str(log),
            *SMALL_VOCABULARY,
        ],
        cwd=REPO,
    )
    logged = []
    for line in proc.stdout:
        match = ITERATION_LINE.search(line)
        if match:
            logged.append(int(match.group(1)))
        if len(logged) == 3:
            break
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "background saves report through a queue served by a process"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _, left = psutil.wait_procs(children, timeout=30)
    assert not left, f"processes outlived the killed run: {left}"
    assert logged == [1, 2, 4]
    steps = [iteration for iteration, _ in read_history(log)["train/loss"]]
    assert steps[: logged[-1]] == list(range(1, logged[-1] + 1)), "every step up to the kill"
    assert (save / "loss.png").stat().st_size > 0, "the plot is drawn at each checkpoint"
