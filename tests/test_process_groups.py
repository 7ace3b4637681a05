"""Process groups reach our code as one megatron-core ``ProcessGroupCollection``: built by
:func:`megatron.apertus.parallel.process_groups`, given to the model chunks, and read back from
them by everything that communicates (docs/megatron_core_changes.md, "Process groups").

Only ``megatron/apertus/parallel.py`` may import megatron-core's global ``parallel_state``: the
check parses every module with :mod:`ast` (deferred imports count too)."""

from __future__ import annotations

import ast
from pathlib import Path

from megatron.apertus import parallel
from megatron.apertus.model import ParallelConfig
from megatron.apertus.model.builder import build_model, chunk_groups
from megatron.apertus.training.step import wrap_ddp

ROOT = Path(__file__).resolve().parents[1] / "megatron" / "apertus"


def _imports_parallel_state(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "megatron.core":
            if any(alias.name == "parallel_state" for alias in node.names):
                return True
        if isinstance(node, ast.ImportFrom) and node.module == "megatron.core.parallel_state":
            return True
        if isinstance(node, ast.Import):
            if any(alias.name == "megatron.core.parallel_state" for alias in node.names):
                return True
    return False


def parallel_state_importers(root: Path = ROOT) -> list[str]:
    """The modules under ``root`` (relative paths, sorted) that import ``parallel_state``."""
    return sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if _imports_parallel_state(ast.parse(path.read_text()))
    )


def test_only_the_process_group_setup_imports_parallel_state():
    assert parallel_state_importers() == ["parallel.py"]


def test_the_check_sees_every_form_of_the_import(tmp_path):
    (tmp_path / "deferred.py").write_text(
        "def f():\n    from megatron.core import parallel_state\n"
    )
    (tmp_path / "plain.py").write_text("import megatron.core.parallel_state as ps\n")
    (tmp_path / "member.py").write_text("from megatron.core.parallel_state import get_pp\n")
    (tmp_path / "other.py").write_text("from megatron.core import tensor_parallel\n")
    assert parallel_state_importers(tmp_path) == ["deferred.py", "member.py", "plain.py"]


def test_chunks_carry_the_collection_they_were_built_with(tiny_cpu):
    groups = parallel.process_groups()
    (chunk,) = build_model(
        tiny_cpu.model, ParallelConfig(), use_cpu_initialization=True, pg_collection=groups
    )
    (ddp,) = wrap_ddp([chunk], chunk.config, use_distributed_optimizer=False)
    assert chunk_groups(ddp) is groups  # found through the DDP wrapper
    assert chunk.decoder.layers[0].self_attention.pg_collection is groups
    assert chunk.pre_process and chunk.post_process  # one stage holds the whole model
    # Built without one: megatron-core's default, the same groups.
    default = chunk_groups(tiny_cpu.build())
    assert default is not groups
    assert (default.tp, default.pp, default.cp, default.dp_cp) == (
        groups.tp,
        groups.pp,
        groups.cp,
        groups.dp_cp,
    )
    assert parallel.is_reporting_rank(groups)
