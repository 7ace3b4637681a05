"""tools/fuse_norms.py, tools/average_checkpoints.py and tools/quantize.py on real checkpoints
saved by a TP=2 run (two processes), read back into one process."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from megatron.apertus import checkpoint
from megatron.apertus.convert.hf_io import model_tensors
from megatron.apertus.data.config import DataConfig
from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.quant.transforms import NORM_FUSIONS, column_scales
from megatron.apertus.tokenizer.tokenizers import build_tokenizer
from tests.conftest import PRETRAIN, REPO, cpu_models, read_json, run_entry, run_script, series

TINY = [
    "--model-preset",
    "tiny",
    "--num-layers",
    "2",
    "--seed",
    "5",
    "--lr",
    "3e-3",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--eval-iters",
    "1",
]
TP2 = ["--tensor-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Checkpoints of iterations 1, 2 and 3 of a TP=2 run."""
    save = tmp_path_factory.mktemp("quant-tools") / "ckpt"
    run_entry(
        PRETRAIN,
        TINY + TP2 + ["--train-iters", "3", "--save-interval", "1", "--save", str(save)],
        nproc=2,
    )
    return save


@pytest.fixture(scope="module")
def fused(trained, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fused") / "ckpt"
    tool("fuse_norms.py", "--load", str(trained), "--save", str(out))
    return out


@contextlib.contextmanager
def loaded(save: Path) -> Iterator[torch.nn.Module]:
    """The model of checkpoint ``save``, loaded into one CPU process."""
    with cpu_models() as models:
        yield models.build(load=save).eval()


def tensors(save: Path) -> dict[str, torch.Tensor]:
    with loaded(save) as chunk:
        return {k: v.detach().clone() for k, v in model_tensors(chunk).items()}


def text_logits(save: Path) -> torch.Tensor:
    data = DataConfig()
    tokens = build_tokenizer(data.tokenizer_type, data.tokenizer_model).encode_document(
        embedded_documents()[3]
    )[:128]
    with loaded(save) as chunk, torch.no_grad():
        ids = torch.tensor([tokens])
        return chunk(ids, torch.arange(ids.shape[1]).unsqueeze(0), None).float()


def tool(name: str, *args: str) -> None:
    run_entry(REPO / "tools" / name, list(args))


def test_norm_fusion_preserves_the_logits_and_follows_the_formula(trained, fused):
    before, after = tensors(trained), tensors(fused)
    for layer in range(2):
        for linear, norm in NORM_FUSIONS:
            w, g = (before[f"decoder.layers.{layer}.{n}"].double() for n in (linear, norm))
            c = column_scales(w)
            fused_w = after[f"decoder.layers.{layer}.{linear}"].double()
            torch.testing.assert_close(fused_w, w * c, rtol=1e-7, atol=0)
            torch.testing.assert_close(
                after[f"decoder.layers.{layer}.{norm}"].double(), g / c, rtol=1e-7, atol=0
            )
            norms = fused_w.norm(dim=0)
            torch.testing.assert_close(
                norms, torch.full_like(norms, norms.mean()), rtol=1e-6, atol=0
            )
            assert not torch.allclose(w.norm(dim=0), norms, rtol=1e-2)  # it did change them
    unchanged = set(before) - {
        f"decoder.layers.{i}.{n}" for i in range(2) for pair in NORM_FUSIONS for n in pair
    }
    assert all(torch.equal(before[k], after[k]) for k in unchanged)
    original, fused_logits = text_logits(trained), text_logits(fused)
    torch.testing.assert_close(fused_logits, original, rtol=1e-5, atol=2e-5)


@pytest.mark.slow
def test_norm_fusion_keeps_the_tp2_validation_loss(trained, fused, tmp_path):
    """Both checkpoints evaluated in a TP=2 layout: the same validation loss (fp32 round-off)."""
    losses = []
    for ckpt in (trained, fused):
        out = tmp_path / f"{ckpt.parent.name}.json"
        run_entry(
            PRETRAIN,
            TINY
            + TP2
            + ["--load", str(ckpt), "--finetune", "--train-iters", "0", "--log-json", str(out)],
            nproc=2,
        )
        losses.append(series(read_json(out), "valid/loss")[1])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


@pytest.mark.parametrize("selection", [["--last", "2"], ["--iterations", "1", "3"]])
def test_average_is_the_mean_of_every_tensor(trained, tmp_path, selection):
    out = tmp_path / "avg"
    tool("average_checkpoints.py", "--load", str(trained), *selection, "--save", str(out))
    picked = [2, 3] if selection[0] == "--last" else [1, 3]
    states = [tensors(trained / f"iter_{i:07d}") for i in picked]
    averaged = tensors(out)
    assert checkpoint.find_checkpoint(out).name == "iter_0000003"
    assert set(averaged) == set(states[0])
    for name, value in averaged.items():
        expected = ((states[0][name].double() + states[1][name].double()) / 2).to(value.dtype)
        assert torch.equal(value, expected), name
    assert not torch.equal(
        averaged["decoder.layers.0.mlp.linear_fc1.weight"],
        states[1]["decoder.layers.0.mlp.linear_fc1.weight"],
    )


def test_rtn_checkpoint_holds_the_fake_quantized_weights(trained, tmp_path):
    out = tmp_path / "rtn"
    tool(
        "quantize.py",
        "--load",
        str(trained),
        "--save",
        str(out),
        "--method",
        "rtn",
        "--quant-format",
        "int3",
        "--quant-group-size",
        "16",
    )
    before, after = tensors(trained), tensors(out)
    weight = "decoder.layers.1.self_attention.linear_proj.weight"
    groups = after[weight].reshape(after[weight].shape[0], -1, 16)
    scale = before[weight].reshape(groups.shape).abs().amax(-1, keepdim=True) / 3
    codes = groups / scale
    torch.testing.assert_close(codes, codes.round(), rtol=0, atol=1e-5)
    assert codes.abs().max() <= 3
    assert torch.equal(
        after["embedding.word_embeddings.weight"], before["embedding.word_embeddings.weight"]
    )


def test_bad_input_is_one_line_and_exit_2(trained, tmp_path):
    args = ["--load", str(trained), "--last", "9", "--save", str(tmp_path / "x")]
    proc = run_script(REPO / "tools" / "average_checkpoints.py", args)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1].startswith("average_checkpoints.py: error: --last 9")
    )
    assert "Traceback" not in proc.stderr
