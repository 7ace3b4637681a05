"""What every entry point shares: one-line errors, exit codes, atomic outputs, worker lifetimes.

The promise every tool under ``tools/`` and ``pretrain_gpt.py`` keep through this module:

* A mistake the user can fix (a flag, a missing or unwritable file, input with nothing usable)
  ends the program with one line, ``PROG: error: ...`` naming the flag, file or line, and exit
  code 2; no traceback, no usage dump (``PROG --help`` shows the usage).
* Ctrl-C or SIGTERM ends it with one line and exit code 130 or 143; worker processes end quietly
  with it, also while they are still starting, and so do they when the parent is killed
  outright.
* Outputs appear under their final names only when complete (:func:`atomic_outputs`, and
  :func:`atomic_directory` for a directory): an error or an interruption leaves neither a
  partial file nor a temporary one.
* Processes that share a cache (two jobs on one node, parallel test workers) build its entries
  one at a time (:func:`exclusive`), never writing the same files at once.

Only the standard library is imported here, so that ``--help`` and argument errors cost no
start-up time.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, NoReturn

from megatron.apertus.errors import ConfigError

EXIT_USAGE = 2
"""Bad flags or input, as argparse's own exit status."""


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that ``finally`` blocks and cleanups run."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but an argument error is one line (and a hint) instead of the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _raise_terminated(signum: int, frame) -> None:
    raise Terminated


def _exit(code: int) -> NoReturn:
    """Exit with ``code``. Everything is cleaned up by now, so a SIGTERM during the interpreter's
    shutdown (torchrun stopping the other ranks of a run that one rank refused) ends the process
    as the default action does, not with a traceback from inside an atexit hook."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.exit(code)


def error_line(prog: str, err: BaseException) -> str:
    """The one line for an error a user can act on."""
    if isinstance(err, OSError) and err.filename is not None:
        return f"{prog}: error: {err.filename}: {err.strerror or err}"
    return f"{prog}: error: {err}"


def check_output(flag: str, path: str | os.PathLike, *, directory: bool) -> None:
    """Refuse, before any work, an output the program could not write when it gets there: a
    file where a directory is wanted or the reverse, or no permission to create or replace it.
    Nothing is created, so ``--dry-run`` may call it. Permissions are what ``os.access`` says,
    so root passes where it could write."""
    path = Path(path)
    if path.exists():
        if path.is_dir() != directory:
            wanted, found = ("directory", "file") if directory else ("file", "directory")
            raise ConfigError(f"{flag} {path} is a {found}, not a {wanted}")
        # A file is replaced through a temporary name beside it: its directory must be writable.
        target = path if directory else path.parent
    else:
        target = next(p for p in path.absolute().parents if p.exists())
        if not target.is_dir():
            raise ConfigError(f"{flag} {path}: {target} is a file, not a directory")
    if not os.access(target, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: cannot write in {target} (permission denied)")


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


_mask_before_fork: set[signal.Signals] = set()


def _hold_stop_signals() -> None:
    global _mask_before_fork
    _mask_before_fork = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def _release_stop_signals() -> None:
    """Back to the signal mask from before the fork."""
    signal.pthread_sigmask(signal.SIG_SETMASK, _mask_before_fork)


def _forked_child_stops_quietly() -> None:
    """In a child just forked from a tool (a worker): the parent's handlers would raise
    ``Terminated`` or ``KeyboardInterrupt`` inside the worker's start-up code and print its
    traceback; SIGTERM ends the child silently and Ctrl-C is left to the parent, which stops its
    workers itself. Signals that arrived since the fork were held and take effect now."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _release_stop_signals()


_fork_hooks_registered = False


def _quiet_forked_children() -> None:
    """Every ``os.fork`` of this process (multiprocessing's fork workers) holds SIGINT and
    SIGTERM across the fork: the parent receives them once the fork returns, and the child
    only after :func:`_forked_child_stops_quietly` has set its own handlers, so that no signal
    reaches a half-started worker while it still runs the parent's handlers."""
    global _fork_hooks_registered
    if _fork_hooks_registered:
        return
    os.register_at_fork(
        before=_hold_stop_signals,
        after_in_parent=_release_stop_signals,
        after_in_child=_forked_child_stops_quietly,
    )
    _fork_hooks_registered = True


INTERRUPTED_NOTE = "no partial output was kept"
"""What the line of an interrupted tool adds: its outputs appear only when complete."""


def run(
    main: Callable[[], int | None], prog: str | None = None, *, kept: str = INTERRUPTED_NOTE
) -> NoReturn:
    """Run a tool's ``main`` and exit with its status; user errors and interruptions become one
    line. An ``OSError`` that names a file (permission denied, disk full, read-only file system)
    is the user's to fix; one without a file name is a bug and keeps its traceback. ``kept``
    ends the line of an interruption: what the user finds afterwards."""
    prog = prog or os.path.basename(sys.argv[0])
    signal.signal(signal.SIGTERM, _raise_terminated)
    _quiet_forked_children()
    try:
        code = main()
    except ConfigError as err:
        print(error_line(prog, err), file=sys.stderr)
        _exit(EXIT_USAGE)
    except StepFailed as err:
        print(error_line(prog, err), file=sys.stderr)
        _exit(err.code)
    except OSError as err:
        if err.filename is None:
            raise
        print(error_line(prog, err), file=sys.stderr)
        _exit(EXIT_USAGE)
    except SystemExit:
        # argparse's errors and sys.exit() in ``main``: the same quiet shutdown as _exit
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; {kept}", file=sys.stderr)
        _exit(128 + signal.SIGINT)
    except Terminated:
        print(f"{prog}: terminated; {kept}", file=sys.stderr)
        _exit(128 + signal.SIGTERM)
    _exit(code or 0)


