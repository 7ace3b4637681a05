"""Imports inside ``megatron.apertus`` point down the layers only; :data:`LAYERS` is the one
written statement of the layer order (the README and the package docstring point here).

Every module under ``megatron/apertus`` is parsed with :mod:`ast` (nothing is imported), and
each ``megatron.apertus.<unit>`` it names is checked against :data:`LAYERS`; a unit is a
subpackage or a top-level module. Module-level, function-level, ``TYPE_CHECKING`` and relative
imports all count: a deferred import still ties the lower layer to the upper one. A module may
import its own unit and any unit of a lower layer, never one of the same layer: peers stay
independent, so no cycle can form between them. Imports by computed name
(``importlib.import_module``) are not seen. Units that promise to use no third-party package, or
only some (:data:`THIRD_PARTY`), are checked for that too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator

import pytest

PACKAGE = "megatron.apertus"
ROOT = Path(__file__).resolve().parents[1] / "megatron" / "apertus"
PACKAGE_INIT = "__init__"
"""The unit of ``megatron/apertus/__init__.py``: it runs before any module of the package, so
it sits below all of them and may import none."""

LAYERS: tuple[frozenset[str], ...] = (
    # The standard library only: what every layer and a host Python without torch may import.
    frozenset({PACKAGE_INIT, "errors", "checkpoint_files"}),
    # ops: torch and our extensions only; cli: the standard library only (one-line errors, exit
    # codes, atomic outputs), so that every layer and entry point may use it; mcore_compat: the
    # supported megatron-core releases' differences, which every layer above may need
    frozenset({"ops", "cli", "mcore_compat"}),
    # cpu_compat patches megatron-core for CPU, the model builder applies it; quant's layers are
    # what the model's spec puts in its linear slots when a run quantizes.
    frozenset({"cpu_compat", "quant"}),
    frozenset({"model"}),
    # What training consumes; ``parallel`` (process groups and seeds) needs the model's layout
    # checks and ``cpu_compat``, and only training, the runners and tools call it.
    frozenset({"checkpoint", "data", "distill", "optim", "parallel"}),
    frozenset({"align"}),  # alignment objectives; reference log-probs live in distill's store
    frozenset({"training"}),  # the loop and the teacher-logit runner
    frozenset({"convert", "launch"}),  # library halves of tools/ and the Slurm launcher
)
"""Lowest first. Entry scripts and ``tools/`` sit above all of these."""

RANK = {unit: rank for rank, layer in enumerate(LAYERS) for unit in layer}

THIRD_PARTY: dict[str, frozenset[str]] = {
    PACKAGE_INIT: frozenset(),
    "errors": frozenset(),
    "checkpoint_files": frozenset(),  # launchers read it on a host Python without torch
    "ops": frozenset({"torch"}),  # torch and our extensions only
    "cli": frozenset(),  # --help and argument errors cost no start-up time
}
"""Units that promise to import no third-party package beyond the ones named (top-level names;
the standard library is always allowed)."""


def units_on_disk(root: Path = ROOT) -> set[str]:
    """Subpackages and top-level modules of the package, and the package's own ``__init__``."""
    units = {PACKAGE_INIT}
    units |= {p.parent.name for p in root.glob("*/__init__.py")}
    units |= {p.stem for p in root.glob("*.py") if p.stem != PACKAGE_INIT}
    return units


def module_name(path: Path, root: Path = ROOT) -> str:
    """Dotted name of the module at ``path`` (a package's ``__init__.py`` names the package)."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == PACKAGE_INIT:
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def unit_of(name: str) -> str | None:
    """The unit of a dotted module name inside the package; None outside it."""
    if name == PACKAGE:
        return PACKAGE_INIT
    if not name.startswith(PACKAGE + "."):
        return None
    return name[len(PACKAGE) + 1 :].split(".")[0]


def imported_names(source: str, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every module ``source`` imports, relative imports resolved.

    ``from X import y`` yields ``X.y`` as well as ``X``: ``y`` may be a submodule (``from
    megatron.apertus import parallel``); when it is not, ``X.y`` still lies in ``X``'s unit,
    except at the package itself, which :func:`imported_units` resolves.
    """
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield node.lineno, target
            for alias in node.names:
                yield node.lineno, f"{target}.{alias.name}"


