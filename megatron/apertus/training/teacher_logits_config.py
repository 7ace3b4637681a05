"""Flags and configuration of the teacher-logit runner (``tools/generate_teacher_logits.py``),
apart from the runner (:mod:`megatron.apertus.training.teacher_logits`) so that ``--help`` and
argument errors need neither torch nor megatron-core."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.apertus.data.config import DataConfig
from megatron.apertus.data.datasets import DatasetConfig
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help
from megatron.apertus.model.config import ApertusConfig, ParallelConfig
from megatron.apertus.training.loop_config import TrainingConfig

SAMPLING = ("topk", "random")
"""``--sampling`` values; a store's kind is ``topk`` or ``sampled`` (logit_store.KINDS)."""


@dataclass(kw_only=True, frozen=True)
class LogitsConfig:
    logits_dir: str | None = flag_help("store directory to write (or resume); required", None)
    topk: int = flag_help("teacher ids and probabilities kept per token", 256)
    samples_per_block: int | None = flag_help(
        "samples per stored block (default: about 131k tokens)", None
    )
    teacher_name: str | None = flag_help(
        "teacher identifier in the header (default: from --load)", None
    )
    topk_chunk_rows: int | None = flag_help(
        "Apertus addition: tokens whose logits the last stage holds at once "
        "(default: a multiple of 64 giving about 256 MiB of logits)",
        None,
    )
    sampling: str = flag_help(
        "what the store keeps per token: topk (the --topk most likely ids and their "
        "probabilities) or random (--samples ids drawn from the teacher, as distinct ids "
        "and counts: unbiased, docs/distillation.md)",
        "topk",
        ours=True,
    )
    samples: int = flag_help("draws per token of --sampling random", 32, ours=True)
    sampling_seed: int | None = flag_help(
        "seed of --sampling random's draws (default: --seed)", None, ours=True
    )

    def __post_init__(self) -> None:
        from megatron.apertus.distill.logit_codec import MAX_DRAWS

        if not self.logits_dir:
            raise ConfigError("--logits-dir is required")
        if self.sampling not in SAMPLING:
            raise ConfigError(
                f"--sampling must be one of {', '.join(SAMPLING)}, " f"got {self.sampling!r}"
            )
        if not 1 <= self.samples <= MAX_DRAWS:
            raise ConfigError(f"--samples must be in [1, {MAX_DRAWS}], got {self.samples}")
        if self.topk < 1:
            raise ConfigError(f"--topk must be at least 1, got {self.topk}")
        if self.topk_chunk_rows is not None and self.topk_chunk_rows < 1:
            raise ConfigError(f"--topk-chunk-rows must be at least 1, got {self.topk_chunk_rows}")
        if self.samples_per_block is not None and self.samples_per_block < 1:
            raise ConfigError(
                f"--samples-per-block must be at least 1, got {self.samples_per_block} (leave it "
                "out for blocks of about 131k tokens)"
            )


@dataclass(kw_only=True)
class GenerationConfig:
    load: str
    """The teacher checkpoint (save directory or iter_* directory)."""
    model: ApertusConfig
    parallel: ParallelConfig
    training: TrainingConfig
    """The *student's* run: batch sizes, seed and length define the consumption order."""
    data: DataConfig
    dataset: DatasetConfig
    logits: LogitsConfig

    def __post_init__(self) -> None:
        flag, kept = (
            ("--samples", self.logits.samples)
            if self.logits.sampling == "random"
            else ("--topk", self.logits.topk)
        )
        if kept > self.model.vocab_size:
            raise ConfigError(
                f"{flag} {kept} is more than the teacher's vocabulary of "
                f"{self.model.vocab_size} ids"
            )
        self._check_student_run()

    def _check_student_run(self) -> None:
        """What ``pretrain_gpt.py`` checks of the same flags when the student starts: a run of
        no samples has no logits to make, and micro-batches must split the global batch."""
        training = self.training
        if not training.total_samples():
            raise ConfigError(
                "--train-iters/--train-samples: the student's run has no samples, so there are "
                "no teacher logits to make"
            )
        if training.global_batch_size % training.micro_batch_size:
            raise ConfigError(
                f"--global-batch-size ({training.global_batch_size}) is not a multiple of "
                f"--micro-batch-size ({training.micro_batch_size})"
            )