class StepFailed(Exception):
    """A step of this program (another entry point it ran) failed, after printing its own
    error; :func:`run` ends this program with the step's exit status and one line naming it."""

    def __init__(self, step: str, code: int) -> None:
        super().__init__(
            f"{step} exited {code} (its error is above); the steps after it did not run"
        )
        self.code = code


def run_step(command: list[str], **kwargs) -> None:
    """Run ``command``, another entry point, as one step of this one (``subprocess.run``'s
    keyword arguments); :class:`StepFailed` when it fails, instead of ``CalledProcessError``'s
    traceback."""
    import subprocess

    code = subprocess.run(command, **kwargs).returncode
    if code != 0:
        step = next((os.path.basename(part) for part in command if part.endswith(".py")), None)
        # killed by a signal: the status a shell reports
        raise StepFailed(step or os.path.basename(command[0]), code if code > 0 else 128 - code)


def temporary_name(path: str | os.PathLike) -> str:
    """``data/x.bin`` -> ``data/x.tmp.bin``: the name a file has until it is complete."""
    path = Path(path)
    return str(path.with_name(f"{path.stem}.tmp{path.suffix}"))


@contextlib.contextmanager
def naming_file(path: str | os.PathLike) -> Iterator[None]:
    """An ``OSError`` raised inside the block that names no file is raised again naming
    ``path``: a write to a file already open fails on a full disk without a name, and
    :func:`run` reports only errors that name their file in one line."""
    try:
        yield
    except OSError as err:
        if err.filename is not None or err.errno is None:
            raise
        raise type(err)(err.errno, err.strerror, os.fspath(path)) from None


@contextlib.contextmanager
def atomic_outputs(*paths: str | os.PathLike) -> Iterator[list[str]]:
    """Temporary names for ``paths``; all are renamed to their final names when the block ends
    normally, and removed when it raises (errors, Ctrl-C, SIGTERM through :func:`run`) or a
    rename fails (a final name that is a directory): that error names the final path, which is
    the user's to fix, not the temporary one. With one path, an unnamed ``OSError`` of the
    block (a full disk) names it too."""
    temporary = [temporary_name(p) for p in paths]
    try:
        with naming_file(paths[0]) if len(paths) == 1 else contextlib.nullcontext():
            yield temporary
        for name, path in zip(temporary, paths):
            _rename(name, path)
    except BaseException:
        for name in temporary:
            with contextlib.suppress(FileNotFoundError):
                os.remove(name)
        raise


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """A fresh temporary directory beside ``path`` (which must not exist), renamed to ``path``
    when the block ends normally and removed with its contents when it raises. An ``OSError``
    of the block that names no file or one inside the temporary directory (a full disk, a
    read-only file system) is raised again naming ``path``: the directory the user asked for,
    not a temporary one that is gone by the time the error line is read."""
    path = Path(path)
    try:
        temporary = Path(tempfile.mkdtemp(prefix=f"{path.name}.tmp.", dir=path.parent))
    except OSError as err:
        raise type(err)(err.errno, err.strerror, os.fspath(path)) from None
    try:
        yield temporary
        _rename(os.fspath(temporary), path)
    except OSError as err:
        shutil.rmtree(temporary, ignore_errors=True)
        named = err.filename is not None and not Path(err.filename).is_relative_to(temporary)
        if named or err.errno is None:
            raise
        raise type(err)(err.errno, err.strerror, os.fspath(path)) from None
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _rename(temporary: str, path: str | os.PathLike) -> None:
    try:
        os.replace(temporary, path)
    except OSError as err:
        raise type(err)(err.errno, err.strerror, os.fspath(path)) from None


@contextlib.contextmanager
def exclusive(lock_file: str | os.PathLike) -> Iterator[None]:
    """Hold an advisory lock on ``lock_file`` (created with its directory if missing) for the
    block. Whoever builds a shared cache entry checks for it again inside the block, so the
    second of two processes finds it complete instead of writing it a second time beside the
    first; the lock is released when the process ends, however it ends."""
    Path(lock_file).parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """In a worker process: end when the parent ends, even by SIGKILL (Linux); leave Ctrl-C to
    the parent, which stops the workers itself, so that they print no traceback of their own.
    (Under :func:`run` the fork itself already set these handlers.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)


def end_with_parent(parent: int) -> None:
    """In a helper process: end once ``parent`` has, however it ended. For helpers that a
    parent may start from any thread: the parent-death signal of :func:`die_with_parent`
    follows the thread that started the helper, not the process."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
