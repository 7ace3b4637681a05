"""tools/tokenize_corpus.py (datatrove, local executor) and tools/merge_datasets.py against
tools/preprocess_data.py on the same real text: document for document, byte for byte, with bad
lines, a killed task, Parquet input and refused reruns."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.prep.merge import dataset_prefixes
from tests.conftest import REPO, run_script

TOKENIZE = REPO / "tools" / "tokenize_corpus.py"
PREPROCESS = REPO / "tools" / "preprocess_data.py"
MERGE = REPO / "tools" / "merge_datasets.py"
DOCS = embedded_documents()
BAD_LINES = [
    b'{"text": "unterminated',
    b'{"text": "caf\xe9"}',
    b'{"title": "no text"}',
    b'{"text": "  "}',
]


def tool_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def run_tool(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=REPO,
        env=tool_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def merge_tool(*args: str) -> subprocess.CompletedProcess:
    """``tools/merge_datasets.py ARGS`` forked from the warm interpreter: a merge imports
    megatron-core, 6 s of start-up in a fresh interpreter."""
    return run_script(MERGE, list(args), env=tool_env(), timeout=600)


def json_line(text: str) -> bytes:
    return json.dumps({"text": text}).encode() + b"\n"


def write_corpus(folder: Path) -> list[str]:
    """The embedded documents in four shards: plain, gzip (with bad lines), zstd, plain."""
    import zstandard

    folder.mkdir()
    quarter = len(DOCS) // 4
    shards = [DOCS[i * quarter : (i + 1) * quarter] for i in range(3)] + [DOCS[3 * quarter :]]
    payloads = [b"".join(json_line(d) for d in shard) for shard in shards]
    payloads[1] = payloads[1] + b"\n".join(BAD_LINES) + b"\n" + json_line("after the bad lines")
    paths = [folder / "a.jsonl", folder / "b.jsonl.gz", folder / "c.jsonl.zst", folder / "d.jsonl"]
    paths[0].write_bytes(payloads[0])
    paths[1].write_bytes(gzip.compress(payloads[1]))
    paths[2].write_bytes(zstandard.ZstdCompressor().compress(payloads[2]))
    paths[3].write_bytes(payloads[3])
    return [str(p) for p in paths]


def documents(prefixes: list[str]) -> list[list[int]]:
    out = []
    for prefix in prefixes:
        dataset = IndexedDataset(prefix)
        out.extend(np.array(dataset[i]).tolist() for i in range(len(dataset)))
    return out


def task_prefixes(folder: Path, tasks: int) -> list[str]:
    return [str(folder / f"{r:05d}_text_document") for r in range(tasks)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenize")
    inputs = write_corpus(root / "corpus")
    reference = run_tool(PREPROCESS, "--input", *inputs, "--output-prefix", str(root / "ref"))
    assert reference.returncode == 0, reference.stderr
    local = run_tool(
        TOKENIZE,
        "--input",
        *inputs,
        "--output-dir",
        str(root / "local"),
        "--executor",
        "local",
        "--workers",
        "2",
    )
    assert local.returncode == 0, local.stderr[-3000:]
    return root, inputs, reference, local


def test_local_two_workers_equal_preprocess_document_for_document(corpus):
    root, _, reference, local = corpus
    expected = documents([str(root / "ref_text_document")])
    got = documents(task_prefixes(root / "local", 4))
    assert len(expected) == len(DOCS) + 1
    assert got == expected
    assert f"{len(expected)} documents" in local.stdout and "rejected 4 lines" in local.stdout
    assert "rejected 4 lines" in reference.stdout
    for bad in ("invalid JSON", "not UTF-8", "missing key 'text'", "empty document"):
        assert bad in local.stdout
    task_log = (root / "local" / ".datatrove" / "logs" / "task_00001.log").read_text()
    assert f"b.jsonl.gz:{len(DOCS) // 4 + 1}: skipped: invalid JSON" in task_log
    assert not list((root / "local").glob("*.tmp*"))


def test_merge_of_the_tasks_equals_one_shot_preprocessing_byte_for_byte(corpus):
    root, *_ = corpus
    merged = merge_tool("--input", str(root / "local"), "--output-prefix", str(root / "m"))
    assert merged.returncode == 0, merged.stderr
    for suffix in (".bin", ".idx"):
        assert (root / f"m{suffix}").read_bytes() == (
            root / f"ref_text_document{suffix}"
        ).read_bytes()
    record = json.loads((root / "m.meta.json").read_text())
    assert record == json.loads((root / "ref_text_document.meta.json").read_text())
    assert record["tokenizer"]["vocab_size"] == 131072 and record["dtype"] == "int32"


def test_killed_task_rerun_alone_gives_the_same_bytes(corpus, tmp_path):
    root, inputs, *_ = corpus
    out = tmp_path / "out"
    command = [sys.executable, str(TOKENIZE), "--input", *inputs, "--output-dir", str(out)]
    proc = subprocess.Popen(
        command, cwd=REPO, env=tool_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    started = out / "00001_text_document.tmp.bin"
    deadline = time.monotonic() + 300
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert started.exists(), "task 1 had not started"
    assert (out / ".datatrove" / "completions" / "00000").is_file()
    assert not (out / ".datatrove" / "completions" / "00001").exists()
    assert not (out / "00001_text_document.bin").exists()
    first_task = (out / "00000_text_document.bin").stat().st_mtime_ns
    rerun = run_tool(TOKENIZE, "--input", *inputs, "--output-dir", str(out))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "skipping 1 completed tasks" in rerun.stderr
    assert "wrote 4 datasets (3 in this run, 1 complete before)" in rerun.stdout
    this_run = sum(
        json.loads(Path(p + ".meta.json").read_text())["tokens"] for p in task_prefixes(out, 4)[1:]
    )
    assert f"this run: {this_run} tokens in" in rerun.stdout
    elapsed, rate = re.search(r"tokens in ([\d.]+) s \(([\d,]+) tokens/s\)", rerun.stdout).groups()
    low, high = float(elapsed) - 0.05, float(elapsed) + 0.05  # printed to 0.1 s
    assert this_run / high - 1 <= int(rate.replace(",", "")) <= this_run / max(low, 1e-9) + 1
    assert (out / "00000_text_document.bin").stat().st_mtime_ns == first_task
    for ours, theirs in zip(task_prefixes(out, 4), task_prefixes(root / "local", 4)):
        for suffix in (".bin", ".idx"):
            assert Path(ours + suffix).read_bytes() == Path(theirs + suffix).read_bytes()


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux ``/proc``)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def start_and_wait_for_task(command: list[str], started: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        command, cwd=REPO, env=tool_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert started.exists() and proc.poll() is None, "the task had not started"
    return proc


def test_a_killed_worker_is_named_and_a_rerun_finishes_the_job(corpus, tmp_path):
    """datatrove's own pool waited forever for a task killed with SIGKILL."""
    root, inputs, *_ = corpus
    out = tmp_path / "out"
    command = [
        sys.executable,
        str(TOKENIZE),
        "--input",
        *inputs,
        "--output-dir",
        str(out),
        "--workers",
        "2",
        "--merge-prefix",
        str(tmp_path / "merged"),
    ]
    proc = start_and_wait_for_task(command, out / "00000_text_document.tmp.bin")
    os.kill(children(proc.pid)[0], signal.SIGKILL)  # the first task started: task 0
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 1, stderr[-3000:]
    assert "task 00000 died (killed by SIGKILL)" in stderr
    assert "run the same command again to redo only the unfinished tasks" in stderr
    assert not (out / "00000_text_document.bin").exists()
    assert not (tmp_path / "merged_text_document.bin").exists()
    rerun = run_tool(TOKENIZE, *command[2:])
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    for ours, theirs in zip(task_prefixes(out, 4), task_prefixes(root / "local", 4)):
        for suffix in (".bin", ".idx"):
            assert Path(ours + suffix).read_bytes() == Path(theirs + suffix).read_bytes()
    for suffix in (".bin", ".idx"):  # --merge-prefix: the merge once every task is complete
        assert (tmp_path / f"merged_text_document{suffix}").read_bytes() == (
            root / f"ref_text_document{suffix}"
        ).read_bytes()


