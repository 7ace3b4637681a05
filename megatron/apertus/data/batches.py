"""Micro-batches for one data-parallel rank: sampling order, Goldfish, document packing.

Order: the global batch of a step holds samples ``[consumed, consumed + B)`` (modulo the dataset
length); data-parallel rank ``r`` of ``D`` takes the contiguous ``B/D`` of them and cuts them
into micro-batches. A step's samples therefore do not depend on the parallel layout, a batch
size that ramps up just changes ``B``, and a run resumed at ``consumed_samples`` sees exactly
the samples it would have seen.

Document packing (``--reset-attention-mask``): a micro-batch ``[b, s]`` becomes one packed
sequence ``[1, b*s]`` whose segments are the documents (a new one starts after every ``</s>``,
and at every sample start). megatron-core's ``thd`` format carries the segment boundaries
(``cu_seqlens``) to attention and RoPE, so attention never crosses a document and positions
restart at each one, without a dense [s, s] mask.

Reading (``--num-workers``): :class:`MicroBatchReader` reads and collates a step's micro-batches
in torch ``DataLoader`` worker processes while the previous step computes; the batches are the
same, bitwise, as those read in the training process.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch
import torch.utils.data
from megatron.core.packed_seq_params import PackedSeqParams

from megatron.apertus.data.goldfish import GoldfishConfig, goldfish_drop_mask

if TYPE_CHECKING:
    from megatron.apertus.model.fused_loss import TeacherTargets

TeacherSource = Callable[[list[int], list[dict]], "TeacherTargets"]
"""Teacher targets (distillation) of the samples at these dataset positions."""


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, s] int64, or [1, b*s] when packed
    labels: torch.Tensor
    loss_mask: torch.Tensor  # float32, same shape
    position_ids: torch.Tensor
    packed_seq_params: PackedSeqParams | None = None
    goldfish_dropped: int = 0
    """Loss positions Goldfish removed from this micro-batch (of ``loss_positions`` before it)."""
    loss_positions: int = 0
    teacher: TeacherTargets | None = None
    """A teacher's top-k per token (distillation), in the same [b, s] or packed layout."""


QUANTITY_PREFIX = "quantity/"
"""Names the (sum, count) pairs an objective's loss reports of its own quantities."""


@dataclass(kw_only=True, frozen=True)
class BatchConfig:
    eod: int
    pack_documents: bool = False
    goldfish: GoldfishConfig | None = None
    special_ids: tuple[int, ...] = ()
    """The tokenizer's control-token ids (Goldfish never drops them with ``exempt_special``)."""


def document_lengths(tokens: torch.Tensor, eod: int) -> list[int]:
    """Lengths of the segments of each row: a segment ends at every ``eod`` and row end."""
    lengths = []
    for row in tokens.tolist():
        start = 0
        for i, token in enumerate(row):
            if token == eod and i + 1 < len(row):
                lengths.append(i + 1 - start)
                start = i + 1
        lengths.append(len(row) - start)
    return lengths


