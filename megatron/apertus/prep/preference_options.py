"""``tools/preprocess_preferences.py``'s own flags, apart from
:mod:`megatron.apertus.prep.preferences`: that module reads the alignment datasets through torch
and megatron-core, and ``--help`` and argument errors must start without them. The constants
below spell out the library's for the same reason (``tests/test_cli.py`` keeps them equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, get_args

from megatron.apertus.flags import flag_help, require

Objective = Literal["dpo", "qrpo"]
OBJECTIVES = get_args(Objective)
"""``megatron.apertus.align.losses.OBJECTIVES``, spelled out so that ``--help`` and argument
errors need not import torch (a test keeps the two equal)."""
MIN_REF_REWARDS = 2
"""``megatron.apertus.prep.preferences.MIN_REF_REWARDS``, spelled out for the same reason."""


@dataclass(kw_only=True, frozen=True)
class PreferenceOptions:
    """``tools/preprocess_preferences.py``'s flags beyond the corpus's: what
    :class:`~megatron.apertus.prep.preferences.PreferenceEncoder` keeps."""

    objective: Objective = flag_help("the alignment objective the examples are for", ours=True)
    max_tokens: Optional[int] = flag_help(
        "skip examples with a conversation longer than this (--seq-length + 1)", None, ours=True
    )
    qrpo_min_ref_rewards: int = flag_help(
        "QRPO: skip completions with fewer reference rewards than this "
        f"(default {MIN_REF_REWARDS})",
        MIN_REF_REWARDS,
        ours=True,
    )

    def __post_init__(self) -> None:
        require(
            self.qrpo_min_ref_rewards >= 1,
            "--qrpo-min-ref-rewards",
            self.qrpo_min_ref_rewards,
            ">= 1",
        )
