"""Alignment datasets from JSON lines: preference pairs (DPO) and rewarded completions (QRPO),
written as the chat datasets :mod:`megatron.apertus.align.data` reads
(``tools/preprocess_preferences.py``).

One JSON line per example, in any of TRL's layouts (:mod:`megatron.apertus.prep.layouts`):

* DPO: ``{"prompt": P, "chosen": C, "rejected": R}`` with P a list of messages and C, R
  assistant messages (or their text), or all three text; or TRL's implicit prompt
  ``{"chosen": C, "rejected": R}``, whole conversations or texts whose shared start is the prompt;
* QRPO: ``{"prompt": P, "completion": C, "reward": r, "ref_rewards": [r1, r2, ...]}``
  where ``ref_rewards`` score the reference policy's own completions of the prompt; they
  define the quantile of ``reward`` (:func:`megatron.apertus.align.losses.quantile_rewards`),
  which is computed here, once.

A line may carry the reference log-probability of each completion (``ref_chosen_logp`` ..., see
:data:`REFERENCE_NAMES`); it is stored beside the example, NaN where a line gives none.
"""

from __future__ import annotations

import json
import math

import numpy as np

from megatron.apertus.data.chat import (
    ConversationError,
    control_token_ids,
    loss_mask_prefix,
    quantile_prefix,
    ref_logp_prefix,
)
from megatron.apertus.prep.layouts import preference
from megatron.apertus.prep.preprocess import decode_line
from megatron.apertus.tokenizer.tokenizers import Tokenizer

COMPLETIONS = {"dpo": ("chosen", "rejected"), "qrpo": ("completion",)}
"""The completion keys of an example, in sequence order."""
REFERENCE_NAMES = ("ref_{}_logp", "ref_{}_logps", "ref_{}_logprob")
"""Precomputed reference log-probabilities of completion ``{}``: ours, TRL's and
swiss-ai/posttraining's column names."""
MIN_REF_REWARDS = 2
"""Default of ``--qrpo-min-ref-rewards``: one reference reward gives only the quantiles 0 and 1,
and leaves the normal-icdf transform's clamp interval [1/n, 1 - 1/n] empty."""


def output_datasets(prefix: str, objective: str) -> dict[str, tuple[str, type]]:
    """Per output of the preprocessing tool under ``--output-prefix``: its dataset prefix and
    value dtype."""
    tokens = f"{prefix}_pref_document"
    outputs = {
        "tokens": (tokens, np.int32),
        "loss_mask": (loss_mask_prefix(tokens), np.uint8),
        "ref_logp": (ref_logp_prefix(tokens), np.float64),
    }
    if objective == "qrpo":
        outputs["quantile"] = (quantile_prefix(tokens), np.float64)
    return outputs


def _reward(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConversationError(f"{what} is not a finite number")
    return float(value)


def reference_logps(record: dict, objective: str) -> np.ndarray:
    """The line's precomputed reference log-probability of each completion (under any of
    :data:`REFERENCE_NAMES`), or NaNs when it gives none; a line that gives some but not all,
    or a value that is not a log-probability, is rejected."""
    values = []
    for key in COMPLETIONS[objective]:
        given = [name.format(key) for name in REFERENCE_NAMES if name.format(key) in record]
        if len(given) > 1:
            raise ConversationError(f"reference log-probability given twice ({', '.join(given)})")
        if given:
            value = _reward(record[given[0]], f"{given[0]!r}")
            if value > 0:
                raise ConversationError(f"{given[0]!r} is {value} > 0, not a log-probability")
            values.append(value)
        else:
            values.append(math.nan)
    if 0 < sum(math.isnan(v) for v in values) < len(values):
        missing = COMPLETIONS[objective][int(np.flatnonzero(np.isnan(values))[0])]
        raise ConversationError(
            f"no reference log-probability of {missing!r} (the other " "completion has one)"
        )
    return np.array(values, dtype=np.float64)


class PreferenceEncoder:
    """One JSON line -> its example's sequences, loss masks, precomputed reference
    log-probabilities (NaN when absent) and, for QRPO, quantile and reference-reward count."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        objective: str,
        max_tokens: int | None = None,
        min_ref_rewards: int = MIN_REF_REWARDS,
    ):
        control_token_ids(tokenizer)
        self.tokenizer, self.objective, self.max_tokens = tokenizer, objective, max_tokens
        self.min_ref_rewards = min_ref_rewards

    def outputs(self, prefix: str) -> dict[str, tuple[str, type]]:
        return output_datasets(prefix, self.objective)

    def _check_length(self, ids: np.ndarray) -> None:
        if self.max_tokens is not None and ids.size > self.max_tokens:
            raise ConversationError(
                f"over-long ({ids.size} tokens > --max-tokens {self.max_tokens})"
            )

    def __call__(self, raw: bytes) -> dict[str, list[np.ndarray]]:
        try:
            record = json.loads(decode_line(raw))
        except json.JSONDecodeError as err:
            raise ConversationError(f"invalid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(record, dict):
            raise ConversationError(f"not a JSON object but {type(record).__name__}")
        parsed = preference(record, COMPLETIONS[self.objective])
        if self.objective == "dpo" and parsed.completions[0] == parsed.completions[1]:
            raise ConversationError("chosen and rejected are identical")
        quantile = self._quantile(record) if self.objective == "qrpo" else None
        ref = reference_logps(record, self.objective)
        pairs = parsed.encode(self.tokenizer)
        for ids, _ in pairs:
            self._check_length(ids)
        example = {
            "tokens": [p[0] for p in pairs],
            "loss_mask": [p[1] for p in pairs],
            "ref_logp": [ref],
        }
        if quantile is not None:
            example["quantile"] = [quantile]
        return example

    def _quantile(self, record: dict) -> np.ndarray:
        """[quantile of the reward among the reference rewards, number of reference rewards]."""
        reward = _reward(record.get("reward"), "'reward'")
        references = record.get("ref_rewards")
        if not isinstance(references, list):
            raise ConversationError("no 'ref_rewards' list (the reference policy's rewards)")
        if len(references) < self.min_ref_rewards:
            raise ConversationError(
                f"{len(references)} reference rewards, fewer than --qrpo-min-ref-rewards "
                f"{self.min_ref_rewards}"
                + (" (the default)" if self.min_ref_rewards == MIN_REF_REWARDS else "")
            )
        ref = np.array([_reward(r, "a 'ref_rewards' entry") for r in references])
        return np.array([np.mean(ref <= reward), ref.size], dtype=np.float64)
