"""Context-parallel attention (megatron/apertus/ops/cp_attention.py): the partitions Megatron and
TE use; the ring's tile arithmetic by fp64 gradcheck; p2p, a2a and hierarchical a2a+p2p (2 x 1,
1 x 2 and 2 x 2) on 2 and 4 gloo processes against one-process attention, outputs and the
gradients of q, k and v, for one causal sequence (batch of 2, GQA) and for packed documents that
cross the chunk boundaries; packed documents padded at their tails as the data loader pads them
give each document's attention alone; and a negative control: the same comparison fails when
documents may see each other.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.apertus.data.context_parallel import padded_document_sources
from megatron.apertus.ops import cp_attention
from megatron.apertus.ops.cp_attention import (
    RingAttention,
    allowed,
    context_parallel_attention,
    document_partition,
    document_starts,
    reference_attention,
    sequence_partition,
)
from tests.conftest import spawn

FP32_TOL = 2e-6
"""Largest error relative to the largest magnitude of the compared tensor (fp32 round-off)."""
BATCH, HEADS, GROUPS, DIM = 2, 4, 2, 8
SEQ = 32
LEVELS = {2: [(2, 1), (1, 2)], 4: [(2, 2)]}
"""Hierarchical (all-to-all, ring) splits compared at each CP size."""
TILE = 3
"""Tile extent in these tests: chunks of 4 to 20 tokens cut into several uneven pieces each."""
DOCUMENTS = [8, 40, 16]
"""Packed document lengths, multiples of 2 x CP for CP 2 and 4; the 40-token one spans the
chunks of the unpacked split, so a leak across documents would change the result."""
PADDED_DOCUMENTS = [5, 27, 11]
"""Document lengths that are no multiple of 2 x CP: each is padded at its tail to one (the padding
repeats its last token), the layout of Transformer Engine's failures with packed sequences, CP and
padding."""


def test_sequence_partition_keeps_chunks_i_and_mirror():
    parts = sequence_partition(16, 2)
    assert parts.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert sorted(sequence_partition(24, 3).reshape(-1).tolist()) == list(range(24))


def test_document_partition_cuts_each_document():
    cu = torch.tensor([0, 4, 12])
    parts = document_partition(cu, 2)
    assert parts.tolist() == [[0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9]]
    assert document_starts(cu).tolist() == [0] * 4 + [4] * 8


def test_partition_refuses_indivisible_length():
    with pytest.raises(ValueError, match="not divisible by 2 x CP"):
        sequence_partition(10, 4)


def _gradcheck_worker(rank: int, world: int, init_file: str, results) -> None:
    cp_attention.TILE = TILE
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cu = torch.tensor([0, 4, 12])
        index, doc_start = document_partition(cu, 1), document_starts(cu)
        gen = torch.Generator().manual_seed(5)
        q = torch.randn(1, 4, 12, 3, generator=gen, dtype=torch.float64, requires_grad=True)
        k, v = (
            torch.randn(1, 2, 12, 3, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2)
        )
        group = dist.new_group([0])
        ring = lambda q, k, v: RingAttention.apply(q, k, v, index, doc_start, 0.7, group)  # noqa
        results[rank] = torch.autograd.gradcheck(ring, (q, k, v))
    finally:
        dist.destroy_process_group()


def test_ring_tiles_pass_fp64_gradcheck(tmp_path):
    """The tile forward/backward (log-sum-exp merge, probabilities recomputed from the saved
    log-sum-exp, masked and skipped tiles) is the derivative of the forward it computes."""
    results = mp.Manager().dict()
    spawn(_gradcheck_worker, args=(1, str(tmp_path / "init"), results), nprocs=1)
    assert results[0] is True


def _full_case(seed: int, batch: int, seq: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HEADS, seq, DIM, generator=gen)
    k = torch.randn(batch, GROUPS, seq, DIM, generator=gen)
    v = torch.randn(batch, GROUPS, seq, DIM, generator=gen)
    grad = torch.randn(batch, HEADS, seq, DIM, generator=gen)
    return q, k, v, grad


def _layouts(cp: int) -> dict:
    """name -> (batch, index [cp, s/cp], doc_start [s]) of each compared layout."""
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(DOCUMENTS), 0).tolist()])
    return {
        "causal": (BATCH, sequence_partition(SEQ, cp), torch.zeros(SEQ, dtype=torch.long)),
        "packed": (1, document_partition(cu, cp), document_starts(cu)),
    }


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _level_groups(world: int, a2a: int) -> tuple:
    """This rank's (all-to-all, ring) groups as megatron-core lays them out: contiguous groups of
    ``a2a`` ranks, the ring over the ranks at the same place in each (every rank creates every
    group, in the same order)."""
    rank = dist.get_rank()
    mine = []
    for level in (
        [list(range(s, s + a2a)) for s in range(0, world, a2a)],
        [list(range(a, world, a2a)) for a in range(a2a)],
    ):
        groups = [(ranks, dist.new_group(ranks)) for ranks in level]
        mine += [group for ranks, group in groups if rank in ranks]
    return tuple(mine)


def _compare(layout, comm_type: str, group, *, leak: bool = False, levels=None) -> float:
    """Largest relative error of this rank's output and of the gathered q/k/v gradients."""
    batch, index, doc_start = layout
    seq = doc_start.numel()
    q, k, v, grad = _full_case(3, batch, seq)
    full = torch.arange(seq)
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = reference_attention(*ref_inputs, allowed(full, full, doc_start), DIM**-0.5)
    ref_out.backward(grad)
    mine = index[dist.get_rank(group)]
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    seen_start = torch.zeros_like(doc_start) if leak else doc_start
    out = context_parallel_attention(
        *local,
        index=index,
        doc_start=seen_start,
        group=group,
        comm_type=comm_type,
        levels=levels,
    )
    out.backward(grad[:, :, mine])
    errors = [_relative_error(out, ref_out[:, :, mine])]
    for got, want in zip(local, ref_inputs):
        gathered = [torch.empty_like(got.grad) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, got.grad.contiguous(), group=group)
        full_grad = torch.empty_like(want.grad)
        full_grad[:, :, index.reshape(-1)] = torch.cat(gathered, dim=2)
        errors.append(_relative_error(full_grad, want.grad))
    return max(errors)


