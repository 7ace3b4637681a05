"""Tokenization as a datatrove pipeline: one megatron-core indexed dataset per task.

Two pipeline steps, run by datatrove's local or Slurm executor:

* :class:`ShardReader` reads task ``r``'s share of the inputs, a contiguous block of the
  ordered file list (datatrove's own readers deal files round-robin and give up on a file at its
  first undecodable line; contiguous blocks make the task outputs, taken in task order, the
  input in its order, so merging them equals preprocessing everything at once). JSON lines
  (plain, ``.gz``, ``.zst``) and Parquet, local or any fsspec URL.
* :class:`IndexedDatasetWriter` tokenizes every document exactly as ``tools/preprocess_data.py``
  does (same functions: :func:`~megatron.apertus.prep.preprocess.parse_record`,
  :func:`~megatron.apertus.prep.preprocess.encode_document`), rejects the same lines for the same
  reasons, and writes ``OUTPUT/NNNNN_KEY_document.bin/.idx`` (+ ``.meta.json``) through
  :mod:`~megatron.apertus.prep.indexed_writer` (megatron-core's format) under temporary names,
  renamed when complete.

A task is marked complete by datatrove only after its outputs are renamed, and a rerun task
starts its files from the beginning, so a killed task rerun gives the same bytes and a rerun of
the whole job neither duplicates nor drops a document.

On one machine the tasks run under :func:`run_local_tasks` rather than datatrove's local
executor, whose pool waits forever for a worker killed outright and whose helper process
outlives a killed parent: each task is a process of its own, watched until it exits, and it
ends with its parent. :class:`MergeTasks` merges the tasks' datasets (on Slurm, as a job that
depends on the tokenization job).

``tools/tokenize_corpus.py``'s flags are declared here too (:class:`TokenizeCorpusConfig`, for
the flags generator): the tokenizer's and the documents' groups are those of
``tools/preprocess_data.py``.
"""

from __future__ import annotations

import functools
import io
import json
import os
import time
from dataclasses import dataclass
from typing import Iterator, Literal, Optional

from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.utils.logging import logger

from megatron.apertus.cli import die_with_parent
from megatron.apertus.flags import flag_help, switch
from megatron.apertus.prep.indexed_writer import IndexedDatasetWriter as _BinWriter
from megatron.apertus.prep.merge import dataset_prefixes, merge
from megatron.apertus.prep.preprocess import (
    DocumentOptions,
    Summary,
    dataset_record,
    encode_document,
    index_dtype,
    output_prefix,
    parse_line,
    parse_record,
    report_rejected,
    tokenizer_record,
    write_dataset_record,
)
from megatron.apertus.tokenizer.config import TokenizerConfig
from megatron.apertus.tokenizer.tokenizers import Tokenizer, checked_tokenizer

COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
PROGRESS_SECONDS = 30.0


@dataclass(kw_only=True, frozen=True)
class TaskData:
    """The inputs and outputs of the tasks; with the tokenizer's and the documents' groups, the
    flags of tools/preprocess_data.py that apply to a task."""

    input: list[str] = flag_help(
        "JSON-lines (.jsonl, .gz, .zst) or .parquet files; globs and fsspec URLs allowed; "
        "sorted per pattern, in the order given"
    )
    output_dir: str = flag_help("where the tasks' datasets go", ours=True)
    max_reported: int = flag_help("bad lines reported in full, per task", 10, ours=True)
    strict: bool = switch("exit 1 when any line was rejected (local executor)", ours=True)


@dataclass(kw_only=True, frozen=True)
class Execution:
    """How the tasks run, and what follows them."""

    executor: Literal["local", "slurm"] = flag_help("where the tasks run", "local", ours=True)
    tasks: Optional[int] = flag_help(
        "datasets to write (default: one per input file)", None, ours=True
    )
    workers: Optional[int] = flag_help(
        "tasks running at once (local default 1; slurm default: no limit)", None, ours=True
    )
    merge_prefix: Optional[str] = flag_help(
        "when every task is complete, merge the tasks' datasets into "
        "MERGE_PREFIX_KEY_document.bin/.idx (on Slurm: a job that depends on the tokenization "
        "job)",
        None,
        ours=True,
    )
    logging_dir: Optional[str] = flag_help(
        "datatrove logs, stats and completion markers (default: OUTPUT_DIR/.datatrove)",
        None,
        ours=True,
    )


