"""Layers out of FP8 (``--bf16-layers``, the FP8 guard's switches): which layers the set names,
that it changes between steps without a rebuild, and the FP8 state a load leaves out."""

from __future__ import annotations

import torch

from megatron.apertus.model.engine import EngineConfig
from megatron.apertus.model.precision import PrecisionTransformerLayer, bf16_layers, set_bf16_layers


def test_the_set_names_global_layer_numbers_and_changes_between_steps(tiny_cpu):
    chunk = tiny_cpu.build(engine=EngineConfig(bf16_layers=[2, 4]))
    layers = chunk.decoder.layers
    assert all(isinstance(layer, PrecisionTransformerLayer) for layer in layers)
    assert [layer.in_bf16 for layer in layers] == [False, True, False, True]
    set_bf16_layers([chunk], [1])
    assert bf16_layers([chunk]) == [1]
    assert bf16_layers([tiny_cpu.build()]) == [], "no flag: every layer in FP8 (when it is on)"


def test_without_fp8_a_layer_in_bf16_computes_the_same(tiny_cpu):
    chunk = tiny_cpu.build().eval()
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        before = chunk(tokens, positions, None)
        set_bf16_layers([chunk], [1, 2, 3, 4])
        assert torch.equal(chunk(tokens, positions, None), before)


def test_a_load_leaves_the_fp8_state_of_layers_in_bf16_out(tiny_cpu):
    chunk = tiny_cpu.build(engine=EngineConfig(bf16_layers=[2]))
    state = chunk.state_dict()
    fp8_state = sorted(key for key in state if key.endswith("_extra_state"))
    assert fp8_state, "megatron-core's linears carry the key TE's FP8 state travels in"
    result = chunk.load_state_dict(state, strict=False)
    assert sorted(result.missing_keys) == [
        k for k in fp8_state if k.startswith("decoder.layers.1.")
    ]
    set_bf16_layers([chunk], [])
    assert chunk.load_state_dict(state, strict=False).missing_keys == []
