"""What a run optimises: one :class:`Objective` per kind of run, chosen once from the config.

An objective owns everything that differs between pretraining (and SFT), distillation from
stored teacher logits and alignment (DPO, QRPO): its datasets and how a step's micro-batches are
cut from them, the targets that come with them (the teacher's top-k decoded a step ahead, the
reference policy's sequence log-probabilities), the reduction of the model's output to the loss
megatron-core's schedules sum, and the names under which its loss and own quantities appear in
the iteration line, the JSON log and TensorBoard. The loop
(:class:`megatron.apertus.training.loop.Trainer`) drives every objective the same way and never
asks which one it runs; a new objective is one more subclass, returned by
:func:`build_objective`.

QAD (quantization-aware distillation) is no objective of its own: it changes the model
(fake-quantized layers), and the distillation objective trains that model as any other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import partial
from pathlib import Path

from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import get_current_running_global_batch_size

from megatron.apertus.align.objective import alignment_loss
from megatron.apertus.checkpoint import TrainingState
from megatron.apertus.data.batches import (
    Batch,
    BatchConfig,
    MicroBatchReader,
    TeacherSource,
    rank_positions,
    step_micro_batches,
)
from megatron.apertus.distill.targets import TeacherLogits
from megatron.apertus.errors import ConfigError
from megatron.apertus.tokenizer.tokenizers import Tokenizer
from megatron.apertus.training import runtime
from megatron.apertus.training.align import AlignRun
from megatron.apertus.training.config import RunConfig
from megatron.apertus.training.metrics import perplexity
from megatron.apertus.training.step import LossFunction, StepShape, token_loss


def metric_name(quantity: str) -> str:
    """The TensorBoard / JSON-log name of a reported quantity: ``reward margin`` ->
    ``reward_margin``."""
    return quantity.replace(" ", "_").replace("-", "_")


def format_quantities(quantities: dict[str, float]) -> str:
    """What the iteration and validation lines add: `` | reward margin: 1.234E-01 | ...``."""
    return "".join(f" | {name}: {value:.6E}" for name, value in quantities.items())


class Objective(ABC):
    """One kind of run's data, targets, loss and names, as the training loop uses them.

    The loop calls :meth:`prepare` once the model holds the weights it starts from, then for
    every step :meth:`train_batches` (this rank's micro-batches, one list per step in order) with
    :meth:`shape` and :attr:`loss`; validation passes read :meth:`valid_batches`.
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

    def prepare(self, model: list, *, state: TrainingState, resume_from: Path | None) -> None:
        """Make the targets ready for the step at ``state`` (``model`` holds the weights the run
        starts from; ``resume_from`` is the checkpoint they came from, if any)."""

    @abstractmethod
    def shape(self, num_microbatches: int) -> StepShape:
        """What megatron-core's schedules need to know of one step's micro-batches."""

    @abstractmethod
    def train_batches(self, consumed: int, global_batch: int) -> list[Batch]:
        """This rank's training micro-batches of the step that starts at sample ``consumed``."""

    @abstractmethod
    def valid_batches(self, consumed: int, global_batch: int) -> list[Batch]:
        """This rank's validation micro-batches of the pass's batch that starts at ``consumed``."""

    @property
    def loss(self) -> LossFunction:
        """The reduction of a micro-batch's model output to (loss, count, reported)."""
        return token_loss

    @abstractmethod
    def validation_line(self, iteration: int, loss: float, quantities: dict[str, float]) -> str:
        """The log line of a validation pass's result."""

    def close(self) -> None:
        """Stop what reads ahead (threads); the run is over."""


class CrossEntropy(Objective):
    """Next-token cross-entropy on GPT datasets: pretraining, and SFT on chat data, with
    Goldfish and document packing as the data flags ask."""

    loss_name = "lm loss"

    def __init__(self, cfg: RunConfig, *, tokenizer: Tokenizer, dp: int) -> None:
        t = cfg.training
        self.micro_batch_size, self.seq_length = t.micro_batch_size, cfg.model.seq_length
        self.dp = dp
        self.batch = BatchConfig(
            eod=tokenizer.eod,
            pack_documents=cfg.dataset.reset_attention_mask,
            goldfish=cfg.goldfish if cfg.data.goldfish_loss else None,
            special_ids=tuple(tokenizer.special_ids()) if cfg.goldfish.exempt_special else (),
        )
        self.train_data, self.valid_data = runtime.pretraining_datasets(
            cfg.dataset, tokenizer, model=cfg.model, training=t
        )
        self.reader = None  # --train-iters 0: no training data
        if self.train_data is not None:
            self.reader = MicroBatchReader(
                self.train_data,
                self.batch,
                micro_batch_size=t.micro_batch_size,
                dp_rank=parallel_state.get_data_parallel_rank(),
                dp_size=dp,
                num_workers=cfg.data.num_workers,
            )
        self.targets: TeacherSource | None = None
        """What gives each training micro-batch its teacher targets (distillation)."""

    def shape(self, num_microbatches: int) -> StepShape:
        """Packed documents make each micro-batch one sequence of ``b * s`` tokens."""
        packed, mbs = self.batch.pack_documents, self.micro_batch_size
        return StepShape(
            num_microbatches=num_microbatches,
            seq_length=self.seq_length * mbs if packed else self.seq_length,
            micro_batch_size=1 if packed else mbs,
        )

    def train_batches(self, consumed: int, global_batch: int) -> list[Batch]:
        """The step's micro-batches; the next step's are read ahead now that these are taken,
        its global batch taken to be this one's."""
        batches = self.reader.read(consumed, global_batch, self.targets)
        self.reader.prefetch(consumed + global_batch, global_batch)
        return batches

    def valid_batches(self, consumed: int, global_batch: int) -> list[Batch]:
        return step_micro_batches(
            self.valid_data,
            self.batch,
            consumed_samples=consumed,
            global_batch_size=global_batch,
            micro_batch_size=self.micro_batch_size,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=self.dp,
        )

    def validation_line(self, iteration: int, loss: float, quantities: dict[str, float]) -> str:
        return (
            f"validation loss at iteration {iteration} | lm loss value: "
            f"{loss:.6E} | lm loss PPL: {perplexity(loss):.6E} |"
        )


class Distillation(CrossEntropy):
    """Cross-entropy plus the KL to a teacher's stored top-k (``--distill-logits-path``), fused
    into the output layer's loss; validation measures the student's plain cross-entropy."""

    loss_name = "kd loss"

    def __init__(self, cfg: RunConfig, *, tokenizer: Tokenizer, dp: int) -> None:
        if not cfg.training.fused_output_loss:
            raise ConfigError(
                "--distill-logits-path needs the fused output-layer loss "
                "(drop --no-fused-output-loss)"
            )
        super().__init__(cfg, tokenizer=tokenizer, dp=dp)
        self.config, self.vocab_size = cfg.distill, cfg.model.vocab_size
        self.total_samples = cfg.training.total_samples()
        self.teacher: TeacherLogits | None = None

    def prepare(self, model: list, *, state: TrainingState, resume_from: Path | None) -> None:
        """Open the store, check it against the samples the run has left, and start decoding the
        first step's targets."""
        self.teacher = TeacherLogits(
            self.config,
            dataset=self.train_data,
            dataset_hash=self.train_data.unique_description_hash,
            seq_length=self.seq_length,
            vocab_size=self.vocab_size,
            first_position=state.consumed_samples,
            last_position=self.total_samples,
        )
        self.targets = self.teacher.targets
        self._prefetch(state.consumed_samples)

    def train_batches(self, consumed: int, global_batch: int) -> list[Batch]:
        batches = super().train_batches(consumed, global_batch)
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
                dp_rank=parallel_state.get_data_parallel_rank(),
                dp_size=self.dp,
                length=len(self.train_data),
            )
        )

    def close(self) -> None:
        if self.teacher is not None:
            self.teacher.close()


