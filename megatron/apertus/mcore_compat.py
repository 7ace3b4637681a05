"""The one place where our code meets the differences between megatron-core releases.

Two lines are supported from one code base: megatron-core 0.16.x (Python >= 3.10; tested on
3.11) and 0.19.x (Python >= 3.12). Every call whose spelling or meaning differs between them goes
through a function here, so the rest of the package is written once; each difference is listed
in ``docs/megatron_core_changes.md`` ("Two megatron-core lines").

Importing this module checks the installed release and refuses an unsupported one with one line
naming it and the supported ones: an untested megatron-core fails loudly at start, not deep
inside a run.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator

from megatron.core import package_info
from packaging.version import Version

SUPPORTED = ((Version("0.16.0"), Version("0.17")), (Version("0.19.0"), Version("0.20")))
"""Half-open ranges of megatron-core releases we test; ``setup.py`` states the same ranges."""

MCORE_VERSION = Version(package_info.__version__)
STEP_SCHEDULE = MCORE_VERSION >= Version("0.19.0")
"""megatron-core 0.19 replaced the linear batch-size ramp-up (``--rampup-batch-size``) by step
schedules; ``init_num_microbatches_calculator`` then ignores ``rampup_batch_size``."""


COMMON_IN_SHARDS = MCORE_VERSION >= Version("0.19.0")
"""megatron-core 0.19 keeps a torch_dist checkpoint's common state inside its shard files and
writes no ``common.pt``; 0.16 reads the common state from ``common.pt`` only (0.19 reads both)."""


CUDA_GRAPH_MODULES = MCORE_VERSION >= Version("0.19.0")
"""megatron-core 0.19 renamed TransformerConfig's ``cuda_graph_scope`` to ``cuda_graph_modules``
(the old name still works, with a DeprecationWarning) and moved whole-iteration graphs to
``cuda_graph_impl="full_iteration"``; Megatron-LM's ``--cuda-graph-scope`` keeps its name."""


ASYNC_STRATEGY_ARGUMENT = MCORE_VERSION >= Version("0.19.0")
"""megatron-core 0.19's ``dist_checkpointing.save`` takes an ``async_strategy``, by default
"nvrx" (NVIDIA's resiliency extension, which this package does not install); "mcore", its own
background writer, is the one 0.16 always uses."""


INFERENCE_WRAPPER_CONFIG = MCORE_VERSION < Version("0.19.0")
"""megatron-core 0.16's ``GPTInferenceWrapper`` takes an ``InferenceWrapperConfig`` (hidden
size, dtype, vocabulary, the KV cache's limits) beside the inference context; 0.19 removed that
class (passing it is a ``TypeError``) and reads what it needs from the model's config."""


