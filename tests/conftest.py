"""Shared helpers: run our entry points as real subprocesses (one process or torchrun), the one
fixture that builds tiny fp32 models on the CPU in this process (:func:`tiny_cpu`), and the
``process`` marker that ``make test-fast`` leaves out.

A test is marked ``process`` when it, one of its fixtures, or a function of ``tests/`` they call
(followed through the names their code uses) reaches ``run_entry``, ``subprocess``,
``multiprocessing`` or torch's process spawning: what it uses decides its tier, not a list.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Callable, Iterator

import pytest

from megatron.apertus import checkpoint, parallel
from megatron.apertus.cli import exclusive
from megatron.apertus.model import ApertusConfig, ParallelConfig, preset, transformer_config
from megatron.apertus.model.builder import build_model
from megatron.apertus.training import step as step_module
from megatron.apertus.training.metrics import read_history
from tests import warm_interpreter

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = REPO / "pretrain_gpt.py"

SMALL_TOKENIZER = REPO / "tests" / "fixtures" / "bpe4096" / "tokenizer.json"
SMALL_TOKENIZER_FLAGS = [
    "--tokenizer-type",
    "HuggingFaceTokenizer",
    "--tokenizer-model",
    str(SMALL_TOKENIZER),
]
"""The data flags of :data:`SMALL_VOCABULARY` (entry points that read a model from a checkpoint
take no model flags)."""
SMALL_VOCABULARY = [*SMALL_TOKENIZER_FLAGS, "--make-vocab-size-divisible-by", "128"]
"""Flags that train on a real 4096-piece BPE (``tests/fixtures/make_bpe4096.py``) instead of
Apertus's 131072-token vocabulary: the tiny model's steps are then 11x faster on CPU. Tests of
the tokenizer, the vocabulary or recorded figures keep the Apertus tokenizer."""


def run_script(
    script: Path,
    args: list[str],
    *,
    nproc: int = 1,
    env: dict | None = None,
    timeout: int = 600,
    python: str = "",
) -> subprocess.CompletedProcess:
    """What ``python SCRIPT ARGS`` (``torchrun --nproc-per-node N --standalone`` when ``nproc``
    > 1) returns, run by ``python`` (this interpreter unless given) from the repository with
    ``env`` (default: this process's) and without a rendezvous inherited from it. With this
    interpreter, the processes are forked from a warm one (``tests/warm_interpreter.py``)
    instead of importing torch and megatron-core again."""
    warm = not python and warm_interpreter.enabled()
    python = python or sys.executable
    if nproc == 1:
        cmd = [python, str(script), *args]
    else:
        cmd = [
            python,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--standalone",
            str(script),
            *args,
        ]
    rendezvous = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in rendezvous}
    if warm:
        return warm_interpreter.run(cmd, str(script), args, nproc, env, timeout)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_entry(
    script: Path, args: list[str], *, nproc: int = 1, timeout: int = 600, python: str = ""
) -> subprocess.CompletedProcess:
    """Run ``script`` with ``args`` (see :func:`run_script`), one thread per process; fail
    with its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = run_script(script, args, nproc=nproc, env=env, timeout=timeout, python=python)
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(proc.args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-4000:]}"
        )
    return proc


