"""The Apertus launch scripts' Megatron-LM arguments parse, every flag with Megatron-LM's meaning,
into the run our own Slurm launchers describe; each restated architecture flag is checked, and
values we do not implement are refused with one line naming the flag.

The two arrays below are the ``*_ARGS=( ... )`` arrays of github swiss-ai/pretrain-code at
commit 531cc8b, ``pretraining/submit_apertus_8b.sh`` and ``pretraining/submit_apertus_70b.sh``,
one flag per line in the scripts' order, comments removed. Shell variables carry the scripts'
values ($SEQ_LEN 4096, $GBS 2048, $COOLDOWN_SAMPLES 403905806, $CHECKPOINT_STEPS 2000); the
directories are placeholders filled with temporary paths. The Hugging Face tokenizer names are
the scripts' own, resolved offline from a Hugging Face cache laid out in a temporary ``HF_HOME``
(``tests/hub_cache.py``). The scripts append ``--data-path ... --data-cache-path DIR``.
"""

from __future__ import annotations

import dataclasses
import re
import shlex

import pytest
import torch

import pretrain_gpt
from megatron.apertus import parallel
from megatron.apertus.launch.submit import read_run
from megatron.apertus.model import ParallelConfig, preset
from megatron.apertus.training.communication_config import CommunicationConfig
from tests.conftest import REPO
from tests.hub_cache import apertus_hf_home, apertus_hub_cache  # noqa: F401 (fixtures)

APERTUS_8B = """
--main-grads-dtype fp32
--num-layers 32
--hidden-size 4096
--ffn-hidden-size 21504
--num-attention-heads 32
--group-query-attention
--num-query-groups 8
--max-position-embeddings 4096
--position-embedding-type rope
--rotary-base 500000
--use-rope-scaling
--rope-scaling-factor 8
--make-vocab-size-divisible-by 128
--normalization RMSNorm
--xielu
--qk-layernorm
--qknorm-impl apex
--untie-embeddings-and-output-weights
--log-throughput
--log-params-norm
--tensorboard-dir {TENSORBOARD_DIR}
--no-log-loss-scale-to-tensorboard
--log-memory-to-tensorboard
--attention-dropout 0.0
--hidden-dropout 0.0
--weight-decay 0.1
--clip-grad 0.1
--adam-beta1 0.9
--adam-beta2 0.999
--ademamix-alpha 8
--ademamix-beta3 0.9999
--ademamix-beta3-warmup 100000
--ademamix-alpha-warmup 100000
--micro-batch-size 4
--global-batch-size 2048
--rampup-batch-size 1024 1024 1718272000
--no-check-for-nan-in-loss-and-grad
--train-samples 3662109375
--log-interval 1
--cross-entropy-loss-fusion
--disable-bias-linear
--optimizer ademamix
--dataloader-type single
--manual-gc
--manual-gc-interval 500
--exit-signal-handler
--trigger-path {TRIGGER_DIR}
--seed 28
--init-method-std 0.008944
--lr 0.00011
--min-lr 0.000011
--lr-decay-style WSD
--lr-warmup-samples 4096000
--lr-wsd-decay-style 1-sqrt
--lr-wsd-decay-samples 403905806
--save {CKPT_DIR}
--load {CKPT_DIR}
--save-interval 2000
--ckpt-format torch_dist
--async-save
--ckpt-fully-parallel-load
--dist-ckpt-strictness assume_ok_unexpected
--override-opt_param-scheduler
--distributed-timeout-minutes 60
--bf16
--tensor-model-parallel-size 2
--pipeline-model-parallel-size 1
--use-distributed-optimizer
--overlap-grad-reduce
--overlap-param-gather
--tokenizer-type HuggingFaceTokenizer
--tokenizer-model swiss-ai/Apertus-8B-2509
--split 100,0,0
--seq-length 4096
--reset-position-ids
--reset-attention-mask
--eod-mask-loss
--num-workers 64
--num-dataset-builder-threads 4
--goldfish-loss
--goldfish-k 50
--goldfish-h 50
"""

