"""The planner's context-parallel model: what CP divides (activations, loss buffers, the RoPE
tables), what it adds (ring or all-to-all buffers, traffic per step), what it keeps (optimizer
states sharded over DP x CP), and the layouts it refuses, one line each naming the flags."""

from __future__ import annotations

import pytest

from megatron.apertus.launch.planner import (
    GIB,
    Cluster,
    cp_traffic_bytes,
    format_plan,
    format_sweep,
    plan,
    run_from_args,
    sweep,
)
from megatron.apertus.model.config import ConfigError

GH200 = dict(gpus_per_node=4, gpu_memory_gib=96)
EIGHT_B_64K = [
    "--model-preset",
    "apertus-8b",
    "--precision",
    "bf16",
    "--optimizer",
    "ademamix",
    "--use-distributed-optimizer",
    "--tensor-model-parallel-size",
    "4",
    "--sequence-parallel",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "128",
    "--seq-length",
    "65536",
    "--max-position-embeddings",
    "65536",
    "--train-iters",
    "100",
]


def eight_b(cp: int, *extra: str, gpus: int = 512):
    flags = EIGHT_B_64K + ["--context-parallel-size", str(cp), *extra]
    return plan(run_from_args(flags), Cluster(gpus=gpus, **GH200))


def test_activations_and_loss_buffers_per_gpu_fall_with_cp():
    """On the same 512 GPUs, CP 2 and 4 hold a half and a quarter of each sequence per rank."""
    one, two, four = (eight_b(cp).peak for cp in (1, 2, 4))
    assert two.activations == pytest.approx(one.activations / 2, rel=1e-6)
    assert four.activations == pytest.approx(one.activations / 4, rel=1e-6)
    assert four.loss_buffers < two.loss_buffers < one.loss_buffers
    assert four.total < two.total < one.total


def test_optimizer_states_are_sharded_over_data_and_context_parallel_ranks():
    """DP x CP is the same 128 on 512 GPUs at any CP: the distributed optimizer's share per GPU
    does not change, while the DP size itself does."""
    one, four = eight_b(1), eight_b(4)
    assert (one.data_parallel, four.data_parallel) == (128, 32)
    assert four.peak.optimizer == one.peak.optimizer
    assert four.peak.weights == one.peak.weights and four.peak.gradients == one.peak.gradients


