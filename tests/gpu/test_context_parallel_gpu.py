"""Context parallelism on two GPUs (NCCL): Transformer Engine's own CP attention, which
megatron-core's ``TEDotProductAttention`` wires (``cp_group``, ``cp_global_ranks``, ``cp_stream``,
``cp_comm_type``) from ``--context-parallel-size`` and ``--cp-comm-type``, and our local ring and
a2a attention on CUDA, each reproduce the one-GPU losses, unpacked and with packed documents
(THD). Skipped (reported, never passed) with fewer than two GPUs or without Transformer Engine.
"""

from __future__ import annotations

import pytest
import torch

from megatron.apertus.model.engine import transformer_engine_error
from tests.conftest import PRETRAIN, read_json, run_entry, series

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
COMMON = [
    "--model-preset",
    "tiny",
    "--hidden-size",
    "256",
    "--ffn-hidden-size",
    "768",
    "--seq-length",
    "256",
    "--seed",
    "5",
    "--lr",
    "3e-3",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "3",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
    "--device",
    "cuda",
    "--deterministic-mode",
    # Packed documents are padded per context-parallel share: the shares' loss-token counts
    # differ, and only the global batch's count is the one-GPU run's.
    "--calculate-per-token-loss",
]
PACKED = ["--reset-attention-mask", "--reset-position-ids"]
TE = ["--transformer-impl", "transformer_engine"]
LOCAL = ["--transformer-impl", "local"]
RTOL = {"local": 1e-5, "transformer_engine": 2e-3}
"""fp32 local attention: round-off; TE's fused attention computes in bf16/TF32 internally."""


def _losses(tmp_path, name: str, args: list[str], nproc: int) -> list[float]:
    out = tmp_path / f"{name}.json"
    run_entry(PRETRAIN, COMMON + args + ["--log-json", str(out)], nproc=nproc)
    return series(read_json(out), "train/loss")[1]


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("comm", ["p2p", "a2a"])
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_cp2_on_two_gpus_matches_one_gpu(tmp_path, impl, comm, packed):
    if impl == "transformer_engine" and transformer_engine_error() is not None:
        pytest.skip(f"needs Transformer Engine ({transformer_engine_error()})")
    args = (TE if impl == "transformer_engine" else LOCAL) + (PACKED if packed else [])
    one = _losses(tmp_path, "cp1", args, 1)
    two = _losses(
        tmp_path, "cp2", args + ["--context-parallel-size", "2", "--cp-comm-type", comm], 2
    )
    assert len(two) == len(one) == 3
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=RTOL[impl], atol=0)
