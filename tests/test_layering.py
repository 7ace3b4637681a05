"""Imports inside ``megatron.apertus`` point down the layers only, and no module imports itself
through others; :data:`LAYERS` is the one written statement of the layer order (the README and
the package docstring point here).

Every module under ``megatron/apertus`` is parsed with :mod:`ast` (nothing is imported), and
each ``megatron.apertus.<unit>`` it names is checked against :data:`LAYERS`; a unit is a
subpackage or a top-level module. Module-level, function-level, ``TYPE_CHECKING`` and relative
imports all count: a deferred import still ties the lower layer to the upper one. A module may
import its own unit and any unit of a lower layer, never one of the same layer: peers stay
independent, so no cycle can form between them.

Inside a unit the layers say nothing, so the modules' imports of each other are checked for
circles too (:func:`import_cycles`), with the same imports counted: ``from X import y`` is an
import of the module ``X.y`` where there is one, else of ``X``. Imports by computed name
(``importlib.import_module``) are not seen. Units that promise to use no third-party package, or
only some (:data:`THIRD_PARTY`), are checked for that too.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from pathlib import Path
from typing import Collection, Iterator

import pytest

PACKAGE = "megatron.apertus"
ROOT = Path(__file__).resolve().parents[1] / "megatron" / "apertus"
PACKAGE_INIT = "__init__"
"""The unit of ``megatron/apertus/__init__.py``: it runs before any module of the package, so
it sits below all of them and may import none."""

LAYERS: tuple[frozenset[str], ...] = (
    # The standard library only: what every layer and a host Python without torch may import;
    # ``cache`` names the one directory that the tokenizer and the datasets cache in.
    frozenset({PACKAGE_INIT, "errors", "checkpoint_files", "cache"}),
    # ops: torch and our extensions only; cli: the standard library only (one-line errors, exit
    # codes, atomic outputs), so that every layer and entry point may use it; flags: the
    # standard library only, the generator that turns each unit's config dataclass into flags,
    # so that every unit declares its config next to its code; mcore_compat: the supported
    # megatron-core releases' differences, which every layer above may need; tokenizer: text
    # <-> ids without torch, below both the data training reads and the offline preparation
    # that writes it
    frozenset({"ops", "cli", "flags", "mcore_compat", "tokenizer"}),
    # cpu_compat patches megatron-core for CPU, the model builder applies it; quant's layers are
    # what the model's spec puts in its linear slots when a run quantizes.
    frozenset({"cpu_compat", "quant"}),
    frozenset({"model"}),
    # What training consumes; ``parallel`` (process groups and seeds) needs the model's layout
    # checks and ``cpu_compat``, and only training, the runners and tools call it.
    frozenset({"checkpoint", "data", "distill", "optim", "parallel"}),
    # alignment objectives (reference log-probs live in distill's store); text generation from
    # a checkpoint (its tool is the entry point)
    frozenset({"align", "inference"}),
    # Offline preparation writes the formats that data and align read, so it sits above them and
    # they never import it; the tools call it, training only to tokenize the embedded corpus.
    frozenset({"prep"}),
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
    "flags": frozenset(),  # so do the flags generated from the config dataclasses
    "cache": frozenset(),
    # the preprocessing tools tokenize without torch or megatron-core
    "tokenizer": frozenset(
        {"huggingface_hub", "mistral_common", "numpy", "sentencepiece", "tiktoken", "tokenizers"}
    ),
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


def import_statements(
    source: str, module: str, is_package: bool
) -> Iterator[tuple[int, str, list[str]]]:
    """(line, dotted name, names taken from it) of every import in ``source``, relative imports
    resolved: ``import a.b`` gives ``(line, "a.b", [])``, ``from a import b, c`` gives
    ``(line, "a", ["b", "c"])``."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield node.lineno, target, [alias.name for alias in node.names]