APERTUS_70B = """
--main-grads-dtype fp32
--transformer-impl transformer_engine
--ddp-bucket-size 10000000000
--decrease-batch-size-if-needed
--num-layers 80
--hidden-size 8192
--ffn-hidden-size 43008
--num-attention-heads 64
--group-query-attention
--num-query-groups 8
--max-position-embeddings 4096
--position-embedding-type rope
--rotary-base 500000
--use-rope-scaling
--rope-scaling-factor 8
--make-vocab-size-divisible-by 128
--normalization RMSNorm
--xielu
--qk-layernorm
--qknorm-impl apex
--untie-embeddings-and-output-weights
--log-throughput
--log-progress
--tensorboard-dir {TENSORBOARD_DIR}
--no-log-loss-scale-to-tensorboard
--log-memory-to-tensorboard
--attention-dropout 0.0
--hidden-dropout 0.0
--weight-decay 0.1
--clip-grad 0.1
--adam-beta1 0.9
--adam-beta2 0.999
--ademamix-alpha 8
--ademamix-beta3 0.9999
--ademamix-beta3-warmup 100000
--ademamix-alpha-warmup 100000
--micro-batch-size 1
--global-batch-size 2048
--rampup-batch-size 2048 2048 1072164864
--no-check-for-nan-in-loss-and-grad
--log-interval 1
--train-samples 3662109375
--cross-entropy-loss-fusion
--disable-bias-linear
--optimizer ademamix
--dataloader-type single
--manual-gc
--manual-gc-interval 50
--exit-signal-handler
--trigger-path {TRIGGER_DIR}
--seed 28
--init-method-std 0.008944
--lr 0.00001
--min-lr 0.000001
--lr-decay-style WSD
--lr-warmup-samples 4096000
--lr-wsd-decay-style 1-sqrt
--lr-wsd-decay-samples 403905806
--save {CKPT_DIR}
--load {CKPT_DIR}
--save-interval 2000
--ckpt-format torch_dist
--async-save
--ckpt-fully-parallel-load
--dist-ckpt-strictness assume_ok_unexpected
--override-opt_param-scheduler
--ckpt-assume-constant-structure
--bf16
--tensor-model-parallel-size 4
--pipeline-model-parallel-size 8
--use-distributed-optimizer
--overlap-grad-reduce
--overlap-param-gather
--sequence-parallel
--num-layers-per-virtual-pipeline-stage 2
--context-parallel-size 1
--overlap-p2p-communication-warmup-flush
--tokenizer-type HuggingFaceTokenizer
--tokenizer-model swiss-ai/Apertus-70B-2509
--split 100,0,0
--seq-length 4096
--reset-position-ids
--reset-attention-mask
--eod-mask-loss
--num-workers 32
--num-dataset-builder-threads 4
--goldfish-loss
--goldfish-k 50
--goldfish-h 50
"""

SCRIPTS = {"8b": APERTUS_8B, "70b": APERTUS_70B}
TOKENIZER_VOCAB = 1000
"""Ids of the stand-in tokenizer: padded to 1024 under --make-vocab-size-divisible-by 128 with
TP 2 (multiples of 256) and TP 4 (of 512)."""


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A Hugging Face tokenizer directory (a word-level tokenizer.json of 1000 ids)."""
    from tokenizers import Tokenizer, models

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    words = [f"w{i}" for i in range(TOKENIZER_VOCAB - len(specials))]
    vocab = {token: i for i, token in enumerate(specials + words)}
    directory = tmp_path_factory.mktemp("tokenizer")
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(directory / "tokenizer.json"))
    return directory


def launch_args(script: str, tmp_path) -> list[list[str]]:
    """The script's array, one list of words per flag line, then the flags it appends."""
    paths = dict(
        CKPT_DIR=tmp_path / "ckpt",
        TRIGGER_DIR=tmp_path / "trigger",
        TENSORBOARD_DIR=tmp_path / "tensorboard",
    )
    text = SCRIPTS[script].format(**{key: str(value) for key, value in paths.items()})
    lines = [shlex.split(line) for line in text.strip().splitlines()]
    return lines + [
        ["--data-path", str(tmp_path / "data")],
        ["--data-cache-path", str(tmp_path / "cache")],
    ]


