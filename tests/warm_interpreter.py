"""Our entry points run as processes forked from a warm interpreter: the process tax of the suite.

A fresh ``python pretrain_gpt.py`` spends about 9 s of CPU importing torch and megatron-core
before it reads its first flag, and a ``torchrun --nproc-per-node 2`` pays it three times (the
launcher and both ranks). The suite starts over a hundred of them. Instead, each pytest process
starts one server that imports them once and then forks, per request, one process per rank that
runs the script as ``python SCRIPT ARGS`` would (``runpy`` as ``__main__``, its own ``sys.argv``,
environment, working directory, standard streams and exit status). What each test runs stays a
real process with its own torch.distributed world, megatron-core parallel state and exit code;
only the imports are shared.

Ranks of a world meet the way torchrun's ranks do: the server holds the rendezvous store on a
port the operating system chose and every rank joins it as a client
(``TORCHELASTIC_USE_AGENT_STORE``), so no port is picked by a test and none can be taken by a
neighbour. When a rank fails the others are stopped (SIGTERM, then SIGKILL), as torchrun does.

What a fork shares with its server and a fresh interpreter would not: the modules already
imported (none of ours reads the environment while importing), Python's string hash seed and
numpy's global random state (our code seeds explicitly). ``APERTUS_TEST_FORK=0`` runs every
entry point as a fresh interpreter instead; so does a machine with a GPU (CUDA cannot be used
in a process forked after it started) and a request for another interpreter.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRELOADED = ("torch", "megatron.core", "megatron.apertus.training.loop")
"""What the server imports once: everything a training entry point needs before its first step."""
STOP_GRACE_SECONDS = 30
"""How long the other ranks of a failed world get to end after SIGTERM, as torchrun waits."""
PR_SET_PDEATHSIG = 1


def enabled() -> bool:
    """Whether entry points run forked from the warm interpreter (see the module docstring)."""
    if os.environ.get("APERTUS_TEST_FORK", "1") == "0":
        return False
    return not Path("/dev/nvidiactl").exists()


# -- the server (one process per pytest process) -------------------------------------------


def _rank_environment(base: dict, rank: int, nproc: int, port: int | None) -> dict:
    """``base`` plus what torchrun exports to each rank of a one-node world."""
    env = dict(base)
    if nproc == 1:
        return env
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_WORLD_SIZE="1",
        ROLE_WORLD_SIZE=str(nproc),
        ROLE_NAME="default",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID="warm",
    )
    return env


_BASE_PATH = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(":")]
"""The interpreter's own module path: what ``python SCRIPT`` has after the script's folder and
``PYTHONPATH``."""


def _script_path(script: str, env: dict) -> list[str]:
    """``sys.path`` of ``python SCRIPT`` run with ``env``."""
    extra = [p for p in env.get("PYTHONPATH", "").split(":") if p]
    return [os.path.dirname(os.path.abspath(script)), *extra, *_BASE_PATH]


def _exit_status(err: SystemExit) -> int:
    """The status ``sys.exit(code)`` gives a process (a message is printed, status 1)."""
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code
    print(err.code, file=sys.stderr)
    return 1


def _run_script(request: dict, env: dict, port_reader: int) -> None:
    """In a forked rank: become ``python SCRIPT ARGS`` and never return."""
    status = 1
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        port = os.read(port_reader, 16).decode() if port_reader >= 0 else ""
        if port:
            env["MASTER_PORT"] = port
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        script = request["script"]
        sys.argv = [script, *request["args"]]
        sys.path[:] = _script_path(script, env)
        try:
            runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as err:
            status = _exit_status(err)
        except BaseException:
            traceback.print_exc()
            status = 1
        threading._shutdown()  # what the interpreter does at exit: wait for non-daemon threads
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(status)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap(pids: list[int], statuses: dict, seconds: float) -> None:
    """Collect the exit statuses of ``pids`` that end within ``seconds``."""
    deadline = time.monotonic() + seconds
    while any(pid not in statuses for pid in pids) and time.monotonic() < deadline:
        pid, raw = os.waitpid(-1, os.WNOHANG)
        if pid:
            statuses[pid] = os.waitstatus_to_exitcode(raw)
        else:
            time.sleep(0.05)


def _stop(pids: list[int], statuses: dict) -> None:
    """End the ranks still running after one failed: SIGTERM, a grace period, SIGKILL."""
    _signal_all(pids, signal.SIGTERM)
    _reap(pids, statuses, STOP_GRACE_SECONDS)
    left = [pid for pid in pids if pid not in statuses]
    _signal_all(left, signal.SIGKILL)
    for pid in left:
        statuses[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _serve_one(request: dict) -> list[int]:
    """Fork the request's ranks, hand them the rendezvous port, wait; their exit statuses."""
    from torch.distributed import TCPStore

    nproc = int(request["nproc"])
    pids, writers = [], []
    for rank in range(nproc):
        reader, writer = os.pipe() if nproc > 1 else (-1, -1)
        pid = os.fork()
        if pid == 0:
            if writer >= 0:
                os.close(writer)
            _run_script(request, _rank_environment(request["env"], rank, nproc, None), reader)
        pids.append(pid)
        if reader >= 0:
            os.close(reader)
            writers.append(writer)
    # The store starts a thread, so it starts after the forks (a fork copies no threads).
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False) if nproc > 1 else None
    for writer in writers:
        os.write(writer, str(store.port).encode())
        os.close(writer)
    statuses: dict[int, int] = {}
    while len(statuses) < nproc:
        pid, raw = os.waitpid(-1, 0)
        statuses[pid] = os.waitstatus_to_exitcode(raw)
        if statuses[pid] != 0:
            _stop([p for p in pids if p not in statuses], statuses)
    del store
    return [statuses[pid] for pid in pids]


