"""Every flag of ``pretrain_gpt.py``, one at a time, given pathological values on top of a tiny run.

The promise this checks (``megatron/apertus/cli.py``): a value the user can fix ends the run with
one line ``pretrain_gpt.py: error: ...`` and exit code 2, no traceback, no hang and no output
left behind. Each case adds one flag to a tiny mock-data run of two steps (the data,
distillation and alignment flags: on the embedded corpus) and is classified as

* ``ran``: exit 0 (the value is accepted and the run finished);
* ``refused``: exit 2 with the one error line (argparse's "N flags cannot be honoured" list
  counts as one refusal) and nothing else on stderr but the run's own log records;
* ``traceback``: a Python traceback on stderr, whatever the exit code;
* ``noise``: exit 2 without traceback, but other lines beside the error line (warnings);
* ``stopped``: exit 1 with one ``pretrain_gpt.py: stopped: ...`` line, the loop's own verdict
  on a run that trained nothing (every step skipped), as Megatron-LM exits 1 there;
* ``exit-N``: another exit code without a traceback (a signal shows as 128+N);
* ``hang``: no exit within ``--timeout`` and no iteration logged for the last half of it;
* ``training``: still logging iterations at ``--timeout`` (a huge ``--train-iters`` is
  a long run, not a defect).

A refusal that leaves a new file in the case's scratch directory is marked ``left``.

Values by the flag's type: ints 0, -1, 2**40; floats 0, -1, nan, inf; strings '', a missing
path, a directory, a file, a path under a file and an unwritable path; choices a value outside
the set; switches alone and together with their opposite (``--no-X``). The flags come from the
frozen list ``tests/training/cli_flags.json``, their choices from the live parser.

Each case runs in a process forked from this one after torch and megatron-core are imported
(0.5 s a case instead of 7), in its own scratch directory and process group, under a memory
limit so that a value asking for terabytes fails instead of swapping the machine.

    python bench/sweep_bad_flags.py                      # all flags, 2 at a time
    python bench/sweep_bad_flags.py --only lr save       # some flags
    python bench/sweep_bad_flags.py --lock /tmp/bench.lock --batch 60  # beside other jobs
    python bench/sweep_bad_flags.py --entry generate_teacher_logits  # the teacher-logit generator

``--entry generate_teacher_logits`` sweeps the flags of ``tools/generate_teacher_logits.py``
(its parser's, there is no frozen list) on a tiny teacher the sweep trains and saves first.

Writes ``bench/results/sweep_bad_flags_<entry>.json`` (every case, the counts per class, the
commit) and prints the counts and each defect with its last line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOKENIZER = REPO / "tests" / "fixtures" / "bpe4096" / "tokenizer.json"
BASE = [
    *("--model-preset", "tiny", "--mock-data", "--train-iters", "2", "--eval-iters", "0"),
    *("--global-batch-size", "2", "--micro-batch-size", "2", "--log-interval", "1"),
    *("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(TOKENIZER)),
    *("--make-vocab-size-divisible-by", "128"),
]
"""The tiny working run every case adds one flag to (the tests' small-vocabulary tiny run)."""
REAL_DATA_GROUPS = ("datasets", "distillation", "alignment")
"""Groups whose flags ``--mock-data`` refuses outright: their cases train on the embedded
corpus instead (no ``--data-path``), so the value itself is what is checked."""

FLAGS_FILE = REPO / "tests" / "training" / "cli_flags.json"
GENERATOR = REPO / "tools" / "generate_teacher_logits.py"
TEACHER = [a for a in BASE if a != "--mock-data"] + ["--train-iters", "1"]
"""The teacher the generator's cases read: the tiny run, one step, saved once per sweep."""
STUDENT = [
    *("--seed", "11", "--global-batch-size", "2", "--micro-batch-size", "2"),
    *("--train-iters", "2", "--eval-iters", "0", "--topk", "4", "--samples-per-block", "2"),
    *("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(TOKENIZER)),
]
"""The generator's tiny working command, after ``--load TEACHER --logits-dir STORE``."""


@dataclass
class Entry:
    """The program a sweep runs: its name on error lines, its ``main`` and its base flags."""

    prog: str
    base: list[str]

    def main(self):
        if self.prog == "pretrain_gpt.py":
            import pretrain_gpt

            return pretrain_gpt.main
        return _module(GENERATOR).main

    def parser(self) -> argparse.ArgumentParser:
        if self.prog == "pretrain_gpt.py":
            import pretrain_gpt

            return pretrain_gpt.build_parser()
        return _generator_parser()

    def frozen(self) -> list[dict]:
        """The flags to sweep: the frozen list for ``pretrain_gpt.py``, else the parser's."""
        if self.prog == "pretrain_gpt.py":
            return json.loads(FLAGS_FILE.read_text())
        return [
            {"flags": a.option_strings, "type": getattr(a.type, "__name__", "str"), "group": ""}
            for a in self.parser()._actions
            if a.option_strings
        ]


def _module(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generator_parser() -> argparse.ArgumentParser:
    """The generator builds its parser inside ``parse_args``: catch it there."""
    module = _module(GENERATOR)
    built = []
    original = module.ArgumentParser.parse_args

    def capture(self, argv=None, namespace=None):
        built.append(self)
        raise SystemExit(0)

    module.ArgumentParser.parse_args = capture
    try:
        module.parse_args([])
    except SystemExit:
        pass
    finally:
        module.ArgumentParser.parse_args = original
    return built[0]


ENTRY = Entry("pretrain_gpt.py", BASE)
UNWRITABLE = "/sys/apertus-sweep/out"
"""A path not even root can create (sysfs): permission bits do not stop root."""
MEMORY_LIMIT = 12 << 30
"""Address space of one case: a value asking for terabytes fails at once instead of swapping."""
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
ITERATION = re.compile(r" iteration +\d+/")
PREPARED = ("dir", "file.txt")
"""What each scratch directory holds before its case runs; anything else was written by it."""


@dataclass
class Case:
    """One flag with one value (or a pair of opposite switches)."""

    flag: str
    label: str
    argv: list[str]
    mock_data: bool = True
    cls: str = ""
    code: int | None = None
    line: str = ""
    seconds: float = 0.0
    left: list[str] = field(default_factory=list)


# -- the cases ---------------------------------------------------------------------------------


def _string_values(scratch: str) -> dict[str, str]:
    return {
        "empty": "",
        "missing": f"{scratch}/missing/x",
        "directory": f"{scratch}/dir",
        "file": f"{scratch}/file.txt",
        "under-a-file": f"{scratch}/file.txt/x",
        "unwritable": UNWRITABLE,
    }


NUMBERS = {
    "int": {"0": "0", "-1": "-1", "2**40": str(2**40)},
    "float": {"0": "0", "-1": "-1", "nan": "nan", "inf": "inf"},
}


def _opposite(flag: str, switches: set[str]) -> str | None:
    """The switch that undoes ``flag`` (``--x`` and ``--no-x``, ``--enable-x`` and
    ``--disable-x``), if the parser has it."""
    pairs = (("--no-", "--"), ("--disable-", "--enable-"), ("--disable-", "--"))
    for a, b in pairs:
        for this, that in ((a, b), (b, a)):
            if flag.startswith(this) and that + flag[len(this) :] in switches:
                return that + flag[len(this) :]
    return None


def cases(parser: argparse.ArgumentParser, only: set[str], scratch: str) -> list[Case]:
    """The cases of every frozen flag (or of ``only``), in the frozen list's order."""
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    switches = {opt for opt, a in actions.items() if a.nargs == 0}
    out = [Case("(base)", "base run", [])]
    for entry in ENTRY.frozen():
        flag = entry["flags"][0]
        if only and flag not in only or flag in ("--help", "--dry-run"):
            continue
        action = actions.get(flag)
        mock = not entry["group"].startswith(REAL_DATA_GROUPS)
        if action is None:
            out.append(Case(flag, "not in the parser", [], cls="missing-flag"))
            continue
        if action.nargs == 0:
            out.append(Case(flag, "alone", [flag], mock))
            opposite = _opposite(flag, switches)
            if opposite:
                out.append(Case(flag, f"with {opposite}", [flag, opposite], mock))
            continue
        if action.choices:
            out.append(Case(flag, "outside the choices", [f"{flag}=bogus"], mock))
            continue
        kind = entry["type"] if entry["type"] in NUMBERS else "str"
        values = NUMBERS[kind] if kind in NUMBERS else _string_values(scratch)
        out += [Case(flag, label, [f"{flag}={v}"], mock) for label, v in values.items()]
    return out


# -- running one case ---------------------------------------------------------------------------


def _prepare(scratch: Path) -> None:
    scratch.mkdir(parents=True)
    (scratch / "dir").mkdir()
    (scratch / "file.txt").write_text("not what this flag expects\n")


def _child(case: Case, scratch: Path) -> None:
    """In the forked process: run the entry point as ``python pretrain_gpt.py ARGS`` would
    under :func:`cli.run`, with stdout and stderr in files; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        os.chdir(scratch)
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        for fd, name in ((1, "stdout"), (2, "stderr")):
            out = os.open(scratch.parent / f"{scratch.name}.{name}", os.O_WRONLY | os.O_CREAT)
            os.dup2(out, fd)
            os.close(out)
        base = ENTRY.base if case.mock_data else [a for a in ENTRY.base if a != "--mock-data"]
        sys.argv = [ENTRY.prog, *base, *case.argv]
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        from megatron.apertus.cli import run

        main = ENTRY.main()
        run(lambda: main(sys.argv[1:]), prog=ENTRY.prog)
    except SystemExit as exited:
        if isinstance(exited.code, str):
            print(exited.code, file=sys.stderr)
        code = exited.code if isinstance(exited.code, int) else (0 if exited.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _classify(case: Case, code: int | None, stderr: str, timed_out: bool, ticking: bool) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(f"{ENTRY.prog}: ")]
    other = [
        line
        for line in lines
        if not LOG_RECORD.match(line) and not line.startswith((f"{ENTRY.prog}: ", "  "))
    ]
    case.code = code
    case.line = (errors or other or lines or [""])[-1][:300]
    if "Traceback (most recent call last)" in stderr:
        case.cls = "traceback"
        case.line = (other or lines)[-1][:300]
    elif timed_out:
        case.cls = "training" if ticking else "hang"
    elif code == 0:
        case.cls = "ran"
    elif code == 2 and len(errors) == 1 and not other:
        case.cls = "refused"
    elif code == 2:
        case.cls = "noise"
    elif code == 1 and len(errors) == 1 and errors[0].startswith(f"{ENTRY.prog}: stopped: "):
        case.cls = "stopped"
    else:
        case.cls = f"exit-{code}"


def _ticking(stderr_file: Path, since: float) -> bool:
    """Whether the run logged an iteration after ``since`` (its last log record's time)."""
    with contextlib.suppress(OSError):
        if stderr_file.stat().st_mtime > since:
            return bool(ITERATION.search(stderr_file.read_text(errors="replace")[-4000:]))
    return False


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _finish(case: Case, scratch: Path, code: int | None, timed_out: bool, ticking: bool) -> None:
    stderr = (scratch.parent / f"{scratch.name}.stderr").read_text(errors="replace")
    _classify(case, code, stderr, timed_out, ticking)
    if case.cls == "refused":
        case.left = sorted(
            str(p.relative_to(scratch))
            for p in scratch.rglob("*")
            if p.relative_to(scratch).parts[0] not in PREPARED or p.parent.name == "dir"
        )
    (scratch.parent / f"{case_id(case)}.stderr").write_text(stderr)
    shutil.rmtree(scratch, ignore_errors=True)


def case_id(case: Case) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{case.flag}__{case.label}").strip("_")


def run_cases(todo: list[Case], work: Path, jobs: int, timeout: float) -> None:
    """Fork up to ``jobs`` cases at a time; kill a case's process group at ``timeout``."""
    running: dict[int, tuple[Case, Path, float]] = {}
    queue = list(todo)
    while queue or running:
        while queue and len(running) < jobs:
            case = queue.pop(0)
            scratch = work / case_id(case)
            _prepare(scratch)
            pid = os.fork()
            if pid == 0:
                _child(case, scratch)
            running[pid] = (case, scratch, time.monotonic())
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            case, scratch, start = running.pop(pid)
            case.seconds = round(time.monotonic() - start, 2)
            _kill_group(pid)  # workers it left behind
            _finish(case, scratch, os.waitstatus_to_exitcode(status), False, False)
            code = case.code if case.code >= 0 else 128 - case.code
            case.code = code
            if case.cls.startswith("exit-"):
                case.cls = f"exit-{code}"
            _report(case)
            continue
        now = time.monotonic()
        for pid, (case, scratch, start) in list(running.items()):
            if now - start > timeout:
                stderr_file = scratch.parent / f"{scratch.name}.stderr"
                ticking = _ticking(stderr_file, time.time() - timeout / 2)
                _kill_group(pid)
                os.waitpid(pid, 0)
                running.pop(pid)
                case.seconds = round(now - start, 2)
                _finish(case, scratch, None, True, ticking)
                _report(case)
        time.sleep(0.05)


def _teacher(work: Path) -> list[str]:
    """Save the tiny teacher once (in a forked process, as every case runs) and return the
    generator's base flags that read it."""
    global ENTRY
    ENTRY = Entry("pretrain_gpt.py", TEACHER + ["--save", str(work / "teacher")])
    case = Case("(teacher)", "save", [])
    run_cases([case], work, 1, 300)
    if case.cls != "ran":
        sys.exit(f"the teacher did not train: {case.line}")
    return ["--load", str(work / "teacher"), "--logits-dir", "store", *STUDENT]


def _report(case: Case) -> None:
    left = f" LEFT {case.left}" if case.left else ""
    shown = "" if case.cls in ("ran",) else f": {case.line}"
    print(f"{case.cls:10} {case.flag} [{case.label}]{left}{shown}", flush=True)


DEFECTS = ("traceback", "hang", "noise")


def summary(done: list[Case]) -> dict:
    counts = Counter(case.cls for case in done)
    defects = [c for c in done if c.cls in DEFECTS or c.cls.startswith("exit-") or c.left]
    return {"counts": dict(sorted(counts.items())), "defects": len(defects)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", nargs="+", default=[], help="these flags only, without their dashes (lr save)"
    )
    parser.add_argument(
        "--entry",
        choices=("pretrain_gpt", "generate_teacher_logits"),
        default="pretrain_gpt",
        help="the program to sweep (the generator's cases read a tiny teacher saved first)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="cases at a time")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take")
    parser.add_argument("--lock", help="flock this file around each batch of cases")
    parser.add_argument("--batch", type=int, default=50, help="cases per lock")
    parser.add_argument("--output", type=Path, help="results file (default: bench/results/)")
    parser.add_argument("--keep-logs", type=Path, help="keep each case's stderr here")
    args = parser.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    import megatron.apertus.training.loop  # noqa: F401  (imported once, before the forks)
    from megatron.apertus import cli

    global ENTRY
    work = Path(tempfile.mkdtemp(prefix="sweep-flags-"))
    if args.entry == "generate_teacher_logits":
        ENTRY = Entry("generate_teacher_logits.py", _teacher(work))
    only = {f"--{name.lstrip('-')}" for name in args.only}
    todo = cases(ENTRY.parser(), only, str(work / "CASE"))
    for case in todo:  # each case's paths point into its own scratch directory
        case.argv = [a.replace(str(work / "CASE"), str(work / case_id(case))) for a in case.argv]
    done = [c for c in todo if c.cls]
    todo = [c for c in todo if not c.cls]
    print(f"{len(todo)} cases, {args.jobs} at a time", flush=True)
    for first in range(0, len(todo), args.batch):
        with cli.exclusive(args.lock) if args.lock else contextlib.nullcontext():
            run_cases(todo[first : first + args.batch], work, args.jobs, args.timeout)
        done += todo[first : first + args.batch]
    if args.keep_logs:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
        for log in work.glob("*.stderr"):
            shutil.copy(log, args.keep_logs / log.name)
    shutil.rmtree(work, ignore_errors=True)

    result = summary(done)
    print(json.dumps(result["counts"]), f"{result['defects']} defects")
    for case in done:
        if case.cls in DEFECTS or case.cls.startswith("exit-") or case.left:
            print(f"  {case.cls:10} {case.flag} [{case.label}]: {case.line}")
    output = args.output or REPO / "bench" / "results" / f"sweep_bad_flags_{args.entry}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    from bench._common import git_commit, machine

    output.write_text(
        json.dumps(
            {
                "commit": git_commit(),
                "machine": machine(),
                "base": ENTRY.base,
                "seconds": round(time.monotonic() - started, 1),
                **result,
                "cases": [asdict(c) for c in done],
            },
            indent=1,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
