"""tools/tokenize_corpus.py --executor slurm on a real one-node cluster (``conftest.py``): an
array job of two tasks writes what tools/preprocess_data.py writes, document for document; a
task whose outputs and completion marker are gone is resubmitted alone and gives the same
bytes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megatron.apertus.data.merge import dataset_prefixes, merge
from tests.conftest import REPO
from tests.data.test_tokenize_corpus import PREPROCESS, TOKENIZE, documents, write_corpus
from tests.slurm.conftest import FINAL_STATES


def tokenize_on_slurm(slurm, inputs: list[str], out: Path) -> tuple[str, str]:
    """Submit as a user would; the job id and the tool's output."""
    env = dict(slurm.env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        str(TOKENIZE),
        "--input",
        *inputs,
        "--output-dir",
        str(out),
        "--executor",
        "slurm",
        "--tasks",
        "2",
        "--partition",
        "debug",
        "--time",
        "00:15:00",
        "--mem-per-cpu-gb",
        "1",
        "--job-name",
        "tokenize-test",
    ]
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout.split("submitted Slurm job ")[1].split()[0], proc.stdout


def wait_for_array(slurm, job: str, timeout: float = 600) -> list[str]:
    """The final states of every task of array job ``job``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = slurm.run("squeue", "-h", "-t", "all", "-j", job, "-o", "%T").stdout.split()
        if states and all(s in FINAL_STATES for s in states):
            return states
        time.sleep(1)
    raise AssertionError(f"array job {job} did not end: {states}\n{slurm.logs()}")


def test_slurm_array_tokenizes_like_preprocess_and_reruns_a_lost_task_alone(slurm, tmp_path):
    inputs = write_corpus(tmp_path / "corpus")
    reference = subprocess.run(
        [
            sys.executable,
            str(PREPROCESS),
            "--input",
            *inputs,
            "--output-prefix",
            str(tmp_path / "ref"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert reference.returncode == 0, reference.stderr
    out = tmp_path / "out"
    job, _ = tokenize_on_slurm(slurm, inputs, out)
    states = wait_for_array(slurm, job)
    logs = out / ".datatrove" / "slurm_logs"
    assert states == ["COMPLETED", "COMPLETED"], "".join(p.read_text() for p in logs.glob("*"))
    assert "#SBATCH --array=0-1" in (out / ".datatrove" / "launch_script.slurm").read_text()
    prefixes = dataset_prefixes(out)
    assert [Path(p).name for p in prefixes] == ["00000_text_document", "00001_text_document"]
    assert documents(prefixes) == documents([str(tmp_path / "ref_text_document")])
    merge(prefixes, str(tmp_path / "merged"))
    for suffix in (".bin", ".idx"):
        ours, theirs = tmp_path / f"merged{suffix}", tmp_path / f"ref_text_document{suffix}"
        assert ours.read_bytes() == theirs.read_bytes()

    # Task 1 lost (node failure after a partial write): only it is submitted again.
    first = {p: Path(p + ".bin").read_bytes() for p in prefixes}
    (out / ".datatrove" / "completions" / "00001").unlink()
    for path in out.glob("00001_*"):
        path.unlink()
    shutil.copy(out / "00000_text_document.bin", out / "00001_text_document.tmp.bin")
    job, _ = tokenize_on_slurm(slurm, inputs, out)
    assert json.loads((out / ".datatrove" / "ranks_to_run.json").read_text()) == [1]
    assert wait_for_array(slurm, job) == ["COMPLETED"]
    assert {p: Path(p + ".bin").read_bytes() for p in prefixes} == first
    assert not list(out.glob("*.tmp.*"))
