"""Flags of offline alignment (DPO, QRPO) after supervised fine-tuning.

The names of the objectives and their options live here, not in
:mod:`~megatron.apertus.align.losses` (which re-exports them): the flags serve ``--help``, which
must not import torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Optional

from megatron.apertus.flags import flag_help

OBJECTIVES = ("dpo", "qrpo")
TRANSFORMS = ("identity", "log", "normal-icdf")
LOG_PARTITIONS = ("exact", "approx")
LENGTH_NORMALIZATIONS = ("beta", "loss")


@dataclass(kw_only=True, frozen=True)
class AlignConfig:
    """Every alignment flag is ours (``ours=True``): neither Megatron-LM nor the Apertus fork
    has one."""

    align_objective: Optional[str] = flag_help(
        "offline alignment objective on datasets from tools/preprocess_preferences.py: dpo "
        "(pairs) or qrpo (completions with quantile rewards); start from the SFT model with "
        "--finetune --load, which is also the frozen reference",
        None,
        ours=True,
    )
    align_beta: float = flag_help("KL-regularisation strength beta of DPO and QRPO", 0.1, ours=True)
    align_length_normalization: bool = flag_help(
        "normalise by each completion's length in tokens (what --align-length-normalization-of "
        "says)",
        False,
        ours=True,
    )
    align_length_normalization_of: str = flag_help(
        "with --align-length-normalization: beta (DPO divides each log-ratio by its length, "
        "QRPO uses beta / length) or loss (each completion's loss divided by its length, a "
        "pair's by the mean of its two: swiss-ai/posttraining's normalize_loss_by_length)",
        "beta",
        ours=True,
    )
    qrpo_transform: str = flag_help(
        "QRPO's transform of the quantile reward, with its own partition function: identity, "
        "log (the QRPO authors' default) or normal-icdf",
        "identity",
        ours=True,
    )
    qrpo_log_partition: str = flag_help(
        "QRPO identity transform: exact log Z, or approx (log beta + 1/beta, as "
        "swiss-ai/posttraining and the QRPO authors' code use)",
        "exact",
        ours=True,
    )
    qrpo_max_beta: Optional[float] = flag_help(
        "clamp QRPO's effective beta (after length normalisation) at this maximum "
        "(swiss-ai/posttraining: 0.1); none by default",
        None,
        ours=True,
    )
    ref_logps_path: Optional[str] = flag_help(
        "directory of the reference policy's sequence log-probabilities: computed once from the "
        "--load weights on first start, then read (and checked against the data) on every "
        "resume; not needed when the data carries them (tools/preprocess_preferences.py)",
        None,
        ours=True,
    )

    def __post_init__(self) -> None:
        if self.align_objective is None:
            self._refuse_without_objective()
            return
        if self.align_objective not in OBJECTIVES:
            raise ValueError(
                f"--align-objective must be one of {', '.join(OBJECTIVES)}, "
                f"got {self.align_objective!r}"
            )
        if not (math.isfinite(self.align_beta) and self.align_beta > 0):
            raise ValueError(f"--align-beta must be a finite number > 0, got {self.align_beta}")
        _choice(
            "--align-length-normalization-of",
            self.align_length_normalization_of,
            LENGTH_NORMALIZATIONS,
        )
        if self.align_length_normalization_of != "beta" and not self.align_length_normalization:
            raise ValueError("--align-length-normalization-of needs --align-length-normalization")
        _choice("--qrpo-transform", self.qrpo_transform, TRANSFORMS)
        _choice("--qrpo-log-partition", self.qrpo_log_partition, LOG_PARTITIONS)
        if self.qrpo_max_beta is not None and not (
            math.isfinite(self.qrpo_max_beta) and self.qrpo_max_beta > 0
        ):
            raise ValueError(
                f"--qrpo-max-beta must be a finite number > 0, got {self.qrpo_max_beta}"
            )
        if self.qrpo_log_partition == "approx" and self.qrpo_transform != "identity":
            raise ValueError(
                f"--qrpo-log-partition approx applies to --qrpo-transform identity; "
                f"{self.qrpo_transform}'s log Z is exact in closed form"
            )
        if self.align_objective != "qrpo":
            for name in _changed(self):
                if name.startswith("qrpo_"):
                    raise ValueError(f"{_flag(name)} applies to --align-objective qrpo only")

    def _refuse_without_objective(self, given: Iterable[str] = ()) -> None:
        named = [f.name for f in dataclasses.fields(self) if f.name in set(given)]
        changed = named or _changed(self)
        if changed:
            raise ValueError(f"{_flag(changed[0])} needs --align-objective (dpo or qrpo)")

    def check_given(self, given: Iterable[str]) -> None:
        """Refuse an alignment flag the command line gives without --align-objective, even at
        its default value: such a run would silently train plain LM. ``given``: the flags'
        destinations the command line set; the construction itself only sees values."""
        if not self.enabled:
            self._refuse_without_objective(given)

    @property
    def enabled(self) -> bool:
        return self.align_objective is not None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


def _changed(config: AlignConfig) -> list[str]:
    """The fields given a value other than their default."""
    return [f.name for f in dataclasses.fields(config) if getattr(config, f.name) != f.default]