def restarted_positions(lengths: Sequence[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def pack(tokens, labels, loss_mask, eod: int) -> Batch:
    """One ``thd`` sequence of the micro-batch's documents."""
    lengths = document_lengths(tokens, eod)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    flat = lambda t: t.reshape(1, -1)  # noqa: E731
    positions = restarted_positions(lengths).unsqueeze(0)
    return Batch(flat(tokens), flat(labels), flat(loss_mask), positions, packed_seq_params=params)


def collate(
    samples: list[dict], config: BatchConfig, teacher: TeacherTargets | None = None
) -> Batch:
    """Stack GPTDataset samples (and their teacher targets); apply Goldfish and packing."""
    tokens = torch.stack([s["tokens"] for s in samples]).long()
    labels = torch.stack([s["labels"] for s in samples]).long()
    loss_mask = torch.stack([s["loss_mask"] for s in samples]).float()
    dropped = eligible = 0
    if config.goldfish is not None:
        special = torch.tensor(config.special_ids, dtype=torch.int64)
        drop = goldfish_drop_mask(labels, config.goldfish, special) & (loss_mask > 0)
        eligible, dropped = int((loss_mask > 0).sum()), int(drop.sum())
        loss_mask = loss_mask.masked_fill(drop, 0.0)  # a new tensor: samples stay untouched
    if config.pack_documents:
        batch = pack(tokens, labels, loss_mask, config.eod)
    else:
        positions = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
        batch = Batch(tokens, labels, loss_mask, positions)
    batch.goldfish_dropped, batch.loss_positions = dropped, eligible
    if teacher is not None:
        attach_teacher(batch, teacher, config)
    return batch


def attach_teacher(batch: Batch, teacher: TeacherTargets, config: BatchConfig) -> None:
    """Give ``batch`` its teacher targets, in the batch's layout (packed: one row)."""
    if config.pack_documents:
        k = teacher.ids.shape[-1]
        teacher = teacher._replace(
            ids=teacher.ids.reshape(1, -1, k), probs=teacher.probs.reshape(1, -1, k)
        )
    batch.teacher = teacher


def rank_positions(
    consumed_samples: int, global_batch_size: int, *, dp_rank: int, dp_size: int, length: int
) -> list[int]:
    """Dataset positions of this rank's samples in the step that starts at ``consumed_samples``."""
    per_rank = global_batch_size // dp_size
    first = consumed_samples + dp_rank * per_rank
    return [(first + i) % length for i in range(per_rank)]


def step_micro_batches(
    dataset,
    config: BatchConfig,
    *,
    consumed_samples: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    teacher: TeacherSource | None = None,
    pass_end: int | None = None,
) -> list[Batch]:
    """This rank's micro-batches of the global batch that starts at ``consumed_samples``.

    Indices wrap around the dataset (validation passes reuse a short held-out split). With
    ``pass_end`` (a pass over the whole dataset, --full-validation), positions from it on fill
    the last global batch for its shape only: they read a sample again with its loss mask
    zeroed, so the pass's per-token loss is the dataset's, whatever the batch sizes.
    """
    length = len(dataset)
    if length == 0:
        raise ValueError("the dataset holds no samples")
    batches = []
    for ids in micro_batch_positions(
        consumed_samples,
        global_batch_size,
        micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        length=length if pass_end is None else pass_end + global_batch_size,
    ):
        samples = [_counted_sample(dataset, i, pass_end) for i in ids]
        ids = [i % length for i in ids]
        batches.append(collate(samples, config, None if teacher is None else teacher(ids, samples)))
    return batches


def _counted_sample(dataset, position: int, pass_end: int | None) -> dict:
    """The sample at ``position`` (wrapped), its loss mask zeroed at or past ``pass_end``."""
    sample = dataset[position % len(dataset)]
    if pass_end is None or position < pass_end:
        return sample
    return {**sample, "loss_mask": torch.zeros_like(sample["loss_mask"])}


def micro_batch_positions(
    consumed_samples: int,
    global_batch_size: int,
    micro_batch_size: int,
    *,
    dp_rank: int,
    dp_size: int,
    length: int,
) -> list[list[int]]:
    """Dataset positions of each of this rank's micro-batches in the step."""
    positions = rank_positions(
        consumed_samples, global_batch_size, dp_rank=dp_rank, dp_size=dp_size, length=length
    )
    return [positions[m : m + micro_batch_size] for m in range(0, len(positions), micro_batch_size)]


class _StepSampler:
    """The micro-batch position lists of the step being read; a DataLoader's batch sampler that
    is pointed at a new step before each iteration."""

    def __init__(self) -> None:
        self.micro_batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.micro_batches)

    def __len__(self) -> int:
        return len(self.micro_batches)


class _Positions(torch.utils.data.Dataset):
    """The dataset as a DataLoader sees it: one sample per position."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, position: int) -> dict:
        return self.dataset[position]

    def __len__(self) -> int:
        return len(self.dataset)


def _read_in_worker(config: BatchConfig, samples: list[dict]) -> tuple[list[dict], Batch]:
    """A worker's share: the samples (the teacher checks them in the training process) and their
    collated micro-batch."""
    return samples, collate(samples, config)


class MicroBatchReader:
    """A rank's training micro-batches, read ahead in ``num_workers`` worker processes.

    :meth:`prefetch` starts reading a step's micro-batches in the workers; :meth:`read` returns
    them (reading them now if they were not prefetched, or were prefetched for another step:
    a batch-size ramp-up can change the step's size). Without workers it reads in the calling
    process, exactly as :func:`step_micro_batches` does.
    """

    def __init__(
        self,
        dataset,
        config: BatchConfig,
        *,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        num_workers: int,
    ) -> None:
        if len(dataset) == 0:
            raise ValueError("the dataset holds no samples")
        self.dataset, self.config = dataset, config
        self.layout = dict(dp_rank=dp_rank, dp_size=dp_size, length=len(dataset))
        self.micro_batch_size = micro_batch_size
        self.loader = None
        if num_workers > 0:
            self.sampler = _StepSampler()
            self.loader = torch.utils.data.DataLoader(
                _Positions(dataset),
                batch_sampler=self.sampler,
                num_workers=num_workers,
                collate_fn=partial(_read_in_worker, config),
                persistent_workers=True,
            )
        self.pending: tuple[tuple[int, int], Iterator] | None = None

    def _positions(self, consumed_samples: int, global_batch_size: int) -> list[list[int]]:
        return micro_batch_positions(
            consumed_samples, global_batch_size, self.micro_batch_size, **self.layout
        )

    def prefetch(self, consumed_samples: int, global_batch_size: int) -> None:
        """Start reading the step that starts at ``consumed_samples`` in the workers."""
        if self.loader is None:
            return
        self.sampler.micro_batches = self._positions(consumed_samples, global_batch_size)
        self.pending = ((consumed_samples, global_batch_size), iter(self.loader))

    def read(
        self, consumed_samples: int, global_batch_size: int, teacher: TeacherSource | None = None
    ) -> list[Batch]:
        """The step's micro-batches, with their teacher targets when ``teacher`` is given."""
        step = (consumed_samples, global_batch_size)
        if self.pending is None or self.pending[0] != step:
            self.prefetch(consumed_samples, global_batch_size)
        if self.pending is None:  # no workers
            return step_micro_batches(
                self.dataset,
                self.config,
                consumed_samples=consumed_samples,
                global_batch_size=global_batch_size,
                micro_batch_size=self.micro_batch_size,
                teacher=teacher,
                dp_rank=self.layout["dp_rank"],
                dp_size=self.layout["dp_size"],
            )
        read = [(ids, *done) for ids, done in zip(self.sampler.micro_batches, self.pending[1])]
        self.pending = None
        for ids, samples, batch in read:
            if teacher is not None:
                attach_teacher(batch, teacher(ids, samples), self.config)
        return [batch for _, _, batch in read]
