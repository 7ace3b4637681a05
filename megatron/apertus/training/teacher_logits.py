"""Teacher top-k logits over a student's training data, in the order the student consumes it.

The student's training dataset is rebuilt from the student's own flags (blend, split, seed,
sequence length and run length: :meth:`TrainingConfig.dataset_sizes`), so position ``i`` of the
store is the ``i``-th sample the student will see. The teacher (any TP/PP layout) runs forward
over the store's blocks; each data-parallel group owns the blocks ``b % DP == dp_rank`` and its
writer (tensor rank 0 of the last pipeline stage) stores them. The top-k is global over the
tensor-parallel vocabulary shards: every shard's own top-k (a superset of its part of the global
top-k) is gathered and reduced once more; the log-probabilities use the all-reduced
log-sum-exp of the full vocabulary. An interrupted run resumes: finished blocks are skipped.

The last stage never holds the [tokens, vocabulary] logits: the teacher is built as a
:class:`megatron.apertus.model.topk.TopKGPTModel`, which returns the top-k itself, computing
logits through the output layer's weight for a chunk of tokens at a time (about 256 MiB of
them). Each chunk's logits are bitwise the unchunked output layer's rows, so the store's bytes
are those of the full logits (docs/teacher_logits.md: where that was measured, and the small
chunks for which a GEMM differs in the last bit).

This runner lives in ``training`` beside the loop because, like the loop, it drives a model
from checkpoints, configs and step helpers of this layer, and builds its device, process groups,
tokenizer, the student's dataset and its model chunks through the loop's own
:mod:`megatron.apertus.training.runtime`; ``distill`` keeps only what the trainer consumes
(store, codec, targets, config), so it never imports ``training``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.utils import is_pp_last_stage
from tqdm import tqdm

from megatron.apertus import checkpoint, parallel
from megatron.apertus.data.batches import Batch, BatchConfig, collate
from megatron.apertus.data.context_parallel import gather_tokens, shard_batch, shard_tokens
from megatron.apertus.distill.logit_store import (
    LogitStoreWriter,
    StoreHeader,
    check_store_dir,
    default_samples_per_block,
    draw_uniforms,
    sample_key,
)
from megatron.apertus.distill.targets import sample_tokens
from megatron.apertus.model.builder import chunk_groups
from megatron.apertus.model.config import ApertusConfig
from megatron.apertus.training import runtime
from megatron.apertus.training.step import packed_seq_params_to, schedule
from megatron.apertus.training.teacher_logits_config import GenerationConfig

log = logging.getLogger("apertus.distill")


def teacher_identifier(load: str, model: ApertusConfig) -> str:
    """Checkpoint directory (with its iteration) and a hash of the teacher's architecture."""
    resolved = checkpoint.resolve_checkpoint(load)
    digest = hashlib.blake2b(model.to_json().encode(), digest_size=6).hexdigest()
    return f"{resolved.resolve()}#{digest}"


# -- forward over a block ---------------------------------------------------------------------------


def _forward_step(data_iterator: Iterator[tuple[Batch, torch.Tensor | None]], model):
    """One micro-batch, with the uniforms its draws are taken at (a sampled store's last stage;
    else None); the last stage's output is already its top-k (or draws), which the schedule
    keeps as it is when there is no loss function."""
    batch, uniforms = next(data_iterator)
    cp = chunk_groups(model).cp
    batch = shard_batch(batch, cp.rank(), cp.size())
    device = next(model.parameters()).device
    output = model(
        batch.tokens.to(device),
        batch.position_ids.to(device),
        None,
        packed_seq_params=packed_seq_params_to(batch.packed_seq_params, device, cp),
        uniforms=uniforms,
    )
    return output, None


def _padded(positions: list[int], micro: int, stages: int) -> list[int]:
    """``positions`` padded by repeating the last to whole micro-batches of ``micro`` samples
    (megatron-core's schedules need one shape for all of them), and to a multiple of ``stages``
    micro-batches (its interleaved schedule runs them in groups of one per pipeline stage);
    the padding's outputs are dropped after the forward."""
    return positions + [positions[-1]] * (-len(positions) % (micro * stages))


def _micro_batches(dataset, padded: list[int], micro: int, config: BatchConfig) -> list[Batch]:
    """Micro-batches of ``micro`` samples of the :func:`_padded` positions ``padded``."""
    return [
        collate([dataset[p] for p in padded[i : i + micro]], config)
        for i in range(0, len(padded), micro)
    ]