def test_cp_buffers_and_traffic_from_the_model_dimensions():
    """8B (32 layers, 8 query groups of 128 channels), TP 4, CP 4, 64k tokens: 16384 tokens per
    rank, keys and values of 2 x 256 channels in bf16 = 16 MiB per layer and micro-batch."""
    result = eight_b(4)
    block = 2 * 2 * (8 * 128 // 4) * (65536 // 4)
    assert block == 16 * 2**20
    assert result.peak.cp_buffers == 4 * block
    layers, microbatches = 32, result.microbatches
    assert result.cp_traffic_per_step == 3 * (4 - 1) * block * layers * microbatches
    recomputed = eight_b(
        4,
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    )
    assert recomputed.cp_traffic_per_step == 4 * (4 - 1) * block * layers * microbatches
    assert eight_b(1).cp_traffic_per_step == 0 and eight_b(1).peak.cp_buffers == 0


def test_block_recomputation_repeats_the_traffic_of_its_layers_only():
    """70B, TP4 PP8 with 5 virtual stages of 2 layers, CP 8, the first layer of each recomputed:
    10 layers per GPU, 5 of them twice; 8192 tokens per rank, 2 x 256 key/value channels."""
    flags = [
        "--model-preset",
        "apertus-70b",
        "--precision",
        "bf16",
        "--tensor-model-parallel-size",
        "4",
        "--pipeline-model-parallel-size",
        "8",
        "--num-layers-per-virtual-pipeline-stage",
        "2",
        "--sequence-parallel",
        "--context-parallel-size",
        "8",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "256",
        "--seq-length",
        "65536",
        "--max-position-embeddings",
        "65536",
        "--train-iters",
        "10",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        "1",
    ]
    result = plan(run_from_args(flags), Cluster(gpus=2048, **GH200))
    assert result.ok, result.problems
    block = 2 * 2 * (8 * 128 // 4) * (65536 // 8)
    assert result.microbatches == 32
    assert result.cp_traffic_per_step == (3 * 10 + 5) * (8 - 1) * block * 32


def test_a2a_moves_queries_keys_values_and_output():
    """CP 2 (2 query groups per TP rank split over 2): forward and backward each move q, k, v
    and the output, (CP - 1) / CP of them."""
    result = eight_b(2, "--cp-comm-type", "a2a")
    assert result.ok, result.problems
    tokens = 65536 // 2
    tensors = 2 * tokens * (2 * 4096 + 2 * 8 * 128) // 4
    assert result.cp_traffic_per_step == pytest.approx(2 * tensors / 2 * 32 * result.microbatches)
    assert cp_traffic_bytes(result.run, 1) > cp_traffic_bytes(
        eight_b(2).run, 1
    ), "with 8 query groups for 32 heads, p2p moves less than a2a"


def test_hierarchical_traffic_all_to_all_within_a_level_ring_over_the_other():
    """8B at TP 2, CP 8 = 2 x 4 (4 query groups per TP rank split over the pair): all-to-alls
    of (A - 1) / A of q, k, v and output within each pair, forward and backward, and 3 blocks of
    the gathered, head-split keys and values per ring step, 3 steps instead of p2p's 7."""
    flags = ["--tensor-model-parallel-size", "2", "--global-batch-size", "512"]
    hier = ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "4"]
    result, flat = eight_b(8, *flags, *hier, gpus=2048), eight_b(8, *flags, gpus=2048)
    assert result.ok and flat.ok, (result.problems, flat.problems)
    tokens = 65536 // 8
    block = 2 * 2 * (8 * 128 // 2) * tokens  # bf16 keys and values of this rank's tokens
    tensors = 2 * tokens * 2 * 4096 // 2 + block
    per_layer = 2 * tensors / 2 + 3 * 3 * block
    assert result.cp_traffic_per_step == pytest.approx(32 * per_layer * result.microbatches)
    assert flat.cp_traffic_per_step == pytest.approx(32 * 3 * 7 * block * flat.microbatches)
    # Two CP ranks per node (4 GPUs / TP 2): the pair's all-to-all stays inside it; every ring
    # step of either layout waits on a link between nodes.
    assert result.cp_inter_node_per_step == pytest.approx(32 * 9 * block * result.microbatches)
    assert flat.cp_inter_node_per_step == flat.cp_traffic_per_step
    assert result.peak.cp_buffers == pytest.approx(tensors + 4 * block)
    text = format_plan(result)
    assert "CP 8 (a2a+p2p 2x4)" in text and "in 3 ring steps over 4 groups" in text


def test_per_layer_comm_types_are_planned_layer_by_layer():
    """Half the layers p2p, half a2a+p2p: the traffic is the mean of the two uniform plans."""
    flags = ["--tensor-model-parallel-size", "2", "--hierarchical-context-parallel-sizes", "2", "4"]
    kinds = {k: eight_b(8, *flags, "--cp-comm-type", k) for k in ("p2p", "a2a+p2p")}
    mixed = eight_b(8, *flags, "--cp-comm-type", *["p2p", "a2a+p2p"] * 16)
    expected = sum(p.cp_traffic_per_step for p in kinds.values()) / 2
    assert mixed.cp_traffic_per_step == pytest.approx(expected)
    assert mixed.peak.cp_buffers == max(p.peak.cp_buffers for p in kinds.values())
    assert "per layer: 16 p2p, 16 a2a+p2p 2x4" in format_plan(mixed)


def test_planner_refuses_hierarchical_layouts_by_the_trainers_rule():
    """The trainer's rule, under Transformer Engine (the launchers' implementation): 2 query
    groups per TP rank do not split over an all-to-all of 4; without sizes the flags are refused
    as the trainer refuses them."""
    hier = ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes"]
    refused = eight_b(8, *hier, "4", "2", "--transformer-impl", "transformer_engine")
    assert refused.problems == [
        "--cp-comm-type a2a+p2p: --num-query-groups (8) / --tensor-model-parallel-size (4) = 2 "
        "per rank is not divisible by the all-to-all level of "
        "--hierarchical-context-parallel-sizes (4), over which the all-to-all (Transformer "
        "Engine) splits them; use a smaller all-to-all level"
    ]
    assert eight_b(8, *hier, "2", "4", "--transformer-impl", "transformer_engine").ok
    with pytest.raises(ConfigError, match="needs --hierarchical-context-parallel-sizes A P"):
        run_from_args(EIGHT_B_64K + ["--context-parallel-size", "8", "--cp-comm-type", "a2a+p2p"])


def test_cp_makes_the_64k_8b_layout_fit():
    refused, fits = eight_b(1, "--global-batch-size", "512", gpus=2048), eight_b(
        4, "--global-batch-size", "512", gpus=2048
    )
    (line,) = refused.problems
    assert (
        line.startswith("pipeline stage 0 needs 120.") and "more than the 86.4 GiB usable" in line
    )
    assert fits.ok, fits.problems
    assert "CP 4 (p2p)" in format_plan(fits) and "CP traffic" in format_plan(fits)


@pytest.mark.parametrize(
    "extra, gpus, message",
    [
        (
            ["--context-parallel-size", "3", "--seq-length", "65532"],
            512,
            "world size (512) is not divisible by --tensor-model-parallel-size (4) x "
            "--pipeline-model-parallel-size (1) x --context-parallel-size (3)",
        ),
        (
            ["--context-parallel-size", "4", "--seq-length", "65512"],
            512,
            "--seq-length (65512) / --context-parallel-size (4) = 16378 tokens per rank is not "
            "divisible by --tensor-model-parallel-size (4)",
        ),
        (
            ["--context-parallel-size", "4", "--cp-comm-type", "a2a"],
            512,
            "--cp-comm-type a2a: --num-query-groups (8) / --tensor-model-parallel-size (4) = 2 per rank "
            "is not divisible by --context-parallel-size (4)",
        ),
    ],
    ids=["world-size", "seq-per-rank-over-tp", "a2a-query-groups"],
)
def test_refusals_name_the_flags(extra, gpus, message):
    result = plan(run_from_args(EIGHT_B_64K + extra), Cluster(gpus=gpus, **GH200))
    assert any(problem.startswith(message) for problem in result.problems), result.problems
    assert "REFUSED:" in format_plan(result)


def test_a_sequence_that_does_not_split_into_2cp_chunks_is_refused_when_parsed():
    with pytest.raises(
        ConfigError,
        match=r"--seq-length \(65532\) is not divisible by 2 x " r"--context-parallel-size \(4\)",
    ):
        run_from_args(EIGHT_B_64K + ["--context-parallel-size", "4", "--seq-length", "65532"])


def test_unknown_cp_comm_type_is_refused():
    with pytest.raises(
        ConfigError, match="--cp-comm-type must be one of p2p, a2a, a2a\\+p2p, got 'ring'"
    ):
        run_from_args(EIGHT_B_64K + ["--cp-comm-type", "ring"])


def test_sweep_keeps_the_tokens_per_step():
    flags = EIGHT_B_64K + [
        "--seq-length",
        "8192",
        "--max-position-embeddings",
        "8192",
        "--global-batch-size",
        "1024",
    ]
    rows = sweep(flags, Cluster(gpus=2048, **GH200), [8192, 65536], [1, 4])
    assert [(r.seq_length, r.context_parallel) for r in rows] == [
        (8192, 1),
        (8192, 4),
        (65536, 1),
        (65536, 4),
    ]
    for row in rows:
        t, m = row.plan.run.training, row.plan.run.model
        assert t.global_batch_size * m.seq_length == 1024 * 8192
    by_key = {(r.seq_length, r.context_parallel): r.plan for r in rows}
    assert by_key[65536, 4].ok and not by_key[65536, 1].ok
    assert by_key[65536, 4].peak.activations / GIB < by_key[65536, 1].peak.activations / GIB / 3
    table = format_sweep(rows, name="apertus-8b")
    assert "| 64k | 4 | 128 | 1 |" in table and "| 64k | 1 | 512 |" in table
    assert (
        "refused: global batch 128 not a multiple of micro-batch x DP 512; needs 120 GiB" in table
    )


TINY_A2A = [
    "--model-preset",
    "tiny",
    "--num-attention-heads",
    "4",
    "--num-query-groups",
    "1",
    "--seq-length",
    "256",
    "--context-parallel-size",
    "2",
    "--cp-comm-type",
    "a2a",
    "--train-iters",
    "1",
]


def test_the_planner_and_the_trainer_apply_one_context_parallel_rule():
    """4 heads and 1 query group at CP=2 with a2a: the local implementation repeats K/V per head
    and runs it; Transformer Engine's all-to-all would split the one group, so both the planner
    (a GPU run: TE unless told otherwise) and the trainer under TE refuse it, in the same line."""
    from megatron.apertus.model.config import validate_context_parallel

    run = run_from_args(TINY_A2A)
    local = plan(
        run_from_args(TINY_A2A + ["--transformer-impl", "local"]), Cluster(gpus=2, **GH200)
    )
    assert not [p for p in local.problems if "--cp-comm-type" in p], local.problems
    validate_context_parallel(run.model, run.parallel, "local")
    (refusal,) = [p for p in plan(run, Cluster(gpus=2, **GH200)).problems if "--cp-comm-type" in p]
    assert refusal.startswith("--cp-comm-type a2a: --num-query-groups (1)")
    with pytest.raises(ConfigError) as trainer:
        validate_context_parallel(run.model, run.parallel, "transformer_engine")
    assert str(trainer.value) == refusal