def serve(channel: socket.socket) -> None:
    """Import once, then answer one request (a JSON line) at a time until the client leaves."""
    for name in PRELOADED:
        __import__(name)
    channel.sendall(b'{"ready": true}\n')
    lines = channel.makefile("r")
    for line in lines:
        statuses = _serve_one(json.loads(line))
        channel.sendall((json.dumps({"statuses": statuses}) + "\n").encode())


# -- the client (in the pytest process) ----------------------------------------------------


class WarmInterpreter:
    """One server process and the connection to it."""

    def __init__(self, env: dict) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.warm_interpreter", str(theirs.fileno())],
            cwd=REPO,
            env=env,
            pass_fds=[theirs.fileno()],
            start_new_session=True,
        )
        theirs.close()
        self.channel = ours
        self.replies = ours.makefile("r")
        self.lock = threading.Lock()
        assert json.loads(self.replies.readline()).get("ready"), "the warm interpreter failed"

    def run(
        self, cmd: list[str], script: str, args: list[str], nproc: int, env: dict, timeout: float
    ) -> subprocess.CompletedProcess:
        """Run ``script`` as ``nproc`` ranks; as ``subprocess.run(cmd, capture_output=True,
        text=True)`` would report it."""
        scratch = tempfile.mkdtemp(prefix="warm-")
        try:
            request = {
                "script": script,
                "args": args,
                "nproc": nproc,
                "env": env,
                "cwd": str(REPO),
                "stdout": os.path.join(scratch, "stdout"),
                "stderr": os.path.join(scratch, "stderr"),
            }
            with self.lock:
                self.channel.settimeout(timeout)
                self.channel.sendall((json.dumps(request) + "\n").encode())
                try:
                    line = self.replies.readline()
                except TimeoutError:
                    self.close()
                    raise subprocess.TimeoutExpired(cmd, timeout) from None
            if not line:
                self.close()
                raise RuntimeError("the warm interpreter ended unexpectedly")
            statuses = json.loads(line)["statuses"]
            status = next((s for s in statuses if s != 0), 0)
            if status != 0 and nproc > 1:
                status = 1  # torchrun's status when a rank failed
            return subprocess.CompletedProcess(
                cmd, status, _read(request["stdout"]), _read(request["stderr"])
            )
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def close(self) -> None:
        """End the server and whatever it still runs (its own process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.channel.close()


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


_server: WarmInterpreter | None = None


def _server_environment() -> dict:
    """This process's environment without a rendezvous, with one thread per process: torch
    sizes its thread pool when it is imported, so every fork runs one thread, as the suite's
    processes do (``OMP_NUM_THREADS=1``: the pytest workers share the cores)."""
    rendezvous = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    return dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def start() -> WarmInterpreter:
    """This process's warm interpreter, started (its imports done) if it was not."""
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = WarmInterpreter(_server_environment())
        atexit.register(_server.close)
    return _server


def stop() -> None:
    """End this process's warm interpreter, if it runs."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


def run(
    cmd: list[str], script: str, args: list[str], nproc: int, env: dict, timeout: float
) -> subprocess.CompletedProcess:
    """Run ``script`` with ``args`` and ``env`` as ``nproc`` ranks forked from this process's
    warm interpreter (started on first use)."""
    return start().run(cmd, script, args, nproc, env, timeout)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