def _apertus_run(script: str, tmp_path) -> pretrain_gpt.RunConfig:
    """The run of the Apertus script's array, every flag of it (the layers local: Transformer
    Engine needs a GPU, and no test here is about the implementation)."""
    lines = launch_args(script, tmp_path)
    return pretrain_gpt.parse_args(sum(lines, []) + ["--transformer-impl", "local"])


def error_lines(capsys, argv: list[str]) -> list[str]:
    """The refusal lines of a command line that parse_args rejects with exit status 2."""
    with pytest.raises(SystemExit) as exit_:
        pretrain_gpt.parse_args(argv)
    assert exit_.value.code == 2
    message = capsys.readouterr().err.split(": error: ", 1)[1].strip()
    message = re.sub(r" \(see \S+ --help\)$", "", message).splitlines()
    return [line.strip() for line in message[1:]] if len(message) > 1 else message


@pytest.mark.smoke
@pytest.mark.parametrize(
    "script, layout",
    [
        ("8b", ParallelConfig(tensor_model_parallel_size=2, distributed_timeout_minutes=60)),
        (
            "70b",
            ParallelConfig(
                tensor_model_parallel_size=4,
                pipeline_model_parallel_size=8,
                virtual_pipeline_model_parallel_size=5,
                sequence_parallel=True,
            ),
        ),
    ],
)
def test_launch_script_is_the_apertus_run(script, layout, tmp_path, apertus_hub_cache):
    cfg = _apertus_run(script, tmp_path)
    assert cfg.model == preset(f"apertus-{script}")  # the cached Apertus tokenizer: 131072 ids
    assert cfg.parallel == layout
    assert cfg.training.precision == "bf16" and cfg.training.fused_output_loss
    assert cfg.optimizer.optimizer == "ademamix" and cfg.optimizer.use_distributed_optimizer
    assert cfg.schedule.lr_decay_style == "WSD" and cfg.schedule.override_opt_param_scheduler
    assert cfg.data.tokenizer_model == f"swiss-ai/Apertus-{script.upper()}-2509"
    assert cfg.data.goldfish_loss
    assert cfg.dataset.split == "100,0,0" and cfg.dataset.reset_attention_mask
    assert cfg.training.manual_gc
    assert cfg.training.manual_gc_interval == {"8b": 500, "70b": 50}[script]
    assert cfg.training.decrease_batch_size_if_needed == (script == "70b")
    assert cfg.logging.log_memory_to_tensorboard
    assert cfg.logging.log_params_norm == (script == "8b")
    assert cfg.communication == CommunicationConfig(
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        ddp_bucket_size=10_000_000_000 if script == "70b" else None,
        overlap_p2p_communication_warmup_flush=script == "70b",
    )


def _our_launcher_run(script: str, tmp_path) -> pretrain_gpt.RunConfig:
    """The run examples/slurm/pretrain_apertus_{script}.sbatch starts, parsed on this CPU."""
    env = dict(
        APERTUS_DATA="/data/web_text_document",
        APERTUS_REPO=str(REPO),
        APERTUS_RUN_DIR=str(tmp_path / "ours"),
        PATH="/usr/bin:/bin",
    )
    command = read_run(REPO / "examples" / "slurm" / f"pretrain_apertus_{script}.sbatch", env)
    return pretrain_gpt.parse_args(
        command["command"][1:] + ["--device", "cpu", "--transformer-impl", "local"]
    )


@pytest.mark.parametrize("script", ["8b", "70b"])
def test_our_slurm_launcher_runs_what_the_apertus_script_runs(script, tmp_path, apertus_hub_cache):
    """Every field both launchers set. They differ, by design, in the run's length and warmup
    (iterations here, samples there), the data split (969,30,1 here for validation, 100,0,0
    there), the batch ramp-up, the logging and checkpoint cadence, the tokenizer (the bundled
    tekken here, its Hugging Face conversion under the hub name there) and, for the 70B,
    the learning rates (its array is a later phase's)."""
    ours, theirs = _our_launcher_run(script, tmp_path), _apertus_run(script, tmp_path)
    assert ours.model == theirs.model
    assert dataclasses.replace(ours.parallel, distributed_timeout_minutes=None) == (
        dataclasses.replace(theirs.parallel, distributed_timeout_minutes=None)
    )
    for part in ("ademamix", "goldfish", "communication"):
        assert getattr(ours, part) == getattr(theirs, part), part
    if script == "70b":  # the 70B array is a later phase's (lr 1e-5); ours starts the run
        ours.optimizer = dataclasses.replace(ours.optimizer, lr=1e-5, min_lr=1e-6)
    assert ours.optimizer == theirs.optimizer
    pick = lambda cfg: (  # noqa: E731
        cfg.training.precision,
        cfg.training.micro_batch_size,
        cfg.training.fused_output_loss,
        cfg.data.goldfish_loss,
        cfg.schedule.lr_decay_style,
        cfg.schedule.lr_wsd_decay_style,
        cfg.dataset.reset_position_ids,
        cfg.dataset.reset_attention_mask,
        cfg.dataset.eod_mask_loss,
        cfg.training.calculate_per_token_loss,  # not given: Megatron-LM's per-micro-batch mean
    )
    assert pick(ours) == pick(theirs)


