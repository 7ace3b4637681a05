"""tools/checkpoint/export_quantized_hf.py: the compressed-tensors directory loads in
``transformers`` and computes what our fake-quantized model computes.

* int4/int3 (weight-only) and fp8 (weights and dynamic input scales): the logits equal ours to
  fp32 round-off, and differ from the unquantized model's (and, for fp8, from the logits with
  transformers' activation quantization switched off) by far more.
* nvfp4: the stored e2m1 codes and e4m3 block scales are our quantizer's, the global scale is
  the reciprocal of our tensor scale; transformers decompresses the weights to bfloat16, so
  its dense weights equal ours to bfloat16 rounding and its logits equal those of our model
  with weight-only nvfp4 to a stated tolerance; its activation quantizer, with the input global
  scale calibrated on the same tokens, is ours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron.apertus import checkpoint
from megatron.apertus.convert.hf import split_qkv, to_hf_state_dict
from megatron.apertus.convert.hf_io import single_process
from megatron.apertus.convert.quant_io import read_state, rtn_weight
from megatron.apertus.data.config import DataConfig
from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.prep.preprocess import PreprocessConfig, preprocess
from megatron.apertus.quant.config import QuantConfig
from megatron.apertus.quant.formats import fake_nvfp4, nvfp4_quantize
from megatron.apertus.quant.layers import decoder_linears
from megatron.apertus.tokenizer.tokenizers import build_tokenizer
from tests.conftest import PRETRAIN, REPO, cpu_models, run_entry, run_script

EXPORT = REPO / "tools" / "checkpoint" / "export_quantized_hf.py"
DOCUMENT = 7
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny checkpoint with weights wide enough that quantization moves the logits."""
    save = tmp_path_factory.mktemp("export") / "ckpt"
    run_entry(
        PRETRAIN,
        [
            "--model-preset",
            "tiny",
            "--num-layers",
            "2",
            "--init-method-std",
            "0.05",
            "--untie-embeddings-and-output-weights",
            "--train-iters",
            "0",
            "--global-batch-size",
            "2",
            "--micro-batch-size",
            "1",
            "--save",
            str(save),
        ],
    )
    return save


def tokens(length: int = 96) -> torch.Tensor:
    data = DataConfig()
    tokenizer = build_tokenizer(data.tokenizer_type, data.tokenizer_model)
    return torch.tensor([tokenizer.encode_document(embedded_documents()[DOCUMENT])[:length]])


