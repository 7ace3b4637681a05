"""The commands and links of README.md and docs/ still match the code.

What is checked, in every fenced code block of README.md and docs/**/*.md:

- a command that runs one of our scripts (``python pretrain_gpt.py``, ``python tools/...``,
  ``python bench/...``, ``python examples/...``, also behind ``torchrun ...``, ``FOO=1`` or a ``$``
  prompt, continued with trailing backslashes) names a file that exists, and each of its ``--flags``
  is one that the script's ``--help`` lists (``--no-X`` included: argparse prints it for
  BooleanOptionalAction). Flags after a ``--`` separator belong to another program and are skipped;
  placeholders (``...``, ``$VAR``, ``<...>``, ``FLAGS``) are not flags and are skipped too.
- ``make TARGET`` names a target of the Makefile.

And outside code, every relative markdown link ``[text](path#anchor)`` resolves to an existing
path relative to its markdown file (web, mailto and pure ``#anchor`` links are skipped; anchors
themselves are not checked).

Flags come from the usage block and the option lines of ``--help`` only, not from descriptions,
so a flag that a docstring mentions but the parser lacks still fails. Abbreviations that argparse
would accept fail on purpose: the docs should spell flags out. Each script's ``--help`` runs once
per test process (the heavy ones import megatron-core, several seconds each), all concurrently.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SCRIPT_DIRS = ("tools/", "bench/", "examples/")
ENTRY_SCRIPTS = ("pretrain_gpt.py",)
# `python -m X` with one of these is a launcher; with any other module there is no script of ours.
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")

FENCE = re.compile(r"^\s*(```|~~~)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PYTHON = re.compile(r"^(.*/)?python(3(\.\d+)?)?$")
FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*(?==|$)")
HELP_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
LINK_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
URL_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


@dataclass(frozen=True)
class Command:
    """One command of a fenced code block that runs a script of ours or ``make``."""

    line: int  # 1-based line of the markdown where the command starts
    text: str  # the command, continuation lines joined
    program: str  # "make", or the script path relative to the repository root
    args: tuple[str, ...]  # the words after the program


def fenced_lines(text: str) -> Iterator[tuple[int, str]]:
    """Yield (1-based line number, line) for each line inside a fenced code block."""
    inside = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
        elif inside:
            yield number, line


def logical_lines(lines: Iterable[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Join lines continued with a trailing backslash; keep the number of the first line."""
    start, parts = 0, []
    for number, line in lines:
        if not parts:
            start = number
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            parts.append(stripped[:-1])
            continue
        parts.append(stripped)
        yield start, " ".join(part.strip() for part in parts)
        parts = []
    if parts:
        yield start, " ".join(part.strip() for part in parts)


def split_words(line: str) -> list[str]:
    """Shell words of ``line`` without comments; lines that are not shell (code) split on blanks."""
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return line.split(" #", 1)[0].split()


def script_of(words: list[str]) -> tuple[str, list[str]] | None:
    """The script of ours that a ``python``/``torchrun`` command runs, and its arguments."""
    if not words:
        return None
    launcher, rest = words[0], words[1:]
    if not (PYTHON.match(launcher) or launcher == "torchrun"):
        return None
    for i, word in enumerate(rest):
        if word in ("-", "-c"):
            return None  # code from stdin or the command line: no script file
        if word == "-m":
            if rest[i + 1 : i + 2] and rest[i + 1] in LAUNCHER_MODULES:
                continue
            return None  # another module, e.g. `python -m pytest tools/x.py`
        if word.endswith(".py") and not word.startswith("-"):
            script = word.removeprefix("./")
            if script in ENTRY_SCRIPTS or script.startswith(SCRIPT_DIRS):
                return script, rest[i + 1 :]
            return None
    return None


def extract_commands(markdown: str) -> list[Command]:
    """The commands in ``markdown``'s fenced code blocks that run a script of ours or ``make``."""
    commands = []
    for number, line in logical_lines(fenced_lines(markdown)):
        text = line.strip().removeprefix("$ ")
        words = split_words(text)
        while words and ENV_ASSIGNMENT.match(words[0]):
            words = words[1:]
        if words[:1] == ["make"]:
            commands.append(Command(number, text, "make", tuple(words[1:])))
        elif (found := script_of(words)) is not None:
            commands.append(Command(number, text, found[0], tuple(found[1])))
    return commands