class Alignment(Objective):
    """DPO or QRPO on preference data against a frozen reference policy (the starting weights),
    whose sequence log-probabilities :class:`AlignRun` computes once or reads."""

    def __init__(self, cfg: RunConfig, *, tokenizer: Tokenizer, dp: int) -> None:
        align = cfg.align
        self.config, self.dp = align, dp
        self.micro_batch_size, self.seq_length = cfg.training.micro_batch_size, cfg.model.seq_length
        self.run = AlignRun(
            align,
            cfg.dataset,
            seq_length=cfg.model.seq_length,
            pad=tokenizer.pad,
            seed=cfg.training.seed,
            fused_output_loss=cfg.training.fused_output_loss,
        )
        self.train_data, self.valid_data = self.run.train_data, self.run.valid_data
        self.loss_name = self.valid_loss_name = f"{align.align_objective} loss"

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

    def train_batches(self, consumed: int, global_batch: int) -> list[Batch]:
        return self.run.micro_batches(
            "train", consumed, global_batch, self.micro_batch_size, self.dp
        )

    def valid_batches(self, consumed: int, global_batch: int) -> list[Batch]:
        return self.run.micro_batches(
            "valid", consumed, global_batch, self.micro_batch_size, self.dp
        )

    @property
    def loss(self) -> LossFunction:
        return partial(alignment_loss, self.config)

    def validation_line(self, iteration: int, loss: float, quantities: dict[str, float]) -> str:
        return (
            f"validation loss at iteration {iteration} | "
            f"{self.config.align_objective} loss value: {loss:.6E}" + format_quantities(quantities)
        )


def build_objective(cfg: RunConfig, *, tokenizer: Tokenizer, dp: int) -> Objective:
    """The run's objective, with its datasets built: the one place a new objective plugs in."""
    if cfg.align.enabled and cfg.distill.enabled:
        raise ConfigError(
            "--align-objective and --distill-logits-path are two objectives: give one of them"
        )
    if cfg.align.enabled:
        return Alignment(cfg, tokenizer=tokenizer, dp=dp)
    if cfg.distill.enabled:
        return Distillation(cfg, tokenizer=tokenizer, dp=dp)
    return CrossEntropy(cfg, tokenizer=tokenizer, dp=dp)
