"""Hugging Face interop: export to ``ApertusForCausalLM``, import back, and the pure mappings.

The end-to-end tests run the real tools as subprocesses on the tiny preset with the real
131072-token vocabulary: a random checkpoint is exported, loaded by transformers, compared
logit by logit with our model on real tokens, imported again and re-exported bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file

from megatron.apertus.convert.hf import (
    ConversionError,
    apertus_config_from_hf,
    from_hf_state_dict,
    fuse_qkv,
    hf_config,
    hf_parameter_shapes,
    split_qkv,
    to_hf_state_dict,
)
from megatron.apertus.model.config import preset
from megatron.apertus.ops.xielu import XIELU_BETA, XIELU_EPS
from megatron.apertus.tokenizer.tokenizers import bundled_tekken_path, load_tokenizer
from tests.conftest import run_entry, run_script

REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "hf_interop_helper.py"
EXPORT = REPO / "tools" / "checkpoint" / "export_hf.py"
IMPORT = REPO / "tools" / "checkpoint" / "import_hf.py"
SEED = 1234
LOGIT_TOLERANCE = 1e-4
SUBPROCESS_TIMEOUT = 900
TOKENIZER = ("--tokenizer", str(bundled_tekken_path()))
"""The helper's and the import's checkpoints record no training run, so export needs it."""


def run(script: Path, *args: str, nproc: int = 1) -> None:
    """Run a script with this interpreter (under torchrun when ``nproc`` > 1); fail with its output."""
    run_entry(script, list(args), nproc=nproc, timeout=SUBPROCESS_TIMEOUT)


def sample_text() -> str:
    """Real English prose from the standard library's documentation topics."""
    from pydoc_data.topics import topics

    return topics["assert"][:700]


@dataclass(frozen=True)
class Exported:
    tied: bool
    checkpoint: Path
    hf_dir: Path
    tokens: list[int]
    our_logits: torch.Tensor


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Callable[[bool], Exported]:
    """Save a random checkpoint, export it with the tekken tokenizer, and run our model once.

    A factory (cached per variant) so that every test of a variant shares one export.
    """
    cache: dict[bool, Exported] = {}

    def get(tied: bool) -> Exported:
        if tied not in cache:
            tmp = tmp_path_factory.mktemp("tied" if tied else "untied")
            ckpt, hf_dir = tmp / "ckpt", tmp / "hf"
            run(HELPER, "save", "--save", str(ckpt), "--seed", str(SEED), *(["--tied"] * tied))
            run(EXPORT, "--load", str(ckpt), "--output", str(hf_dir), *TOKENIZER)
            tokens = load_tokenizer().encode_document(sample_text())
            (tmp / "tokens.json").write_text(json.dumps(tokens))
            logits = tmp / "logits.safetensors"
            run(
                HELPER,
                "logits",
                "--load",
                str(ckpt),
                "--tokens",
                str(tmp / "tokens.json"),
                "--out",
                str(logits),
            )
            cache[tied] = Exported(tied, ckpt, hf_dir, tokens, load_file(str(logits))["logits"])
        return cache[tied]

    return get