class TeacherRunner:
    """One process of the teacher: its model chunks, the student's dataset, the store writer;
    it communicates over the runtime's process groups."""

    def __init__(self, cfg: GenerationConfig) -> None:
        self.cfg = cfg
        self.runtime = runtime.start(cfg.parallel, model=cfg.model, training=cfg.training)
        self.groups = self.runtime.groups
        self.tokenizer = runtime.tokenizer(cfg.data, cfg.model)
        self.dataset, _ = runtime.pretraining_datasets(
            cfg.dataset, self.tokenizer, model=cfg.model, training=cfg.training
        )
        self.batch = BatchConfig(
            eod=self.tokenizer.eod, pack_documents=cfg.dataset.reset_attention_mask
        )
        self.chunks = self._load_teacher()
        self.store_header = self._header()
        self.writer = self._writer()

    def _load_teacher(self) -> list:
        cfg = self.cfg
        chunks = runtime.model_chunks(
            cfg.model,
            cfg.parallel,
            training=cfg.training,
            runtime=self.runtime,
            packed_documents=cfg.dataset.reset_attention_mask,
            topk=cfg.logits.topk,
            topk_chunk_rows=cfg.logits.topk_chunk_rows,
        )
        checkpoint.load_model(cfg.load, chunks)
        # No Float16Module: the parameters are already in the teacher's dtype, token ids need no
        # input conversion, and the top-k and the row statistics read each chunk's 16-bit logits
        # directly (no fp32 copy).
        for chunk in chunks:
            chunk.eval()
        return chunks

    @property
    def is_writer(self) -> bool:
        groups = self.groups
        return is_pp_last_stage(groups.pp) and groups.tp.rank() == 0 and groups.cp.rank() == 0

    @property
    def sampled(self) -> bool:
        return self.cfg.logits.sampling == "random"

    @property
    def sampling_seed(self) -> int:
        seed = self.cfg.logits.sampling_seed
        return self.cfg.training.seed if seed is None else seed

    def _header(self) -> StoreHeader:
        cfg = self.cfg
        return StoreHeader(
            k=cfg.logits.samples if self.sampled else cfg.logits.topk,
            kind="sampled" if self.sampled else "topk",
            seed=self.sampling_seed if self.sampled else None,
            vocab_size=cfg.model.vocab_size,
            seq_length=cfg.model.seq_length,
            num_samples=cfg.training.total_samples(),
            samples_per_block=cfg.logits.samples_per_block
            or default_samples_per_block(cfg.model.seq_length),
            teacher=cfg.logits.teacher_name or teacher_identifier(cfg.load, cfg.model),
            dataset_hash=self.dataset.unique_description_hash,
        )

    def _writer(self) -> LogitStoreWriter | None:
        """Data-parallel rank 0's writer creates the store before the others open it."""
        dp_rank, dp_size = self.groups.dp.rank(), self.groups.dp.size()
        writer = None
        for turn in (True, False):
            if self.is_writer and (dp_rank == 0) == turn:
                writer = LogitStoreWriter(
                    self.cfg.logits.logits_dir, self.store_header, rank=dp_rank, world_size=dp_size
                )
            dist.barrier()
        return writer

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.runtime.device)

    def pending_blocks(self) -> list[int]:
        """This data-parallel group's unfinished blocks, as its writer sees them."""
        group = self.groups.mp
        flags = self._tensor([int(self.is_writer)] * group.size())
        dist.all_gather_into_tensor(flags, self._tensor([int(self.is_writer)]), group=group)
        source = dist.get_global_rank(group, int(flags.argmax()))
        pending = self.writer.pending_blocks() if self.writer is not None else []
        count = self._tensor([len(pending)])
        dist.broadcast(count, source, group=group)
        blocks = (
            self._tensor(pending) if self.writer is not None else self._tensor([0] * int(count))
        )
        if int(count):
            dist.broadcast(blocks, source, group=group)
        return self._from_first_context_rank(blocks.tolist())

    def _from_first_context_rank(self, blocks: list[int]) -> list[int]:
        """Context-parallel ranks share the writer of their first rank, and so its blocks."""
        group = self.groups.cp
        if group.size() == 1:
            return blocks
        shared = [blocks]
        dist.broadcast_object_list(shared, dist.get_global_rank(group, 0), group=group)
        return shared[0]

    def block_topk(self, positions: list[int]) -> tuple[np.ndarray, ...] | None:
        """Teacher top-k ids [n, s, k] and log-probabilities of the samples at ``positions``;
        of a sampled store, the drawn ids [n, s, N] alone."""
        micro = self.cfg.training.micro_batch_size
        padded = _padded(positions, micro, self.groups.pp.size() if len(self.chunks) > 1 else 1)
        batches = _micro_batches(self.dataset, padded, micro, self.batch)
        seq = self.cfg.model.seq_length
        packed = self.batch.pack_documents
        uniforms = [None] * len(batches)
        if self.sampled and is_pp_last_stage(self.groups.pp):
            uniforms = self._uniforms(padded, micro, batches)
        iterators = [iter(zip(batches, uniforms)) for _ in self.chunks]
        with torch.no_grad():
            outputs = schedule(self.chunks)(
                forward_step_func=_forward_step,
                data_iterator=iterators[0] if len(iterators) == 1 else iterators,
                model=self.chunks,
                num_microbatches=len(batches),
                seq_length=seq * micro if packed else seq,
                micro_batch_size=1 if packed else micro,
                forward_only=True,
                collect_non_loss_data=True,
            )
        if is_pp_last_stage(self.groups.pp):
            outputs = [
                self._whole_sequence(batch, output) for batch, output in zip(batches, outputs)
            ]
        if not self.is_writer:
            return None
        if self.sampled:
            draws = torch.cat([o[0].reshape(-1, seq, o[0].shape[-1]) for o in outputs])
            return (draws[: len(positions)].cpu().numpy(),)
        k = self.cfg.logits.topk
        ids = torch.cat([o[0].reshape(-1, seq, k) for o in outputs])[: len(positions)]
        logprobs = torch.cat([o[1].reshape(-1, seq, k) for o in outputs])[: len(positions)]
        return ids.cpu().numpy(), logprobs.cpu().numpy()

    def _uniforms(self, padded: list[int], micro: int, batches: list[Batch]) -> list:
        """Each micro-batch's uniforms [b, s, N] (packed: [1, b*s, N]) of the :func:`_padded`
        positions ``padded``, fixed by the sampling seed and each sample's position alone (the
        padding repeats the last sample's); under context parallelism this rank's tokens of
        them, as its share of the batch."""
        seq, draws = self.cfg.model.seq_length, self.cfg.logits.samples
        rank, size = self.groups.cp.rank(), self.groups.cp.size()
        result = []
        for i, batch in enumerate(batches):
            u = np.stack(
                [
                    draw_uniforms(self.sampling_seed, p, seq, draws)
                    for p in padded[i * micro : (i + 1) * micro]
                ]
            )
            whole = torch.from_numpy(u).reshape(*batch.tokens.shape, draws)
            result.append(shard_tokens(whole, batch, rank, size))
        return result

    def _whole_sequence(self, batch: Batch, output: tuple[torch.Tensor, torch.Tensor]):
        """A micro-batch's (ids, log-probabilities) over the whole sequence, from the CP ranks'
        shares."""
        group = self.groups.cp
        return tuple(gather_tokens(t, batch, group.rank(), group.size(), group) for t in output)

    def run(self) -> None:
        pending = self.pending_blocks()
        bar = tqdm(
            total=len(pending),
            unit="block",
            disable=not self.is_writer,
            desc=f"teacher logits (dp rank {self.groups.dp.rank()})",
        )
        start, tokens = time.perf_counter(), 0
        for block in pending:
            positions = list(self.store_header.block_positions(block))
            result = self.block_topk(positions)
            if result is not None:
                keys = np.array(
                    [sample_key(sample_tokens(self.dataset[p])) for p in positions], dtype=np.uint64
                )
                if self.sampled:
                    self.writer.write_sampled_block(block, keys, *result)
                else:
                    self.writer.write_block(block, keys, *result)
            tokens += len(positions) * self.cfg.model.seq_length
            bar.set_postfix(tokens_s=f"{tokens / (time.perf_counter() - start):.0f}")
            bar.update()
        bar.close()
        dist.barrier()
        if self.writer is not None and self.groups.dp.rank() == 0:
            self.writer.finalize()
            log.info(f"teacher logits complete: {self.cfg.logits.logits_dir}")


def generate(cfg: GenerationConfig) -> None:
    check_store_dir(cfg.logits.logits_dir)  # before the checkpoint, the data and the model
    try:  # a refusal while building must not leave the process groups to a library caller
        TeacherRunner(cfg).run()
    finally:
        parallel.shutdown()
