"""Every impossible layout is refused before anything is allocated, naming the argument."""

from __future__ import annotations

import dataclasses

import pytest

from megatron.apertus.errors import ConfigError
from megatron.apertus.model import ParallelConfig, preset, validate_layout
from megatron.apertus.model.config import ApertusConfig
from tests.conftest import PRETRAIN, run_script

TINY = preset("tiny")


@pytest.mark.parametrize(
    "model, parallel, world, argument",
    [
        (TINY, ParallelConfig(tensor_model_parallel_size=3), 3, "--num-attention-heads"),
        (
            dataclasses.replace(TINY, num_attention_heads=8, hidden_size=64, num_query_groups=2),
            ParallelConfig(tensor_model_parallel_size=4),
            4,
            "--num-query-groups",
        ),
        (
            dataclasses.replace(TINY, ffn_hidden_size=190, num_query_groups=4),
            ParallelConfig(tensor_model_parallel_size=4),
            4,
            "--ffn-hidden-size",
        ),
        (
            dataclasses.replace(TINY, vocab_size=1001),
            ParallelConfig(tensor_model_parallel_size=2),
            2,
            "--vocab-size",
        ),
        (TINY, ParallelConfig(pipeline_model_parallel_size=3), 3, "--num-layers"),
        (
            TINY,
            ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4),
            2,
            "virtual stages",
        ),
        (TINY, ParallelConfig(tensor_model_parallel_size=2), 3, "world size (3)"),
    ],
)
def test_layout_errors_name_the_argument(model, parallel, world, argument):
    with pytest.raises(ConfigError) as err:
        validate_layout(model, parallel, world)
    assert argument in str(err.value)


def test_valid_layouts_give_the_data_parallel_size():
    assert validate_layout(TINY, ParallelConfig(tensor_model_parallel_size=2), 8) == 4
    assert (
        validate_layout(
            preset("apertus-70b"),
            ParallelConfig(
                tensor_model_parallel_size=4,
                pipeline_model_parallel_size=8,
                virtual_pipeline_model_parallel_size=5,
            ),
            4096,
        )
        == 128
    )


def test_kv_heads_must_divide_heads():
    with pytest.raises(ConfigError, match="--num-query-groups"):
        ApertusConfig(
            num_layers=2,
            hidden_size=48,
            ffn_hidden_size=96,
            num_attention_heads=6,
            num_query_groups=4,
        )


def test_hidden_must_split_into_heads():
    with pytest.raises(ConfigError, match="--hidden-size"):
        ApertusConfig(
            num_layers=2,
            hidden_size=50,
            ffn_hidden_size=96,
            num_attention_heads=4,
            num_query_groups=2,
        )


def test_parallel_config_rejects_virtual_stages_without_pipeline():
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size"):
        ParallelConfig(virtual_pipeline_model_parallel_size=2)


def test_command_line_refuses_bad_layout_before_building():
    proc = run_script(PRETRAIN, ["--tensor-model-parallel-size", "3", "--train-iters", "1"])
    assert proc.returncode != 0
    assert (
        "--num-attention-heads (4) is not divisible by --tensor-model-parallel-size (3)"
        in proc.stderr
    )
    assert "iteration" not in proc.stdout


def test_command_line_refuses_bad_model_at_parse_time():
    proc = run_script(PRETRAIN, ["--num-query-groups", "3"])
    assert proc.returncode == 2
    assert "--num-query-groups (3) does not divide --num-attention-heads (4)" in proc.stderr