def command_flags(args: Iterable[str]) -> list[str]:
    """The ``--flags`` among ``args``, up to a ``--`` separator; optional brackets are dropped."""
    flags = []
    for word in args:
        if word == "--":
            break
        match = FLAG.match(word.strip("[](),|"))
        if match:
            flags.append(match.group(0))
    return flags


def help_flags(help_text: str) -> frozenset[str]:
    """The flags of an argparse ``--help`` text: its usage block and option lines, not prose."""
    flags: set[str] = set()
    in_usage = False
    for line in help_text.splitlines():
        if line.startswith("usage:"):
            in_usage = True
        elif not line.strip():
            in_usage = False
        if in_usage:
            flags.update(HELP_FLAG.findall(line))
        elif re.match(r"^ {2}-", line):  # "  -h, --help   show ...": the invocation, not its help
            flags.update(HELP_FLAG.findall(re.split(r"\s{2,}", line.strip())[0]))
    return frozenset(flags)


@functools.lru_cache(maxsize=None)
def script_help(script: str) -> tuple[int, str]:
    """(exit status, output) of ``python SCRIPT --help`` in the repository, once per script."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=300,
    )
    return proc.returncode, proc.stdout if proc.returncode == 0 else proc.stdout + proc.stderr


def prefetch_help(scripts: Iterable[str]) -> None:
    """Run the ``--help`` of the existing ``scripts`` concurrently, filling the cache."""
    existing = sorted({s for s in scripts if (REPO / s).is_file()})
    with ThreadPoolExecutor(max_workers=max(1, min(len(existing), os.cpu_count() or 1))) as pool:
        list(pool.map(script_help, existing))


def makefile_targets(makefile: Path) -> frozenset[str]:
    """The explicit targets of ``makefile`` (``name:`` rules; ``:=`` assignments excluded)."""
    targets: set[str] = set()
    for line in makefile.read_text().splitlines():
        match = re.match(r"^([^\s:#=][^:#=]*?)\s*::?(?!=)", line)
        if match:
            targets.update(match.group(1).split())
    return frozenset(targets)


def check_command(
    command: Command, source: str, help_of: Callable[[str], tuple[int, str]] = script_help
) -> list[str]:
    """Problems of one command: a missing script or make target, or flags its parser lacks."""
    where = f"{source}:{command.line}: `{command.text}`"
    if command.program == "make":
        targets = makefile_targets(REPO / "Makefile")
        missing = [t for t in command.args if not t.startswith("-") and "=" not in t]
        return [f"{where}: no target '{t}' in the Makefile" for t in missing if t not in targets]
    if not (REPO / command.program).is_file():
        return [f"{where}: {command.program} does not exist"]
    status, output = help_of(command.program)
    if status != 0:
        tail = output.strip().splitlines()[-1:] or ["no output"]
        return [f"{where}: `python {command.program} --help` exited {status}: {tail[0]}"]
    known = help_flags(output)
    return [
        f"{where}: {command.program} has no flag {flag}"
        for flag in command_flags(command.args)
        if flag not in known
    ]


def check_links(markdown_path: Path, markdown: str) -> list[str]:
    """Problems of the relative links of ``markdown`` (the text of ``markdown_path``)."""
    source = markdown_path.relative_to(REPO)
    fenced = {number for number, _ in fenced_lines(markdown)}
    problems = []
    for number, line in enumerate(markdown.splitlines(), 1):
        if number in fenced or FENCE.match(line):
            continue
        prose = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)
        targets = LINK.findall(prose) + LINK_DEFINITION.findall(prose)
        for target in targets:
            if target.startswith("#") or URL_SCHEME.match(target):
                continue
            path = unquote(target.split("#", 1)[0].split("?", 1)[0])
            base = REPO if path.startswith("/") else markdown_path.parent
            if not (base / path.lstrip("/")).exists():
                problems.append(f"{source}:{number}: link ({target}): {path} does not exist")
    return problems


def doc_id(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.fixture(scope="module")
def help_of() -> Callable[[str], tuple[int, str]]:
    """``script_help`` with every script of every doc already run, concurrently."""
    prefetch_help(c.program for doc in DOCS for c in extract_commands(doc.read_text()))
    prefetch_help(ENTRY_SCRIPTS)
    return script_help


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_doc_commands_match_the_scripts(doc: Path, help_of) -> None:
    commands = extract_commands(doc.read_text())
    problems = [p for c in commands for p in check_command(c, doc_id(doc), help_of)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_doc_links_resolve(doc: Path) -> None:
    problems = check_links(doc, doc.read_text())
    assert not problems, "\n".join(problems)


def test_readme_has_commands_to_check() -> None:
    """Guards the extractor: if it silently matched nothing, the tests above would pass vacuously."""
    programs = {c.program for c in extract_commands((REPO / "README.md").read_text())}
    assert {"make", "pretrain_gpt.py"} <= programs, programs


def test_extract_commands_handles_launchers_continuations_and_placeholders() -> None:
    markdown = "\n".join(
        [
            "python pretrain_gpt.py --outside-a-fence 1",
            "```bash",
            "# a comment line",
            "FOO=1 BAR=x torchrun --nproc-per-node 2 pretrain_gpt.py --seed 3 \\",
            "    [--train-iters 5] ... $VAR <FLAGS> --data-path=a -- --after-separator",
            "$ python tools/plan_layout.py --gpus 8   # --in-a-comment",
            "python setup.py build_ext --inplace",
            ".venv/bin/python - full float32 <<'EOF'",
            "python -m pytest tools/x.py",
            "make demo",
            "```",
        ]
    )
    commands = extract_commands(markdown)
    assert [(c.line, c.program) for c in commands] == [
        (4, "pretrain_gpt.py"),
        (6, "tools/plan_layout.py"),
        (10, "make"),
    ]
    assert command_flags(commands[0].args) == ["--seed", "--train-iters", "--data-path"]
    assert command_flags(commands[1].args) == ["--gpus"]


def test_checker_names_file_script_and_unknown_flag(help_of) -> None:
    markdown = "\n".join(
        [
            "Intro.",
            "```bash",
            "torchrun --nproc-per-node 2 pretrain_gpt.py --seed 3 \\",
            "    --no-such-flag 3 -- --not-ours",
            "python tools/no_such_tool.py --x 1",
            "make test",
            "make no-such-target",
            "```",
        ]
    )
    problems = [p for c in extract_commands(markdown) for p in check_command(c, "FAKE.md", help_of)]
    assert len(problems) == 3, "\n".join(problems)
    flag, tool, target = problems
    assert flag.startswith("FAKE.md:3:") and "pretrain_gpt.py has no flag --no-such-flag" in flag
    assert tool.startswith("FAKE.md:5:") and "tools/no_such_tool.py does not exist" in tool
    assert target.startswith("FAKE.md:7:") and "no target 'no-such-target'" in target


def test_checker_names_file_and_broken_link() -> None:
    markdown = "\n".join(
        [
            "See [data](docs/data.md#top), [the web](https://example.org), [here](#top).",
            "`[not a link](nowhere.md)`",
            "```",
            "[in code](nowhere.md)",
            "```",
            "And [a missing one](docs/no_such_doc.md#part).",
        ]
    )
    problems = check_links(REPO / "README.md", markdown)
    assert problems == [
        "README.md:6: link (docs/no_such_doc.md#part): docs/no_such_doc.md does not exist"
    ]


def test_help_flags_reads_usage_and_option_lines_not_prose() -> None:
    help_text = "\n".join(
        [
            "usage: x.py [-h] [--seed SEED] [--qk-layernorm | --no-qk-layernorm]",
            "            [--data-path DATA_PATH [DATA_PATH ...]]",
            "",
            "Run it like: x.py --only-in-prose 1",
            "",
            "options:",
            "  -h, --help            show this help message and exit",
            "  --seed SEED           see also --only-in-help-text",
            "  --late-option LATE_OPTION",
            "                        --also-only-in-help-text",
        ]
    )
    assert help_flags(help_text) == {
        "--help",
        "--seed",
        "--qk-layernorm",
        "--no-qk-layernorm",
        "--data-path",
        "--late-option",
    }


def test_checker_reports_a_script_whose_help_fails() -> None:
    command = Command(7, "python pretrain_gpt.py --seed 1", "pretrain_gpt.py", ("--seed", "1"))
    problems = check_command(command, "FAKE.md", lambda _: (1, "Traceback\nImportError: boom"))
    assert problems == [
        "FAKE.md:7: `python pretrain_gpt.py --seed 1`: "
        "`python pretrain_gpt.py --help` exited 1: ImportError: boom"
    ]
