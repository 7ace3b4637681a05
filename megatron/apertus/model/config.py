"""Typed configuration of the Apertus architecture and of its parallel layout, and the
published shapes (:data:`PRESETS`).

``ApertusConfig`` describes the network only; ``ParallelConfig`` describes how it is split
over processes. :func:`validate_layout` checks the two against each other and against the
world size *before* anything is allocated, and names the offending argument in each error.
Both read their own flags (:class:`megatron.apertus.flags.SelfParsing`): the model starts from
``--model-preset`` and pads the tokenizer's vocabulary as Megatron-LM does, the layout takes
Megatron-LM's ``--num-layers-per-virtual-pipeline-stage`` and checks itself against the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Mapping

from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import (
    ADDITION_MARK,
    add_arguments,
    flag_help,
    from_arguments,
    require,
)
from megatron.apertus.ops.constants import XIELU_BETA, XIELU_EPS

if TYPE_CHECKING:
    import torch


@dataclass(kw_only=True, frozen=True)
class ApertusConfig:
    """The Apertus decoder: xIELU MLP, QK-norm, GQA, RoPE with llama3 scaling, RMSNorm."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Width of the residual stream."""
    ffn_hidden_size: int
    """Width of the non-gated xIELU MLP (1.5x what a SwiGLU MLP of the same cost would use)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA)."""
    vocab_size: int = 131072
    """Rows of the embedding and the output layer (the tokenizer's vocabulary, padded)."""
    seq_length: int = 4096
    """Tokens per training sample."""
    max_position_embeddings: int = 4096
    """Longest sequence the model is built for (at least --seq-length)."""
    rotary_base: int = 500000
    """RoPE base frequency."""
    rope_scaling: bool = field(default=True, metadata={"ours": True})
    """llama3 frequency scaling (low 1, high 4, original context 8192)."""
    rope_scaling_factor: float = 8.0
    """llama3 RoPE scaling factor."""
    norm_epsilon: float = 1e-5
    """Epsilon of every RMSNorm."""
    init_method_std: float = 0.008944
    """Standard deviation of the normal initialisation of the weights."""
    untie_embeddings_and_output_weights: bool = True
    """Separate input embedding and output layer weights (off: one shared matrix)."""
    qk_layernorm: bool = True
    """RMSNorm on queries and keys of every head (QK-norm)."""
    xielu_beta: float = field(default=XIELU_BETA, metadata={"ours": True})
    """xIELU's fixed beta (the linear coefficient of both branches)."""
    xielu_eps: float = field(default=XIELU_EPS, metadata={"ours": True})
    """xIELU's fixed epsilon (clamps the negative branch's input below 0)."""

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        positive = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
        for name in positive + ("num_query_groups", "vocab_size", "seq_length"):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}"
                )
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"--hidden-size ({self.hidden_size}) is not divisible by --num-attention-heads "
                f"({self.num_attention_heads}): every head needs the same width"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"--num-query-groups ({self.num_query_groups}) does not divide --num-attention-heads "
                f"({self.num_attention_heads}): GQA shares each key/value head among an equal number "
                "of query heads"
            )
        if self.seq_length > self.max_position_embeddings:
            raise ConfigError(
                f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                f"({self.max_position_embeddings})"
            )
        self._check_numbers()

    def _check_numbers(self) -> None:
        """Values that would build a model whose first step is not finite (or, for xIELU, no
        model at all): refused here, naming the flag, instead of a run that skips every step."""
        require(self.rotary_base > 0, "--rotary-base", self.rotary_base, "positive")
        rules = {
            "rope_scaling_factor": ("a finite number > 0", lambda v: v > 0),
            "norm_epsilon": ("a finite number >= 0", lambda v: v >= 0),
            "init_method_std": ("a finite number >= 0", lambda v: v >= 0),
            "xielu_beta": ("a finite number", lambda v: True),
            "xielu_eps": ("a finite number", lambda v: True),
        }
        for name, (rule, ok) in rules.items():
            value = getattr(self, name)
            require(math.isfinite(value) and ok(value), f"--{name.replace('_', '-')}", value, rule)

    def num_parameters(self) -> int:
        """Exact parameter count of the unsharded model."""
        h, f, kv = self.hidden_size, self.ffn_hidden_size, self.kv_channels
        qkv = h * kv * (self.num_attention_heads + 2 * self.num_query_groups)
        attention = qkv + self.num_attention_heads * kv * h + 2 * kv  # + q/k norms
        layer = attention + 2 * h * f + 2 + 2 * h  # MLP, xIELU alphas, two norms
        embeddings = self.vocab_size * h * (2 if self.untie_embeddings_and_output_weights else 1)
        return self.num_layers * layer + embeddings + h

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ApertusConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown model config fields: {', '.join(unknown)}")
        return cls(**values)

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser, title: str) -> None:
        """``--model-preset`` and the model flags, which override the preset's fields."""
        parser.add_argument(
            "--model-preset",
            default="tiny",
            choices=sorted(PRESETS),
            help="architecture to start from; any model flag below overrides it" + ADDITION_MARK,
        )
        model = add_arguments(parser, cls, title=title, defaults=False)
        model.add_argument(
            "--make-vocab-size-divisible-by",
            type=int,
            help="the model's vocabulary is the tokenizer's, padded to a multiple of this x "
            "--tensor-model-parallel-size (Megatron-LM's rule; with --vocab-size: checked to be "
            "one)",
        )
        for flag, ours in ENCODER_SPELLINGS.items():
            model.add_argument(
                flag,
                type=int,
                help=f"Megatron-LM's other spelling of {ours} (a GPT model is all encoder in "
                "its argument names); given both, they must agree",
            )
        model.add_argument(
            "--padded-vocab-size",
            type=int,
            help="the model's vocabulary exactly (Megatron-LM's: not padded, not read from the "
            "tokenizer); the same as --vocab-size here",
        )
        model.add_argument(
            "--no-pad-vocab-size",
            "--disable-pad-vocab-size",
            dest="pad_vocab_size",
            action="store_false",
            default=True,
            help="do not derive the vocabulary from the tokenizer (Megatron-LM's): it is "
            "--padded-vocab-size, --vocab-size, the --use-checkpoint-args checkpoint's or the "
            "preset's, and --make-vocab-size-divisible-by is not applied",
        )
        model.add_argument(
            "--kv-channels",
            type=int,
            help="the head dimension: accepted when it is --hidden-size / --num-attention-heads "
            "(the only one implemented), refused otherwise",
        )

    @classmethod
    def from_flags(
        cls, args: argparse.Namespace, prefix: str, built: Mapping[str, Any]
    ) -> ApertusConfig:
        """The preset, overridden by the model flags; ``--make-vocab-size-divisible-by`` pads
        the tokenizer's vocabulary as Megatron-LM does unless ``--vocab-size`` is given (then it
        checks).

        A parser without the tokenizer flags (the launch planner's) checks the preset's
        vocabulary instead of loading a tokenizer.
        """
        if args.vocab_size is None and getattr(args, "tokenizer_type", None) == "NullTokenizer":
            raise ConfigError(
                "--tokenizer-type NullTokenizer needs --vocab-size: its ids are 0 to --vocab-size - 1"
            )
        args = _megatron_spellings(args)
        model = from_arguments(cls, args, base=preset(args.model_preset))
        if args.kv_channels not in (None, model.kv_channels):
            raise ConfigError(
                f"--kv-channels {args.kv_channels}: the head dimension is --hidden-size / "
                f"--num-attention-heads ({model.kv_channels}) here; other head dimensions are "
                f"not implemented"
            )
        divisor = args.make_vocab_size_divisible_by
        if divisor is None or not args.pad_vocab_size or args.padded_vocab_size is not None:
            return model
        tp = args.tensor_model_parallel_size
        if args.vocab_size is None and "tokenizer_type" in args:
            vocab = padded_vocab_size(_tokenizer_vocab_size(args), divisor, tp)
            return dataclasses.replace(model, vocab_size=vocab)
        if padded_vocab_size(model.vocab_size, divisor, tp) != model.vocab_size:
            raise ConfigError(
                f"--make-vocab-size-divisible-by {divisor}: the vocabulary ({model.vocab_size}, "
                f"--vocab-size) is not a multiple of {divisor} x --tensor-model-parallel-size "
                f"({tp})"
            )
        return model