BASE = ["--train-iters", "1", "--device", "cpu"]


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--normalization", "LayerNorm"],
            "--normalization LayerNorm: only RMSNorm is implemented",
        ),
        (
            ["--position-embedding-type", "learned_absolute"],
            "--position-embedding-type learned_absolute: only rope is implemented",
        ),
        (
            ["--position-embedding-type", "none"],
            "--position-embedding-type none: only rope is implemented",
        ),
        (["--swiglu"], "--swiglu: the Apertus MLP is xIELU, not gated; SwiGLU is not implemented"),
        (["--group-query-attention"], "--group-query-attention: needs --num-query-groups"),
        (
            ["--main-grads-dtype", "bf16"],
            "--main-grads-dtype bf16: bf16 main gradients are not " "implemented yet",
        ),
        (["--attention-dropout", "0.1"], "--attention-dropout 0.1: dropout is not implemented yet"),
        (["--hidden-dropout", "0.1"], "--hidden-dropout 0.1: dropout is not implemented yet"),
        (["--ckpt-format", "torch"], "--ckpt-format torch: only torch_dist is implemented"),
        (["--dataloader-type", "cyclic"], "--dataloader-type cyclic: only single is implemented"),
        (["--dist-ckpt-format", "zarr"], "--dist-ckpt-format zarr: only torch_dist is implemented"),
        (["--save-retain-interval", "0"], "--save-retain-interval must be > 0, got 0"),
        (
            ["--save-interval", "2", "--save-retain-interval", "3"],
            "--save-retain-interval 3 must be a multiple of --save-interval 2",
        ),
        (
            ["--non-persistent-ckpt-type", "local"],
            "--non-persistent-ckpt-type local: each rank's part on node-local storage is saved "
            "by NVIDIA's resiliency extension (nvidia_resiliency_ext), which this code does not "
            "use: use global",
        ),
        (
            ["--non-persistent-ckpt-type", "in_memory"],
            "--non-persistent-ckpt-type in_memory: Megatron-LM itself has not implemented it",
        ),
        (
            ["--non-persistent-save-interval", "2"],
            "--non-persistent-save-interval needs --non-persistent-ckpt-type global",
        ),
        (
            ["--non-persistent-save-interval", "-1", "--non-persistent-ckpt-type", "global"],
            "--non-persistent-save-interval must be > 0, got -1",
        ),
        (
            [
                *("--non-persistent-ckpt-type", "global", "--non-persistent-save-interval", "1"),
                *("--save", "ck", "--non-persistent-global-ckpt-dir", "ck"),
            ],
            "--non-persistent-global-ckpt-dir ck is --save: each keeps its own tracker there",
        ),
        (
            ["--dist-ckpt-strictness", "log_all"],
            "--dist-ckpt-strictness log_all: loads always fail on "
            "missing tensors and ignore extra ones",
        ),
        (["--bf16", "--fp16"], "--bf16 and --fp16 exclude each other"),
        (["--bf16", "--precision", "fp32"], "--bf16 contradicts --precision fp32"),
        (
            ["--make-vocab-size-divisible-by", "128", "--vocab-size", "1000"],
            "--make-vocab-size-divisible-by 128: the vocabulary (1000, --vocab-size) is not a multiple "
            "of 128 x --tensor-model-parallel-size (1)",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
            "--num-layers-per-virtual-pipeline-stage 3 does not divide the 2 layers of each pipeline "
            "stage",
        ),
        (
            ["--num-layers-per-virtual-pipeline-stage", "1"],
            "--num-layers-per-virtual-pipeline-stage 1 needs --pipeline-model-parallel-size > 1",
        ),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--virtual-pipeline-model-parallel-size",
                "2",
            ],
            "give --num-layers-per-virtual-pipeline-stage or --virtual-pipeline-model-parallel-size",
        ),
        (["--rotary-percent", "0.5"], "--rotary-percent 0.5: partial rotary embeddings are not"),
        (["--apply-layernorm-1p"], "--apply-layernorm-1p: the RMSNorm weights are the scale"),
        (["--add-qkv-bias"], "--add-qkv-bias: the linear layers have no biases"),
        (["--squared-relu"], "--squared-relu: the Apertus MLP is xIELU; squared ReLU is not"),
        (["--use-flash-attn"], "--use-flash-attn: Megatron-LM's deprecated spelling; give "),
        (
            ["--apply-query-key-layer-scaling"],
            "--apply-query-key-layer-scaling: fp16 query-key layer scaling is not implemented",
        ),
        (
            ["--kv-channels", "32"],
            "--kv-channels 32: the head dimension is --hidden-size / --num-attention-heads (16) "
            "here; other head dimensions are not implemented",
        ),
        (
            ["--recompute-activations", "--recompute-granularity", "full"],
            "--recompute-activations (selective recomputation) contradicts "
            "--recompute-granularity full",
        ),
        (["--exit-signal", "SIGSEGV"], "--exit-signal SIGSEGV: choose one of SIGTERM, SIGINT"),
        (["--xielu-bet", "0.5"], "unrecognized arguments: --xielu-bet 0.5"),
        (["--rope-type", "yarn"], "--rope-type yarn: YaRN is not implemented"),
        (["--batch-size", "4"], "--batch-size 4: Megatron-LM's removed spelling; give "),
        (["--checkpoint-activations"], "--checkpoint-activations: Megatron-LM's removed spelling"),
        (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16: lower-precision optimizer state"),
        (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16: gradients reduce in fp32 (always)"),
        (["--decoder-last-pipeline-num-layers", "1"], "--decoder-last-pipeline-num-layers 1: "),
        (["--fp32-residual-connection"], "--fp32-residual-connection: the residual stream"),
        (["--vocab-file", "vocab.json"], "--vocab-file vocab.json: GPT-2 BPE vocabulary files"),
        (["--tp-comm-overlap"], "--tp-comm-overlap: Transformer Engine's userbuffer overlap"),
        (["--window-size", "4096,0"], "--window-size 4096,0: every layer attends to the whole"),
        (["--no-rope-freq", "4"], "--no-rope-freq 4: every layer applies rotary embeddings"),
        (
            ["--decoder-num-layers", "2"],
            "--decoder-num-layers 2: the decoder layers of Megatron-LM's T5 encoder-decoder; a "
            "GPT model's is --num-layers",
        ),
        (
            ["--decoder-seq-length", "64"],
            "--decoder-seq-length 64: the decoder sequence length of Megatron-LM's T5 "
            "encoder-decoder; a GPT model's is --seq-length",
        ),
        (["--head-lr-mult", "2"], "--head-lr-mult 2.0: Megatron-LM's GPT training ignores it"),
        (
            ["--init-model-with-meta-device"],
            "--init-model-with-meta-device: meta-device initialisation serves Megatron FSDP",
        ),
        (
            ["--load-main-params-from-ckpt"],
            "--load-main-params-from-ckpt: the fp32 main parameters of a --no-load-optim load",
        ),
    ],
)
def test_what_we_do_not_implement_is_refused_naming_the_flag(flags, line, capsys):
    (refusal,) = error_lines(capsys, BASE + flags)
    assert refusal.startswith(line)