def spawn(fn: Callable, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join=True)``, its processes forked from a
    fork server that imports torch and ``fn``'s module once per pytest process: spawned anew,
    each process paid those imports (7 s of CPU for the attention tests' module). Each process
    is still its own, with its own ``torch.distributed`` world; the server is a fresh interpreter
    with no threads, so forking it is safe."""
    import multiprocessing

    import torch.multiprocessing

    multiprocessing.set_forkserver_preload(["torch", fn.__module__])
    torch.multiprocessing.start_processes(
        fn, args=args, nprocs=nprocs, join=True, start_method="forkserver"
    )


SHARED = "built-once"
"""The folder, beside the pytest workers' own, of what :func:`built_once` builds."""


def built_once(tmp_path_factory, name: str, key: object, build: Callable[[Path], None]) -> Path:
    """A folder that ``build(folder)`` fills, built once per pytest run for ``name`` and ``key``
    (what decides its contents, e.g. a command line) and shared by every test module and
    pytest-xdist worker that asks for it: a tiny teacher and its stored logits are trained and
    written once, not once per module. Whoever asks first builds it under a lock; the others
    wait for it. What is built must only be read."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / SHARED
    folder = root / f"{name}-{hashlib.sha256(repr(key).encode()).hexdigest()[:16]}"
    complete = folder.with_name(folder.name + ".complete")
    with exclusive(folder.with_name(folder.name + ".lock")):
        if not complete.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            build(folder)
            complete.touch()
    return folder


def read_json(path: Path) -> dict:
    """A ``--log-json`` file as ``{name: [[iteration, value], ...]}``."""
    return read_history(path)


def series(history: dict, name: str) -> tuple[list[int], list[float]]:
    """Iterations and values of one recorded metric (``--log-json`` stores [iteration, value])."""
    pairs = history.get(name, [])
    return [int(i) for i, _ in pairs], [float(v) for _, v in pairs]


class TinyCPU:
    """Models of one process on the CPU, fp32, built the way the package builds them
    (:func:`megatron.apertus.model.builder.build_model`); ``model`` is the tiny preset."""

    def __init__(self, model: ApertusConfig) -> None:
        self.model = model

    def config(self, model: ApertusConfig | None = None, **fields):
        """megatron-core's TransformerConfig of ``model`` (default: the tiny preset)."""
        return transformer_config(
            model or self.model, ParallelConfig(), use_cpu_initialization=True, **fields
        )

    def build(
        self, model: ApertusConfig | None = None, *, load=None, fused_loss: bool = False, **fields
    ):
        """The one chunk of ``model`` (default: the checkpoint ``load``'s model, else the tiny
        preset); with ``load``, holding that checkpoint's weights."""
        if model is None:
            model = self.model if load is None else checkpoint.load_model_config(load)
        (chunk,) = build_model(
            model, ParallelConfig(), fused_loss=fused_loss, use_cpu_initialization=True, **fields
        )
        if load is not None:
            checkpoint.load_model(load, [chunk])
        return chunk


@contextlib.contextmanager
def after_backward(hook: Callable[[int, list], None]) -> Iterator[None]:
    """Within the block, ``hook(n, model_chunks)`` runs after the n-th training backward pass and
    before its optimizer step (gradients are in ``main_grad``): how tests inject faults into a
    real run. Evaluation passes (forward only) are not counted."""
    original = step_module.run_microbatches
    passes = 0

    def with_hook(model, data_iterators, shape, *, forward_only: bool, **objective):
        nonlocal passes
        losses = original(model, data_iterators, shape, forward_only=forward_only, **objective)
        if not forward_only:
            passes += 1
            hook(passes, model)
        return losses

    step_module.run_microbatches = with_hook
    try:
        yield
    finally:
        step_module.run_microbatches = original


@contextlib.contextmanager
def cpu_models() -> Iterator[TinyCPU]:
    """One-process CPU parallel state (seed 0) and a :class:`TinyCPU` to build models in it,
    torn down on exit; for helpers that load checkpoints outside a test's own scope."""
    model = preset("tiny")
    parallel.initialize(ParallelConfig(), device="cpu", seed=0, model=model)
    try:
        yield TinyCPU(model)
    finally:
        parallel.shutdown()


@pytest.fixture
def tiny_cpu() -> Iterator[TinyCPU]:
    """:func:`cpu_models` for the duration of one test."""
    with cpu_models() as models:
        yield models


PROCESS_NAMES = frozenset({"run_entry", "subprocess", "Popen", "multiprocessing", "spawn"})
"""Names whose use in a test's code means that the test starts processes."""
PROCESS_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing")


def _starts_processes(code: types.CodeType, scope: dict, seen: set) -> bool:
    """Whether ``code`` (or a function of ``tests/`` it names, recursively) starts processes."""
    if code in seen:
        return False
    seen.add(code)
    for name in code.co_names:
        if name in PROCESS_NAMES:
            return True
        target = scope.get(name)
        target = getattr(target, "__wrapped__", target)  # through functools' caches
        if getattr(target, "__module__", None) in PROCESS_MODULES:
            return True
        if isinstance(target, types.FunctionType) and target.__module__.startswith("tests"):
            if _starts_processes(target.__code__, target.__globals__, seen):
                return True
    return any(
        _starts_processes(const, scope, seen)
        for const in code.co_consts
        if isinstance(const, types.CodeType)
    )


def _uses_processes(item: pytest.Item) -> bool:
    functions = [getattr(item, "obj", None)]
    for name in getattr(item, "fixturenames", ()):
        functions += [d.func for d in item._fixtureinfo.name2fixturedefs.get(name, ())]
    seen: set = set()
    return any(
        _starts_processes(f.__code__, f.__globals__, seen)
        for f in functions
        if isinstance(f, types.FunctionType)
    )


def worker_group(nodeid: str) -> str:
    """The pytest-xdist work unit of a test: its file, so that a module's fixtures are built
    once, or, for all the Slurm tests, ``slurm``: they share one Slurm cluster."""
    path = Path(nodeid.split("::")[0])
    return "slurm" if path.parts[:2] == ("tests", "slurm") else str(path)


GROUP_SECONDS = Path(__file__).with_name("group_seconds.json")
"""Seconds each work unit took in a recorded full run (``APERTUS_RECORD_GROUP_SECONDS=1 make
test`` rewrites it)."""


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` hands each worker whole :func:`worker_group` units, in the order of
    the collection (longest first, see below).

    pytest-xdist's own loadgroup reads groups from a suffix it writes into each node id, which
    pytest 9.2's structured node ids no longer carry: every test became its own unit and each
    module's fixtures were built in both workers. This scheduler takes the unit from the node id
    itself, and keeps the collection's order (xdist would reorder by test count)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class TestFileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    config.option.loadscopereorder = False
    return TestFileScheduling(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """Mark process tests, and put the work units that took longest first.

    pytest-xdist hands whole units to the workers in collection order; a long unit dealt last
    runs alone while the other worker idles (8 minutes at the end of a full run). Longest first
    keeps both workers busy to the end."""
    for item in items:
        if _uses_processes(item):
            item.add_marker(pytest.mark.process)
    seconds = json.loads(GROUP_SECONDS.read_text()) if GROUP_SECONDS.exists() else {}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-seconds.get(worker_group(item.nodeid), 0.0), order[id(item)]))


_GROUP_TOTALS: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    """Seconds per work unit (set-up, call and tear-down), summed in the controller."""
    group = worker_group(report.nodeid)
    _GROUP_TOTALS[group] = _GROUP_TOTALS.get(group, 0.0) + report.duration


def pytest_sessionfinish() -> None:
    if os.environ.get("APERTUS_RECORD_GROUP_SECONDS") and not os.environ.get("PYTEST_XDIST_WORKER"):
        ranked = dict(sorted(_GROUP_TOTALS.items(), key=lambda kv: -kv[1]))
        GROUP_SECONDS.write_text(json.dumps({k: round(v, 1) for k, v in ranked.items()}, indent=1))


_MODULES_WITH_FAILURES: set[str] = set()
"""Names of the test modules in which a test failed or errored: their scratch is kept."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        _MODULES_WITH_FAILURES.add(item.module.__name__)
    return report


@pytest.fixture(scope="module", autouse=True)
def _module_scratch_removed(request, tmp_path_factory) -> Iterator[None]:
    """The temporary folders a test module made (its fixtures' checkpoints and runs, several
    GB for the whole suite) are removed when the module ends, unless one of its tests failed:
    pytest keeps module-scoped folders until the whole run ends, and a full run would fill a
    small disk."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    if request.module.__name__ in _MODULES_WITH_FAILURES:
        return
    for path in set(base.iterdir()) - before:
        if path.name != SHARED:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """An entry point run in this process (``pretrain_gpt.main``) sets the root logger's level
    and puts a console handler on the ``sys.stdout`` pytest captured for that test: both are
    put back when the test ends, so what a later test logs, and at which level, never depends
    on which tests ran before it in the same worker."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    for added in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(added)
        added.close()
    root.setLevel(level)


@pytest.fixture(scope="module", autouse=True)
def _no_process_groups_left() -> Iterator[None]:
    """A test module that ran an entry point or built a model in this process leaves no
    megatron-core process groups behind (a refusal mid-start that skipped the teardown): else a
    later module in the same worker fails to start its own, far from the cause. The module's
    last test errors naming the leak, and the groups are torn down for the next module."""
    yield
    state = sys.modules.get("megatron.core.parallel_state")
    if state is None or not state.model_parallel_is_initialized():
        return
    state.destroy_model_parallel()
    pytest.fail("this module left megatron-core's process groups initialized")


def pytest_configure(config) -> None:
    """In a pytest-xdist worker, this process's own tensor work uses one thread: the workers
    share the CPU's cores, as the processes the tests start do (``OMP_NUM_THREADS=1``)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