def gpt_inference_wrapper(model, max_sequence_length: int):
    """megatron-core's GPT inference wrapper over a fresh static KV cache for one sequence of up
    to ``max_sequence_length`` tokens, in the release's spelling; the process groups are
    parallel_state's on both lines."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )

    context = StaticInferenceContext(max_batch_size=1, max_sequence_length=max_sequence_length)
    if not INFERENCE_WRAPPER_CONFIG:
        return GPTInferenceWrapper(model, context)
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
        InferenceWrapperConfig,
    )

    config = InferenceWrapperConfig(
        hidden_size=model.config.hidden_size,
        params_dtype=model.config.params_dtype,
        inference_batch_times_seqlen_threshold=-1,
        padded_vocab_size=model.vocab_size,
        inference_max_requests=1,
        inference_max_seq_length=max_sequence_length,
    )
    return GPTInferenceWrapper(model, config, context)


def materialize_every_position(context, every: bool) -> None:
    """Whether the model's next forward under the static inference ``context`` computes the
    logits at every position of its window (a prompt's log-probabilities) or at the last one
    only (decoding): the context's own flag on 0.16, its ``InferenceConfig``'s on 0.19."""
    holder = context if INFERENCE_WRAPPER_CONFIG else context.config
    holder.materialize_only_last_token_logits = not every


def async_save_arguments() -> dict[str, str]:
    """``dist_checkpointing.save``'s extra arguments for a background save: megatron-core's own
    writer on both lines."""
    return {"async_strategy": "mcore"} if ASYNC_STRATEGY_ARGUMENT else {}


class _Messages(logging.Handler):
    def __init__(self, messages: list[str]) -> None:
        super().__init__(level=logging.ERROR)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def checkpoint_writer_errors() -> Iterator[list[str]]:
    """The errors megatron-core's checkpoint writer logs meanwhile. 0.19's synchronous writer logs
    a failed write's ``OSError`` (errno and all) and then raises an ``AssertionError`` naming only
    its class, so the log is where a full disk shows; 0.16 raises the ``OSError`` itself."""
    messages: list[str] = []
    handler = _Messages(messages)
    logger = logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def cuda_graph_fields(impl: str, scope: list[str], warmup_steps: int) -> dict[str, Any]:
    """TransformerConfig's CUDA-graph fields on this megatron-core line (an empty scope: whole
    layers, what megatron-core's deprecated default "full" means too)."""
    key = "cuda_graph_modules" if CUDA_GRAPH_MODULES else "cuda_graph_scope"
    return {"cuda_graph_impl": impl, key: list(scope), "cuda_graph_warmup_steps": warmup_steps}


def te_cuda_graph_helper(
    model: list,
    config: Any,
    *,
    seq_length: int,
    micro_batch_size: int,
    optimizers: list,
    groups: Any,
) -> Any:
    """megatron-core's ``TECudaGraphHelper``; 0.19 takes the process groups (0.16 reads
    parallel_state's, the same groups here)."""
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    extra = {"pg_collection": groups} if CUDA_GRAPH_MODULES else {}
    return TECudaGraphHelper(
        model=model,
        config=config,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        optimizers=optimizers,
        **extra,
    )


def check_checkpoint_readable(directory: Path) -> None:
    """Refuse, in one line, a 0.19 checkpoint under 0.16, which would fail deep in torch.load."""
    written_by_019 = (directory / "metadata.json").is_file() and not (
        directory / "common.pt"
    ).is_file()
    if written_by_019 and not COMMON_IN_SHARDS:
        raise ValueError(
            f"{directory} was written by megatron-core 0.19 (its common state is inside the shard "
            f"files, no common.pt), which megatron-core {MCORE_VERSION} cannot read: load it "
            f"with megatron-core 0.19.x (docs/install.md)"
        )


def supported_text() -> str:
    return ", ".join(f"{low.major}.{low.minor}.x" for low, _ in SUPPORTED)


def is_supported(version: Version) -> bool:
    return any(low <= version < high for low, high in SUPPORTED)


if not is_supported(MCORE_VERSION):
    raise ImportError(
        f"megatron-core {MCORE_VERSION} is installed; megatron-apertus supports "
        f"{supported_text()} (see docs/install.md)"
    )


def rampup_step_schedule(
    start: int, increment: int, ramp_samples: int, global_batch_size: int
) -> str:
    """Megatron-LM's ``--rampup-batch-size START INCREMENT SAMPLES`` as a 0.19 step schedule.

    The ramp (megatron-core <= 0.18, ``RampupBatchsizeNumMicroBatchesCalculator``) uses
    ``START + int(consumed / (SAMPLES / n)) * INCREMENT`` for ``n = (GBS - START) / INCREMENT``
    increments while ``consumed <= SAMPLES``, then GBS. Consumed counts are integers, so each
    increment takes effect at the smallest integer count that this float expression moves to it:
    that count is its threshold, and the batch sizes agree at every consumed count.
    """
    if (global_batch_size - start) % increment:
        raise ValueError(
            f"--rampup-batch-size: GBS - START ({global_batch_size - start}) is not a multiple "
            f"of INCREMENT ({increment})"
        )
    increments = (global_batch_size - start) // increment
    per_increment = ramp_samples / increments
    thresholds = {0: start}  # a later increment at the same count replaces an earlier one
    for k in range(1, increments + 1):
        threshold = max(1, int(k * per_increment) - 1)
        while threshold <= ramp_samples and int(threshold / per_increment) < k:
            threshold += 1
        if threshold > ramp_samples:  # the last increment: taken once past the ramp
            threshold = ramp_samples + 1
        thresholds[threshold] = start + k * increment
    return " ".join(f"{threshold}:{size}" for threshold, size in thresholds.items())


def init_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: list[int] | None,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    decrease_batch_size_if_needed: bool = False,
) -> None:
    """megatron-core's global micro-batch calculator, with Megatron-LM's ramp-up on both lines."""
    from megatron.core import num_microbatches_calculator as nmc

    if not (STEP_SCHEDULE and rampup_batch_size):
        nmc.init_num_microbatches_calculator(
            rank,
            rampup_batch_size,
            global_batch_size,
            micro_batch_size,
            data_parallel_size,
            decrease_batch_size_if_needed=decrease_batch_size_if_needed,
        )
        return
    _refuse_decrease_with_ramp(decrease_batch_size_if_needed)
    nmc.init_num_microbatches_calculator(
        rank,
        None,
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        step_batch_size_schedule=rampup_step_schedule(*rampup_batch_size, global_batch_size),
    )


def rampup_calculator(
    rampup_batch_size: list[int], global_batch_size: int, micro_batch_size: int, dp: int
) -> Any:
    """A stand-alone calculator of the ramp-up (no log lines), to count a run's steps."""
    from megatron.core import num_microbatches_calculator as nmc

    start, increment, ramp_samples = rampup_batch_size
    if STEP_SCHEDULE:
        schedule = rampup_step_schedule(start, increment, ramp_samples, global_batch_size)
        return nmc.StepBatchsizeNumMicroBatchesCalculator(micro_batch_size, dp, False, 1, schedule)
    return nmc.RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size, micro_batch_size, dp, False, 1, start, increment, ramp_samples
    )


def _refuse_decrease_with_ramp(decrease: bool) -> None:
    if decrease:
        raise ValueError(
            f"--decrease-batch-size-if-needed with --rampup-batch-size is not supported on "
            f"megatron-core {MCORE_VERSION} (its step schedules refuse it); use 0.16.x or "
            f"drop one of the two flags"
        )


class _HiddenNotice(logging.Filter):
    """Drops the records of one logger whose message contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


RELEASE_NOTICES = {
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",
    "megatron.core.dist_checkpointing.strategies.torch": "MCore's async save is deprecated",
    "megatron.core.transformer.transformer_layer": "Rewrapping ModuleSpec with module",
}
"""megatron-core 0.19's notices that ask for a migration we document instead, by logger:
``GPTModel`` is deprecated in favour of ``HybridModel`` but still maintained (logged for every
model chunk); megatron-core's own checkpoint writer is deprecated in favour of NVIDIA's
resiliency extension, which this package does not install, and the notice comes with every
first save, the synchronous ones included (0.19's synchronous save goes through that writer);
an MLP given as a ``ModuleSpec`` is rewrapped by megatron-core itself into the call it asks
for (``MLP.as_mlp_submodule``), the same module either way, while 0.16 knows only the spec."""


def quiet_release_notices() -> None:
    """Hide :data:`RELEASE_NOTICES`; ``docs/megatron_core_changes.md`` says why we keep what they
    deprecate."""
    for name, text in RELEASE_NOTICES.items():
        logging.getLogger(name).addFilter(_HiddenNotice(text))


quiet_release_notices()
