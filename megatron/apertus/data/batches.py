"""Fixed-length language-model samples cut from a token stream, split over data-parallel ranks.

Sample ``i`` is ``stream[i*S : i*S + S + 1]`` (inputs and shifted labels). Global batch ``g``
holds samples ``[g*B, (g+1)*B)``; data-parallel rank ``r`` of ``D`` takes the contiguous
``B/D`` of them and cuts them into micro-batches. The sample set of a step is therefore
independent of the parallel layout, which is what makes TP/PP/DP runs comparable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, s] int64
    labels: torch.Tensor  # [b, s] int64
    loss_mask: torch.Tensor  # [b, s] float32
    position_ids: torch.Tensor  # [b, s] int64


def num_samples(stream: np.ndarray, seq_length: int) -> int:
    return (len(stream) - 1) // seq_length


def make_batch(stream: np.ndarray, sample_ids: np.ndarray, seq_length: int) -> Batch:
    rows = np.stack([stream[i * seq_length : i * seq_length + seq_length + 1] for i in sample_ids])
    rows = torch.from_numpy(rows.astype(np.int64))
    tokens, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    positions = torch.arange(seq_length).unsqueeze(0).expand_as(tokens).contiguous()
    return Batch(tokens, labels, torch.ones_like(tokens, dtype=torch.float32), positions)


def micro_batches(
    stream: np.ndarray,
    *,
    seq_length: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    start_step: int = 0,
) -> Iterator[Batch]:
    """Endless micro-batches for this data-parallel rank, cycling over the stream (a stream
    shorter than a global batch repeats samples within it)."""
    per_rank = global_batch_size // dp_size
    total = num_samples(stream, seq_length)
    if total < 1:
        raise ValueError(
            f"the token stream holds fewer than {seq_length + 1} tokens: no sample fits"
        )
    step = start_step
    while True:
        first = step * global_batch_size + dp_rank * per_rank
        ids = (first + np.arange(per_rank)) % total
        for m in range(0, per_rank, micro_batch_size):
            yield make_batch(stream, ids[m : m + micro_batch_size], seq_length)
        step += 1
