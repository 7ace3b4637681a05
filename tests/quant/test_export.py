"""tools/checkpoint/export_quantized_hf.py: the compressed-tensors directory loads in
``transformers`` and its logits are those of our fake-quantized model (fp32 round-off), while
they differ from the unquantized model's by far more."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.apertus import parallel
from megatron.apertus.data.corpus import embedded_documents
from megatron.apertus.data.tokenizer import build_tokenizer
from megatron.apertus.model import ParallelConfig, transformer_config
from megatron.apertus.model.builder import build_model
from megatron.apertus.quant.config import QuantConfig
from megatron.apertus.quant.layers import apply_fake_quant
from megatron.apertus.training import checkpoint
from megatron.apertus.training.config import DataConfig
from tests.conftest import PRETRAIN, REPO, run_entry

EXPORT = REPO / "tools" / "checkpoint" / "export_quantized_hf.py"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny checkpoint with weights wide enough that quantization moves the logits."""
    save = tmp_path_factory.mktemp("export") / "ckpt"
    run_entry(PRETRAIN, ["--model-preset", "tiny", "--num-layers", "2", "--init-method-std",
                         "0.05", "--untie-embeddings-and-output-weights", "--train-iters", "0",
                         "--global-batch-size", "2", "--micro-batch-size", "1",
                         "--save", str(save)])  # fmt: skip
    return save


def tokens() -> torch.Tensor:
    data = DataConfig()
    tokenizer = build_tokenizer(data.tokenizer_type, data.tokenizer_model)
    return torch.tensor([tokenizer.encode_document(embedded_documents()[7])[:96]])


def our_logits(save: Path, quant: QuantConfig | None) -> torch.Tensor:
    model = checkpoint.load_model_config(save)
    parallel.initialize(ParallelConfig(), device="cpu", seed=0)
    try:
        config = transformer_config(model, ParallelConfig(), use_cpu_initialization=True)
        chunk = build_model(model, config)[0]
        checkpoint.load_model(save, [chunk])
        if quant is not None:
            apply_fake_quant([chunk], quant)
        ids = tokens()
        with torch.no_grad():
            return chunk.eval()(ids, torch.arange(ids.shape[1]).unsqueeze(0), None).float()
    finally:
        parallel.shutdown()


@pytest.mark.parametrize("fmt,group", [("int4", "16"), ("int3", "-1")])
def test_transformers_loads_the_export_and_matches_fake_quant(base, tmp_path, fmt, group):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    run_entry(EXPORT, ["--load", str(base), "--output", str(out), "--quant-format", fmt,
                       "--quant-group-size", group])  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(tokens()).logits.float()
    quant = QuantConfig(quant_format=fmt, quant_group_size=int(group))
    ours, unquantized = our_logits(base, quant), our_logits(base, None)
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert (ours - unquantized).abs().max() > 100 * (theirs - ours).abs().max()
