"""Megatron-LM flags that no config of ours has a field for: accepted where they restate what
this code always does, refused where they ask for something it does not implement.

Megatron-LM launch scripts (the Apertus 8B and 70B ones among them) carry two kinds of such
flags: restatements of the architecture (``--xielu``, ``--normalization RMSNorm``) and choices
that name our only behaviour (``--ckpt-format torch_dist``, ``--use-dist-ckpt``,
``--dataloader-type single``). They are accepted, so such scripts run unmodified; any other value (``--normalization LayerNorm``,
``--swiglu``, dropout) is refused, all of them at once, one line each naming the flag, so a
script learns in one try what to drop.

Nothing here changes a run. Megatron-LM flags that do change one are fields of the run's configs
(``--bf16``, ``--use-rope-scaling``, ``--make-vocab-size-divisible-by``,
``--num-layers-per-virtual-pipeline-stage``, ``--distributed-timeout-minutes``, ``--finetune``,
``--manual-gc``, ``--log-params-norm``, ``--overlap-grad-reduce``, ``--async-save``,
``--num-workers``, ``--log-progress``, ``--loss-scale``, ``--use-cpu-initialization``,
``--data-parallel-random-init``, ``--distributed-backend``, ``--local-rank`` ...).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

SWITCH = (True,)
"""``accepts`` of a switch that restates what we do."""


@dataclass(frozen=True)
class MegatronFlag:
    """One Megatron-LM flag, and which of its values are what this code does."""

    flag: str
    meaning: str = ""
    """What the accepted values mean here."""
    refusal: str = ""
    """Why any other value (a switch: the switch itself) is refused."""
    takes: type | None = None
    """Type of the flag's value; None for a switch."""
    accepts: tuple = ()
    """Values that are what this code does (a switch that restates it: ``SWITCH``); none: the
    flag is always refused."""
    choices: tuple | None = None
    """Megatron-LM's choices, where it restricts them."""

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def refused(self, value) -> str | None:
        """The refusal line for ``value`` as parsed (None: not given, or accepted)."""
        if value is None or value in self.accepts:
            return None
        given = self.flag if self.takes is None else f"{self.flag} {value}"
        return f"{given}: {self.refusal}"

    def help(self) -> str:
        if not self.accepts:
            return f"Megatron-LM's; refused: {self.refusal}"
        if self.takes is None or self.accepts == self.choices:
            return f"Megatron-LM's; accepted: {self.meaning}"
        values = ", ".join(str(v) for v in self.accepts)
        return f"Megatron-LM's; {values}: {self.meaning}; other values refused: {self.refusal}"


NOT_YET = "not implemented yet"
STRICTNESS = (
    "assume_ok_unexpected",
    "log_unexpected",
    "log_all",
    "raise_unexpected",
    "raise_all",
    "return_unexpected",
    "return_all",
    "ignore_all",
)
"""megatron-core's ``StrictHandling`` values, spelled out so that parsing flags needs no
megatron-core (a test compares them with the library's)."""

