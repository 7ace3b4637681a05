"""On a GPU: --use-cpu-initialization draws the weights with the CPU generator (the weights a
CPU run of the same seed gets) and hands them to the GPU; without it they are drawn on the GPU,
from another generator. Skipped (reported, never passed) without CUDA."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron.apertus import parallel
from megatron.apertus.model import ParallelConfig, preset
from megatron.apertus.model.builder import build_model
from megatron.apertus.training import runtime
from megatron.apertus.training.loop_config import TrainingConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SEED = 7


def weights(chunks) -> list[torch.Tensor]:
    return [p.detach().cpu() for chunk in chunks for p in chunk.parameters()]


def test_cpu_initialization_on_a_gpu_moves_the_cpu_weights_there():
    model = preset("tiny", vocab_size=256)
    parallel.initialize(ParallelConfig(), device="cuda", seed=SEED, model=model)
    try:
        started = runtime.Runtime(device_name="cuda", dp=1, groups=parallel.process_groups())
        training = TrainingConfig(train_iters=1, use_cpu_initialization=True)
        built = {}
        for name, cpu_init in (("flag", True), ("default", False)):
            parallel.set_seed(SEED)
            built[name] = runtime.model_chunks(
                model,
                ParallelConfig(),
                training=replace(training, use_cpu_initialization=cpu_init),
                runtime=started,
            )
        parallel.set_seed(SEED)
        on_cpu = build_model(model, ParallelConfig(), use_cpu_initialization=True)
    finally:
        parallel.shutdown()
    assert all(p.is_cuda for chunk in built["flag"] for p in chunk.parameters())
    expected = weights(on_cpu)
    assert all(torch.equal(a, b) for a, b in zip(weights(built["flag"]), expected))
    assert not all(torch.equal(a, b) for a, b in zip(weights(built["default"]), expected))