def load_hf(hf_dir: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def read_config(hf_dir: Path) -> dict:
    return json.loads((hf_dir / "config.json").read_text())


def assert_same_tensors(a_dir: Path, b_dir: Path) -> None:
    a, b = (load_file(str(d / "model.safetensors")) for d in (a_dir, b_dir))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_transformers_loads_export(exported, tied: bool) -> None:
    e = exported(tied)
    model, info = load_hf(e.hf_dir)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"] and not info["error_msgs"], info
    assert type(model).__name__ == "ApertusForCausalLM"
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.config.rope_parameters["rope_theta"] == 500000
    assert model.config.tie_word_embeddings == tied
    for layer in model.model.layers:
        assert layer.mlp.act_fn.beta.item() == XIELU_BETA
        assert layer.mlp.act_fn.eps.item() == torch.tensor(XIELU_EPS).item()
    same = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert same == tied


@pytest.mark.smoke
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_logits_match_ours(exported, tied: bool) -> None:
    e = exported(tied)
    model, _ = load_hf(e.hf_dir)
    with torch.no_grad():
        theirs = model(torch.tensor([e.tokens])).logits
    assert theirs.shape == e.our_logits.shape == (1, len(e.tokens), 131072)
    diff = (theirs - e.our_logits).abs().max().item()
    print(f"max abs logit difference ({'tied' if tied else 'untied'}): {diff:.3e}")
    assert diff <= LOGIT_TOLERANCE


def test_exported_tokenizer_encodes_like_ours(exported) -> None:
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(exported(False).hf_dir))
    ours = load_tokenizer()
    text = sample_text()
    assert hf_tok(text)["input_ids"] == [ours.bos, *ours.encode(text)]
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (ours.bos, ours.eod)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_import_then_export_is_bit_exact(exported, tied: bool, tmp_path: Path) -> None:
    e = exported(tied)
    run(IMPORT, "--hf-dir", str(e.hf_dir), "--save", str(tmp_path / "ckpt"), "--iteration", "5")
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    run(EXPORT, "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf"), *TOKENIZER)
    assert_same_tensors(e.hf_dir, tmp_path / "hf")
    assert read_config(e.hf_dir) == read_config(tmp_path / "hf")


def test_bf16_export_round_trips(exported, tmp_path: Path) -> None:
    e = exported(False)
    run(
        EXPORT,
        "--load",
        str(e.checkpoint),
        "--output",
        str(tmp_path / "a"),
        "--dtype",
        "bf16",
        *TOKENIZER,
    )
    tensors = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert read_config(tmp_path / "a")["dtype"] == "bfloat16"
    run(IMPORT, "--hf-dir", str(tmp_path / "a"), "--save", str(tmp_path / "ckpt"))
    run(
        EXPORT,
        "--load",
        str(tmp_path / "ckpt"),
        "--output",
        str(tmp_path / "b"),
        "--dtype",
        "bf16",
        *TOKENIZER,
    )
    assert_same_tensors(tmp_path / "a", tmp_path / "b")


def test_tp2_checkpoint_exports_like_tp1(exported, tmp_path: Path) -> None:
    """megatron-core's CPU init draws each full weight then slices it, so same seed = same model."""
    e = exported(False)
    ckpt = tmp_path / "ckpt_tp2"
    run(HELPER, "save", "--save", str(ckpt), "--seed", str(SEED), "--tp", "2", nproc=2)
    run(EXPORT, "--load", str(ckpt), "--output", str(tmp_path / "hf"), *TOKENIZER)
    assert_same_tensors(e.hf_dir, tmp_path / "hf")


# ---- pure mappings (no subprocesses) --------------------------------------------------------


