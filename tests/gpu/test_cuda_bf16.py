"""On a GPU: the Apertus model trains in bf16 through the real entry point, and its bf16
forward/backward agrees with fp32 on the same weights. Skipped (reported, never passed) without CUDA.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import PRETRAIN, REPO, read_json, series

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_pretrain_bf16_on_cuda(tmp_path):
    log = tmp_path / "history.json"
    cmd = [
        sys.executable,
        str(PRETRAIN),
        "--device",
        "cuda",
        "--precision",
        "bf16",
        "--model-preset",
        "tiny",
        "--hidden-size",
        "256",
        "--ffn-hidden-size",
        "768",
        "--train-iters",
        "30",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "4",
        "--lr",
        "3e-3",
        "--log-interval",
        "10",
        "--eval-iters",
        "2",
        "--log-json",
        str(log),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = series(read_json(log), "train/loss")[1]
    assert losses[-1] < losses[0] - 1.0
    print(proc.stdout[-1500:])


def test_bf16_forward_backward_close_to_fp32():
    from megatron.apertus import parallel
    from megatron.apertus.model import ParallelConfig, preset
    from megatron.apertus.model.builder import build_model

    model = preset("tiny", hidden_size=256, ffn_hidden_size=768)
    parallel.initialize(ParallelConfig(), device="cuda", seed=11, model=model)
    try:
        fp32 = build_model(model, ParallelConfig())[0]
        bf16 = build_model(model, ParallelConfig(), params_dtype=torch.bfloat16)[0]
        bf16.load_state_dict(
            {
                k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in fp32.state_dict().items()
            }
        )
        tokens = torch.randint(0, model.vocab_size, (2, 128), device="cuda")
        positions = torch.arange(128, device="cuda").expand(2, -1)
        losses = {}
        for name, net in (("fp32", fp32), ("bf16", bf16)):
            loss = net(tokens, positions, None, labels=tokens).float().mean()
            loss.backward()
            losses[name] = loss.item()
            assert all(
                p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters()
            )
        assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)
        print(f"device {torch.cuda.get_device_name()} losses {losses}")
    finally:
        parallel.shutdown()