def imported_names(source: str, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every module ``source`` imports, relative imports resolved.

    ``from X import y`` yields ``X.y`` as well as ``X``: ``y`` may be a submodule (``from
    megatron.apertus import parallel``); when it is not, ``X.y`` still lies in ``X``'s unit,
    except at the package itself, which :func:`imported_units` resolves.
    """
    for line, target, names in import_statements(source, module, is_package):
        yield line, target
        for name in names:
            yield line, f"{target}.{name}"


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


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module under ``root`` by dotted name (a package by its ``__init__.py``)."""
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imported_modules(
    source: str, module: str, is_package: bool, modules: Collection[str]
) -> set[str]:
    """The modules among ``modules``, other than ``module`` itself, that ``source`` imports.

    ``from X import y`` imports the module ``X.y`` where there is one, else ``X`` (``y`` is a
    name that ``X`` defines, so ``X`` must have run)."""
    found = set()
    for _, target, names in import_statements(source, module, is_package):
        for name in names or [""]:
            submodule = f"{target}.{name}" if name else target
            if submodule in modules:
                found.add(submodule)
            elif target in modules:
                found.add(target)
    found.discard(module)
    return found


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module under ``root`` -> the modules under ``root`` that it imports."""
    modules = module_files(root)
    return {
        name: imported_modules(
            path.read_text(encoding="utf-8"), name, path.name == "__init__.py", modules
        )
        for name, path in modules.items()
    }


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules that ``start`` imports, directly or through others (itself only when it sits
    in a circle)."""
    found: set[str] = set()
    todo = list(graph[start])
    while todo:
        module = todo.pop()
        if module not in found:
            found.add(module)
            todo.extend(graph.get(module, ()))
    return found


def shortest_circle(graph: dict[str, set[str]], start: str) -> list[str]:
    """The shortest chain of imports from ``start`` back to ``start`` (breadth first), as
    ``[start, ..., start]``; empty when there is none."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        current = queue.popleft()
        for imported in sorted(graph.get(current, ())):
            if imported == start:
                chain = [current]
                while chain[-1] != start:
                    chain.append(parent[chain[-1]])
                return [*reversed(chain), start]
            if imported not in parent:
                parent[imported] = current
                queue.append(imported)
    return []


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per group of modules that import each other, directly or through others: the
    shortest through the group's first module by name. Empty when the imports form no circle."""
    reach = {module: reachable(graph, module) for module in graph}
    circles, seen = [], set()
    for module in sorted(graph):
        if module in seen or module not in reach[module]:
            continue
        seen |= {other for other in reach[module] if module in reach[other]}
        circles.append(shortest_circle(graph, module))
    return circles


def test_every_unit_has_a_layer():
    assert units_on_disk() == set(RANK), "place new subpackages and modules in LAYERS"


def test_imports_point_down_only():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        found += violations(source, module_name(path), path.name == "__init__.py")
    assert not found, "imports against the layering:\n" + "\n".join(found)


def test_no_module_imports_itself_through_others():
    circles = import_cycles(module_graph())
    assert not circles, "imports that go round in a circle:\n" + "\n".join(
        " -> ".join(circle) for circle in circles
    )


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """A package tree under ``root``: relative path -> source."""
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
    return root


@pytest.mark.parametrize(
    "files, expected",
    [
        (  # a circle of three files closed by a function-level import, and a module outside it
            {
                "__init__.py": "",
                "data/__init__.py": "",
                "data/tokenizer.py": "def cache():\n    from ..data.datasets import cache_dir\n",
                "data/datasets.py": "from megatron.apertus.data.corpus import prefix\n",
                "data/corpus.py": "from megatron.apertus.data import tokenizer\n",
                "data/batches.py": "from megatron.apertus.data.datasets import Config\n",
            },
            [
                [
                    "megatron.apertus.data.corpus",
                    "megatron.apertus.data.tokenizer",
                    "megatron.apertus.data.datasets",
                    "megatron.apertus.data.corpus",
                ]
            ],
        ),
        (  # a package that imports its module, which takes a name the package defines
            {
                "__init__.py": "",
                "data/__init__.py": "from .batches import Batch\nLIMIT = 1\n",
                "data/batches.py": "from megatron.apertus.data import LIMIT\n",
            },
            [["megatron.apertus.data", "megatron.apertus.data.batches", "megatron.apertus.data"]],
        ),
        (  # the same package whose module takes a sibling module through the package: no circle
            {
                "__init__.py": "",
                "data/__init__.py": "from .batches import Batch\n",
                "data/batches.py": "from megatron.apertus.data import goldfish\n",
                "data/goldfish.py": "import megatron.apertus.errors\n",
                "errors.py": "",
            },
            [],
        ),
    ],
)
def test_cycle_checker_finds_circles_of_imports(tmp_path, files, expected):
    assert import_cycles(module_graph(write_tree(tmp_path / "apertus", files))) == expected


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
            ["megatron.apertus.distill.targets:2: distill (layer 4) imports training (layer 7)"],
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
        "megatron.apertus.training:2: training (layer 7) imports launch (layer 8)"
    ]
    # The package's own __init__ runs before every module: it may import none of them.
    assert violations("from . import ops\n", PACKAGE, is_package=True) == [
        "megatron.apertus:1: __init__ (layer 0) imports ops (layer 1)"
    ]