def imported_units(
    source: str, module: str, is_package: bool, units: set[str]
) -> Iterator[tuple[int, str]]:
    """(line, unit) of every import of another unit of the package by ``source``.

    A name imported from the package itself that is no unit (``from megatron.apertus import
    __version__``) belongs to the package's ``__init__``.
    """
    own = unit_of(module)
    for line, name in imported_names(source, module, is_package):
        unit = unit_of(name)
        if unit is None or name == PACKAGE:
            continue  # ``from megatron.apertus import x`` is judged by ``x``
        if unit not in units:
            unit = PACKAGE_INIT
        if unit != own:
            yield line, unit


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """One line per import in ``source`` of a unit that is not in a lower layer than its own."""
    own = unit_of(module)
    found = []
    for line, unit in imported_units(source, module, is_package, set(RANK)):
        if RANK[unit] >= RANK[own]:
            found.append(
                f"{module}:{line}: {own} (layer {RANK[own]}) imports {unit} (layer {RANK[unit]})"
            )
    return sorted(set(found))


def third_party_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """One line per import in ``source`` of a third-party package its unit promises not to use."""
    allowed = THIRD_PARTY.get(unit_of(module))
    if allowed is None:
        return []
    found = []
    for line, name in imported_names(source, module, is_package):
        top = name.split(".")[0]
        if not top or unit_of(name) is not None or name == PACKAGE:
            continue
        if top in sys.stdlib_module_names or top in allowed or top == "__future__":
            continue
        found.append(f"{module}:{line}: {unit_of(module)} promises not to import {top}")
    return sorted(set(found))


def test_every_unit_has_a_layer():
    assert units_on_disk() == set(RANK), "place new subpackages and modules in LAYERS"


def test_imports_point_down_only():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        found += violations(source, module_name(path), path.name == "__init__.py")
    assert not found, "imports against the layering:\n" + "\n".join(found)


def test_units_keep_their_third_party_promises():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        found += third_party_violations(source, module_name(path), path.name == "__init__.py")
    assert not found, "third-party imports against a unit's promise:\n" + "\n".join(found)


def test_third_party_checker_reports_broken_promises():
    source = "import numpy\nfrom megatron.core import parallel_state\nimport torch\nimport os\n"
    assert third_party_violations(source, "megatron.apertus.ops.xielu") == [
        "megatron.apertus.ops.xielu:1: ops promises not to import numpy",
        "megatron.apertus.ops.xielu:2: ops promises not to import megatron",
    ]
    assert third_party_violations("import torch\n", "megatron.apertus.errors") == [
        "megatron.apertus.errors:1: errors promises not to import torch"
    ]
    assert third_party_violations(source, "megatron.apertus.model.spec") == []


@pytest.mark.parametrize(
    "module, source, expected",
    [
        (  # a function-level import of the layer above
            "megatron.apertus.distill.targets",
            "def f():\n    from megatron.apertus.training import checkpoint\n",
            ["megatron.apertus.distill.targets:2: distill (layer 4) imports training (layer 6)"],
        ),
        (  # relative, and a module of the package named in ``from megatron.apertus import``
            "megatron.apertus.model.spec",
            "from ..data.batches import Batch\nfrom megatron.apertus import parallel\n",
            [
                "megatron.apertus.model.spec:1: model (layer 3) imports data (layer 4)",
                "megatron.apertus.model.spec:2: model (layer 3) imports parallel (layer 4)",
            ],
        ),
        (  # a peer of the same layer
            "megatron.apertus.data.batches",
            "import megatron.apertus.distill.targets as targets\n",
            ["megatron.apertus.data.batches:1: data (layer 4) imports distill (layer 4)"],
        ),
        (  # down, within the unit, and outside the package: all allowed
            "megatron.apertus.training.loop",
            "from . import step\nfrom ..model.config import ConfigError\n"
            "from megatron.apertus import __version__, cpu_compat\n"
            "import megatron.core\nimport torch\n",
            [],
        ),
    ],
)
def test_checker_reports_imports_against_the_layering(module, source, expected):
    assert violations(source, module) == expected


def test_package_inits_resolve_relative_imports_from_the_package():
    source = "from .teacher_logits import generate\nfrom ..launch import planner\n"
    assert violations(source, "megatron.apertus.training", is_package=True) == [
        "megatron.apertus.training:2: training (layer 6) imports launch (layer 7)"
    ]
    # The package's own __init__ runs before every module: it may import none of them.
    assert violations("from . import ops\n", PACKAGE, is_package=True) == [
        "megatron.apertus:1: __init__ (layer 0) imports ops (layer 1)"
    ]