def our_logits(
    save: Path,
    quant: QuantConfig | None,
    *,
    ids: torch.Tensor | None = None,
    weights_only: bool = False,
    weight_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Our model's logits with ``quant`` fake-quantizing it, or (``weights_only``) with its
    decoder weights rounded as tools/quantize.py --method rtn does (then to ``weight_dtype``)
    and its inputs unquantized."""
    with cpu_models() as models:
        chunk = models.build(load=save, quant=None if weights_only else quant)
        if weights_only:
            with torch.no_grad():
                for _, module in decoder_linears(chunk):
                    module.weight.copy_(rtn_weight(module.weight, quant).to(weight_dtype))
        ids = tokens() if ids is None else ids
        with torch.no_grad():
            return chunk.eval()(ids, torch.arange(ids.shape[1]).unsqueeze(0), None).float()


def our_state(save: Path) -> tuple[dict[str, torch.Tensor], object]:
    model = checkpoint.load_model_config(save)
    with single_process(model) as chunk:
        return read_state(chunk, save), model


def hf_parts(ours: str, tensor: torch.Tensor, model) -> dict[str, torch.Tensor]:
    """``tensor``, laid out along the rows of our decoder weight ``ours``, under HF names."""
    layer = ours.split(".")[2]
    if "linear_qkv" in ours:
        names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        return {f"model.layers.{layer}.{n}": t for n, t in zip(names, split_qkv(tensor, model))}
    name = {
        "linear_proj": "self_attn.o_proj",
        "linear_fc1": "mlp.up_proj",
        "linear_fc2": "mlp.down_proj",
    }[ours.split(".")[-2]]
    return {f"model.layers.{layer}.{name}": tensor}


def fake_quantized_hf_weights(save: Path, quant: QuantConfig) -> dict[str, torch.Tensor]:
    """Our fake-quantized decoder weights (RTN of the whole fused tensors), under HF names."""
    state, model = our_state(save)
    for name in [
        n
        for n in state
        if n.split(".")[-2] in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    ]:
        state[name] = rtn_weight(state[name], quant)
    return to_hf_state_dict(state, model, torch.float32)


def linears(hf) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in hf.named_modules() if n.split(".")[-1] in PROJECTIONS}


def export(base: Path, out: Path, *args: str) -> dict:
    run_entry(EXPORT, ["--load", str(base), "--output", str(out), *args])
    return json.loads((out / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize(
    "fmt,group", [("int4", "16"), pytest.param("int3", "-1", marks=pytest.mark.slow)]
)
def test_transformers_loads_the_export_and_matches_fake_quant(base, tmp_path, fmt, group):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    export(base, out, "--quant-format", fmt, "--quant-group-size", group)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(tokens()).logits.float()
    quant = QuantConfig(quant_format=fmt, quant_group_size=int(group))
    ours, unquantized = our_logits(base, quant), our_logits(base, None)
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert (ours - unquantized).abs().max() > 100 * (theirs - ours).abs().max()


@pytest.mark.parametrize("scaling", ["tensor", pytest.param("channel", marks=pytest.mark.slow)])
def test_fp8_export_quantizes_weights_and_inputs_as_we_do(base, tmp_path, scaling):
    """transformers runs compressed-tensors' forward: dense e4m3 weights times their scales
    (equal to ours bit for bit) and dynamically fake-quantized inputs."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    config = export(base, out, "--quant-format", "fp8", "--quant-fp8-scaling", scaling)
    assert config["format"] == "float-quantized"
    inputs = config["config_groups"]["group_0"]["input_activations"]
    assert inputs["dynamic"] is True
    assert inputs["strategy"] == {"tensor": "tensor", "channel": "token"}[scaling]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = tokens()
    with torch.no_grad():
        theirs = hf(ids).logits.float()
        for module in linears(hf).values():
            module.quantization_enabled = False  # compressed-tensors' switch for input quant
        weights_only = hf(ids).logits.float()
    quant = QuantConfig(quant_format="fp8", quant_fp8_scaling=scaling)
    expected = fake_quantized_hf_weights(base, quant)
    for name, module in linears(hf).items():
        assert torch.equal(module.weight, expected[f"{name}.weight"]), name
    ours, unquantized = our_logits(base, quant), our_logits(base, None)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    gap = (theirs - ours).abs().max()
    assert (ours - unquantized).abs().max() > 1000 * gap
    assert (weights_only - ours).abs().max() > 1000 * gap  # the inputs are quantized too


@pytest.fixture(scope="module")
def nvfp4_export(base, tmp_path_factory) -> Path:
    """The nvfp4 export, its input global scales calibrated on the one document the tests
    evaluate, cut to the model's sequence length."""
    root = tmp_path_factory.mktemp("nvfp4")
    source = root / "calibration.jsonl"
    source.write_text(json.dumps({"text": embedded_documents()[DOCUMENT]}) + "\n", "utf-8")
    preprocess(PreprocessConfig(inputs=[source], output_prefix=str(root / "calibration")))
    out = root / "hf"
    export(
        base,
        out,
        "--quant-format",
        "nvfp4",
        "--calibration-data",
        str(root / "calibration_text_document"),
        "--calibration-samples",
        "1",
    )
    return out


def test_nvfp4_export_holds_our_codes_and_scales(base, nvfp4_export):
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from safetensors.torch import load_file

    stored = load_file(str(nvfp4_export / "model.safetensors"))
    state, model = our_state(base)
    checked = 0
    for name, weight in state.items():
        if name.split(".")[-2] not in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
            continue
        values, block_scale, tensor_scale = nvfp4_quantize(weight)
        codes = hf_parts(name, values.reshape(weight.shape), model)
        scales = hf_parts(name, block_scale[..., 0], model)
        for hf_name, code in codes.items():
            packed = stored[f"{hf_name}.weight_packed"]
            unpacked = unpack_fp4_from_uint8(packed, *code.shape, dtype=torch.float32)
            assert torch.equal(unpacked, code), hf_name
            assert torch.equal(stored[f"{hf_name}.weight_scale"].float(), scales[hf_name])
            assert torch.equal(stored[f"{hf_name}.weight_global_scale"], 1 / tensor_scale)
            checked += 1
    assert checked == 6 * model.num_layers


def test_nvfp4_export_loads_in_transformers_and_matches_weight_only_fake_quant(base, nvfp4_export):
    """``dequantize=True`` gives the dense model: bfloat16-rounded weights, inputs unquantized."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    hf = AutoModelForCausalLM.from_pretrained(
        nvfp4_export,
        dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(dequantize=True),
    )
    quant = QuantConfig(quant_format="nvfp4")
    expected = fake_quantized_hf_weights(base, quant)
    for name, module in linears(hf).items():
        torch.testing.assert_close(module.weight, expected[f"{name}.weight"], rtol=2**-8, atol=0)
    with torch.no_grad():
        theirs = hf(tokens()).logits.float()
    ours = our_logits(base, quant, weights_only=True)
    unquantized = our_logits(base, None)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=2e-2)  # measured: 0.0097
    assert (ours - unquantized).abs().max() > 20 * (theirs - ours).abs().max()  # 57x
    # ... and the whole difference is that bfloat16 rounding:
    bf16 = our_logits(base, quant, weights_only=True, weight_dtype=torch.bfloat16)
    torch.testing.assert_close(theirs, bf16, rtol=1e-5, atol=1e-5)


def test_nvfp4_inputs_are_quantized_by_transformers_as_by_us(nvfp4_export):
    """transformers' default load quantizes each linear's input with the static global scale;
    on the calibration tokens (the first layer's input is the same as ours there) that is our
    dynamic nvfp4 quantizer. compressed-tensors decompresses nvfp4 weights to bfloat16, so a
    float32 model needs its decompressed linears cast back to float32 before it runs."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(nvfp4_export, dtype=torch.float32)
    hf.hf_quantizer.compressor.decompress_model(hf)
    for module in linears(hf).values():
        for param in module.parameters(recurse=False):
            param.data = param.data.float()
    seen = {}
    q_proj = hf.model.layers[0].self_attn.q_proj
    q_proj.register_forward_hook(lambda _m, args, out: seen.update(x=args[0], y=out))
    ids = tokens(128)  # the calibration sample: the document cut to the model's seq_length
    with torch.no_grad():
        hf(ids)
        expected = torch.nn.functional.linear(fake_nvfp4(seen["x"]), q_proj.weight)
        unquantized = torch.nn.functional.linear(seen["x"], q_proj.weight)
    torch.testing.assert_close(seen["y"], expected, rtol=1e-5, atol=1e-5)
    assert (unquantized - expected).abs().max() > 1000 * (seen["y"] - expected).abs().max()


def test_nvfp4_export_runs_with_transformers_defaults(nvfp4_export):
    """The config's dtype is bfloat16, what compressed-tensors decompresses NVFP4 to: a load
    with transformers' defaults runs (a float32 one would fail in its first matmul)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(nvfp4_export)
    assert hf.dtype == torch.bfloat16
    with torch.no_grad():
        logits = hf(tokens()).logits
    assert logits.shape[-1] == 131072 and torch.isfinite(logits).all()


def test_a_group_size_that_does_not_divide_the_rows_is_one_line_and_exit_2(base, tmp_path):
    args = [
        "--load",
        str(base),
        "--output",
        str(tmp_path / "hf"),
        "--quant-format",
        "int4",
        "--quant-group-size",
        "48",
    ]
    proc = run_script(EXPORT, args, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "export_quantized_hf.py: error: --quant-group-size 48 does not divide the 64 input "
        "features of model.layers.*.self_attn.q_proj"
    ]
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


def test_a_missing_calibration_prefix_is_one_line_and_exit_2(base, tmp_path):
    args = [
        "--load",
        str(base),
        "--output",
        str(tmp_path / "hf"),
        "--quant-format",
        "nvfp4",
        "--calibration-data",
        str(tmp_path / "missing"),
    ]
    proc = run_script(EXPORT, args, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"export_quantized_hf.py: error: --calibration-data: neither {tmp_path / 'missing'}.bin "
        f"nor {tmp_path / 'missing'}.idx exists"
    ]
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()
