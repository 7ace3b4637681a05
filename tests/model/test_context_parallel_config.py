"""The context-parallel layout rule (``model/config.py: context_parallel_problems``) that the
trainer and the planner share, and per-layer ``--cp-comm-type`` lists built into the model:
each layer's core attention runs its own entry, where megatron-core 0.16.1's own pick is off by
one layer (docs/megatron_core_changes.md)."""

from __future__ import annotations

import dataclasses

import megatron.core
import pytest
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.apertus.errors import ConfigError
from megatron.apertus.model import ParallelConfig, preset, transformer_config
from megatron.apertus.model.builder import build_model
from megatron.apertus.model.config import context_parallel_problems, validate_layout
from megatron.apertus.model.spec import apertus_layer_spec

TINY = dataclasses.replace(preset("tiny"), seq_length=64)
"""4 layers, 4 attention heads, 2 query groups."""
PER_LAYER = ["p2p", "a2a", "a2a", "p2p"]


def _problems(model=TINY, impl: str = "local", **parallel) -> list[str]:
    return context_parallel_problems(model, ParallelConfig(**parallel), impl)


@pytest.mark.parametrize(
    "parallel, impl, refusal",
    [
        (
            dict(context_parallel_size=4, cp_comm_type="a2a+p2p"),
            "local",
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P",
        ),
        (
            dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 3]),
            "local",
            "--hierarchical-context-parallel-sizes 2 3: the product 2 x 3 = 6 is not "
            "--context-parallel-size (4)",
        ),
        (
            dict(
                context_parallel_size=8,
                cp_comm_type="a2a+p2p",
                hierarchical_context_parallel_sizes=[2, 2, 2],
            ),
            "local",
            "--cp-comm-type a2a+p2p needs two --hierarchical-context-parallel-sizes",
        ),
        (
            dict(context_parallel_size=2, cp_comm_type=["p2p", "a2a"]),
            "local",
            "--cp-comm-type lists 2 values for --num-layers (4)",
        ),
        (
            dict(
                context_parallel_size=8,
                cp_comm_type="a2a+p2p",
                hierarchical_context_parallel_sizes=[8, 1],
            ),
            "local",
            "--cp-comm-type a2a+p2p: --num-attention-heads (4) / --tensor-model-parallel-size (1) "
            "= 4 per rank is not divisible by the all-to-all level of "
            "--hierarchical-context-parallel-sizes (8)",
        ),
        (
            dict(
                context_parallel_size=8,
                cp_comm_type="a2a+p2p",
                hierarchical_context_parallel_sizes=[4, 2],
            ),
            "transformer_engine",
            "--cp-comm-type a2a+p2p: --num-query-groups (2) / --tensor-model-parallel-size (1) "
            "= 2 per rank is not divisible by the all-to-all level",
        ),
        (
            dict(context_parallel_size=8, cp_comm_type=["p2p", "a2a", "p2p", "p2p"]),
            "local",
            "--cp-comm-type a2a: --num-attention-heads (4) / --tensor-model-parallel-size (1) = 4 "
            "per rank is not divisible by --context-parallel-size (8)",
        ),
    ],
    ids=[
        "a2a+p2p-without-sizes",
        "sizes-product",
        "three-levels",
        "list-length",
        "heads-over-a2a-level",
        "te-groups-over-a2a-level",
        "a2a-layer-of-list",
    ],
)
def test_context_parallel_layouts_are_refused_in_one_line(parallel, impl, refusal):
    problems = _problems(impl=impl, **parallel)
    assert len(problems) == 1 and problems[0].startswith(refusal), problems
    assert "\n" not in problems[0]


def test_hierarchical_layouts_that_split_are_accepted():
    """Negative controls of the refusals: the same rules pass the layouts that split."""
    for impl in ("local", "transformer_engine"):
        assert not _problems(
            impl=impl,
            context_parallel_size=4,
            cp_comm_type="a2a+p2p",
            hierarchical_context_parallel_sizes=[2, 2],
        )
    # Local layers repeat K/V per query head: 4 heads over an all-to-all of 4 need no groups.
    assert not _problems(
        context_parallel_size=8,
        cp_comm_type=["a2a+p2p", "p2p", "a2a+p2p", "p2p"],
        hierarchical_context_parallel_sizes=[4, 2],
    )
    parallel = ParallelConfig(
        context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2]
    )
    assert validate_layout(TINY, parallel, 8) == 2


def test_one_value_list_means_every_layer():
    """Megatron-LM's parsing: ``--cp-comm-type a2a`` arrives as a one-value list."""
    parallel = ParallelConfig(cp_comm_type=["a2a"])
    assert parallel.cp_comm_type == "a2a"
    assert [parallel.layer_cp_comm_type(i) for i in range(4)] == ["a2a"] * 4


def test_unknown_comm_type_in_a_list_is_refused():
    with pytest.raises(ConfigError, match="--cp-comm-type must be one of p2p, a2a, a2a\\+p2p"):
        ParallelConfig(cp_comm_type=["p2p", "ring", "p2p", "p2p"])


def test_each_layer_runs_its_own_entry_of_a_per_layer_list(tiny_cpu):
    (chunk,) = build_model(
        tiny_cpu.model, ParallelConfig(cp_comm_type=PER_LAYER), use_cpu_initialization=True
    )
    built = [layer.self_attention.core_attention.cp_comm_type for layer in chunk.decoder.layers]
    assert built == PER_LAYER


@pytest.mark.skipif(
    not megatron.core.__version__.startswith("0.16."), reason="the pick of megatron-core 0.16"
)
def test_megatron_core_picks_the_next_layers_entry(tiny_cpu):
    """Why the block spec picks the entries: megatron-core 0.16's ``TransformerLayer`` reads
    ``cp_comm_type[layer_number]`` with the 1-based layer number."""
    config = transformer_config(
        tiny_cpu.model, ParallelConfig(context_parallel_size=2), use_cpu_initialization=True
    )
    config.cp_comm_type = PER_LAYER
    spec = apertus_layer_spec(tiny_cpu.model).submodules
    picked = [
        TransformerLayer(config, spec, layer_number=n).self_attention.core_attention.cp_comm_type
        for n in (1, 2, 3)
    ]
    assert picked == PER_LAYER[1:]
    with pytest.raises(IndexError):
        TransformerLayer(config, spec, layer_number=4)
