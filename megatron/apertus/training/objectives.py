"""What a run optimises: one :class:`Objective` per kind of run, chosen once from the config.

An objective owns everything that differs between pretraining (and SFT), distillation from
stored teacher logits and alignment (DPO, QRPO): its datasets and how a step's micro-batches are
cut from them (Goldfish and document packing are part of that data: :class:`TokenData`), the
targets that come with them (the teacher's top-k decoded a step ahead, the reference policy's
sequence log-probabilities), its forward pass, which hands those targets to the model as
arguments, the reduction of the model's output to the loss megatron-core's schedules sum, and
the names and formats under which its loss and own quantities appear in the iteration line, the
JSON log and TensorBoard. Each objective is built from its own config groups; only
:func:`build_objective` reads the whole run's. The loop
(:class:`megatron.apertus.training.loop.Trainer`) drives every objective the same way and never
asks which one it runs; a new objective is one more subclass, returned by
:func:`build_objective`.

QAD (quantization-aware distillation) is no objective of its own: it changes the model
(fake-quantized layers), and the distillation objective trains that model as any other.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from functools import partial
from pathlib import Path
from typing import Iterable

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.num_microbatches_calculator import get_current_running_global_batch_size

from megatron.apertus.align.config import AlignConfig
from megatron.apertus.align.objective import alignment_loss
from megatron.apertus.checkpoint import TrainingState
from megatron.apertus.data.batches import (
    QUANTITY_PREFIX,
    Batch,
    BatchConfig,
    MicroBatchReader,
    TeacherSource,
    rank_positions,
    step_micro_batches,
)
from megatron.apertus.data.datasets import DatasetConfig
from megatron.apertus.distill.config import DistillConfig
from megatron.apertus.distill.targets import TeacherLogits
from megatron.apertus.errors import ConfigError
from megatron.apertus.model.builder import chunk_groups
from megatron.apertus.tokenizer.tokenizers import Tokenizer
from megatron.apertus.training import runtime
from megatron.apertus.training.align import AlignRun
from megatron.apertus.training.config import RunConfig
from megatron.apertus.training.loop_config import TrainingConfig
from megatron.apertus.training.metrics import perplexity
from megatron.apertus.training.step import (
    StepShape,
    language_model_output,
    model_device,
    to_device,
    token_forward,
    token_loss,
)

GOLDFISH_DROPPED = "goldfish dropped"
"""The quantity a Goldfish run reports: the share of loss positions Goldfish dropped."""


def metric_name(quantity: str) -> str:
    """The TensorBoard / JSON-log name of a reported quantity: ``reward margin`` ->
    ``reward_margin``."""
    return quantity.replace(" ", "_").replace("-", "_")


def format_quantities(quantities: dict[str, float]) -> str:
    """What the iteration and validation lines add: `` | reward margin: 1.234E-01 | ...``."""
    return "".join(f" | {name}: {value:.6E}" for name, value in quantities.items())


def goldfish_token_loss(batch: Batch, loss_mask: torch.Tensor, output: torch.Tensor):
    """:func:`token_loss`, reporting the (dropped, eligible) loss positions of the batch, which
    Goldfish counted when it cut the batch, as the quantity :data:`GOLDFISH_DROPPED`."""
    loss_sum, count, reported = token_loss(batch, loss_mask, output)
    counts = torch.tensor([batch.goldfish_dropped, batch.loss_positions], dtype=torch.float32)
    reported[QUANTITY_PREFIX + GOLDFISH_DROPPED] = to_device(counts, loss_mask.device)
    return loss_sum, count, reported


class Objective(ABC):
    """One kind of run's data, targets, forward pass, loss and names, as the training loop uses
    them.

    The loop calls :meth:`prepare` once the model holds the weights it starts from, then for
    every step :meth:`train_batches` (this rank's micro-batches, one list per step in order) with
    :meth:`shape` and :meth:`train_forward`; validation passes read :meth:`valid_batches` through
    :meth:`valid_forward`.
    """

    loss_name: str
    """The loss's name in the iteration line and its TensorBoard tag (``lm loss``)."""
    valid_loss_name: str = "lm loss"
    """The validation loss's name; its TensorBoard tag is ``<name> validation``. Megatron's
    ``lm loss`` wherever validation measures the cross-entropy (distillation too), so that
    curves of other objectives never share its tag."""
    train_data: object | None
    valid_data: object | None
    """The validation data; None: the run has no validation."""
    valid_suffixes: tuple[str, ...] = ("",)
    """What follows ``validation`` in each validation set's log line and tags (Megatron-LM's
    ``-NAME``, --multiple-validation-sets); one empty suffix: one set."""

    def prepare(self, model: list, *, state: TrainingState, resume_from: Path | None) -> None:
        """Make the targets ready for the step at ``state`` (``model`` holds the weights the run
        starts from; ``resume_from`` is the checkpoint they came from, if any)."""

    @abstractmethod
    def shape(self, num_microbatches: int) -> StepShape:
        """What megatron-core's schedules need to know of one step's micro-batches."""

    def valid_shape(self, num_microbatches: int) -> StepShape:
        """:meth:`shape` of a validation batch (its micro-batches may be of another size)."""
        return self.shape(num_microbatches)

    @abstractmethod
    def train_batches(self, consumed: int, global_batch: int) -> list[Batch]:
        """This rank's training micro-batches of the step that starts at sample ``consumed``."""

    @abstractmethod
    def valid_batches(self, consumed: int, global_batch: int, valid_set: int = 0) -> list[Batch]:
        """This rank's micro-batches of the pass's batch that starts at ``consumed`` in
        validation set ``valid_set`` (an index of :attr:`valid_suffixes`)."""

    def whole_valid_set(self, valid_set: int = 0) -> int | None:
        """The samples of validation set ``valid_set`` when a pass covers all of them
        (--full-validation); None: a pass reads --eval-iters global batches."""
        return None

    @abstractmethod
    def train_forward(self, batch: Batch, model: GPTModel):
        """The :data:`~megatron.apertus.training.step.ForwardPass` of a training micro-batch."""

    def valid_forward(self, batch: Batch, model: GPTModel):
        """The forward pass of a validation micro-batch: the training one unless the objective
        validates on another measure."""
        return self.train_forward(batch, model)

    def quantity_fields(self, quantities: dict[str, float]) -> list[str]:
        """The iteration line's fields of the step's own quantities."""
        return [f"{name}: {value:.6E}" for name, value in quantities.items()]

    @abstractmethod
    def validation_line(
        self, at: str, loss: float, quantities: dict[str, float], suffix: str = ""
    ) -> str:
        """The log line of a validation pass's result; ``at``: where it ran, as Megatron-LM
        says it (``iteration 100``, ``iteration 100 on validation set``); ``suffix``: the
        validation set's (:attr:`valid_suffixes`)."""

    def close(self) -> None:
        """Stop what reads ahead (threads); the run is over."""


class TokenData:
    """GPT datasets as an objective reads them: this rank's micro-batches of a step, with
    Goldfish and document packing applied as the data flags ask (:class:`BatchConfig`)."""

    def __init__(
        self,
        datasets: tuple,
        batch: BatchConfig,
        *,
        micro_batch_size: int,
        seq_length: int,
        dp: int,
        dp_rank: int,
        num_workers: int,
        valid_suffixes: tuple[str, ...] = ("",),
        full_validation: bool = False,
        valid_micro_batch_size: int | None = None,
    ) -> None:
        """``datasets``: the training dataset and the validation one, or a list of them (one
        per validation set, named by ``valid_suffixes``); either may be None.
        ``full_validation``: a validation pass reads each set whole, once.
        ``valid_micro_batch_size``: the validation micro-batches' (default: the training's)."""
        self.train, valid = datasets
        self.valid_sets = valid if isinstance(valid, list) else [] if valid is None else [valid]
        self.valid_suffixes, self.full_validation = valid_suffixes, full_validation
        self.batch, self.micro_batch_size, self.seq_length = batch, micro_batch_size, seq_length
        self.valid_micro_batch_size = valid_micro_batch_size or micro_batch_size
        self.dp, self.dp_rank = dp, dp_rank
        self.reader = None  # --train-iters 0: no training data
        if self.train is not None:
            self.reader = MicroBatchReader(
                self.train,
                batch,
                micro_batch_size=micro_batch_size,
                dp_rank=dp_rank,
                dp_size=dp,
                num_workers=num_workers,
            )

    @property
    def goldfish(self) -> bool:
        """Whether Goldfish drops loss positions of these batches."""
        return self.batch.goldfish is not None

    def shape(self, num_microbatches: int, micro_batch_size: int | None = None) -> StepShape:
        """Packed documents make each micro-batch one sequence of ``b * s`` tokens;
        ``micro_batch_size``: default the training's."""
        packed, mbs = self.batch.pack_documents, micro_batch_size or self.micro_batch_size
        return StepShape(
            num_microbatches=num_microbatches,
            seq_length=self.seq_length * mbs if packed else self.seq_length,
            micro_batch_size=1 if packed else mbs,
        )

    def train_batches(
        self, consumed: int, global_batch: int, targets: TeacherSource | None = None
    ) -> list[Batch]:
        """The step's micro-batches (with ``targets``' teacher targets); the next step's are
        read ahead now that these are taken, its global batch taken to be this one's."""
        batches = self.reader.read(consumed, global_batch, targets)
        self.reader.prefetch(consumed + global_batch, global_batch)
        return batches

    def whole_valid_set(self, valid_set: int = 0) -> int | None:
        return len(self.valid_sets[valid_set]) if self.full_validation else None

    def valid_batches(self, consumed: int, global_batch: int, valid_set: int = 0) -> list[Batch]:
        return step_micro_batches(
            self.valid_sets[valid_set],
            self.batch,
            consumed_samples=consumed,
            global_batch_size=global_batch,
            micro_batch_size=self.valid_micro_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp,
            pass_end=self.whole_valid_set(valid_set),
        )


def token_data(cfg: RunConfig, *, tokenizer: Tokenizer, dp: int, dp_rank: int) -> TokenData:
    """The run's GPT datasets with their Goldfish and packing settings, read by data-parallel
    rank ``dp_rank`` of ``dp``."""
    batch = BatchConfig(
        eod=tokenizer.eod,
        pack_documents=cfg.dataset.reset_attention_mask,
        goldfish=cfg.goldfish if cfg.data.goldfish_loss else None,
        special_ids=tuple(tokenizer.special_ids()) if cfg.goldfish.exempt_special else (),
    )
    datasets = runtime.pretraining_datasets(
        cfg.dataset, tokenizer, model=cfg.model, training=cfg.training
    )
    return TokenData(
        datasets,
        batch,
        micro_batch_size=cfg.training.micro_batch_size,
        seq_length=cfg.model.seq_length,
        dp=dp,
        dp_rank=dp_rank,
        num_workers=cfg.data.num_workers,
        valid_suffixes=cfg.dataset.validation_set_suffixes(),
        full_validation=cfg.training.full_validation,
        valid_micro_batch_size=cfg.training.eval_micro_batch_size,
    )


class CrossEntropy(Objective):
    """Next-token cross-entropy on GPT datasets: pretraining, and SFT on chat data, with
    Goldfish and document packing as the data flags ask."""

    loss_name = "lm loss"

    def __init__(self, data: TokenData) -> None:
        self.data = data
        self.train_data, self.valid_data = data.train, data.valid_sets or None
        self.valid_suffixes = data.valid_suffixes

    def shape(self, num_microbatches: int) -> StepShape:
        return self.data.shape(num_microbatches)

    def valid_shape(self, num_microbatches: int) -> StepShape:
        return self.data.shape(num_microbatches, self.data.valid_micro_batch_size)

    def train_batches(self, consumed: int, global_batch: int) -> list[Batch]:
        return self.data.train_batches(consumed, global_batch)

    def valid_batches(self, consumed: int, global_batch: int, valid_set: int = 0) -> list[Batch]:
        return self.data.valid_batches(consumed, global_batch, valid_set)

    def whole_valid_set(self, valid_set: int = 0) -> int | None:
        return self.data.whole_valid_set(valid_set)

    def train_forward(self, batch: Batch, model: GPTModel):
        output, loss_mask = language_model_output(model, batch)
        return output, partial(self.train_loss, batch, loss_mask)

    def valid_forward(self, batch: Batch, model: GPTModel):
        """Validation reports the cross-entropy alone."""
        return token_forward(batch, model)

    @property
    def train_loss(self):
        """The training micro-batch's reduction: with Goldfish, its dropped share is reported."""
        return goldfish_token_loss if self.data.goldfish else token_loss

    def quantity_fields(self, quantities: dict[str, float]) -> list[str]:
        """Goldfish's dropped share, the one quantity, as a percentage."""
        return [f"{name}: {100 * value:.2f}%" for name, value in quantities.items()]

    def validation_line(
        self, at: str, loss: float, quantities: dict[str, float], suffix: str = ""
    ) -> str:
        return (
            f"validation{suffix} loss at {at} | lm loss value: "
            f"{loss:.6E} | lm loss PPL: {perplexity(loss):.6E} |"
        )


def output_loss_fused(
    training: TrainingConfig, align: AlignConfig, given: Iterable[str] = ()
) -> bool:
    """Whether the output layer and the loss run fused, for the run's objective.

    Alignment sums each token's log-probability over a completion; the fused output loss never
    holds them (it returns the summed loss), so an alignment run takes the unfused path by
    itself. ``given``: the flag destinations the command line set
    (:func:`~megatron.apertus.flags.given_destinations`); a fused loss asked for by name with
    an alignment objective is refused rather than overridden.
    """
    if not align.enabled:
        return training.fused_output_loss
    if training.fused_output_loss and "fused_output_loss" in set(given):
        raise ConfigError(
            "--fused-output-loss (--cross-entropy-loss-fusion) cannot run with --align-objective: "
            "alignment needs each token's log-probability, which the fused output loss never "
            "holds; drop the flag (alignment runs the output loss unfused)"
        )
    return False


def with_objective_output_loss(cfg: RunConfig, given: Iterable[str] = ()) -> RunConfig:
    """``cfg`` with the output loss :func:`output_loss_fused` decides for its objective."""
    fused = output_loss_fused(cfg.training, cfg.align, given)
    if fused == cfg.training.fused_output_loss:
        return cfg
    training = dataclasses.replace(cfg.training, fused_output_loss=fused)
    return dataclasses.replace(cfg, training=training)


def describe_output_loss(training: TrainingConfig, align: AlignConfig) -> str:
    """Whether the output loss is fused, and why not, for the run's start line."""
    if training.fused_output_loss:
        return "output layer + loss fused"
    why = "--align-objective needs per-token log-probabilities"
    why = why if align.enabled else "--no-fused-output-loss"
    return f"output layer + loss unfused ({why})"


def _check_distillation(training: TrainingConfig) -> None:
    """Distillation's KL lives in the fused output-layer loss; refused before any data is read."""
    if not training.fused_output_loss:
        raise ConfigError(
            "--distill-logits-path needs the fused output-layer loss "
            "(drop --no-fused-output-loss)"
        )


def _check_alignment(training: TrainingConfig, dataset: DatasetConfig) -> None:
    """The preference loss is one value per example: a count of tokens does not normalise it;
    and alignment validates on --eval-iters batches of its one --valid-data-path."""
    for flag, given in (
        ("--multiple-validation-sets", dataset.multiple_validation_sets),
        ("--full-validation", training.full_validation),
    ):
        if given:
            raise ConfigError(
                f"{flag}: alignment validates on --eval-iters batches of its one "
                f"--valid-data-path"
            )
    if training.calculate_per_token_loss:
        raise ConfigError(
            "--calculate-per-token-loss cannot run with --align-objective: the preference loss "
            "is one value per example, not a sum over tokens (every micro-batch holds the same "
            "number of examples, so the default already gives the global batch's mean); drop "
            "the flag"
        )


class Distillation(CrossEntropy):
    """Cross-entropy plus the KL to a teacher's stored top-k (``--distill-logits-path``), fused
    into the output layer's loss; validation measures the student's plain cross-entropy."""

    loss_name = "kd loss"

    def __init__(
        self, data: TokenData, config: DistillConfig, *, vocab_size: int, total_samples: int
    ) -> None:
        super().__init__(data)
        self.config, self.vocab_size, self.total_samples = config, vocab_size, total_samples
        self.teacher: TeacherLogits | None = None

    def prepare(self, model: list, *, state: TrainingState, resume_from: Path | None) -> None:
        """Open the store, check it against the samples the run has left, and start decoding the
        first step's targets."""
        self.teacher = TeacherLogits(
            self.config,
            dataset=self.train_data,
            dataset_hash=self.train_data.unique_description_hash,
            seq_length=self.data.seq_length,
            vocab_size=self.vocab_size,
            first_position=state.consumed_samples,
            last_position=self.total_samples,
        )
        self._prefetch(state.consumed_samples)

    def train_batches(self, consumed: int, global_batch: int) -> list[Batch]:
        """The step's micro-batches with their teacher targets."""
        batches = self.data.train_batches(consumed, global_batch, self.teacher.targets)
        self._prefetch(consumed + global_batch)
        return batches

    def _prefetch(self, consumed: int) -> None:
        """Start decoding the teacher targets of the step that starts at ``consumed`` (its global
        batch taken as the current one: a batch-size ramp-up reads the samples beyond it when
        they are needed)."""
        if consumed >= self.total_samples:
            return
        self.teacher.prefetch(
            rank_positions(
                consumed,
                get_current_running_global_batch_size(),
                dp_rank=self.data.dp_rank,
                dp_size=self.data.dp,
                length=len(self.train_data),
            )
        )

    def train_forward(self, batch: Batch, model: GPTModel):
        """The batch's teacher targets, on the model's device, reach the fused loss as the
        model's ``teacher`` argument."""
        device = model_device(model)
        ids, probs = (to_device(t, device) for t in batch.teacher[:2])
        teacher = batch.teacher._replace(ids=ids, probs=probs)
        output, loss_mask = language_model_output(model, batch, teacher=teacher)
        return output, partial(self.train_loss, batch, loss_mask)

    def close(self) -> None:
        if self.teacher is not None:
            self.teacher.close()


class Alignment(Objective):
    """DPO or QRPO on preference data against a frozen reference policy (the starting weights),
    whose sequence log-probabilities :class:`AlignRun` computes once or reads."""

    def __init__(
        self,
        config: AlignConfig,
        dataset: DatasetConfig,
        training: TrainingConfig,
        *,
        seq_length: int,
        pad: int,
        dp: int,
        dp_rank: int,
    ) -> None:
        self.config, self.dp, self.dp_rank = config, dp, dp_rank
        self.micro_batch_size, self.seq_length = training.micro_batch_size, seq_length
        self.valid_micro_batch_size = training.eval_micro_batch_size or training.micro_batch_size
        self.run = AlignRun(
            config,
            dataset,
            seq_length=seq_length,
            pad=pad,
            seed=training.seed,
            fused_output_loss=training.fused_output_loss,
        )
        self.train_data, self.valid_data = self.run.train_data, self.run.valid_data
        self.loss_name = self.valid_loss_name = f"{config.align_objective} loss"

    def prepare(self, model: list, *, state: TrainingState, resume_from: Path | None) -> None:
        """The reference log-probabilities: computed by the starting weights when none are
        stored yet and no step has been taken, else read and checked."""
        self.run.prepare(
            model,
            self.micro_batch_size,
            reference_name=str(resume_from),
            fresh=state.iteration == 0,
            reporting=runtime.is_reporting_rank(),
        )

    def shape(self, num_microbatches: int) -> StepShape:
        return self.run.shape(num_microbatches, self.seq_length, self.micro_batch_size)

    def valid_shape(self, num_microbatches: int) -> StepShape:
        return self.run.shape(num_microbatches, self.seq_length, self.valid_micro_batch_size)

    def train_batches(self, consumed: int, global_batch: int) -> list[Batch]:
        return self.run.micro_batches(
            "train", consumed, global_batch, self.micro_batch_size, self.dp, self.dp_rank
        )

    def valid_batches(self, consumed: int, global_batch: int, valid_set: int = 0) -> list[Batch]:
        return self.run.micro_batches(
            "valid", consumed, global_batch, self.valid_micro_batch_size, self.dp, self.dp_rank
        )

    def train_forward(self, batch: Batch, model: GPTModel):
        """Per-token log-probabilities, reduced to the preference loss against the reference
        values the batch carries (summed over the model's context-parallel group)."""
        loss = partial(alignment_loss, self.config, chunk_groups(model).cp)
        return token_forward(batch, model, loss=loss)

    def validation_line(
        self, at: str, loss: float, quantities: dict[str, float], suffix: str = ""
    ) -> str:
        return (
            f"validation{suffix} loss at {at} | "
            f"{self.config.align_objective} loss value: {loss:.6E}" + format_quantities(quantities)
        )


def build_objective(cfg: RunConfig, *, tokenizer: Tokenizer, dp: int, dp_rank: int) -> Objective:
    """The run's objective, with its datasets built, read by data-parallel rank ``dp_rank`` of
    ``dp``: the one place a new objective plugs in, and the one that hands each objective its
    config groups."""
    if cfg.align.enabled and cfg.distill.enabled:
        raise ConfigError(
            "--align-objective and --distill-logits-path are two objectives: give one of them"
        )
    if cfg.align.enabled:
        _check_alignment(cfg.training, cfg.dataset)
        return Alignment(
            cfg.align,
            cfg.dataset,
            cfg.training,
            seq_length=cfg.model.seq_length,
            pad=tokenizer.pad,
            dp=dp,
            dp_rank=dp_rank,
        )
    if cfg.distill.enabled:
        _check_distillation(cfg.training)
        return Distillation(
            token_data(cfg, tokenizer=tokenizer, dp=dp, dp_rank=dp_rank),
            cfg.distill,
            vocab_size=cfg.model.vocab_size,
            total_samples=cfg.training.total_samples(),
        )
    return CrossEntropy(token_data(cfg, tokenizer=tokenizer, dp=dp, dp_rank=dp_rank))