def random_hf_state(model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    state = {
        name: torch.randn(shape, generator=gen).to(dtype)
        for name, shape in hf_parameter_shapes(model).items()
    }
    for name in state:
        if name.endswith("act_fn.beta"):
            state[name] = torch.tensor(XIELU_BETA, dtype=dtype)
        elif name.endswith("act_fn.eps"):
            state[name] = torch.tensor(XIELU_EPS, dtype=dtype)
    return state


def test_qkv_split_follows_megatron_group_layout() -> None:
    model = preset("tiny", vocab_size=8)  # 4 heads in 2 groups, kv_channels 16
    d = model.kv_channels
    # Block b of the fused weight (b = group * 4 + slot; slots q0, q1, k, v) is filled with b.
    fused = torch.arange(8).repeat_interleave(d).unsqueeze(1).expand(-1, 3).float()
    q, k, v = split_qkv(fused, model)
    assert q.shape == (4 * d, 3) and k.shape == v.shape == (2 * d, 3)
    assert q[::d, 0].tolist() == [0, 1, 4, 5]
    assert k[::d, 0].tolist() == [2, 6] and v[::d, 0].tolist() == [3, 7]
    assert torch.equal(fuse_qkv(q, k, v, model), fused)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_state_dict_mapping_round_trips(tied: bool) -> None:
    model = preset("tiny", vocab_size=32, untie_embeddings_and_output_weights=not tied)
    hf = random_hf_state(model)
    back = to_hf_state_dict(from_hf_state_dict(hf, model), model, torch.float32)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_import_refuses_other_xielu_constants() -> None:
    model = preset("tiny", vocab_size=32)
    hf = random_hf_state(model)
    hf["model.layers.2.mlp.act_fn.beta"] = torch.tensor(0.25)
    with pytest.raises(ConversionError, match=r"model\.layers\.2\.mlp\.act_fn\.beta"):
        from_hf_state_dict(hf, model)
    # bf16 cannot hold -1e-6 exactly: the value rounded to the tensor's dtype is accepted.
    from_hf_state_dict(random_hf_state(model, torch.bfloat16), model)


def test_import_refuses_missing_and_misshapen_tensors() -> None:
    model = preset("tiny", vocab_size=32)
    hf = random_hf_state(model)
    del hf["model.layers.0.mlp.act_fn.eps"]
    with pytest.raises(ConversionError, match=r"missing \['model\.layers\.0\.mlp\.act_fn\.eps'\]"):
        from_hf_state_dict(hf, model)
    hf = random_hf_state(model)
    hf["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(ConversionError, match=r"k_proj\.weight has shape \(64, 64\)"):
        from_hf_state_dict(hf, model)


def test_import_of_an_empty_safetensors_file_is_one_line_naming_it(tmp_path: Path) -> None:
    """A download cut short leaves a 0-byte model.safetensors: exit 2 and one line, not
    safetensors' traceback; nothing is saved."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    config = hf_config(preset("tiny", vocab_size=32), torch.float32)
    (hf_dir / "config.json").write_text(json.dumps(config))
    (hf_dir / "model.safetensors").write_bytes(b"")
    save = tmp_path / "ckpt"
    proc = run_script(IMPORT, ["--hf-dir", str(hf_dir), "--save", str(save)], timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert line.startswith("import_hf.py: error: ") and "not a readable safetensors" in line
    assert str(hf_dir / "model.safetensors") in line
    assert not save.exists()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_config_round_trips(tied: bool) -> None:
    model = preset("tiny", untie_embeddings_and_output_weights=not tied)
    config = hf_config(model, torch.bfloat16)
    assert config["rope_parameters"] == {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 3)
    assert config["tie_word_embeddings"] == tied and config["dtype"] == "bfloat16"
    # seq_length is training-only and absent from HF configs.
    expected = dataclasses.replace(model, seq_length=4096)
    assert apertus_config_from_hf(config) == expected


def test_config_accepts_legacy_rope_scaling() -> None:
    """transformers 4.x configs (as published for Apertus-8B) carry rope_theta + rope_scaling."""
    config = hf_config(preset("apertus-8b"), torch.bfloat16)
    del config["rope_parameters"]
    config["rope_theta"] = 12000000.0
    config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    model = apertus_config_from_hf(config)
    assert model.rotary_base == 12000000 and model.rope_scaling and model.rope_scaling_factor == 8.0


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_act": "silu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"model_type": "llama"}, "model_type"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}}, "rope_type"),
        (
            {
                "rope_parameters": {
                    **hf_config(preset("tiny"), torch.float32)["rope_parameters"],
                    "low_freq_factor": 2.0,
                }
            },
            "low_freq_factor",
        ),
        ({"rope_theta": 1e6}, "rope_theta"),
    ],
)
def test_config_refuses_what_we_cannot_represent(change: dict, field: str) -> None:
    config = {**hf_config(preset("tiny"), torch.float32), **change}
    with pytest.raises(ConversionError, match=field):
        apertus_config_from_hf(config)
