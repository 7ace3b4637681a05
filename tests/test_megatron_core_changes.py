"""Every place where our code changes megatron-core's behaviour is listed in
``docs/megatron_core_changes.md``.

Found by reading the package with :mod:`ast` (nothing of ours is run):

* a method of a subclass of a megatron-core class that overrides a method megatron-core defines
  (``__init__`` aside: building differently is not changing behaviour; a ``forward`` that only
  fills ``torch.nn.Module``'s is a new module, not a change);
* a function bound onto an existing object or module: ``obj.attr = lambda ...``,
  ``= types.MethodType(...)`` or ``=`` a function of the module.

Each must appear in the document as `` `name` `` (or `` `Class.name` ``) on a line that also names
its file or its class.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "megatron" / "apertus"
DOC = REPO / "docs" / "megatron_core_changes.md"
BINDERS = {"MethodType"}


def _megatron_imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted origin of every ``from megatron.core... import X``."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.core"):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _defined_by_megatron_core(base: type, name: str) -> bool:
    owner = next((k for k in base.__mro__ if name in vars(k)), None)
    return owner is not None and owner.__module__.startswith("megatron.core")


def overrides(tree: ast.Module) -> list[tuple[str, str]]:
    """(class, method) of each override of a megatron-core base class's method."""
    imported = _megatron_imports(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = [
            _resolve(imported[b.id])
            for b in node.bases
            if isinstance(b, ast.Name) and b.id in imported
        ]
        for item in node.body:
            if not isinstance(item, ast.FunctionDef) or item.name == "__init__":
                continue
            if any(_defined_by_megatron_core(base, item.name) for base in bases):
                found.append((node.name, item.name))
    return found


def _is_binding(value: ast.expr, functions: set[str]) -> bool:
    if isinstance(value, ast.Lambda):
        return True
    if isinstance(value, ast.Name):
        return value.id in functions
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in BINDERS
    return False


def rebindings(tree: ast.Module) -> list[str]:
    """Attribute names onto which a function is bound (``self``'s own attributes aside)."""
    functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or not _is_binding(node.value, functions):
            continue
        for target in node.targets:
            if isinstance(target, ast.Attribute) and not (
                isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")
            ):
                found.append(target.attr)
    return found


def changes() -> list[tuple[str, str, str]]:
    """(file, class or "", name) of every change of megatron-core's behaviour in the package."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [(path.name, cls, name) for cls, name in overrides(tree)]
        found += [(path.name, "", name) for name in rebindings(tree)]
    return found


def listed(doc: str, file: str, cls: str, name: str) -> bool:
    for line in doc.splitlines():
        if f"`{cls}.{name}`" in line if cls else False:
            return True
        if f"{name}`" in line and (file in line or (cls and cls in line)):
            return True
    return False


def test_every_change_of_megatron_core_is_listed():
    doc = DOC.read_text(encoding="utf-8")
    missing = [
        f"{file}: {cls + '.' if cls else ''}{name}"
        for file, cls, name in changes()
        if not listed(doc, file, cls, name)
    ]
    assert not missing, f"not in {DOC.name}:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import types\nm._forward_impl = types.MethodType(f, m)\n", ["_forward_impl"]),
        ("def post(h):\n    return h\nmodel._postprocess = post\n", ["_postprocess"]),
        (
            "mod._get_cuda_rng_state = lambda: 0\nself._cache = lambda: 0\nx.y = 3\n",
            ["_get_cuda_rng_state"],
        ),
    ],
)
def test_finds_functions_bound_onto_objects(source, expected):
    assert rebindings(ast.parse(source)) == expected


def test_finds_overrides_of_megatron_core_methods():
    source = (
        "from megatron.core.models.gpt import GPTModel\n"
        "class M(GPTModel):\n"
        "    def __init__(self):\n        pass\n"
        "    def _postprocess(self):\n        pass\n"
        "    def ours_only(self):\n        pass\n"
    )
    assert overrides(ast.parse(source)) == [("M", "_postprocess")]
