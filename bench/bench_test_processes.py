"""The test suite's process tax: an entry point run as a fresh interpreter against a fork of the
warm one (``tests/warm_interpreter.py``), the same commands in the same run.

Rows: a one-step tiny training run with a save (one process), and the same as a two-process
data-parallel world (``torchrun --standalone`` against two forked ranks). Each row gives the
median wall time over ``--repeat`` runs and the CPU time (user + system) of every process the
run started, waited for or not, taken from the kernel's per-process accounting.

    python bench/bench_test_processes.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import write_results  # noqa: E402
from tests.conftest import PRETRAIN, run_script  # noqa: E402

TINY_STEP = [
    "--model-preset",
    "tiny",
    "--train-iters",
    "1",
    "--global-batch-size",
    "2",
    "--micro-batch-size",
    "1",
    "--eval-iters",
    "0",
]


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cold_run(nproc: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of every process it started) of one tiny step with a save,
    in fresh interpreters."""
    os.environ["APERTUS_TEST_FORK"] = "0"
    before = _cpu_of_children()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        args = TINY_STEP + ["--save", str(Path(scratch) / "ckpt")]
        proc = run_script(PRETRAIN, args, nproc=nproc, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr[-3000:]
    return time.perf_counter() - start, _cpu_of_children() - before


def warm_rows(nproc: int, repeat: int) -> dict:
    """Wall time of each run once the warm interpreter is up, its start apart, and the CPU time
    of the whole (server and forks: their accounting reaches this process when the server
    ends) per run."""
    from tests import warm_interpreter

    os.environ["APERTUS_TEST_FORK"] = "1"
    before = _cpu_of_children()
    start = time.perf_counter()
    warm_interpreter.start()
    startup = time.perf_counter() - start
    walls = []
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(repeat):
            args = TINY_STEP + ["--save", str(Path(scratch) / f"ckpt{i}")]
            begin = time.perf_counter()
            proc = run_script(
                PRETRAIN, args, nproc=nproc, env=dict(os.environ, OMP_NUM_THREADS="1")
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            walls.append(time.perf_counter() - begin)
    warm_interpreter.stop()
    return {
        "server_start_wall_s": startup,
        "run_wall_s": statistics.median(walls),
        "cpu_s_per_run_with_imports_shared": (_cpu_of_children() - before) / repeat,
    }


def cold_row(nproc: int, repeat: int) -> dict:
    runs = [cold_run(nproc) for _ in range(repeat)]
    return {
        "run_wall_s": statistics.median(w for w, _ in runs),
        "cpu_s_per_run": statistics.median(c for _, c in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for nproc in (1, 2):
        cold = cold_row(nproc, args.repeat)
        warm = warm_rows(nproc, args.repeat)
        row = {"processes": nproc, "fresh_interpreter": cold, "forked_from_warm": warm}
        row["wall_ratio"] = cold["run_wall_s"] / warm["run_wall_s"]
        print(row, flush=True)
        rows.append(row)
    load = os.getloadavg()[0]
    print(f"wrote {write_results('test_processes', rows, {'load_average_at_start': load})}")


if __name__ == "__main__":
    main()