@dataclass(kw_only=True, frozen=True)
class SlurmJob:
    """The Slurm executor's job options."""

    partition: Optional[str] = flag_help("the partition the jobs run in", None, ours=True)
    time: str = flag_help("time limit per task", "24:00:00", ours=True)
    cpus_per_task: int = flag_help("CPUs per task", 1, ours=True)
    mem_per_cpu_gb: int = flag_help("memory per CPU in GB", 4, ours=True)
    job_name: str = flag_help("the job's name", "tokenize", ours=True)
    qos: Optional[str] = flag_help("the jobs' quality of service", None, ours=True)
    sbatch_args: list[str] = flag_help(
        "further #SBATCH options as KEY=VALUE, e.g. account=a01", default_factory=list, ours=True
    )
    env_command: Optional[str] = flag_help(
        "shell line run before each task (default: put this Python's bin directory first on "
        "PATH)",
        None,
        ours=True,
    )


@dataclass(kw_only=True, frozen=True)
class TokenizeCorpusConfig(TokenizerConfig, DocumentOptions, TaskData, Execution, SlurmJob):
    """Every flag of ``tools/tokenize_corpus.py``, one group each in its ``--help``."""


@functools.lru_cache(maxsize=None)
def cached_tokenizer(tokenizer_type: str, tokenizer_model: str | None) -> Tokenizer:
    """One tokenizer per process; tasks forked by the local executor inherit the parent's. A file
    that is no tokenizer of ``tokenizer_type`` is refused naming ``--tokenizer-model``."""
    return checked_tokenizer(tokenizer_type, tokenizer_model)


def task_files(files: list[str], rank: int, world_size: int) -> list[str]:
    """Task ``rank``'s contiguous block of ``files`` (sizes differ by at most one)."""
    return files[rank * len(files) // world_size : (rank + 1) * len(files) // world_size]


def task_prefix(output_dir: str, rank: int, key: str) -> str:
    return output_prefix(os.path.join(output_dir, f"{rank:05d}"), key)


def is_parquet(path: str) -> bool:
    return path.endswith(".parquet")


@dataclass(frozen=True)
class Line:
    """A line (or Parquet row) that the writer either tokenizes or reports."""

    where: str
    texts: dict[str, str] | None
    reason: str | None


def _document(line: Line, file_index: int, files: int) -> Document:
    return Document(
        text=next(iter(line.texts.values())) if line.texts else "",
        id=line.where,
        metadata={"line": line, "files": (file_index, files)},
    )


class ShardReader(PipelineStep):
    """Task ``rank``'s block of input files as documents, bad lines included (flagged)."""

    name = "shard reader"
    type = "📖 - READER"

    def __init__(self, files: list[str], json_keys: list[str]):
        super().__init__()
        self.files = files
        self.json_keys = json_keys

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1):
        shard = task_files(self.files, rank, world_size)
        for index, path in enumerate(shard):
            logger.info(f"reading {path} ({index + 1}/{len(shard)})")
            self.stat_update("input_files")
            lines = self._parquet_rows(path) if is_parquet(path) else self._json_lines(path)
            read = 0
            try:
                for line in lines:
                    read += 1
                    yield _document(line, index, len(shard))
            except (OSError, EOFError, ValueError) as err:  # corrupt compression or Parquet
                reason = f"unreadable shard ({type(err).__name__}: {err}); rest of file skipped"
                yield _document(Line(f"{path}:{read + 1}", None, reason), index, len(shard))
            if not read:
                logger.warning(f"{path}: empty shard (no lines)")
                self.stat_update("empty_shards")

    def _json_lines(self, path: str) -> Iterator[Line]:
        from fsspec import open as fs_open

        compression = COMPRESSION.get(os.path.splitext(path)[1])
        with fs_open(path, "rb", compression=compression) as opened:
            # zstandard's reader is not line-iterable; a buffer over it is
            stream = io.BufferedReader(opened) if compression == "zstd" else opened
            for number, raw in enumerate(stream, start=1):
                try:
                    yield Line(f"{path}:{number}", parse_line(raw, self.json_keys), None)
                except ValueError as err:
                    yield Line(f"{path}:{number}", None, str(err))

    def _parquet_rows(self, path: str) -> Iterator[Line]:
        import pyarrow.parquet as pq
        from fsspec import open as fs_open

        with fs_open(path, "rb") as stream:
            table = pq.ParquetFile(stream)
            columns = [k for k in self.json_keys if k in table.schema_arrow.names]
            number = 0
            for batch in table.iter_batches(columns=columns or None):
                for row in batch.to_pylist():
                    number += 1
                    record = {k: row[k] for k in columns}
                    try:
                        yield Line(f"{path}:{number}", parse_record(record, self.json_keys), None)
                    except ValueError as err:
                        yield Line(f"{path}:{number}", None, str(err))


