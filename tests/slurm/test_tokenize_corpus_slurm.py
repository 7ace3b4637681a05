"""tools/tokenize_corpus.py --executor slurm on a real one-node cluster (``conftest.py``): an
array job of two tasks writes what tools/preprocess_data.py writes, document for document; a
task whose outputs and completion marker are gone is resubmitted alone and gives the same
bytes; ``--merge-prefix`` merges in a job that starts after every task succeeded, and a failed
task cancels it (and its rerun merges)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megatron.apertus.prep.merge import dataset_prefixes, merge
from tests.conftest import REPO
from tests.prep.test_tokenize_corpus import (
    DOCS,
    PREPROCESS,
    TOKENIZE,
    documents,
    json_line,
    run_tool,
    write_corpus,
)
from tests.slurm.conftest import FINAL_STATES


def tokenize_on_slurm(slurm, inputs: list[str], out: Path, *extra: str) -> tuple[str, str]:
    """Submit as a user would; the tokenization job's id and the tool's output."""
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
        *extra,
    ]
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout.split("submitted Slurm job ")[1].split()[0], proc.stdout


def wait_for_array(slurm, job: str, timeout: float = 600) -> list[str]:
    """The final states of every task of array job ``job``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = slurm.query("squeue", "-h", "-t", "all", "-j", job, "-o", "%T").split()
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


def merge_job_of(stdout: str) -> str:
    return re.search(r"submitted Slurm job (\d+): the merge", stdout).group(1)


def test_merge_job_waits_for_the_tasks_and_equals_the_local_merge(slurm, tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    inputs = []
    for name, shard in (("a.jsonl", DOCS[:12]), ("b.jsonl", DOCS[12:30])):
        (folder / name).write_bytes(b"".join(json_line(d) for d in shard))
        inputs.append(str(folder / name))
    local = run_tool(
        TOKENIZE,
        "--input",
        *inputs,
        "--output-dir",
        str(tmp_path / "local"),
        "--workers",
        "2",
        "--merge-prefix",
        str(tmp_path / "local_merged"),
    )
    assert local.returncode == 0, local.stderr[-3000:]

    # Task 1 cannot open its output (a directory in the way): it fails, and the merge that
    # waits for it is cancelled instead of pending forever.
    out = tmp_path / "out"
    out.mkdir()
    (out / "00001_text_document.tmp.bin").mkdir()
    merged = tmp_path / "merged"
    job, stdout = tokenize_on_slurm(slurm, inputs, out, "--merge-prefix", str(merged))
    merge = merge_job_of(stdout)
    assert slurm.job(merge)["Dependency"].startswith(f"afterok:{job}")
    assert sorted(wait_for_array(slurm, job)) == ["COMPLETED", "FAILED"]
    assert slurm.wait(merge, timeout=120)["JobState"] == "CANCELLED", slurm.job(merge)
    assert not (tmp_path / "merged_text_document.bin").exists()

    (out / "00001_text_document.tmp.bin").rmdir()
    job, stdout = tokenize_on_slurm(slurm, inputs, out, "--merge-prefix", str(merged))
    merge = merge_job_of(stdout)
    assert json.loads((out / ".datatrove" / "ranks_to_run.json").read_text()) == [1]
    assert wait_for_array(slurm, job) == ["COMPLETED"]
    record = slurm.wait(merge)
    assert record["JobState"] == "COMPLETED", slurm.logs()
    tasks_ended = slurm.job(job)["EndTime"]
    assert record["StartTime"] >= tasks_ended  # ISO times: text order is time order
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged_text_document{suffix}").read_bytes() == (
            tmp_path / f"local_merged_text_document{suffix}"
        ).read_bytes()
    assert not list(tmp_path.glob("merged*.tmp*"))

    # Every task complete and the merged dataset gone: nothing to tokenize, the merge runs.
    for suffix in (".bin", ".idx"):
        (tmp_path / f"merged_text_document{suffix}").unlink()
    _, stdout = tokenize_on_slurm(slurm, inputs, out, "--merge-prefix", str(merged))
    assert "all 2 tasks are complete; nothing submitted" in stdout
    assert slurm.wait(merge_job_of(stdout))["JobState"] == "COMPLETED", slurm.logs()
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged_text_document{suffix}").read_bytes() == (
            tmp_path / f"local_merged_text_document{suffix}"
        ).read_bytes()