FLAGS: tuple[MegatronFlag, ...] = (
    # -- the architecture, restated ------------------------------------------------------------
    MegatronFlag("--xielu", "the MLP is xIELU (always)", accepts=SWITCH),
    MegatronFlag(
        "--swiglu", refusal="the Apertus MLP is xIELU, not gated; SwiGLU is not " "implemented"
    ),
    MegatronFlag(
        "--normalization",
        "every norm is RMSNorm (always)",
        "only RMSNorm is implemented",
        takes=str,
        accepts=("RMSNorm",),
    ),
    MegatronFlag(
        "--position-embedding-type",
        "rotary position embeddings (always)",
        "only rope is implemented",
        takes=str,
        accepts=("rope",),
    ),
    MegatronFlag(
        "--group-query-attention", "key/value heads from --num-query-groups", accepts=SWITCH
    ),
    MegatronFlag(
        "--disable-bias-linear", "the linear layers have no biases (always)", accepts=SWITCH
    ),
    MegatronFlag(
        "--use-mcore-models", "the model is megatron-core's GPTModel (always)", accepts=SWITCH
    ),
    MegatronFlag(
        "--use-rotary-position-embeddings",
        "rotary position embeddings (always; Megatron-LM's older spelling of "
        "--position-embedding-type rope)",
        accepts=SWITCH,
    ),
    MegatronFlag(
        "--no-position-embedding",
        "no learned absolute position embedding (always: positions are rotary)",
        accepts=SWITCH,
    ),
    MegatronFlag(
        "--rotary-percent",
        "rotary embeddings turn the whole head dimension",
        "partial rotary embeddings are not implemented",
        takes=float,
        accepts=(1.0,),
    ),
    MegatronFlag(
        "--apply-layernorm-1p",
        refusal="the RMSNorm weights are the scale itself; zero-centred (1 + weight) norms are "
        "not implemented",
    ),
    MegatronFlag("--add-qkv-bias", refusal="the linear layers have no biases"),
    *(
        MegatronFlag(flag, refusal=f"the Apertus MLP is xIELU; {name} is not implemented")
        for flag, name in (
            ("--openai-gelu", "GeLU"),
            ("--squared-relu", "squared ReLU"),
            ("--quick-geglu", "quick GeGLU"),
        )
    ),
    MegatronFlag(
        "--qknorm-impl",
        "picks the QK RMSNorm's kernels in Megatron-LM; here "
        "--transformer-impl does (the same RMSNorm)",
        takes=str,
        accepts=("apex", "torch", "te"),
        choices=("apex", "torch", "te"),
    ),
    MegatronFlag(
        "--apply-residual-connection-post-layernorm",
        refusal="the Apertus blocks are pre-norm (the residual bypasses the norm); BERT's "
        "post-norm residual is not implemented",
    ),
    MegatronFlag(
        "--fp32-residual-connection",
        refusal="the residual stream is in the parameters' dtype; an fp32 residual is not "
        "implemented",
    ),
    MegatronFlag(
        "--init-method-xavier-uniform",
        refusal="weights are initialised normal(0, --init-method-std); Xavier initialisation "
        "is not implemented",
    ),
    MegatronFlag(
        "--qk-l2-norm",
        refusal="queries and keys are RMS-normalised with learned scales (--qk-layernorm); "
        "Llama 4's L2 norm is not implemented",
    ),
    MegatronFlag(
        "--rope-type",
        "rotary position embeddings (always; the scaling is llama3's, --use-rope-scaling)",
        "YaRN is not implemented",
        takes=str,
        accepts=("rope",),
        choices=("rope", "yarn"),
    ),
    MegatronFlag(
        "--rotary-interleaved",
        refusal="rotary embeddings turn the two halves of each head (Llama's layout); "
        "interleaved pairs are not implemented",
    ),
    MegatronFlag(
        "--rotary-seq-len-interpolation-factor",
        refusal="linear position interpolation is not implemented; the RoPE scaling is "
        "llama3's (--use-rope-scaling, --rope-scaling-factor)",
        takes=int,
    ),
    MegatronFlag(
        "--softmax-type",
        "the attention softmax is the standard one (always)",
        "off-by-one and learnable softmax are not implemented",
        takes=str,
        accepts=("vanilla",),
        choices=("vanilla", "off-by-one", "learnable"),
    ),
    MegatronFlag(
        "--embedding-init-method-std",
        refusal="the embeddings initialise normal(0, --init-method-std) like every weight; a "
        "separate standard deviation is " + NOT_YET,
        takes=float,
    ),
    MegatronFlag(
        "--window-size",
        refusal="every layer attends to the whole causal context; sliding-window attention is "
        "not implemented",
        takes=str,
    ),
    *(
        MegatronFlag(
            flag,
            refusal="uneven pipeline stages are not implemented: every stage holds --num-layers "
            "/ --pipeline-model-parallel-size layers",
            takes=takes,
        )
        for flag, takes in (
            ("--decoder-first-pipeline-num-layers", int),
            ("--decoder-last-pipeline-num-layers", int),
            ("--pipeline-model-parallel-layout", str),
            ("--account-for-embedding-in-pipeline-split", None),
            ("--account-for-loss-in-pipeline-split", None),
        )
    ),
    MegatronFlag(
        "--no-rope-freq",
        refusal="every layer applies rotary embeddings; layers without them (NoPE) are not "
        "implemented",
        takes=str,
    ),
    *(
        MegatronFlag(
            flag,
            refusal=f"the {what} of Megatron-LM's T5 encoder-decoder; a GPT model's is {ours}",
            takes=int,
        )
        for flag, what, ours in (
            ("--decoder-num-layers", "decoder layers", "--num-layers"),
            ("--decoder-seq-length", "decoder sequence length", "--seq-length"),
        )
    ),
    # -- fusions: megatron-core's own kernels, which this model does not use --------------------
    *(
        MegatronFlag(flag, f"{what} (always)", accepts=SWITCH)
        for flag, what in (
            (
                "--no-masked-softmax-fusion",
                "megatron-core's fused masked softmax is off; the attention backend computes "
                "its own softmax",
            ),
            ("--no-bias-dropout-fusion", "no bias-dropout-add fusion: no biases, no dropout"),
            ("--no-bias-swiglu-fusion", "no bias-SwiGLU fusion: the MLP is xIELU, without biases"),
            ("--no-bias-gelu-fusion", "no bias-GeLU fusion: the MLP is xIELU, without biases"),
            ("--no-persist-layer-norm", "no persistent LayerNorm kernel: the norms are RMSNorm"),
        )
    ),
    MegatronFlag(
        "--attention-softmax-in-fp32",
        "the attention softmax is computed in fp32 (always)",
        accepts=SWITCH,
    ),
    MegatronFlag(
        "--apply-query-key-layer-scaling",
        refusal="fp16 query-key layer scaling is not implemented (the QK RMSNorm bounds the "
        "attention logits)",
    ),
    MegatronFlag(
        "--use-flash-attn",
        refusal="Megatron-LM's deprecated spelling; give --attention-backend flash",
    ),
    # -- precision, regularisation, data order --------------------------------------------------
    MegatronFlag(
        "--main-grads-dtype",
        "gradients accumulate and reduce in fp32 (always)",
        "bf16 main gradients are " + NOT_YET,
        takes=str,
        accepts=("fp32",),
        choices=("fp32", "bf16"),
    ),
    MegatronFlag(
        "--accumulate-allreduce-grads-in-fp32",
        "gradients accumulate and reduce in fp32 (always)",
        accepts=SWITCH,
    ),
    MegatronFlag(
        "--grad-reduce-in-bf16",
        refusal="gradients reduce in fp32 (always); a bf16 reduction is " + NOT_YET,
    ),
    MegatronFlag(
        "--use-precision-aware-optimizer",
        refusal="the optimizer keeps fp32 main parameters and moments; Transformer Engine's "
        "precision-aware optimizer is " + NOT_YET,
    ),
    *(
        MegatronFlag(
            flag,
            f"the optimizer keeps its {what} in fp32 (always)",
            "lower-precision optimizer state (--use-precision-aware-optimizer) is " + NOT_YET,
            takes=str,
            accepts=("fp32",),
            choices=choices,
        )
        for flag, what, choices in (
            ("--main-params-dtype", "main parameters", ("fp32", "fp16")),
            ("--exp-avg-dtype", "first moments", ("fp32", "fp16", "bf16", "fp8")),
            ("--exp-avg-sq-dtype", "second moments", ("fp32", "fp16", "bf16", "fp8")),
        )
    ),
    MegatronFlag(
        "--fp16-lm-cross-entropy",
        refusal="the output layer's loss is computed in fp32 (always)",
    ),
    MegatronFlag(
        "--cross-entropy-fusion-impl",
        "picks the fused cross-entropy's kernels in Megatron-LM; here the fused output layer "
        "and loss (--cross-entropy-loss-fusion) has its own",
        takes=str,
        accepts=("native", "te"),
        choices=("native", "te"),
    ),
    MegatronFlag(
        "--tp-comm-overlap",
        refusal="Transformer Engine's userbuffer overlap of tensor-parallel communication is "
        + NOT_YET,
    ),
    MegatronFlag(
        "--attention-dropout",
        "no attention dropout (always)",
        "dropout is " + NOT_YET,
        takes=float,
        accepts=(0.0,),
    ),
    MegatronFlag(
        "--hidden-dropout",
        "no hidden dropout (always)",
        "dropout is " + NOT_YET,
        takes=float,
        accepts=(0.0,),
    ),
    MegatronFlag(
        "--no-check-for-nan-in-loss-and-grad",
        "changes nothing: every step checks its loss and gradient norm, a non-finite "
        "step is skipped (weights untouched) and --max-skipped-steps of them in a row "
        "stop the run (Megatron-LM without the check would apply the update)",
        accepts=SWITCH,
    ),
    MegatronFlag(
        "--no-create-attention-mask-in-dataloader",
        "the data loader never builds attention masks (always): the attention is causal, and "
        "packed documents travel as sequence boundaries",
        accepts=SWITCH,
    ),
    MegatronFlag(
        "--dataloader-type",
        "each step reads the next global batch in order, split "
        "over the data-parallel ranks (Megatron-LM's single sampler)",
        "only single is implemented",
        takes=str,
        accepts=("single",),
        choices=("single", "cyclic", "external"),
    ),
    # -- spellings Megatron-LM removed, and tokenizer files --------------------------------------
    MegatronFlag(
        "--batch-size", refusal="Megatron-LM's removed spelling; give --micro-batch-size", takes=int
    ),
    MegatronFlag(
        "--model-parallel-size",
        refusal="Megatron-LM's removed spelling; give --tensor-model-parallel-size",
        takes=int,
    ),
    MegatronFlag(
        "--checkpoint-activations",
        refusal="Megatron-LM's removed spelling; give --recompute-activations, or "
        "--recompute-granularity and --recompute-method",
    ),
    *(
        MegatronFlag(
            flag,
            refusal="GPT-2 BPE vocabulary files are not read here; give the tokenizer's "
            "tokenizer.json with --tokenizer-type HuggingFaceTokenizer --tokenizer-model",
            takes=str,
        )
        for flag in ("--vocab-file", "--merge-file")
    ),
    MegatronFlag(
        "--trust-remote-code",
        "changes nothing: no tokenizer code runs here (HuggingFaceTokenizer reads "
        "tokenizer.json with the tokenizers library)",
        accepts=SWITCH,
    ),
    MegatronFlag(
        "--tokenizer-hf-no-use-fast",
        refusal="HuggingFaceTokenizer is the fast tokenizer of a tokenizer.json; slow Python "
        "tokenizers are not implemented",
    ),
    MegatronFlag(
        "--vocab-extra-ids",
        "no extra vocabulary ids (T5's span-masking sentinels)",
        "extra vocabulary ids (T5's span masking) are not implemented",
        takes=int,
        accepts=(0,),
    ),
    MegatronFlag(
        "--head-lr-mult",
        "no effect: Megatron-LM's GPT training never reads it (it scales the learning rate of "
        "its vision fine-tuning's classification head)",
        "Megatron-LM's GPT training ignores it (the head of its vision fine-tuning); the output "
        "layer's own learning rate is --decoupled-lr",
        takes=float,
        accepts=(1.0,),
    ),
    MegatronFlag(
        "--init-model-with-meta-device",
        refusal="meta-device initialisation serves Megatron FSDP's sharded parameters, which "
        "are not implemented here",
    ),
    MegatronFlag(
        "--load-main-params-from-ckpt",
        refusal="the fp32 main parameters of a --no-load-optim load start from the loaded "
        "weights; reading them from the checkpoint instead is " + NOT_YET,
    ),
    # -- checkpoints ---------------------------------------------------------------------------
    MegatronFlag(
        "--ckpt-format",
        "megatron-core torch_dist checkpoints (always)",
        "only torch_dist is implemented",
        takes=str,
        accepts=("torch_dist",),
    ),
    MegatronFlag(
        "--use-dist-ckpt",
        "checkpoints are megatron-core's distributed (torch_dist) ones (always; deprecated "
        "in Megatron-LM, where --ckpt-format decides)",
        accepts=SWITCH,
    ),
    MegatronFlag(
        "--dist-ckpt-format",
        "megatron-core torch_dist checkpoints (always; deprecated in Megatron-LM, where "
        "--ckpt-format decides)",
        "only torch_dist is implemented",
        takes=str,
        accepts=("torch_dist",),
    ),
    MegatronFlag(
        "--auto-detect-ckpt-format",
        "a --load checkpoint is always checked before it is read: this code's torch_dist "
        "checkpoints load, any other (Megatron-LM's legacy torch format among them) is refused "
        "in one line",
        accepts=SWITCH,
    ),
    MegatronFlag(
        "--dist-ckpt-strictness",
        "a load fails when the checkpoint lacks a tensor the "
        "model needs (Transformer Engine's FP8 _extra_state excepted) and ignores "
        "tensors the model does not use (always)",
        "loads always fail on missing tensors and ignore extra ones",
        takes=str,
        accepts=("assume_ok_unexpected", "raise_unexpected"),
        choices=STRICTNESS,
    ),
    # -- the command line itself ---------------------------------------------------------------
    MegatronFlag(
        "--yaml-cfg",
        refusal="Megatron-LM's experimental YAML file (a nested schema of its own that replaces "
        "the whole command line) is not implemented; give the flags on the command line, a long "
        "blend in --data-args-path",
        takes=str,
    ),
    MegatronFlag(
        "--dataloader-inter-document-masking",
        refusal="give --reset-attention-mask --reset-position-ids: they pass each micro-batch's "
        "document boundaries as cu_seqlens (THD) so that attention stays within each document, "
        "and restart the positions per document, which this flag alone does not",
    ),
    MegatronFlag(
        "--fp8-interval",
        "changes nothing: deprecated in Megatron-LM, ignored by Transformer Engine from 1.8 on",
        "deprecated in Megatron-LM and ignored by Transformer Engine from 1.8 on (the FP8 "
        "scales follow the recipe at every step)",
        takes=int,
        accepts=(1,),
    ),
    MegatronFlag(
        "--disable-gloo-process-groups",
        refusal="megatron-core's gloo process groups are made with the others: a CPU run's "
        "groups are all gloo, and leaving them out of a GPU run is " + NOT_YET,
    ),
    # -- logging -------------------------------------------------------------------------------
    MegatronFlag(
        "--log-energy",
        refusal="the GPUs' energy is read through NVML (a CPU run has none); logging it is "
        + NOT_YET,
    ),
    MegatronFlag(
        "--log-throughput",
        "the iteration line always has tokens/s and TFLOP/s per "
        "device (Megatron-LM's 'throughput per GPU'), and MFU on GPUs of known peak",
        accepts=SWITCH,
    ),
)


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """Recognise every flag of :data:`FLAGS` (absent ones parse as None)."""
    group = parser.add_argument_group(
        "Megatron-LM flags without a setting here (restatements accepted, the rest refused)"
    )
    for entry in FLAGS:
        if entry.takes is None:
            group.add_argument(entry.flag, action="store_true", default=None, help=entry.help())
        else:
            group.add_argument(
                entry.flag, type=entry.takes, choices=entry.choices, default=None, help=entry.help()
            )


def refusals(args: argparse.Namespace) -> list[str]:
    """One line per flag of ``args`` that asks for something this code does not do."""
    lines = [line for entry in FLAGS if (line := entry.refused(getattr(args, entry.dest)))]
    if args.group_query_attention and args.num_query_groups is None:
        lines.append(
            "--group-query-attention: needs --num-query-groups (Megatron-LM would use 1 key/value "
            "head; the preset's number is not assumed)"
        )
    return lines
