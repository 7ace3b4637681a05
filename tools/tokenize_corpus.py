"""Tokenize a corpus on one machine or a Slurm cluster with datatrove: one indexed dataset per task.

    python tools/tokenize_corpus.py --input 'corpus/*.jsonl.zst' --output-dir data/tokens \\
        --executor local --workers 8
    python tools/tokenize_corpus.py --input 'corpus/*.parquet' --output-dir data/tokens \\
        --executor slurm --tasks 512 --partition normal --time 04:00:00

Task ``r`` tokenizes a contiguous block of the sorted input files into
``OUTPUT_DIR/r_KEY_document.bin/.idx`` (``r`` as 5 digits) exactly as tools/preprocess_data.py
would (same ``<s>``/``</s>`` rules and rejected lines), so that the tasks' outputs in order equal
one preprocess_data.py run over all inputs. Rerunning the same command skips completed tasks
(datatrove's completion markers under ``--logging-dir``) and redoes the others from scratch.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import sys
import time
from pathlib import Path

from megatron.apertus.cli import ArgumentParser, atomic_outputs, run
from megatron.apertus.data.indexed import RECORD_SUFFIX
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import add_arguments, from_arguments
from megatron.apertus.prep.preprocess import (
    DocumentOptions,
    Summary,
    check_input_files,
    require_documents,
    tokenizer_record,
)
from megatron.apertus.prep.tokenize_pipeline import (
    Execution,
    IndexedDatasetWriter,
    MergeTasks,
    ShardReader,
    SlurmJob,
    TaskData,
    TokenizeCorpusConfig,
    cached_tokenizer,
    run_local_tasks,
    task_prefix,
)
from megatron.apertus.tokenizer.config import TokenizerConfig

PLAN_FILE = "tokenize_corpus.json"


InputError = ConfigError
"""Bad flags or inputs, reported in one line with exit status 2."""


GROUPS = {
    "data (as tools/preprocess_data.py)": TaskData,
    "tokenizer": TokenizerConfig,
    "documents": DocumentOptions,
    "execution": Execution,
    "Slurm executor": SlurmJob,
}
"""The groups of :class:`TokenizeCorpusConfig` by their ``--help`` titles."""


def parse_args(argv: list[str] | None = None) -> TokenizeCorpusConfig:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for title, group in GROUPS.items():
        add_arguments(parser, group, title=title)
    return from_arguments(TokenizeCorpusConfig, parser.parse_args(argv))


def expand_inputs(patterns: list[str]) -> list[str]:
    """Every input file, each pattern's matches sorted; a pattern matching nothing is an error."""
    files = []
    for pattern in patterns:
        if "://" in pattern:
            from fsspec.core import url_to_fs

            fs, path = url_to_fs(pattern)
            matches = sorted(fs.unstrip_protocol(p) for p in fs.glob(path))
        else:
            matches = sorted(glob.glob(pattern))
        if not matches:
            raise InputError(f"--input {pattern}: no such file")
        files.extend(matches)
    check_input_files(files)
    return files


def check(config: TokenizeCorpusConfig, files: list[str]) -> tuple[int, dict]:
    """The number of tasks and the tokenizer's record; refuse what would fail later, on a
    compute node."""
    tasks = config.tasks or len(files)
    if tasks < 1 or tasks > len(files):
        raise InputError(
            f"--tasks {tasks}: give between 1 and the {len(files)} input files "
            "(a task tokenizes whole files)"
        )
    if config.executor == "slurm" and not config.partition:
        raise InputError("--executor slurm needs --partition")
    if config.executor == "slurm" and shutil.which("sbatch") is None:
        raise InputError(
            "--executor slurm: sbatch is not on PATH (run this on a Slurm login "
            "node, or use --executor local)"
        )
    if config.workers is not None and config.workers < 1 and config.executor == "local":
        raise InputError(f"--workers {config.workers}: must be at least 1")
    if not Path(config.output_dir).parent.is_dir():
        raise InputError(f"--output-dir: {Path(config.output_dir).parent} does not exist")
    if config.merge_prefix and not Path(config.merge_prefix).absolute().parent.is_dir():
        raise InputError(
            f"--merge-prefix: {Path(config.merge_prefix).absolute().parent} does " "not exist"
        )
    tokenizer = cached_tokenizer(config.tokenizer_type, config.tokenizer_model)
    for item in config.sbatch_args:
        if "=" not in item:
            raise InputError(f"--sbatch-config {item}: expected KEY=VALUE")
    return tasks, tokenizer_record(config.tokenizer_type, tokenizer)


