"""Flags of a distillation run (``pretrain_gpt.py --distill-logits-path DIR``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help
from megatron.apertus.ops.constants import DEFAULT_TAIL, TAIL_MODES


@dataclass(kw_only=True, frozen=True)
class DistillConfig:
    distill_logits_path: Optional[str] = flag_help(
        "teacher top-k logits (tools/generate_teacher_logits.py) to distil from", None, ours=True
    )
    kd_alpha: float = flag_help(
        "loss = alpha * KL(teacher || student) + (1 - alpha) * CE", 0.9, ours=True
    )
    kd_tail: str = flag_help(
        f"teacher mass outside the top-k: {', '.join(TAIL_MODES)} (a sampled store has none)",
        DEFAULT_TAIL,
        ours=True,
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.kd_alpha <= 1.0:
            raise ConfigError(f"--kd-alpha must be in [0, 1], got {self.kd_alpha}")
        if self.kd_tail not in TAIL_MODES:
            raise ConfigError(
                f"--kd-tail must be one of {', '.join(TAIL_MODES)}, got {self.kd_tail!r}"
            )

    @property
    def enabled(self) -> bool:
        return self.distill_logits_path is not None