def _gathered_output(out: torch.Tensor, index: torch.Tensor, group) -> torch.Tensor:
    """Every rank's output, in the order of the whole (padded) sequence."""
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out.contiguous(), group=group)
    full = torch.empty(*out.shape[:2], index.numel(), out.shape[3])
    full[:, :, index.reshape(-1)] = torch.cat(parts, dim=2)
    return full


def _padded_documents_error(comm_type: str, group, *, levels=None) -> float:
    """Largest relative error of each tail-padded document's real tokens against that document's
    causal attention computed alone."""
    cp = dist.get_world_size(group)
    lengths = torch.tensor(PADDED_DOCUMENTS)
    real_cu = torch.tensor([0, *torch.cumsum(lengths, 0).tolist()])
    sources, _, padded_cu = padded_document_sources(real_cu, cp)
    q, k, v, _ = _full_case(5, 1, int(real_cu[-1]))
    index = document_partition(padded_cu, cp)
    mine = sources[index[dist.get_rank(group)]]
    out = context_parallel_attention(
        *(t[:, :, mine] for t in (q, k, v)),
        index=index,
        doc_start=document_starts(padded_cu),
        group=group,
        comm_type=comm_type,
        levels=levels,
    )
    full = _gathered_output(out, index, group)
    errors = []
    for doc, length in enumerate(PADDED_DOCUMENTS):
        real = slice(int(real_cu[doc]), int(real_cu[doc + 1]))
        alone = torch.arange(length)
        want = reference_attention(
            q[:, :, real],
            k[:, :, real],
            v[:, :, real],
            allowed(alone, alone, torch.zeros(length, dtype=torch.long)),
            DIM**-0.5,
        )
        start = int(padded_cu[doc])
        errors.append(_relative_error(full[:, :, start : start + length], want))
    return max(errors)


def _worker(rank: int, world: int, init_file: str, results) -> None:
    torch.set_num_threads(1)
    cp_attention.TILE = TILE
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))
        report = {}
        for name, layout in _layouts(world).items():
            for comm in ("p2p", "a2a"):
                report[f"{name}/{comm}"] = _compare(layout, comm, group)
            report[f"{name}/p2p/leak"] = _compare(layout, "p2p", group, leak=True)
        for comm in ("p2p", "a2a"):
            report[f"padded/{comm}"] = _padded_documents_error(comm, group)
        for a2a, ring in LEVELS[world]:
            levels = _level_groups(world, a2a)
            for name, layout in _layouts(world).items():
                key = f"{name}/a2a+p2p/{a2a}x{ring}"
                report[key] = _compare(layout, "a2a+p2p", group, levels=levels)
                report[key + "/leak"] = _compare(layout, "a2a+p2p", group, leak=True, levels=levels)
            report[f"padded/a2a+p2p/{a2a}x{ring}"] = _padded_documents_error(
                "a2a+p2p", group, levels=levels
            )
        results[rank] = report
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def cp_report(request, tmp_path_factory):
    world = request.param
    results = mp.Manager().dict()
    init = tmp_path_factory.mktemp(f"cp{world}") / "init"
    spawn(_worker, args=(world, str(init), results), nprocs=world)
    return dict(results)


@pytest.mark.parametrize("case", ["causal/p2p", "causal/a2a", "packed/p2p", "packed/a2a"])
def test_cp_attention_matches_one_process(cp_report, case):
    for rank, report in cp_report.items():
        assert report[case] < FP32_TOL, (rank, case, report[case])


@pytest.mark.parametrize("layout", ["causal", "packed"])
def test_hierarchical_cp_attention_matches_one_process(cp_report, layout):
    """a2a+p2p: all-to-all within the first level, ring over the second (2x1, 1x2 and 2x2)."""
    world = len(cp_report)
    for rank, report in cp_report.items():
        for a2a, ring in LEVELS[world]:
            key = f"{layout}/a2a+p2p/{a2a}x{ring}"
            assert report[key] < FP32_TOL, (rank, key, report[key])
            if layout == "packed":  # negative control
                assert report[key + "/leak"] > 1e-2, (rank, key)


def test_tail_padded_documents_attend_as_if_alone(cp_report):
    """Documents padded to a multiple of 2 x CP at their tails: each real token's output equals
    its document's causal attention computed alone, with p2p, a2a and a2a+p2p."""
    for rank, report in cp_report.items():
        padded = {key: error for key, error in report.items() if key.startswith("padded/")}
        assert len(padded) == 2 + len(LEVELS[len(cp_report)]), padded
        for key, error in padded.items():
            assert error < FP32_TOL, (rank, key, error)


def test_leaking_documents_are_detected(cp_report):
    """Negative control: letting packed documents see each other must fail the comparison."""
    for report in cp_report.values():
        assert report["packed/p2p/leak"] > 1e-2
        assert report["causal/p2p/leak"] < FP32_TOL  # one document: nothing to leak
