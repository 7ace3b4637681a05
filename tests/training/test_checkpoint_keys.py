"""A load restores every weight the model asks for or names what the checkpoint lacks; only
Transformer Engine's ``_extra_state`` (FP8 metadata) may be absent, so checkpoints of the local
and the TE layers load into each other (checked on GPU in tests/gpu/test_transformer_engine.py)."""

from __future__ import annotations

import psutil
import pytest
import torch

from megatron.apertus import checkpoint
from megatron.apertus.model import preset


def tiny(tiny_cpu, **fields):
    model = preset("tiny", **fields)
    return model, tiny_cpu.build(model)


def test_weights_round_trip(tiny_cpu, tmp_path):
    model, saved = tiny(tiny_cpu)
    checkpoint.save_model(tmp_path, 0, [saved], model)
    _, loaded = tiny(tiny_cpu)
    checkpoint.load_model(tmp_path, [loaded])
    for (name, want), got in zip(saved.state_dict().items(), loaded.state_dict().values()):
        if torch.is_tensor(want):
            assert torch.equal(want, got), name


def test_a_synchronous_save_leaves_no_process_behind(tiny_cpu, tmp_path):
    """megatron-core's writer would start a multiprocessing manager (a fresh interpreter that
    imports torch) for the report of a save written by this very process."""
    model, saved = tiny(tiny_cpu)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    checkpoint.save_model(tmp_path, 0, [saved], model)
    checkpoint.save_model(tmp_path, 1, [saved], model)
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not started, [p.cmdline() for p in started]
    assert checkpoint.latest_iteration(tmp_path) == 1


def test_a_checkpoint_missing_weights_is_refused_naming_them(tiny_cpu, tmp_path):
    model, saved = tiny(tiny_cpu, qk_layernorm=False)
    checkpoint.save_model(tmp_path, 0, [saved], model)
    _, needs_qk_norms = tiny(tiny_cpu, qk_layernorm=True)
    with pytest.raises(checkpoint.CheckpointMismatch, match="k_layernorm") as err:
        checkpoint.load_model(tmp_path, [needs_qk_norms])
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)


def test_only_te_extra_state_may_be_absent():
    assert checkpoint._is_extra_state("decoder.layers.0.mlp.linear_fc1._extra_state")
    assert not checkpoint._is_extra_state("decoder.layers.0.mlp.linear_fc1.weight")
