"""The layer spec's quantizing slots: a model built with ``quant`` computes what the plain model
computes with its decoder weights fake-quantized (the int formats are weight-only), and the
embedding and output layer stay as they are."""

from __future__ import annotations

import pytest
import torch

from megatron.apertus.errors import ConfigError
from megatron.apertus.model import preset
from megatron.apertus.model.spec import apertus_layer_spec
from megatron.apertus.quant.config import QuantConfig
from megatron.apertus.quant.formats import fake_int
from megatron.apertus.quant.layers import (
    QuantColumnParallelLinear,
    QuantRowParallelLinear,
    decoder_linears,
)


def test_quantized_slots_compute_the_fake_quantized_weights(tiny_cpu):
    quant = QuantConfig(quant_format="int4", quant_group_size=32)
    plain = tiny_cpu.build().eval()
    quantized = tiny_cpu.build(quant=quant).eval()
    quantized.load_state_dict(plain.state_dict())
    kinds = {type(m) for _, m in decoder_linears(quantized)}
    assert kinds == {QuantColumnParallelLinear, QuantRowParallelLinear}
    tokens = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(64).expand(2, -1)
    with torch.no_grad():
        got = quantized(tokens, positions, None)
        for _, module in decoder_linears(plain):
            module.weight.copy_(fake_int(module.weight, 4, 32))
        want = plain(tokens, positions, None)
    assert torch.equal(got, want)
    assert set(quantized.state_dict()) == set(plain.state_dict())


def test_a_group_size_that_does_not_divide_names_the_slot(tiny_cpu):
    with pytest.raises(ConfigError, match="does not divide the .* input features of linear_"):
        tiny_cpu.build(quant=QuantConfig(quant_format="int4", quant_group_size=48))


def test_transformer_engine_layers_are_refused_before_anything_is_built():
    quant = QuantConfig(quant_format="int4")
    with pytest.raises(ConfigError, match="--quant-format needs --transformer-impl local"):
        apertus_layer_spec(preset("tiny"), transformer_impl="transformer_engine", quant=quant)
