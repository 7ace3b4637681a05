"""Tokenize alignment data: DPO preference pairs or QRPO rewarded completions.

    python tools/preprocess_preferences.py --objective dpo --input pairs.jsonl \
        --output-prefix data/pairs --max-tokens 4097

DPO lines: ``{"prompt": [messages], "chosen": "...", "rejected": "..."}`` or any of TRL's
preference layouts (chosen and rejected as assistant messages, all text, or an implicit prompt:
whole ``chosen`` and ``rejected`` conversations or texts sharing their start); QRPO lines:
``{"prompt": [messages], "completion": "...", "reward": r, "ref_rewards": [r1, ...]}`` (or
text prompt and completion, or the completion as an assistant message); either
may carry the reference policy's log-probability of each completion (``ref_chosen_logp``,
``ref_rejected_logp``, ``ref_completion_logp``, or TRL's ``..._logps`` and swiss-ai's
``..._logprob``): then training uses them instead of its reference pass, and every line must
carry them. Writes ``data/pairs_pref_document.bin/.idx``, its ``_loss_mask`` and
``_ref_logp`` (QRPO also ``_quantile``); train with ``pretrain_gpt.py --align-objective dpo
--train-data-path data/pairs_pref_document``. Bad lines are reported as FILE:LINE: skipped:
REASON, counted and skipped; no line left, or reference log-probabilities on some lines only,
is an error (exit code 2, nothing written). The layouts: docs/post_training.md.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time
from pathlib import Path

from megatron.apertus.cli import ArgumentParser, run
from megatron.apertus.prep.preprocess import (
    add_corpus_arguments,
    corpus_config,
    format_summary,
    preprocess,
)

OBJECTIVES = ("dpo", "qrpo")
"""``megatron.apertus.align.losses.OBJECTIVES``, spelled out so that ``--help`` and argument
errors need not import torch (a test keeps the two equal)."""
MIN_REF_REWARDS = 2
"""``megatron.apertus.prep.preferences.MIN_REF_REWARDS``, spelled out for the same reason."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--objective", required=True, choices=OBJECTIVES)
    add_corpus_arguments(parser)
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="skip examples with a conversation longer than this (--seq-length + 1)",
    )
    parser.add_argument(
        "--qrpo-min-ref-rewards",
        type=int,
        default=MIN_REF_REWARDS,
        help="QRPO: skip completions with fewer reference rewards than this "
        f"(default {MIN_REF_REWARDS})",
    )
    args = parser.parse_args(argv)
    if args.qrpo_min_ref_rewards < 1:
        parser.error(f"--qrpo-min-ref-rewards must be >= 1, got {args.qrpo_min_ref_rewards}")
    return args


def _remove_outputs(prefix: str, objective: str) -> None:
    """Remove what this run wrote (a refused dataset is not left behind to be trained on)."""
    from megatron.apertus.prep.preferences import output_datasets

    for name, _ in output_datasets(prefix, objective).values():
        for suffix in (".bin", ".idx", ".meta.json"):
            Path(name + suffix).unlink(missing_ok=True)


def _check_reference(args: argparse.Namespace) -> None:
    """Refuse a run whose lines carry reference log-probabilities only in part (a run that kept
    no example is refused by ``preprocess`` itself)."""
    from megatron.apertus.align.data import partial_reference_error, stored_reference
    from megatron.apertus.prep.preferences import output_datasets

    inputs = ", ".join(args.input)
    tokens, _ = output_datasets(args.output_prefix, args.objective)["tokens"]
    values = stored_reference(tokens)
    error = None if values is None else partial_reference_error(values)
    if error:
        raise ValueError(f"{inputs}: {error}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("megatron.core").setLevel(logging.WARNING)  # index loading chatter
    args = parse_args(argv)
    from megatron.apertus.prep.preferences import PreferenceEncoder

    config = corpus_config(args)
    encoder = functools.partial(
        PreferenceEncoder,
        objective=args.objective,
        max_tokens=args.max_tokens,
        min_ref_rewards=args.qrpo_min_ref_rewards,
    )
    start = time.perf_counter()
    summary = preprocess(config, encoder)
    try:
        _check_reference(args)
    except ValueError as err:
        _remove_outputs(args.output_prefix, args.objective)
        print(f"preprocess_preferences.py: error: {err}", file=sys.stderr)
        return 2
    print(format_summary(summary, time.perf_counter() - start).replace("documents", "examples"))
    return 0


if __name__ == "__main__":
    run(main)
