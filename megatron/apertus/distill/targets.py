"""The student's side of distillation: teacher targets for each micro-batch, read ahead.

A student consumes its training samples in dataset order (``data/batches.py``): the global
batch of a step is positions ``[consumed, consumed + B)``, data-parallel rank ``r`` takes its
contiguous ``B/D`` of them. The teacher logits store is keyed by the same positions, so a
rank reads just its own samples, a resumed run continues at ``consumed_samples``, and a
different data-parallel size reads the same store.

Every sample read is checked against the store's key of that position (a fingerprint of the
sample's tokens): logits made for other data, another order or another sequence length are
refused with the first mismatched sample named, before a step uses them.

The rank's samples of the next step are decoded in a thread while the current step runs, and
each micro-batch takes its rows of that step's batch.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np
import torch

from megatron.apertus.distill.config import DistillConfig
from megatron.apertus.distill.logit_store import (
    LogitStoreError,
    LogitStoreReader,
    TopKBatch,
    sample_key,
)
from megatron.apertus.errors import ConfigError
from megatron.apertus.model.fused_loss import TeacherTargets

log = logging.getLogger("apertus.distill")

SPOT_CHECKS = 64
"""Positions spread over the run whose keys are compared at start-up (fail before training)."""


def sample_tokens(sample: dict) -> np.ndarray:
    """The seq_length + 1 token window of a GPTDataset sample (tokens, then the last label)."""
    tokens = np.asarray(sample["tokens"], dtype=np.int64)
    return np.concatenate([tokens, np.asarray(sample["labels"][-1:], dtype=np.int64)])


def dataset_key(dataset, position: int) -> int:
    """The store key of the sample at ``position`` of ``dataset``."""
    return sample_key(sample_tokens(dataset[position]))


class TeacherLogits:
    """Teacher targets for the student's micro-batches, decoded one step ahead."""

    def __init__(
        self,
        config: DistillConfig,
        *,
        dataset,
        dataset_hash: str,
        seq_length: int,
        vocab_size: int,
        first_position: int,
        last_position: int,
    ) -> None:
        self.config = config
        try:
            self.reader = LogitStoreReader(config.distill_logits_path)
        except (LogitStoreError, OSError) as err:
            raise ConfigError(f"--distill-logits-path {config.distill_logits_path}: {err}") from err
        self._check_header(seq_length, vocab_size, last_position)
        self._check_data(dataset, dataset_hash, first_position, last_position)
        self._pin = torch.cuda.is_available()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="teacher-logits")
        self._ahead: tuple[tuple[int, ...], Callable[[], TopKBatch]] | None = None
        self._ahead_batch: TopKBatch | None = None

    def _check_header(self, seq_length: int, vocab_size: int, last_position: int) -> None:
        header, path = self.reader.header, self.config.distill_logits_path
        if header.seq_length != seq_length:
            raise ConfigError(
                f"{path}: teacher logits were made for --seq-length "
                f"{header.seq_length}, the student uses {seq_length}"
            )
        if header.vocab_size > vocab_size:
            raise ConfigError(
                f"{path}: the teacher's vocabulary ({header.vocab_size}) is larger "
                f"than the student's ({vocab_size})"
            )
        if last_position > header.num_samples:
            raise ConfigError(
                f"{path}: holds {header.num_samples} samples, the run needs "
                f"{last_position}; generate logits for the whole run"
            )

    def _check_data(self, dataset, dataset_hash: str, first: int, last: int) -> None:
        """Refuse logits of other data now, not hours into the run: the dataset description
        and the keys of samples spread over the rest of the run."""
        header = self.reader.header
        if header.dataset_hash != dataset_hash:
            log.warning(
                f"teacher logits were made for dataset {header.dataset_hash}, the student "
                f"trains on {dataset_hash}; checking samples"
            )
        positions = np.unique(np.linspace(first, last - 1, SPOT_CHECKS).round().astype(int))
        self._check_keys(dataset, positions.tolist())
        kind = f"{header.k} draws (sampled)" if header.kind == "sampled" else f"top-{header.k}"
        log.info(
            f"teacher logits {self.config.distill_logits_path}: teacher {header.teacher}, "
            f"{kind}, {header.num_samples} samples; {len(positions)} spot checks "
            f"passed"
        )

    def _check_keys(self, dataset, positions: Sequence[int]) -> None:
        keys = [dataset_key(dataset, p) for p in positions]
        try:
            self.reader.check_samples(positions, keys)
        except LogitStoreError as err:
            raise ConfigError(
                f"--distill-logits-path {self.config.distill_logits_path}: teacher "
                f"logits do not match the training data: {err}"
            ) from err

    def _read(self, positions: tuple[int, ...]) -> TopKBatch:
        return self.reader.read(positions, pin_memory=self._pin)

    def prefetch(self, positions: Sequence[int]) -> None:
        """Start decoding ``positions`` (the rank's samples of the next step) in the background,
        once the current step has taken its targets; the current step's batch is released."""
        key = tuple(int(p) for p in positions)
        if self._ahead is None or self._ahead[0] != key:
            self._ahead = (key, self._pool.submit(self._read, key).result)
            self._ahead_batch = None

    def _prefetched(self, positions: tuple[int, ...]) -> TopKBatch | None:
        """Rows of the prefetched step for a micro-batch (a contiguous run of its positions)."""
        if self._ahead is None or not positions or positions[0] not in self._ahead[0]:
            return None
        step, result = self._ahead
        start = step.index(positions[0])
        end = start + len(positions)
        if step[start:end] != positions:
            return None
        if self._ahead_batch is None:
            self._ahead_batch = result()
        keys, ids, probs = self._ahead_batch
        return TopKBatch(keys[start:end], ids[start:end], probs[start:end])

    def targets(self, positions: Sequence[int], samples: list[dict]) -> TeacherTargets:
        """The teacher's top-k for ``samples`` (at ``positions``), checked against their keys."""
        key = tuple(int(p) for p in positions)
        batch = self._prefetched(key)
        if batch is None:
            batch = self._read(key)
        expected = np.array([sample_key(sample_tokens(s)) for s in samples], dtype=np.uint64)
        if not np.array_equal(batch.sample_keys.astype(np.uint64), expected):
            self._check_keys_of(positions, expected)
        return TeacherTargets(batch.ids, batch.probs, self.config.kd_alpha, self.tail)

    @property
    def tail(self) -> str:
        """``--kd-tail``, for a top-k store. A sampled store's rows sum to 1 (no tail): the loss
        is the cross-entropy to the drawn ids' counts / N, unbiased only without a tail term
        (``label`` would add the label's cross-entropy where it was not drawn)."""
        return "ignore" if self.reader.header.kind == "sampled" else self.config.kd_tail

    def _check_keys_of(self, positions: Sequence[int], expected: np.ndarray) -> None:
        try:
            self.reader.check_samples(positions, expected.tolist())
        except LogitStoreError as err:
            raise LogitStoreError(
                f"{self.config.distill_logits_path}: teacher logits do not "
                f"match the training data: {err}"
            ) from err

    def close(self) -> None:
        self._ahead, self._ahead_batch = None, None
        self._pool.shutdown(wait=True, cancel_futures=True)