def test_restated_architecture_changes_nothing():
    restated = [
        "--xielu",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--disable-bias-linear",
        "--qknorm-impl",
        "apex",
        "--main-grads-dtype",
        "fp32",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0.0",
        "--dataloader-type",
        "single",
        "--ckpt-format",
        "torch_dist",
        "--use-dist-ckpt",
        "--dist-ckpt-format",
        "torch_dist",
        "--auto-detect-ckpt-format",
        "--dist-ckpt-strictness",
        "assume_ok_unexpected",
        "--no-check-for-nan-in-loss-and-grad",
        "--log-throughput",
        "--cross-entropy-loss-fusion",
        "--use-rope-scaling",
        # the llama example scripts of Megatron-LM carry these
        "--use-mcore-models",
        "--use-rotary-position-embeddings",
        "--no-position-embedding",
        "--rotary-percent",
        "1.0",
        "--kv-channels",
        "16",
        "--no-masked-softmax-fusion",
        "--no-bias-dropout-fusion",
        "--no-bias-swiglu-fusion",
        "--no-bias-gelu-fusion",
        "--no-persist-layer-norm",
        "--attention-softmax-in-fp32",
        "--no-create-attention-mask-in-dataloader",
        "--rope-type",
        "rope",
        "--softmax-type",
        "vanilla",
        "--accumulate-allreduce-grads-in-fp32",
        "--main-params-dtype",
        "fp32",
        "--exp-avg-dtype",
        "fp32",
        "--exp-avg-sq-dtype",
        "fp32",
        "--cross-entropy-fusion-impl",
        "te",
        "--vocab-extra-ids",
        "0",
        "--trust-remote-code",
        "--head-lr-mult",
        "1.0",
    ]
    assert pretrain_gpt.parse_args(BASE + restated) == pretrain_gpt.parse_args(BASE)


