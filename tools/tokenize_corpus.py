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
from megatron.apertus.errors import ConfigError
from megatron.apertus.prep.preprocess import (
    RECORD_SUFFIX,
    Summary,
    check_input_files,
    require_documents,
    tokenizer_record,
)
from megatron.apertus.prep.tokenize_pipeline import (
    IndexedDatasetWriter,
    MergeTasks,
    ShardReader,
    cached_tokenizer,
    run_local_tasks,
    task_prefix,
)
from megatron.apertus.tokenizer.tokenizers import TOKENIZER_TYPES

ADDITION = " [megatron-apertus addition]"
PLAN_FILE = "tokenize_corpus.json"


InputError = ConfigError
"""Bad flags or inputs, reported in one line with exit status 2."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    data = parser.add_argument_group("data (as tools/preprocess_data.py)")
    data.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="JSON-lines (.jsonl, .gz, .zst) or .parquet files; globs and fsspec "
        "URLs allowed; sorted per pattern, in the order given",
    )
    data.add_argument("--json-keys", nargs="+", default=["text"])
    data.add_argument("--output-dir", required=True, help="where the tasks' datasets go" + ADDITION)
    data.add_argument("--tokenizer-type", default="TekkenTokenizer", choices=TOKENIZER_TYPES)
    data.add_argument(
        "--tokenizer-model",
        default=None,
        help="tokenizer file/directory (TekkenTokenizer defaults to mistral-common's)",
    )
    data.add_argument(
        "--append-eod",
        action="store_true",
        default=True,
        help="end every document with </s> (the default)",
    )
    data.add_argument(
        "--no-eod", dest="append_eod", action="store_false", help="do not append </s>" + ADDITION
    )
    data.add_argument(
        "--no-bos",
        dest="add_bos",
        action="store_false",
        default=True,
        help="do not prepend <s>" + ADDITION,
    )
    data.add_argument(
        "--max-reported",
        type=int,
        default=10,
        help="bad lines reported in full, per task" + ADDITION,
    )
    data.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when any line was rejected (local executor)" + ADDITION,
    )
    run = parser.add_argument_group("execution" + ADDITION)
    run.add_argument("--executor", choices=("local", "slurm"), default="local")
    run.add_argument(
        "--tasks", type=int, default=None, help="datasets to write (default: one per input file)"
    )
    run.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tasks running at once (local default 1; slurm default: no limit)",
    )
    run.add_argument(
        "--merge-prefix",
        default=None,
        help="when every task is complete, merge the tasks' datasets into "
        "MERGE_PREFIX_KEY_document.bin/.idx (on Slurm: a job that depends on the "
        "tokenization job)",
    )
    run.add_argument(
        "--logging-dir",
        default=None,
        help="datatrove logs, stats and completion markers (default: " "OUTPUT_DIR/.datatrove)",
    )
    slurm = parser.add_argument_group("Slurm executor" + ADDITION)
    slurm.add_argument("--partition", default=None)
    slurm.add_argument("--time", default="24:00:00", help="time limit per task")
    slurm.add_argument("--cpus-per-task", type=int, default=1)
    slurm.add_argument("--mem-per-cpu-gb", type=int, default=4)
    slurm.add_argument("--job-name", default="tokenize")
    slurm.add_argument("--qos", default=None)
    slurm.add_argument(
        "--sbatch-args",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="further #SBATCH options, e.g. account=a01",
    )
    slurm.add_argument(
        "--env-command",
        default=None,
        help="shell line run before each task (default: put this Python's bin "
        "directory first on PATH)",
    )
    return parser.parse_args(argv)


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


def check(args: argparse.Namespace, files: list[str]) -> tuple[int, dict]:
    """The number of tasks and the tokenizer's record; refuse what would fail later, on a
    compute node."""
    tasks = args.tasks or len(files)
    if tasks < 1 or tasks > len(files):
        raise InputError(
            f"--tasks {tasks}: give between 1 and the {len(files)} input files "
            "(a task tokenizes whole files)"
        )
    if args.executor == "slurm" and not args.partition:
        raise InputError("--executor slurm needs --partition")
    if args.executor == "slurm" and shutil.which("sbatch") is None:
        raise InputError(
            "--executor slurm: sbatch is not on PATH (run this on a Slurm login "
            "node, or use --executor local)"
        )
    if args.workers is not None and args.workers < 1 and args.executor == "local":
        raise InputError(f"--workers {args.workers}: must be at least 1")
    if not Path(args.output_dir).parent.is_dir():
        raise InputError(f"--output-dir: {Path(args.output_dir).parent} does not exist")
    if args.merge_prefix and not Path(args.merge_prefix).absolute().parent.is_dir():
        raise InputError(
            f"--merge-prefix: {Path(args.merge_prefix).absolute().parent} does " "not exist"
        )
    try:
        tokenizer = cached_tokenizer(args.tokenizer_type, args.tokenizer_model)
    except (FileNotFoundError, ValueError) as err:
        raise InputError(f"--tokenizer-model: {err}") from None
    for item in args.sbatch_args:
        if "=" not in item:
            raise InputError(f"--sbatch-args {item}: expected KEY=VALUE")
    return tasks, tokenizer_record(args.tokenizer_type, tokenizer)


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


def logging_dir_of(args: argparse.Namespace) -> str:
    return os.path.abspath(args.logging_dir or os.path.join(args.output_dir, ".datatrove"))


def build_executor(args: argparse.Namespace, files: list[str], tasks: int) -> tuple:
    """The tokenization executor, and the Slurm options a dependent job reuses (none locally)."""
    output_dir = os.path.abspath(args.output_dir)
    pipeline = [
        ShardReader(files, args.json_keys),
        IndexedDatasetWriter(
            output_dir,
            args.json_keys,
            args.tokenizer_type,
            args.tokenizer_model,
            args.add_bos,
            args.append_eod,
            args.max_reported,
        ),
    ]
    logging_dir = logging_dir_of(args)
    if args.executor == "local":
        from datatrove.executor import LocalPipelineExecutor

        return (
            LocalPipelineExecutor(
                pipeline,
                tasks=tasks,
                workers=args.workers or 1,
                logging_dir=logging_dir,
                start_method="fork",
            ),
            {},
        )
    from datatrove.executor import SlurmPipelineExecutor

    env_command = args.env_command or f'export PATH="{os.path.dirname(sys.executable)}:$PATH"'
    slurm = dict(
        time=args.time,
        partition=args.partition,
        cpus_per_task=args.cpus_per_task,
        mem_per_cpu_gb=args.mem_per_cpu_gb,
        qos=args.qos,
        env_command=env_command,
        # a job whose dependency failed (the merge, datatrove's stats merge) would otherwise
        # stay pending forever, holding its place in the queue
        sbatch_args={"kill-on-invalid-dep": "yes"}
        | dict(item.split("=", 1) for item in args.sbatch_args),
    )
    executor = SlurmPipelineExecutor(
        pipeline,
        tasks=tasks,
        workers=args.workers or -1,
        job_name=args.job_name,
        logging_dir=logging_dir,
        **slurm,
    )
    return executor, slurm


def merge_job(args: argparse.Namespace, tokenize, slurm: dict):
    """The Slurm job that merges the tasks' datasets once the tokenization job succeeded.

    It runs on every submission, as the local merge does: a merge marked complete by an earlier
    run would otherwise be skipped although its output may be gone."""
    from datatrove.executor import SlurmPipelineExecutor

    step = MergeTasks(
        os.path.abspath(args.output_dir), args.json_keys, os.path.abspath(args.merge_prefix)
    )
    return SlurmPipelineExecutor(
        [step],
        tasks=1,
        job_name=args.job_name + "-merge",
        logging_dir=os.path.join(logging_dir_of(args), "merge"),
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
    args = parse_args(argv)
    files = expand_inputs(args.input)
    tasks, tokenizer = check(args, files)
    os.makedirs(args.output_dir, exist_ok=True)
    plan = dict(
        inputs=files,
        tasks=tasks,
        json_keys=args.json_keys,
        tokenizer=tokenizer,
        add_bos=args.add_bos,
        add_eod=args.append_eod,
    )
    check_same_run(logging_dir_of(args), plan)
    executor, slurm = build_executor(args, files, tasks)
    if args.executor == "slurm":
        merge = merge_job(args, executor, slurm) if args.merge_prefix else None
        return submit(executor, merge, tasks)
    to_run = executor.get_incomplete_ranks()
    if len(to_run) < tasks:
        print(f"skipping {tasks - len(to_run)} completed tasks", file=sys.stderr)
    start = time.perf_counter()
    failed = run_local_tasks(
        executor,
        args.workers or 1,
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
    output_dir = os.path.abspath(args.output_dir)
    if not to_run:
        print(f"nothing to do: all {tasks} tasks were complete")
    else:
        line, total = summarize(
            output_dir, tasks, to_run, args.json_keys[0], time.perf_counter() - start
        )
        try:
            require_documents(files, total)
        except InputError:
            forget_tasks(executor, to_run, output_dir, args.json_keys)
            raise
        print(line)
        if args.strict and total.rejected_lines:
            return 1
    if args.merge_prefix:
        MergeTasks(output_dir, args.json_keys, args.merge_prefix).run()
        print(f"merged the {tasks} tasks' datasets into {args.merge_prefix}_KEY_document")
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