def test_tasks_end_with_their_parent(corpus, tmp_path):
    root, inputs, *_ = corpus
    out = tmp_path / "out"
    command = [
        sys.executable,
        str(TOKENIZE),
        "--input",
        *inputs,
        "--output-dir",
        str(out),
        "--workers",
        "2",
    ]
    proc = start_and_wait_for_task(command, out / "00000_text_document.tmp.bin")
    workers = children(proc.pid)
    assert workers
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 60
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(w) for w in workers), "a task outlived its parent"


def test_slurm_without_sbatch_on_path_says_so(corpus, tmp_path):
    _, inputs, *_ = corpus
    env = dict(tool_env(), PATH=os.path.dirname(sys.executable))
    proc = subprocess.run(
        [
            sys.executable,
            str(TOKENIZE),
            "--input",
            *inputs,
            "--output-dir",
            str(tmp_path / "out"),
            "--executor",
            "slurm",
            "--partition",
            "normal",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "tokenize_corpus.py: error: --executor slurm: sbatch is not "
        "on PATH (run this on a Slurm login node, or use --executor "
        "local)"
    )
    assert not (tmp_path / "out").exists()


def test_parquet_shards_give_the_jsonl_stream(corpus, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root, *_ = corpus
    half = len(DOCS) // 2
    for name, texts in (("a", DOCS[:half]), ("b", [None, *DOCS[half:]])):
        pq.write_table(pa.table({"text": texts}), tmp_path / f"{name}.parquet", row_group_size=7)
    proc = run_tool(
        TOKENIZE,
        "--input",
        str(tmp_path / "*.parquet"),
        "--output-dir",
        str(tmp_path / "out"),
        "--strict",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # the null row is rejected
    assert "b.parquet:1: skipped: key 'text' is NoneType, not a string" in proc.stderr
    reference = documents([str(root / "ref_text_document")])
    quarter = len(DOCS) // 4
    clean = reference[: 2 * quarter] + reference[2 * quarter + 1 :]  # drop "after the bad lines"
    assert documents(task_prefixes(tmp_path / "out", 2)) == clean


def test_bad_flags_and_changed_reruns_exit_2_in_one_line(corpus, tmp_path):
    root, inputs, *_ = corpus
    cases = [
        (["--input", str(tmp_path / "nothing*.jsonl")], "no such file"),
        (["--input", *inputs, "--tasks", "5"], "--tasks 5: give between 1 and the 4 input files"),
        (["--input", *inputs, "--executor", "slurm"], "--executor slurm needs --partition"),
        (["--input", *inputs[:3]], "holds the tasks of another command"),
    ]
    for args, message in cases:
        proc = run_tool(TOKENIZE, *args, "--output-dir", str(root / "local"))
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert message in proc.stderr and "Traceback" not in proc.stderr


def test_merge_refuses_parts_of_another_tokenizer_setting(corpus, tmp_path):
    root, inputs, *_ = corpus
    parts = tmp_path / "parts"
    parts.mkdir()
    for suffix in (".bin", ".idx", ".meta.json"):
        os.link(root / "local" / f"00000_text_document{suffix}", parts / f"00000{suffix}")
    proc = run_tool(
        PREPROCESS, "--input", inputs[3], "--output-prefix", str(parts / "x"), "--no-bos"
    )
    assert proc.returncode == 0, proc.stderr
    merged = merge_tool("--input", str(parts), "--output-prefix", str(tmp_path / "m"))
    assert merged.returncode == 2 and "add_bos False differs from" in merged.stderr
    (parts / "x_text_document.meta.json").unlink()
    merged = merge_tool("--input", str(parts), "--output-prefix", str(tmp_path / "m"))
    assert merged.returncode == 2 and "x_text_document.meta.json is missing" in merged.stderr
    unchecked = merge_tool(
        "--input", str(parts), "--output-prefix", str(tmp_path / "m"), "--no-tokenizer-check"
    )
    assert unchecked.returncode == 0, unchecked.stderr
    assert not list(tmp_path.glob("m.tmp*"))


def test_empty_and_unreadable_shards_are_named_and_the_rest_is_kept(corpus, tmp_path):
    _, inputs, *_ = corpus
    empty, broken = tmp_path / "e.jsonl", tmp_path / "f.jsonl.gz"
    empty.write_bytes(b"")
    broken.write_bytes(gzip.compress(json_line(DOCS[0]))[:-12])  # truncated: no gzip trailer
    out = tmp_path / "out"
    proc = run_tool(
        TOKENIZE, "--input", inputs[0], str(empty), str(broken), "--output-dir", str(out)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{empty}: empty shard (no lines)" in proc.stderr
    assert f"{broken}:1: skipped: unreadable shard (EOFError: Compressed file ended" in proc.stderr
    assert "rejected 1 lines (1 unreadable shard)" in proc.stdout
    # tasks with no document (the empty shard, the unreadable one) write a record, no dataset:
    # megatron-core cannot map an empty .bin
    assert [Path(p).name for p in dataset_prefixes(out)] == ["00000_text_document"]
    for rank in (1, 2):
        record = json.loads((out / f"{rank:05d}_text_document.meta.json").read_text())
        assert record["documents"] == 0
    assert len(documents(dataset_prefixes(out))) == len(DOCS) // 4