ENCODER_SPELLINGS = {"--encoder-num-layers": "--num-layers", "--encoder-seq-length": "--seq-length"}
"""Megatron-LM's encoder spellings of the model's shape: its ``validate_args`` takes each for the
other when only one is given (and asserts against both)."""


def _megatron_spellings(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with Megatron-LM's other spellings of the model's fields folded in:
    ``--encoder-num-layers``, ``--encoder-seq-length`` and ``--padded-vocab-size``; a spelling
    that contradicts the flag it restates is refused."""
    args = argparse.Namespace(**vars(args))
    spellings = {**ENCODER_SPELLINGS, "--padded-vocab-size": "--vocab-size"}
    for flag, ours in spellings.items():
        given, name = getattr(args, _dest(flag), None), _dest(ours)
        if given is None:
            continue
        if getattr(args, name) not in (None, given):
            raise ConfigError(f"{flag} {given} contradicts {ours} {getattr(args, name)}")
        setattr(args, name, given)
    return args


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


LONGEST_TIMEOUT_SECONDS = (2**63 - 1) // 10**9
"""The longest collective timeout torch.distributed holds: its backends count it in int64
nanoseconds (about 292 years), and a longer one fails inside gloo or NCCL with a traceback."""

CP_COMM_TYPES = ("p2p", "a2a", "a2a+p2p")
"""Megatron-LM's ``--cp-comm-type`` values this code runs and models."""


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """How the model is split: tensor, pipeline (optionally interleaved) and data parallel, and
    how its processes talk: the backend, each one's local device, how long a collective may
    wait."""

    tensor_model_parallel_size: int = 1
    """Processes that split each layer's weights (tensor parallelism)."""
    pipeline_model_parallel_size: int = 1
    """Processes that split the layers into consecutive stages (pipeline parallelism)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Interleaved pipeline: model chunks (virtual stages) per pipeline rank."""
    sequence_parallel: bool = False
    """With tensor parallelism: split norms and activations along the sequence as well."""
    context_parallel_size: int = flag_help(
        "ranks that share each sequence (context parallelism): the sequence is cut "
        "into 2 x this many chunks and rank i keeps chunks i and 2CP-1-i",
        1,
    )
    cp_comm_type: list[str] | str = flag_help(
        "attention under context parallelism: p2p (K/V passed around a ring), a2a "
        "(all-to-all between heads and sequence) or a2a+p2p (all-to-all within the first "
        "level of --hierarchical-context-parallel-sizes, ring over the second); one value for "
        "every layer or one per transformer layer",
        "p2p",
    )
    hierarchical_context_parallel_sizes: list[int] | None = flag_help(
        "sizes of the levels of hierarchical context parallelism (a2a+p2p: the all-to-all "
        "level, then the ring level); their product is --context-parallel-size",
        None,
    )
    distributed_timeout_minutes: int | None = flag_help(
        "timeout of collectives on every process group (default: torch's for the "
        "default group, megatron-core's 30 minutes for its groups)",
        None,
    )
    distributed_timeout_seconds_after_init: int | None = flag_help(
        "after this job's first training step (start-up, compilation and the first "
        "collectives are slow): the timeout of collectives on every process group, in seconds",
        None,
    )
    distributed_backend: Literal["nccl", "gloo"] | None = flag_help(
        "torch.distributed backend: nccl (CUDA only) or gloo; default: nccl on a GPU (Megatron-LM's "
        "default), gloo on the CPU",
        None,
    )
    local_rank: int | None = flag_help(
        "this process's rank on its node, as torch.distributed.launch passes it: the CUDA device "
        "it uses (default: $LOCAL_RANK, else 0; refused when it contradicts $LOCAL_RANK)",
        None,
    )

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if isinstance(self.cp_comm_type, (list, tuple)):
            # Megatron-LM's parsing: one value means every layer; a list stays one per layer.
            types = list(self.cp_comm_type)
            object.__setattr__(self, "cp_comm_type", types[0] if len(types) == 1 else types)
        for kind in self.cp_comm_types:
            if kind not in CP_COMM_TYPES:
                raise ConfigError(
                    f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got {kind!r}"
                )
        vp = self.virtual_pipeline_model_parallel_size
        if vp is not None and (vp < 1 or self.pipeline_model_parallel_size == 1):
            raise ConfigError(
                "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1 "
                f"(got PP={self.pipeline_model_parallel_size}, virtual stages={vp})"
            )
        if self.hierarchical_context_parallel_sizes is not None:
            object.__setattr__(
                self,
                "hierarchical_context_parallel_sizes",
                list(self.hierarchical_context_parallel_sizes),
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        timeout = self.distributed_timeout_minutes
        if timeout is not None and not 1 <= timeout <= LONGEST_TIMEOUT_SECONDS // 60:
            raise ConfigError(
                f"--distributed-timeout-minutes must be in [1, {LONGEST_TIMEOUT_SECONDS // 60}], "
                f"got {timeout}"
            )
        after_init = self.distributed_timeout_seconds_after_init
        if after_init is not None and not 1 <= after_init <= LONGEST_TIMEOUT_SECONDS:
            raise ConfigError(
                f"--distributed-timeout-seconds-after-init must be in "
                f"[1, {LONGEST_TIMEOUT_SECONDS}], got {after_init}"
            )
        if self.local_rank is not None and self.local_rank < 0:
            raise ConfigError(f"--local-rank must be >= 0, got {self.local_rank}")

    @property
    def cp_comm_types(self) -> list[str]:
        """The distinct ``--cp-comm-type`` values, in order of first use."""
        kinds = self.cp_comm_type if isinstance(self.cp_comm_type, list) else [self.cp_comm_type]
        return list(dict.fromkeys(kinds))

    def layer_cp_comm_type(self, layer: int) -> str:
        """The comm type of transformer layer ``layer`` (0-based, counted over the whole
        model): Megatron-LM's per-layer list has one entry per layer, in order."""
        kinds = self.cp_comm_type
        return kinds[layer] if isinstance(kinds, list) else kinds

    @property
    def a2a_level_size(self) -> int:
        """Ranks of the hierarchical all-to-all level (1 without hierarchical sizes)."""
        sizes = self.hierarchical_context_parallel_sizes
        return sizes[0] if sizes else 1

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser, title: str) -> None:
        """The layout flags and Megatron-LM's ``--num-layers-per-virtual-pipeline-stage``."""
        layout = add_arguments(parser, cls, title=title)
        layout.add_argument(
            "--num-layers-per-virtual-pipeline-stage",
            type=int,
            help="interleaved pipeline: layers per virtual stage (sets "
            "--virtual-pipeline-model-parallel-size to --num-layers / PP / this)",
        )

    @classmethod
    def from_flags(
        cls, args: argparse.Namespace, prefix: str, built: Mapping[str, Any]
    ) -> ParallelConfig:
        """The layout flags, checked against ``built["model"]``; Megatron-LM's
        ``--num-layers-per-virtual-pipeline-stage`` becomes the number of virtual stages per
        pipeline rank."""
        model = built["model"]
        parallel = from_arguments(cls, args)
        validate_context_parallel(model, parallel)
        per_stage = args.num_layers_per_virtual_pipeline_stage
        if per_stage is None:
            return parallel
        if parallel.virtual_pipeline_model_parallel_size is not None:
            raise ConfigError(
                "give --num-layers-per-virtual-pipeline-stage or "
                "--virtual-pipeline-model-parallel-size, not both"
            )
        stages = virtual_stages(model.num_layers, parallel.pipeline_model_parallel_size, per_stage)
        return dataclasses.replace(parallel, virtual_pipeline_model_parallel_size=stages)


def validate_layout(model: ApertusConfig, parallel: ParallelConfig, world_size: int) -> int:
    """Check that ``model`` can be split as ``parallel`` over ``world_size`` ranks.

    Returns the data-parallel size. Raises :class:`ConfigError` naming the argument.
    """
    tp = parallel.tensor_model_parallel_size
    pp = parallel.pipeline_model_parallel_size
    vp = parallel.virtual_pipeline_model_parallel_size or 1
    checks = [
        (
            model.num_attention_heads,
            "--num-attention-heads",
            "attention heads are split over TP ranks",
        ),
        (model.num_query_groups, "--num-query-groups", "key/value heads are split over TP ranks"),
        (
            model.ffn_hidden_size,
            "--ffn-hidden-size",
            "the MLP's fc1 columns are split over TP ranks",
        ),
        (
            model.vocab_size,
            "--vocab-size (padded tokenizer vocabulary)",
            "the vocabulary is split over TP ranks",
        ),
    ]
    for value, arg, why in checks:
        if value % tp:
            raise ConfigError(
                f"{arg} ({value}) is not divisible by --tensor-model-parallel-size ({tp}): {why}"
            )
    if model.num_layers % (pp * vp):
        what = f"--pipeline-model-parallel-size ({pp})"
        if vp > 1:
            what += f" x virtual stages ({vp})"
        raise ConfigError(
            f"--num-layers ({model.num_layers}) is not divisible by {what}: every pipeline stage "
            "needs the same number of layers"
        )
    validate_context_parallel(model, parallel)
    cp = parallel.context_parallel_size
    if world_size % (tp * pp * cp):
        raise ConfigError(
            f"world size ({world_size}) is not divisible by --tensor-model-parallel-size ({tp}) x "
            f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}); the rest is "
            "the data-parallel size"
        )
    return world_size // (tp * pp * cp)


def context_parallel_problems(
    model: ApertusConfig, parallel: ParallelConfig, impl: str = "local"
) -> list[str]:
    """Every reason ``parallel``'s context parallelism cannot run ``model`` under the
    transformer implementation ``impl``, one line each: the rule the trainer and the launch
    planner share.

    The sequence splits into 2 x CP equal chunks. ``--hierarchical-context-parallel-sizes``
    multiply to CP; ``a2a+p2p`` needs two of them (the all-to-all level, the ring level). A
    per-layer ``--cp-comm-type`` list has one entry per transformer layer. An all-to-all splits
    each tensor-parallel rank's attention heads over its ranks (CP for ``a2a``, the first level
    for ``a2a+p2p``); Transformer Engine's splits K/V's query groups too (its kernel asserts
    it), while the local implementation repeats K/V per query head first.
    """
    cp = parallel.context_parallel_size
    kinds = parallel.cp_comm_types
    problems = _comm_type_problems(model, parallel)
    if cp == 1 or problems:
        return problems
    if model.seq_length % (2 * cp):
        return [
            f"--seq-length ({model.seq_length}) is not divisible by 2 x --context-parallel-size "
            f"({cp}): each rank keeps two of 2 x CP equal chunks"
        ]
    splits = [(kind, cp if kind == "a2a" else parallel.a2a_level_size) for kind in kinds]
    return [
        line
        for kind, ranks in splits
        if kind != "p2p"
        for line in _head_split_problems(model, parallel, kind, ranks, impl)
    ]


def _comm_type_problems(model: ApertusConfig, parallel: ParallelConfig) -> list[str]:
    """The comm-type list and the hierarchical sizes against the model and CP."""
    cp, sizes = parallel.context_parallel_size, parallel.hierarchical_context_parallel_sizes
    kinds = parallel.cp_comm_type
    problems = []
    if isinstance(kinds, list) and len(kinds) != model.num_layers:
        problems.append(
            f"--cp-comm-type lists {len(kinds)} values for --num-layers ({model.num_layers}): "
            "give one value, or one per transformer layer"
        )
    if sizes is not None:
        if min(sizes) < 1 or math.prod(sizes) != cp:
            product = " x ".join(map(str, sizes))
            problems.append(
                f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: the product "
                f"{product} = {math.prod(sizes)} is not --context-parallel-size ({cp})"
            )
    if "a2a+p2p" in parallel.cp_comm_types:
        if sizes is None:
            problems.append(
                "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P "
                "(all-to-all level, ring level; A x P = --context-parallel-size)"
            )
        elif len(sizes) != 2:
            problems.append(
                f"--cp-comm-type a2a+p2p needs two --hierarchical-context-parallel-sizes (the "
                f"all-to-all level, the ring level), got {len(sizes)}"
            )
    return problems


def _head_split_problems(
    model: ApertusConfig, parallel: ParallelConfig, kind: str, ranks: int, impl: str
) -> list[str]:
    """Heads (and under TE query groups) of a TP rank over the ``ranks`` of an all-to-all."""
    tp = parallel.tensor_model_parallel_size
    over = (
        f"--context-parallel-size ({ranks})"
        if kind == "a2a"
        else f"the all-to-all level of --hierarchical-context-parallel-sizes ({ranks})"
    )
    fix = "use --cp-comm-type p2p" if kind == "a2a" else "use a smaller all-to-all level"
    split = [(model.num_attention_heads, "--num-attention-heads", "")]
    if impl == "transformer_engine":
        split.append((model.num_query_groups, "--num-query-groups", " (Transformer Engine)"))
    return [
        f"--cp-comm-type {kind}: {flag} ({value}) / --tensor-model-parallel-size ({tp}) = "
        f"{value // tp} per rank is not divisible by {over}, over which "
        f"the all-to-all{who} splits them; {fix}"
        for value, flag, who in split
        if (value // tp) % ranks
    ]


def validate_context_parallel(
    model: ApertusConfig, parallel: ParallelConfig, impl: str = "local"
) -> None:
    """:func:`context_parallel_problems`, the first one raised."""
    problems = context_parallel_problems(model, parallel, impl)
    if problems:
        raise ConfigError(problems[0])


def virtual_stages(num_layers: int, pipeline: int, layers_per_virtual_stage: int) -> int | None:
    """Megatron-LM's ``--num-layers-per-virtual-pipeline-stage`` as virtual stages per pipeline
    rank (our ``virtual_pipeline_model_parallel_size``); None when each rank holds one stage, the
    plain (non-interleaved) schedule, which computes the same as an interleaved one of one chunk.
    """
    flag = f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage}"
    if layers_per_virtual_stage < 1:
        raise ConfigError(f"{flag}: must be >= 1")
    if pipeline == 1:
        raise ConfigError(f"{flag} needs --pipeline-model-parallel-size > 1")
    if num_layers % pipeline:
        raise ConfigError(
            f"--num-layers ({num_layers}) is not divisible by --pipeline-model-parallel-size "
            f"({pipeline}): every pipeline stage needs the same number of layers"
        )
    per_stage = num_layers // pipeline
    if per_stage % layers_per_virtual_stage:
        raise ConfigError(
            f"{flag} does not divide the {per_stage} layers of each pipeline stage "
            f"(--num-layers {num_layers} / --pipeline-model-parallel-size {pipeline})"
        )
    stages = per_stage // layers_per_virtual_stage
    return stages if stages > 1 else None


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron-LM's padded vocabulary: ``vocab_size`` rounded up to a multiple of
    ``divisible_by`` x the tensor-parallel size, so every TP rank holds an equal, aligned slice."""
    if divisible_by < 1:
        raise ConfigError(f"--make-vocab-size-divisible-by must be >= 1, got {divisible_by}")
    if tensor_parallel < 1:  # read here before the parallel config checks it
        raise ConfigError(f"--tensor-model-parallel-size must be >= 1, got {tensor_parallel}")
    multiple = divisible_by * tensor_parallel
    return math.ceil(vocab_size / multiple) * multiple


def dtype_from_name(name: str) -> torch.dtype:
    import torch  # here, not at the top: the configs above serve --help without torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name not in dtypes:
        raise ConfigError(f"unknown precision {name!r}; choose one of {', '.join(dtypes)}")
    return dtypes[name]


def _tokenizer_vocab_size(args: argparse.Namespace) -> int:
    # here, not at the top: the tokenizers load only for a vocabulary padded from one
    from megatron.apertus.tokenizer.tokenizers import checked_tokenizer

    return checked_tokenizer(args.tokenizer_type, args.tokenizer_model).vocab_size


# -- published shapes (docs/recipe.md) and a tiny model for tests and the demo ----------------


PRESETS: dict[str, ApertusConfig] = {
    "apertus-8b": ApertusConfig(
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=21504,
        num_attention_heads=32,
        num_query_groups=8,
    ),
    "apertus-70b": ApertusConfig(
        num_layers=80,
        hidden_size=8192,
        ffn_hidden_size=43008,
        num_attention_heads=64,
        num_query_groups=8,
    ),
    "apertus-v1.1-0.5b": ApertusConfig(
        num_layers=20,
        hidden_size=1024,
        ffn_hidden_size=6144,
        num_attention_heads=16,
        num_query_groups=4,
        untie_embeddings_and_output_weights=False,
    ),
    "apertus-v1.1-1.5b": ApertusConfig(
        num_layers=16,
        hidden_size=2048,
        ffn_hidden_size=12288,
        num_attention_heads=32,
        num_query_groups=8,
    ),
    "apertus-v1.1-4b": ApertusConfig(
        num_layers=24,
        hidden_size=3072,
        ffn_hidden_size=16384,
        num_attention_heads=24,
        num_query_groups=8,
    ),
    # Same architecture, CPU-sized: 4 layers so that PP=2 and PP=2 x 2 virtual stages split evenly,
    # 4 query heads over 2 kv heads so that TP=2 keeps GQA.
    "tiny": ApertusConfig(
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=192,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=128,
        max_position_embeddings=4096,
    ),
}


def preset(name: str, **overrides) -> ApertusConfig:
    """A preset by name, with fields overridden (e.g. ``seq_length=256``)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown --model-preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