class IndexedDatasetWriter(PipelineStep):
    """Tokenize the task's documents into one megatron-core indexed dataset per JSON key."""

    name = "indexed dataset writer"
    type = "💽 - WRITER"

    def __init__(
        self,
        output_dir: str,
        json_keys: list[str],
        tokenizer_type: str,
        tokenizer_model: str | None,
        add_bos: bool,
        add_eod: bool,
        max_reported: int,
    ):
        super().__init__()
        self.output_dir = output_dir
        self.json_keys = json_keys
        self.tokenizer_type = tokenizer_type
        self.tokenizer_model = tokenizer_model
        self.add_bos = add_bos
        self.add_eod = add_eod
        self.max_reported = max_reported

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> None:
        """Consume the documents (the last step: it yields nothing further)."""
        tokenizer = cached_tokenizer(self.tokenizer_type, self.tokenizer_model)
        dtype = index_dtype(tokenizer.vocab_size)
        prefixes = {key: task_prefix(self.output_dir, rank, key) for key in self.json_keys}
        builders = {k: _BinWriter(f"{p}.tmp.bin", dtype=dtype) for k, p in prefixes.items()}
        summary, key_tokens = Summary(), dict.fromkeys(self.json_keys, 0)
        progress = _Progress(rank)
        for document in data or []:
            line: Line = document.metadata["line"]
            if line.texts is None:
                report_rejected(
                    summary, line.where, line.reason, self.max_reported, warn=logger.warning
                )
                self.stat_update("rejected")
                continue
            for key, text in line.texts.items():
                ids = encode_document(tokenizer, text, self.add_bos, self.add_eod)
                builders[key].add_document(ids, [ids.size])
                key_tokens[key] += ids.size
                summary.tokens += ids.size
            summary.documents += 1
            self.stat_update("documents")
            progress.update(summary, *document.metadata["files"])
        record = tokenizer_record(self.tokenizer_type, tokenizer)
        for key, prefix in prefixes.items():
            builders[key].finalize(f"{prefix}.tmp.idx")
            for suffix in (".bin", ".idx"):
                if summary.documents:
                    os.replace(f"{prefix}.tmp{suffix}", f"{prefix}{suffix}")
                else:  # megatron-core cannot map an empty .bin: no dataset, only the record
                    os.remove(f"{prefix}.tmp{suffix}")
            per_key = Summary(documents=summary.documents, tokens=key_tokens[key])
            write_dataset_record(
                prefix,
                dataset_record(record, self.add_bos, self.add_eod, per_key)
                | {"rejected": dict(summary.rejected)},
            )
        logger.info(
            f"task {rank}: wrote {summary.documents} documents, {summary.tokens} tokens; "
            f"rejected {summary.rejected_lines} lines {json.dumps(dict(summary.rejected))}"
        )


