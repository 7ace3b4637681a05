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
from megatron.apertus.flags import add_arguments, from_arguments
from megatron.apertus.prep.preference_options import PreferenceOptions
from megatron.apertus.prep.preprocess import (
    PreprocessConfig,
    add_corpus_arguments,
    corpus_config,
    format_summary,
    preprocess,
)


def parse_args(argv: list[str] | None = None) -> tuple[PreprocessConfig, PreferenceOptions]:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser, PreferenceOptions, title="examples")
    add_corpus_arguments(parser)
    args = parser.parse_args(argv)
    return corpus_config(args), from_arguments(PreferenceOptions, args)


def _remove_outputs(prefix: str, objective: str) -> None:
    """Remove what this run wrote (a refused dataset is not left behind to be trained on)."""
    from megatron.apertus.prep.preferences import output_datasets

    for name, _ in output_datasets(prefix, objective).values():
        for suffix in (".bin", ".idx", ".meta.json"):
            Path(name + suffix).unlink(missing_ok=True)


def _check_reference(config: PreprocessConfig, objective: str) -> None:
    """Refuse a run whose lines carry reference log-probabilities only in part (a run that kept
    no example is refused by ``preprocess`` itself)."""
    from megatron.apertus.align.data import partial_reference_error, stored_reference
    from megatron.apertus.prep.preferences import output_datasets

    inputs = ", ".join(str(path) for path in config.inputs)
    tokens, _ = output_datasets(config.output_prefix, objective)["tokens"]
    values = stored_reference(tokens)
    error = None if values is None else partial_reference_error(values)
    if error:
        raise ValueError(f"{inputs}: {error}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("megatron.core").setLevel(logging.WARNING)  # index loading chatter
    config, options = parse_args(argv)
    from megatron.apertus.prep.preferences import PreferenceEncoder

    encoder = functools.partial(
        PreferenceEncoder,
        objective=options.objective,
        max_tokens=options.max_tokens,
        min_ref_rewards=options.qrpo_min_ref_rewards,
    )
    start = time.perf_counter()
    summary = preprocess(config, encoder)
    try:
        _check_reference(config, options.objective)
    except ValueError as err:
        _remove_outputs(config.output_prefix, options.objective)
        print(f"preprocess_preferences.py: error: {err}", file=sys.stderr)
        return 2
    print(format_summary(summary, time.perf_counter() - start).replace("documents", "examples"))
    return 0


if __name__ == "__main__":
    run(main)
