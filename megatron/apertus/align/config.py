"""Flags of offline alignment (DPO, QRPO) after supervised fine-tuning."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron.apertus.align.losses import OBJECTIVES


def _help(text: str, default):
    """Every alignment flag is ours: neither Megatron-LM nor the Apertus fork has one."""
    return field(default=default, metadata={"help": text, "ours": True})


@dataclass(kw_only=True, frozen=True)
class AlignConfig:
    align_objective: Optional[str] = _help(
        "offline alignment objective on datasets from tools/preprocess_preferences.py: dpo "
        "(pairs) or qrpo (completions with quantile rewards); start from the SFT model with "
        "--finetune --load, which is also the frozen reference", None)  # fmt: skip
    align_beta: float = _help("KL-regularisation strength beta of DPO and QRPO", 0.1)
    align_length_normalization: bool = _help(
        "divide each sequence log-ratio by its completion length (DPO), or use beta / length "
        "(QRPO)", False)  # fmt: skip
    ref_logps_path: Optional[str] = _help(
        "directory of the reference policy's sequence log-probabilities: computed once from the "
        "--load weights on first start, then read (and checked against the data) on every "
        "resume", None)  # fmt: skip

    def __post_init__(self) -> None:
        if self.align_objective is not None and self.align_objective not in OBJECTIVES:
            raise ValueError(f"--align-objective must be one of {', '.join(OBJECTIVES)}, "
                             f"got {self.align_objective!r}")  # fmt: skip
        if self.align_beta <= 0:
            raise ValueError(f"--align-beta must be > 0, got {self.align_beta}")
        if self.align_objective and not self.ref_logps_path:
            raise ValueError("--align-objective needs --ref-logps-path (where the reference "
                             "log-probabilities are stored)")  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.align_objective is not None