class _Progress:
    """Documents/s, tokens/s and an ETA (from the share of files done) every 30 s."""

    def __init__(self, rank: int):
        self.rank = rank
        self.start = self.last = time.monotonic()

    def update(self, summary: Summary, file_index: int, files: int) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_SECONDS:
            return
        self.last, elapsed = now, now - self.start
        eta = elapsed * (files / file_index - 1) if file_index else float("nan")
        logger.info(
            f"task {self.rank}: file {file_index + 1}/{files}, {summary.documents:,} documents "
            f"({summary.documents / elapsed:,.0f}/s), {summary.tokens / elapsed:,.0f} tokens/s, "
            f"ETA {eta:,.0f} s (by files done)"
        )


class MergeTasks(PipelineStep):
    """Merge the tasks' datasets of each key, in task order, into ``PREFIX_KEY_document``."""

    name = "merge task datasets"
    type = "🔗 - MERGER"

    def __init__(self, output_dir: str, json_keys: list[str], merge_prefix: str):
        super().__init__()
        self.output_dir = output_dir
        self.json_keys = json_keys
        self.merge_prefix = merge_prefix

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> None:
        for key, parts in task_datasets(self.output_dir, self.json_keys).items():
            target = output_prefix(self.merge_prefix, key)
            documents = merge(parts, target)
            logger.info(f"merged {len(parts)} task datasets, {documents} documents into {target}")


def task_datasets(output_dir: str, json_keys: list[str]) -> dict[str, list[str]]:
    """Per key, the prefixes of the tasks' datasets in task order (a task that kept no document
    has none)."""
    prefixes = dataset_prefixes(output_dir)
    return {key: [p for p in prefixes if p.endswith(f"_{key}_document")] for key in json_keys}


def run_local_tasks(executor, workers: int, report=print) -> dict[int, str]:
    """Run the incomplete tasks of a datatrove ``LocalPipelineExecutor``, at most ``workers`` at
    once, each in a forked process of its own; {task: why it failed} for those that did not
    complete. A task that dies (killed, out of memory) is reported through ``report`` when it
    happens and the others go on; a rerun redoes exactly the tasks that did not complete.
    Ctrl-C or SIGTERM here stops the running tasks and removes their temporary outputs."""
    import multiprocessing
    from multiprocessing.connection import wait

    context = multiprocessing.get_context("fork")
    pending = executor.get_incomplete_ranks()
    executor.save_executor_as_json()
    running: dict[int, tuple[int, int, multiprocessing.Process]] = {}
    slots, failed = list(range(workers)), {}
    try:
        while pending or running:
            while pending and slots:
                rank, slot = pending.pop(0), slots.pop()
                process = context.Process(
                    target=_run_task, args=(executor, rank, slot), name=f"task {rank:05d}"
                )
                process.start()
                running[process.sentinel] = (rank, slot, process)
            for sentinel in wait(list(running)):
                rank, slot, process = running.pop(sentinel)
                process.join()
                slots.append(slot)
                if process.exitcode != 0:
                    failed[rank] = _exit_reason(process.exitcode)
                    report(f"task {rank:05d} {failed[rank]}; the other tasks go on")
    except BaseException:
        for rank, _, process in running.values():
            process.terminate()
            process.join()
            _remove_partial_outputs(executor, rank)
        raise
    return failed


def _run_task(executor, rank: int, slot: int) -> None:
    die_with_parent()
    try:
        executor._run_for_rank(rank, local_rank=slot)
    except Exception:  # datatrove logged the traceback in the task's log
        raise SystemExit(1) from None


def _exit_reason(exitcode: int) -> str:
    import signal

    if exitcode < 0:
        return f"died (killed by {signal.Signals(-exitcode).name})"
    return f"failed (exit status {exitcode})"


def _remove_partial_outputs(executor, rank: int) -> None:
    writer = executor.pipeline[-1]
    for key in writer.json_keys:
        for suffix in (".tmp.bin", ".tmp.idx"):
            path = task_prefix(writer.output_dir, rank, key) + suffix
            if os.path.exists(path):
                os.remove(path)