def test_recompute_activations_is_selective_recomputation():
    spelled = pretrain_gpt.parse_args(BASE + ["--recompute-activations"]).training
    named = pretrain_gpt.parse_args(BASE + ["--recompute-granularity", "selective"]).training
    assert spelled.recompute_overrides() == named.recompute_overrides()
    assert spelled.recompute_overrides()["recompute_granularity"] == "selective"


def test_no_log_loss_scale_to_tensorboard_switches_the_loss_scale_off():
    assert pretrain_gpt.parse_args(BASE).logging.log_loss_scale_to_tensorboard
    quiet = pretrain_gpt.parse_args(BASE + ["--no-log-loss-scale-to-tensorboard"])
    assert not quiet.logging.log_loss_scale_to_tensorboard


@pytest.mark.parametrize(
    "flags, precision",
    [
        ([], "fp32"),
        (["--bf16"], "bf16"),
        (["--fp16"], "fp16"),
        (["--precision", "bf16"], "bf16"),
        (["--bf16", "--precision", "bf16"], "bf16"),
    ],
)
def test_megatron_precision_switches_set_the_precision(flags, precision):
    assert pretrain_gpt.parse_args(BASE + flags).training.precision == precision


def test_megatron_spellings_of_our_switches():
    assert not pretrain_gpt.parse_args(BASE + ["--no-rope-scaling"]).model.rope_scaling
    assert pretrain_gpt.parse_args(
        BASE + ["--no-rope-scaling", "--use-rope-scaling"]
    ).model.rope_scaling
    unfused = pretrain_gpt.parse_args(BASE + ["--no-fused-output-loss"])
    assert not unfused.training.fused_output_loss
    fused = pretrain_gpt.parse_args(
        BASE + ["--no-fused-output-loss", "--cross-entropy-loss-fusion"]
    )
    assert fused.training.fused_output_loss
    default = pretrain_gpt.parse_args(BASE)
    assert default.training.manual_gc_eval and default.logging.log_loss_scale_to_tensorboard
    disabled = pretrain_gpt.parse_args(
        BASE + ["--disable-manual-gc-eval", "--disable-log-loss-scale-to-tensorboard"]
    )
    assert not disabled.training.manual_gc_eval
    assert not disabled.logging.log_loss_scale_to_tensorboard


