"""Offline alignment (DPO, QRPO) inside the training loop.

The run starts from the SFT model (``--finetune --load``), whose weights are also the frozen
reference policy: before the first step, if ``--ref-logps-path`` holds no values yet, one
forward pass over the training and validation examples computes the reference sequence
log-probabilities, data-parallel ranks each taking a contiguous share (a progress bar with the
time left on the reporting rank), and they are stored
(:mod:`megatron.apertus.align.reference`). Every later start, resumes included, reads them and
checks them against the data. Data that carries its own reference log-probabilities
(:func:`megatron.apertus.align.data.precomputed_reference`) needs no reference pass.

Examples are visited in a seeded permutation; a step's global batch holds examples
``[consumed, consumed + B)`` of it, split over data-parallel ranks exactly as pretraining
samples are (:func:`megatron.apertus.data.batches.rank_positions`).
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import numpy as np
import torch
from megatron.core.pipeline_parallel.utils import is_pp_last_stage
from tqdm import tqdm

from megatron.apertus.align import reference
from megatron.apertus.align.config import AlignConfig
from megatron.apertus.align.data import PreferenceDataset
from megatron.apertus.align.objective import PreferenceBatch, alignment_loss, collate
from megatron.apertus.data.batches import rank_positions
from megatron.apertus.data.datasets import DatasetConfig
from megatron.apertus.distill.logit_store import LogitStoreError
from megatron.apertus.errors import ConfigError
from megatron.apertus.model.builder import chunk_groups
from megatron.apertus.training.step import StepShape, run_microbatches, token_forward

log = logging.getLogger("apertus")


def _check_ref_rewards(config: AlignConfig, data: PreferenceDataset) -> None:
    """Refuse normal-icdf on quantiles from a single reference reward: they are 0 or 1, the
    clamp to [1/n, 1 - 1/n] is empty at n = 1 and leaves Phi^-1 at -inf, so every step would be
    skipped. Widening the clamp instead would depart from the QRPO authors' transform, which the
    data with two or more reference rewards reproduces exactly."""
    if config.qrpo_transform != "normal-icdf":
        return
    fewest = data.fewest_ref_rewards()
    if fewest is not None and fewest < 2:
        raise ConfigError(
            f"--qrpo-transform normal-icdf needs two or more reference rewards per example, but "
            f"{data.prefix} has examples with {fewest} (preprocessed with "
            f"--qrpo-min-ref-rewards {fewest}): preprocess with --qrpo-min-ref-rewards 2 or "
            "use --qrpo-transform identity or log"
        )


def _single_prefix(flag: str, blend: list[str]) -> str | None:
    if not blend:
        return None
    if len(blend) != 1:
        raise ConfigError(f"{flag}: alignment reads one dataset prefix, got {len(blend)} values")
    return blend[0]


class AlignRun:
    """Datasets, reference log-probabilities and micro-batches of one alignment run."""

    def __init__(
        self,
        config: AlignConfig,
        dataset: DatasetConfig,
        *,
        seq_length: int,
        pad: int,
        seed: int,
        fused_output_loss: bool,
    ) -> None:
        self.config = config
        if fused_output_loss:
            raise ConfigError(
                "--align-objective needs each token's log-probability: the run's output loss "
                "must be unfused"
            )
        train = _single_prefix("--train-data-path", dataset.train_data_path)
        if train is None or dataset.data_path:
            raise ConfigError(
                "--align-objective reads --train-data-path PREFIX (and optionally "
                "--valid-data-path) from tools/preprocess_preferences.py"
            )
        valid = _single_prefix("--valid-data-path", dataset.valid_data_path)
        objective = config.align_objective
        mmap = dataset.mmap_bin_files
        self.parts = {"train": PreferenceDataset(train, objective, seq_length, pad, mmap)}
        if valid is not None:
            self.parts["valid"] = PreferenceDataset(valid, objective, seq_length, pad, mmap)
        for data in self.parts.values():
            _check_ref_rewards(config, data)
            if data.ref_logps is None and not config.ref_logps_path:
                raise ConfigError(
                    f"--align-objective: {data.prefix} carries no reference "
                    "log-probabilities: give --ref-logps-path (where the reference "
                    "pass stores them)"
                )
        self.order = np.random.default_rng(seed).permutation(len(self.parts["train"]))
        self.ref: dict[str, torch.Tensor] = {}
        self._stored: dict[str, tuple[Path, reference.ReferenceLogps]] = {}

    @property
    def train_data(self) -> PreferenceDataset:
        return self.parts["train"]

    @property
    def valid_data(self) -> PreferenceDataset | None:
        return self.parts.get("valid")

    # -- reference log-probabilities -------------------------------------------------------------

    def prepare(
        self, model, micro_batch_size: int, *, reference_name: str, fresh: bool, reporting: bool
    ) -> None:
        """Read the stored reference log-probabilities, computing and storing them first when
        ``--ref-logps-path`` holds none yet and the weights are the reference (``fresh``: no
        alignment step taken); every rank takes part."""
        for name, data in self.parts.items():
            if data.ref_logps is not None:
                self.ref[name] = torch.from_numpy(data.ref_logps.copy())
                if reporting:
                    log.info(
                        f"reference log-probabilities of {data.ref_logps.size} {name} "
                        f"sequences read from the data ({data.prefix})"
                    )
                continue
            directory = Path(self.config.ref_logps_path)
            path = directory / f"{name}.bin"
            data_hash = reference.dataset_hash(data.prefix)
            if not path.exists() and not fresh:
                raise ConfigError(
                    f"--ref-logps-path: {path} is missing and the loaded weights "
                    "are no longer the reference (training has started)"
                )
            if not path.exists():
                values = self._compute(model, data, micro_batch_size, name, reporting)
                if reporting:
                    directory.mkdir(parents=True, exist_ok=True)
                    reference.write(path, values, data_hash=data_hash, reference=reference_name)
                    log.info(
                        f"reference log-probabilities of {len(values.keys)} {name} sequences "
                        f"stored in {path}"
                    )
                torch.distributed.barrier()
            try:
                stored, _ = reference.read(path, data_hash=data_hash)
            except LogitStoreError as err:
                raise ConfigError(f"--ref-logps-path: {err}") from err
            if len(stored.keys) != data.group * len(data):
                raise ConfigError(
                    f"--ref-logps-path {path}: {len(stored.keys)} sequences, the "
                    f"data has {data.group * len(data)}"
                )
            self.ref[name] = torch.from_numpy(stored.logps.copy())
            self._stored[name] = (path, stored)

    def _compute(
        self, model, data: PreferenceDataset, micro_batch_size: int, name: str, reporting: bool
    ):
        """Reference values of every sequence of ``data`` from the current weights, over the
        groups the model was built with."""
        groups = chunk_groups(model[0])
        dp, rank = groups.dp.size(), groups.dp.rank()
        share = -(-len(data) // dp)
        examples = [min(i, len(data) - 1) for i in range(rank * share, (rank + 1) * share)]
        # Whole micro-batches (pipeline stages send one shape), in groups of one per stage
        # under the interleaved schedule; the padding's values are dropped.
        stages = groups.pp.size() if len(model) > 1 else 1
        examples += examples[-1:] * (-share % (micro_batch_size * stages))
        zero = torch.zeros(data.group * len(data), dtype=torch.float64)
        batches = [
            self._batch(data, examples[i : i + micro_batch_size], zero)
            for i in range(0, len(examples), micro_batch_size)
        ]
        for chunk in model:
            chunk.eval()
        reported = []
        with torch.no_grad(), tqdm(
            total=share * data.group * dp,
            unit=" sequences",
            desc=f"reference log-probs ({name})",
            disable=not reporting,
            mininterval=1.0,
        ) as bar:
            for part in _pieces(batches, groups.pp.size(), stages):
                shape = StepShape(
                    num_microbatches=len(part),
                    seq_length=data.seq_length,
                    micro_batch_size=micro_batch_size * data.group,
                )
                reported += run_microbatches(
                    model,
                    [iter(part) for _ in model],
                    shape,
                    forward_only=True,
                    forward=partial(
                        token_forward, loss=partial(alignment_loss, self.config, groups.cp)
                    ),
                )
                bar.update(sum(b.tokens.shape[0] for b in part) * dp)
        for chunk in model:
            chunk.train()
        logps = torch.zeros(share * data.group, dtype=torch.float64)
        if is_pp_last_stage(groups.pp):
            logps = torch.cat([entry["sequence logp"].cpu() for entry in reported])
            logps = logps[: share * data.group]
        gathered = [torch.zeros_like(logps) for _ in range(dp)]
        torch.distributed.all_gather(gathered, logps, group=groups.dp)
        values = torch.cat(gathered)[: data.group * len(data)].numpy()
        sequences = [data.sequence(i) for i in range(data.group * len(data))]
        return reference.ReferenceLogps(
            keys=np.array([reference.sequence_key(ids) for ids, _ in sequences], dtype=np.uint64),
            logps=values.astype(np.float64),
            lengths=np.array([int(mask[1:].sum()) for _, mask in sequences], dtype=np.int32),
        )

    # -- micro-batches ---------------------------------------------------------------------------

    def _batch(
        self, data: PreferenceDataset, examples: list[int], ref: torch.Tensor
    ) -> PreferenceBatch:
        rows = [data.group * e + j for e in examples for j in range(data.group)]
        return collate([data[e] for e in examples], ref[rows])

    def micro_batches(
        self,
        name: str,
        consumed: int,
        global_batch: int,
        micro_batch_size: int,
        dp_size: int,
        dp_rank: int,
    ) -> list[PreferenceBatch]:
        """Data-parallel rank ``dp_rank``'s micro-batches of the step that starts at example
        ``consumed``."""
        data = self.parts[name]
        positions = rank_positions(
            consumed,
            global_batch,
            dp_rank=dp_rank,
            dp_size=dp_size,
            length=len(data),
        )
        examples = [int(self.order[p]) if name == "train" else p for p in positions]
        rows = np.array([data.group * e + j for e in examples for j in range(data.group)])
        if name in self._stored:  # values from the reference pass, keyed by their sequences
            path, stored = self._stored[name]
            reference.check_keys(path, stored, rows, [data.sequence(r)[0] for r in rows])
        return [
            self._batch(data, examples[i : i + micro_batch_size], self.ref[name])
            for i in range(0, len(examples), micro_batch_size)
        ]

    def shape(self, num_microbatches: int, seq_length: int, micro_batch_size: int) -> StepShape:
        return StepShape(
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size * self.train_data.group,
        )


def _pieces(
    batches: list[PreferenceBatch], pipeline_stages: int, group: int
) -> list[list[PreferenceBatch]]:
    """The reference pass's micro-batches in schedule calls of at least ``2 x stages`` (and 8)
    micro-batches each, so that the progress bar moves while the pipeline stays full; each
    call's count is a multiple of ``group`` (of which ``batches`` holds a multiple)."""
    groups = len(batches) // group
    count = max(1, len(batches) // max(8, 2 * pipeline_stages))
    bounds = [group * (i * groups // count) for i in range(count + 1)]
    return [batches[a:b] for a, b in zip(bounds, bounds[1:])]