def check_same_run(logging_dir: str, plan: dict) -> None:
    """Record what the tasks are; refuse a rerun that would make them something else.

    Completed tasks are skipped on a rerun, so a rerun with other inputs, tasks, keys, tokenizer
    or ``<s>``/``</s>`` rules would mix two datasets (or drop and duplicate documents).
    """
    path = Path(logging_dir) / PLAN_FILE
    if path.is_file():
        if json.loads(path.read_text()) != plan:
            raise InputError(
                f"{path.parent} holds the tasks of another command (other "
                f"inputs, --tasks, keys or tokenizer; see {path}): use a new "
                "--output-dir or --logging-dir"
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_outputs(path) as (temporary,):
        Path(temporary).write_text(json.dumps(plan, indent=1))


def logging_dir_of(config: TokenizeCorpusConfig) -> str:
    return os.path.abspath(config.logging_dir or os.path.join(config.output_dir, ".datatrove"))


def build_executor(config: TokenizeCorpusConfig, files: list[str], tasks: int) -> tuple:
    """The tokenization executor, and the Slurm options a dependent job reuses (none locally)."""
    output_dir = os.path.abspath(config.output_dir)
    pipeline = [
        ShardReader(files, config.json_keys),
        IndexedDatasetWriter(
            output_dir,
            config.json_keys,
            config.tokenizer_type,
            config.tokenizer_model,
            config.add_bos,
            config.add_eod,
            config.max_reported,
        ),
    ]
    logging_dir = logging_dir_of(config)
    if config.executor == "local":
        from datatrove.executor import LocalPipelineExecutor

        return (
            LocalPipelineExecutor(
                pipeline,
                tasks=tasks,
                workers=config.workers or 1,
                logging_dir=logging_dir,
                start_method="fork",
            ),
            {},
        )
    from datatrove.executor import SlurmPipelineExecutor

    env_command = config.env_command or f'export PATH="{os.path.dirname(sys.executable)}:$PATH"'
    slurm = dict(
        time=config.time,
        partition=config.partition,
        cpus_per_task=config.cpus_per_task,
        mem_per_cpu_gb=config.mem_per_cpu_gb,
        qos=config.qos,
        env_command=env_command,
        # a job whose dependency failed (the merge, datatrove's stats merge) would otherwise
        # stay pending forever, holding its place in the queue
        sbatch_args={"kill-on-invalid-dep": "yes"}
        | dict(item.split("=", 1) for item in config.sbatch_args),
    )
    executor = SlurmPipelineExecutor(
        pipeline,
        tasks=tasks,
        workers=config.workers or -1,
        job_name=config.job_name,
        logging_dir=logging_dir,
        **slurm,
    )
    return executor, slurm


def merge_job(config: TokenizeCorpusConfig, tokenize, slurm: dict):
    """The Slurm job that merges the tasks' datasets once the tokenization job succeeded.

    It runs on every submission, as the local merge does: a merge marked complete by an earlier
    run would otherwise be skipped although its output may be gone."""
    from datatrove.executor import SlurmPipelineExecutor

    step = MergeTasks(
        os.path.abspath(config.output_dir), config.json_keys, os.path.abspath(config.merge_prefix)
    )
    return SlurmPipelineExecutor(
        [step],
        tasks=1,
        job_name=config.job_name + "-merge",
        logging_dir=os.path.join(logging_dir_of(config), "merge"),
        depends=tokenize,
        skip_completed=False,
        **slurm,
    )


def summarize(
    output_dir: str, tasks: int, ran: list[int], key: str, elapsed: float
) -> tuple[str, Summary]:
    """One line over every task's record (tokens/s over the tasks of this run only), and the
    totals of all tasks."""
    total, tokens_run = Summary(), 0
    for rank in range(tasks):
        record = json.loads(Path(task_prefix(output_dir, rank, key) + RECORD_SUFFIX).read_text())
        total.documents += record["documents"]
        total.tokens += record["tokens"]
        tokens_run += record["tokens"] if rank in ran else 0
        total.rejected.update(record["rejected"])
    reasons = ", ".join(f"{count} {reason}" for reason, count in total.rejected.most_common())
    skipped = f", {tasks - len(ran)} complete before" if len(ran) < tasks else ""
    line = (
        f"wrote {tasks} datasets ({len(ran)} in this run{skipped}), {total.documents} "
        f"documents, {total.tokens} tokens ({key}); this run: {tokens_run} tokens in "
        f"{elapsed:.1f} s ({tokens_run / max(elapsed, 1e-9):,.0f} tokens/s); rejected "
        f"{total.rejected_lines} lines" + (f" ({reasons})" if reasons else "")
    )
    return line, total


def forget_tasks(executor, ranks: list[int], output_dir: str, keys: list[str]) -> None:
    """Undo the tasks of a refused run: their records go, and datatrove's completion markers
    with them, so that the same command runs them again (and refuses again) instead of calling
    them complete."""
    for rank in ranks:
        for key in keys:
            Path(task_prefix(output_dir, rank, key) + RECORD_SUFFIX).unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            executor.logging_dir.rm_file(f"completions/{rank:05d}")


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    files = expand_inputs(config.input)
    tasks, tokenizer = check(config, files)
    os.makedirs(config.output_dir, exist_ok=True)
    plan = dict(
        inputs=files,
        tasks=tasks,
        json_keys=config.json_keys,
        tokenizer=tokenizer,
        add_bos=config.add_bos,
        add_eod=config.add_eod,
    )
    check_same_run(logging_dir_of(config), plan)
    executor, slurm = build_executor(config, files, tasks)
    if config.executor == "slurm":
        merge = merge_job(config, executor, slurm) if config.merge_prefix else None
        return submit(executor, merge, tasks)
    to_run = executor.get_incomplete_ranks()
    if len(to_run) < tasks:
        print(f"skipping {tasks - len(to_run)} completed tasks", file=sys.stderr)
    start = time.perf_counter()
    failed = run_local_tasks(
        executor,
        config.workers or 1,
        report=lambda line: print(f"tokenize_corpus.py: {line}", file=sys.stderr),
    )
    if failed:
        named = ", ".join(f"{rank:05d} ({why})" for rank, why in sorted(failed.items()))
        print(
            f"tokenize_corpus.py: {len(failed)} of {len(to_run)} tasks did not complete: "
            f"{named}; see {executor.logging_dir.path}/logs; run the same command again to "
            "redo only the unfinished tasks",
            file=sys.stderr,
        )
        return 1
    output_dir = os.path.abspath(config.output_dir)
    if not to_run:
        print(f"nothing to do: all {tasks} tasks were complete")
    else:
        line, total = summarize(
            output_dir, tasks, to_run, config.json_keys[0], time.perf_counter() - start
        )
        try:
            require_documents(files, total)
        except InputError:
            forget_tasks(executor, to_run, output_dir, config.json_keys)
            raise
        print(line)
        if config.strict and total.rejected_lines:
            return 1
    if config.merge_prefix:
        MergeTasks(output_dir, config.json_keys, config.merge_prefix).run()
        print(f"merged the {tasks} tasks' datasets into {config.merge_prefix}_KEY_document")
    return 0


def submit(tokenize, merge, tasks: int) -> int:
    """Submit the Slurm job, and the merge job that depends on it."""
    try:
        (merge or tokenize).run()  # the merge job submits the job it depends on first
    except Exception as err:  # sbatch refused the job: its message is the one that helps
        print(
            f"tokenize_corpus.py: error: the job was not submitted ({type(err).__name__}: "
            f"{err})",
            file=sys.stderr,
        )
        return 1
    if tokenize.job_id == -1:
        print(f"all {tasks} tasks are complete; nothing submitted")
    else:
        print(
            f"submitted Slurm job {tokenize.job_id} ({tasks} tasks); run the same command "
            "again after it ends to redo any failed task"
        )
    if merge is not None:
        print(
            f"submitted Slurm job {merge.job_id}: the merge, once every task is complete "
            "(Slurm cancels it if a task fails; run the same command again)"
        )
    return 0


if __name__ == "__main__":
    run(main)