@pytest.mark.parametrize(
    "tp, flags, vocab",
    [
        (1, [], 131072),  # without the flag: the preset's vocabulary
        (
            2,
            ["--make-vocab-size-divisible-by", "128"],
            1024,
        ),  # the tokenizer's 1000, padded to 256s
        (1, ["--make-vocab-size-divisible-by", "7"], 1001),
        (2, ["--make-vocab-size-divisible-by", "128", "--vocab-size", "2048"], 2048),
        # Megatron-LM's: the vocabulary as given, neither padded nor the tokenizer's
        (2, ["--make-vocab-size-divisible-by", "128", "--padded-vocab-size", "1000"], 1000),
        (2, ["--make-vocab-size-divisible-by", "128", "--no-pad-vocab-size"], 131072),
        (1, ["--make-vocab-size-divisible-by", "7", "--disable-pad-vocab-size"], 131072),
    ],
)
def test_vocabulary_padding(tp, flags, vocab, tokenizer_dir):
    tokenizer = [
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(tokenizer_dir),
    ]
    cfg = pretrain_gpt.parse_args(
        BASE + tokenizer + flags + ["--tensor-model-parallel-size", str(tp)]
    )
    assert cfg.model.vocab_size == vocab


def test_encoder_spellings_are_the_gpt_models_shape():
    """Megatron-LM's GPT takes --encoder-num-layers and --encoder-seq-length for --num-layers and
    --seq-length; given with them, they must agree."""
    shape = ["--num-layers", "3", "--seq-length", "64"]
    spelled = ["--encoder-num-layers", "3", "--encoder-seq-length", "64"]
    ours = pretrain_gpt.parse_args(BASE + shape)
    assert (ours.model.num_layers, ours.model.seq_length) == (3, 64)
    assert pretrain_gpt.parse_args(BASE + spelled) == ours
    assert pretrain_gpt.parse_args(BASE + spelled + shape) == ours


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--encoder-num-layers", "3", "--num-layers", "2"],
            "--encoder-num-layers 3 contradicts --num-layers 2",
        ),
        (
            ["--encoder-seq-length", "64", "--seq-length", "32"],
            "--encoder-seq-length 64 contradicts --seq-length 32",
        ),
        (
            ["--padded-vocab-size", "1024", "--vocab-size", "2048"],
            "--padded-vocab-size 1024 contradicts --vocab-size 2048",
        ),
    ],
)
def test_contradicting_spellings_are_refused(flags, line, capsys):
    assert error_lines(capsys, BASE + flags) == [line]


def test_virtual_stages_per_pipeline_rank_is_megatron_lms_spelling():
    flags = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
    cfg = pretrain_gpt.parse_args(BASE + flags)
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2


@pytest.mark.parametrize("per_stage, stages", [(1, 2), (2, None)])
def test_layers_per_virtual_stage_become_virtual_stages(per_stage, stages):
    flags = [
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        str(per_stage),
    ]
    cfg = pretrain_gpt.parse_args(BASE + flags)
    assert cfg.parallel.virtual_pipeline_model_parallel_size == stages


def test_distributed_timeout_reaches_every_process_group():
    parallel.initialize(ParallelConfig(distributed_timeout_minutes=7), device="cpu", seed=1)
    try:
        from megatron.core import parallel_state

        groups = [
            torch.distributed.distributed_c10d._get_default_group(),
            parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_data_parallel_group(),
        ]
        for group in groups:
            backend = group._get_backend(torch.device("cpu"))
            assert backend.options._timeout.total_seconds() == 7 * 60
    finally:
        parallel.shutdown()


@pytest.mark.smoke
@pytest.mark.parametrize(
    "script, tasks, plan_line",
    [
        # 512 GPUs: DP 256 x micro-batch 4 divides the ramp-up's first global batch (1024).
        ("8b", "512", "TP 2 x PP 1 (virtual stages 1) x DP 256"),
        ("70b", "4096", "TP 4 x PP 8 (virtual stages 5) x DP 128"),
    ],
)
def test_dry_run_plans_the_apertus_layout_without_data(
    script, tasks, plan_line, tmp_path, apertus_hub_cache, capsys, monkeypatch
):
    """--dry-run prints the planner's layout for Slurm's task count; --data-path names nothing
    that exists, and nothing is read or written."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", tasks)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x128)")
    argv = sum(launch_args(script, tmp_path), [])
    with pytest.raises(SystemExit) as exit_:
        pretrain_gpt.parse_args(argv + ["--transformer-impl", "local", "--dry-run"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0, out
    assert plan_line in out and "OK: the layout is valid" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == []
