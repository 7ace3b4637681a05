"""What every process that drives a model builds first: device, process groups, tokenizer,
pretraining datasets and model chunks.

The training loop (:class:`megatron.apertus.training.loop.Trainer`) and the teacher-logit runner
(:mod:`megatron.apertus.training.teacher_logits`) build these here, from the same config groups,
so that they cannot drift apart: the teacher's store is keyed by the positions of the student's
dataset, which both take from :func:`pretraining_datasets` with the student's flags.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron.apertus import parallel
from megatron.apertus.data.config import DataConfig
from megatron.apertus.data.datasets import DatasetConfig, build_datasets
from megatron.apertus.errors import ConfigError, out_of_memory
from megatron.apertus.model.builder import build_model
from megatron.apertus.model.config import (
    ApertusConfig,
    ParallelConfig,
    dtype_from_name,
    validate_context_parallel,
)
from megatron.apertus.model.engine import (
    EngineConfig,
    deterministic_core_attention,
    enable_deterministic_mode,
    select_te_attention_backend,
    validate_engine,
)
from megatron.apertus.prep.corpus import embedded_corpus_prefix
from megatron.apertus.tokenizer.tokenizers import Tokenizer, build_tokenizer, null_tokenizer
from megatron.apertus.training.loop_config import TrainingConfig
from megatron.apertus.training.run_log import warn_if_slow_precision


@dataclass(kw_only=True, frozen=True)
class Runtime:
    """The device and process groups of this process, once they exist."""

    device_name: str
    """``cuda`` or ``cpu``."""
    dp: int
    """The data-parallel size (context-parallel ranks share their data and are not counted)."""
    groups: ProcessGroupCollection
    """megatron-core's process groups of this process, built once after they exist and passed
    to the model chunks and every component that communicates."""
    transformer_impl: str | None = None
    """The transformer implementation the engine config chose (None: the builder's default)."""
    engine: EngineConfig | None = None
    """The engine flags as this machine runs them (None: the builder's default)."""

    @property
    def device(self) -> torch.device:
        """This rank's device (the current CUDA device, which the process-group setup chose)."""
        if self.device_name == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def start(
    layout: ParallelConfig,
    *,
    model: ApertusConfig,
    training: TrainingConfig,
    engine: EngineConfig | None = None,
    packed_documents: bool = False,
    te_rng_tracker: bool = False,
) -> Runtime:
    """Resolve the device, set up the transformer engine (when ``engine`` is given: it is
    checked before any process group exists), the process groups and the seeds.
    ``packed_documents`` (the run's ``--reset-attention-mask``) decides which core attention a
    deterministic TE run can use; ``te_rng_tracker``: Transformer Engine's RNG tracker, which
    CUDA graphs need."""
    device_name = parallel.resolve_device(training.device)
    transformer_impl = None
    if engine is not None:
        transformer_impl = validate_engine(engine, device=device_name, num_layers=model.num_layers)
        validate_context_parallel(model, layout, transformer_impl)
        engine = deterministic_core_attention(
            engine, transformer_impl, packed_documents=packed_documents
        )
        _apply_engine(engine, transformer_impl)
    dp = parallel.initialize(
        layout,
        device=device_name,
        seed=training.seed,
        model=model,
        te_rng_tracker=te_rng_tracker,
        data_parallel_random_init=training.data_parallel_random_init,
    )
    warn_if_slow_precision(training.precision, device_name)
    if training.disable_jit_fuser:
        from megatron.core.jit import disable_jit_fuser

        disable_jit_fuser()
    return Runtime(
        device_name=device_name,
        dp=dp,
        groups=parallel.process_groups(),
        transformer_impl=transformer_impl,
        engine=engine,
    )


def _apply_engine(engine: EngineConfig, transformer_impl: str) -> None:
    """The process-wide switches of the engine flags: deterministic kernels, TE's attention
    backend."""
    if engine.deterministic_mode:
        enable_deterministic_mode()
    select_te_attention_backend(engine.attention_backend, transformer_impl)


def is_reporting_rank() -> bool:
    """The one rank that holds the loss and writes reports (:func:`parallel.is_reporting_rank`).

    Asked of the process's groups rather than passed: it gates the logging of a dozen call sites
    in the loop's components, which otherwise would carry the groups for that alone."""
    return parallel.is_reporting_rank(parallel.process_groups())


def tokenizer(data: DataConfig, model: ApertusConfig) -> Tokenizer:
    """The run's tokenizer, refused when its ids do not fit the model's vocabulary; a
    ``NullTokenizer``'s ids are the model's vocabulary."""
    if data.tokenizer_type == "NullTokenizer":
        return null_tokenizer(
            model.vocab_size, data.null_tokenizer_eod_id, data.null_tokenizer_pad_id
        )
    built = build_tokenizer(data.tokenizer_type, data.tokenizer_model)
    if built.vocab_size > model.vocab_size:
        raise ConfigError(
            f"--vocab-size ({model.vocab_size}) is smaller than the tokenizer's "
            f"vocabulary ({built.vocab_size})"
        )
    return built


def pretraining_datasets(
    dataset: DatasetConfig, tokenizer: Tokenizer, *, model: ApertusConfig, training: TrainingConfig
):
    """The training and validation GPT datasets of a run (None where a part holds no samples),
    sized by the run's length; the same flags give the same samples at the same positions.
    Without ``--data-path``, the embedded corpus, tokenized on first use."""
    sizes = training.dataset_sizes()
    try:
        train, valid, _ = build_datasets(
            dataset,
            tokenizer,
            seq_length=model.seq_length,
            seed=training.seed,
            num_samples=sizes,
            default_corpus=embedded_corpus_prefix,
        )
    except Exception as err:  # megatron-core's builder wraps the allocation's MemoryError
        if not out_of_memory(err):
            raise
        raise ConfigError(
            f"the sample indices of {sizes[0]} training and {sizes[1]} validation samples "
            "(--train-iters x --global-batch-size, --eval-iters) do not fit in memory: "
            f"{err.__cause__ or err}"
        ) from None
    return train, valid


def model_chunks(
    model: ApertusConfig,
    layout: ParallelConfig,
    *,
    training: TrainingConfig,
    runtime: Runtime,
    packed_documents: bool = False,
    **options,
) -> list:
    """This rank's model chunks in the run's precision, initialised on the CPU when the run is
    there or ``--use-cpu-initialization`` asks (then moved to the GPU); ``options`` go to :func:`megatron.apertus.model.builder.build_model` (the output
    layer, quantization, recomputation, the engine).

    ``packed_documents`` under context parallelism pads each document to a multiple of 2 x CP
    tokens, so the length of a micro-batch varies: pipeline stages then send each message's
    shape before it (megatron-core's ``variable_seq_lengths``; its config refuses that beside
    the default MoE token dispatcher, which a dense model never builds, so the other is named)."""
    varying = packed_documents and layout.context_parallel_size > 1
    if varying and layout.pipeline_model_parallel_size > 1:
        options.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    try:
        chunks = build_model(
            model,
            layout,
            xielu_impl=training.xielu_impl,
            params_dtype=dtype_from_name(training.precision),
            use_cpu_initialization=runtime.device_name == "cpu" or training.use_cpu_initialization,
            pg_collection=runtime.groups,
            **options,
        )
    except (MemoryError, RuntimeError) as err:
        if not out_of_memory(err):
            raise
        raise ConfigError(
            f"the model does not fit in memory: {model.num_parameters():,} parameters from "
            f"--num-layers {model.num_layers}, --hidden-size {model.hidden_size}, "
            f"--ffn-hidden-size {model.ffn_hidden_size} and a vocabulary of "
            f"{model.vocab_size} (--vocab-size, --make-vocab-size-divisible-by); make it "
            "smaller or split it (--tensor-model-parallel-size, --pipeline-model-parallel-size)"
        ) from None
    if runtime.device_name == "cuda" and training.use_cpu_initialization:
        chunks = [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]
    return chunks
