"""Goldfish loss (Hans et al. 2024): drop a deterministic 1/k of the label positions.

The decision for label ``i`` depends only on the ``h`` labels ending at ``i`` (inclusive), so a
passage repeated anywhere, in any sample, drops exactly the same tokens and can never be
learned verbatim from its repetitions. Windows cross document boundaries; the first ``h-1``
positions of a sample have no full window and are always kept.

Two hash rules, selected by ``--goldfish-hash``:

``apertus`` (parity with the Apertus fork)
    ``table`` holds 1_000_003 uniform floats from a CPU ``torch.Generator`` seeded 2971215073;
    ``key = (product of the h label ids as int64, wrapping on overflow) mod 1_000_003``
    (Python/``torch.remainder`` semantics, so the key is non-negative); drop iff
    ``table[key] < 1/k``. Its realised rate is below 1/k: whenever the window's ids carry 64
    or more factors of two the wrapped product is exactly 0, and all such windows share one
    table entry (about 9% of windows for h=50 on random ids), and any id 0 in a window does
    the same.
``mix64`` (default for new runs)
    each window is folded through the SplitMix64 finaliser, one id at a time; drop iff the
    top 53 bits, read as a fraction in [0, 1), are below ``1/k``. The expected drop rate is
    exactly 1/k and windows that share ids in other orders do not collide.

Masks are new tensors; cached dataset arrays are never modified. torch is imported by the
functions that use it: :class:`GoldfishConfig` serves ``--help``, which must not pay for it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from megatron.apertus.flags import switch

if TYPE_CHECKING:
    import torch

APERTUS_TABLE_SIZE = 1_000_003
APERTUS_TABLE_SEED = 2971215073
HASHES = ("mix64", "apertus")


@dataclass(kw_only=True, frozen=True)
class GoldfishConfig:
    k: int = 50
    """Drop one position in k."""
    h: int = 50
    """Context width of the hash: the labels ending at the position, inclusive."""
    hash: str = field(default="mix64", metadata={"ours": True})
    """Which positions drop: mix64 (SplitMix64 of the context) or apertus (the Apertus fork's
    table rule, for parity)."""
    exempt_special: bool = switch(
        "never drop the loss of control tokens (begin/end of document, chat tokens), as the "
        "Apertus-2 recipe does; off: every label is a candidate, as in Apertus-1",
        ours=True,
    )

    def __post_init__(self) -> None:
        if self.k < 2:
            raise ValueError(f"--goldfish-k must be >= 2, got {self.k}")
        if self.h < 1:
            raise ValueError(f"--goldfish-h must be >= 1, got {self.h}")
        if self.hash not in HASHES:
            raise ValueError(
                f"--goldfish-hash must be one of {', '.join(HASHES)}, got {self.hash!r}"
            )


@functools.cache
def apertus_table() -> torch.Tensor:
    import torch

    generator = torch.Generator().manual_seed(APERTUS_TABLE_SEED)
    return torch.rand(APERTUS_TABLE_SIZE, generator=generator)


def _apertus_drop(windows: torch.Tensor, k: int) -> torch.Tensor:
    import torch

    key = torch.remainder(windows.prod(dim=-1), APERTUS_TABLE_SIZE)
    return apertus_table()[key] < 1.0 / k


_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _mix64_drop(windows: torch.Tensor, k: int) -> torch.Tensor:
    import torch

    ids = windows.numpy().astype(np.uint64)
    with np.errstate(over="ignore"):
        acc = np.zeros(ids.shape[:-1], dtype=np.uint64)
        for j in range(ids.shape[-1]):
            acc = _splitmix64(acc ^ ids[..., j])
    fraction = (acc >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return torch.from_numpy(fraction < 1.0 / k)


def goldfish_drop_mask(
    labels: torch.Tensor, config: GoldfishConfig, special_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean [..., s] mask of the label positions to drop from the loss; with
    ``config.exempt_special``, positions whose label is one of ``special_ids`` are kept."""
    import torch

    labels = labels.detach().to("cpu", torch.int64)
    drop = torch.zeros(labels.shape, dtype=torch.bool)
    if labels.shape[-1] < config.h:
        return drop
    windows = labels.unfold(-1, config.h, 1)  # [..., s - h + 1, h], window ending at i
    rule = _apertus_drop if config.hash == "apertus" else _mix64_drop
    drop[..., config.h - 1 :] = rule(windows, config.k)
    if config.exempt_special and special_ids is not None:
        drop &= ~torch.isin(labels, special_ids)
    return drop
