"""Flags of text generation (``tools/generate_text.py``) and the prompts it reads, apart from
the generator (:mod:`megatron.apertus.inference.generate`) so that ``--help`` and every refusal
of a flag or a prompts file need neither torch nor megatron-core.

Sampling follows megatron-core's text generation controller: ``--top-k 1`` is greedy (argmax,
the temperature unused); otherwise the logits are divided by the temperature, cut to the ``k``
most likely tokens (``--top-k`` > 1) or to the smallest set whose probability reaches ``p``
(``--top-p`` > 0, the token that crosses ``p`` kept), and a token is drawn. ``--top-k`` and
``--top-p`` together are refused, as there; neither samples from the whole distribution.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import ADDITION_MARK, flag_help, require, switch

PROMPT_FIELD = "prompt"
"""The field of a ``--prompts-file`` line that holds its prompt; the line's other fields are
copied to its output line."""


@dataclass(kw_only=True, frozen=True)
class SamplingConfig:
    num_tokens_to_generate: int = flag_help(
        "tokens generated per prompt at most; fewer when the end-of-document token comes", 30
    )
    temperature: float = flag_help("sampling temperature (unused by greedy --top-k 1)", 1.0)
    top_k: int = flag_help(
        "sample from the k most likely tokens; 1: greedy (the default, as Megatron-LM's "
        "static inference example); 0: no top-k cut",
        1,
    )
    top_p: float = flag_help(
        "sample from the smallest set of tokens whose probability reaches p (0: no top-p cut; "
        "needs --top-k 0)",
        0.0,
    )
    seed: int = flag_help("seed of the sampling generator (unused by greedy decoding)", 1234)
    return_log_probs: bool = switch(
        "also write each prompt token's and each generated token's log-probability under the "
        "model (the raw logits: before temperature and cuts); with --num-tokens-to-generate 0 "
        "the prompts are scored only"
    )
    skip_prompt_log_probs: bool = switch(
        "with --return-log-probs, the generated tokens' log-probabilities only (the prompt is "
        "then not materialized at every position)"
    )
    top_n_logprobs: int = flag_help(
        "also write the n most likely tokens and their log-probabilities at each generated "
        "position (and each prompt position unless --skip-prompt-log-probs); 0: none",
        0,
    )

    def __post_init__(self) -> None:
        tokens = self.num_tokens_to_generate
        if self.prompt_log_probs:
            require(tokens >= 0, "--num-tokens-to-generate", tokens, "at least 0")
        else:
            require(
                tokens >= 1,
                "--num-tokens-to-generate",
                tokens,
                "at least 1 (0 scores the prompts: with --return-log-probs)",
            )
        require(self.top_n_logprobs >= 0, "--top-n-logprobs", self.top_n_logprobs, "at least 0")
        if self.skip_prompt_log_probs and not self.log_probs:
            raise ConfigError(
                "--skip-prompt-log-probs needs --return-log-probs or --top-n-logprobs"
            )
        require(self.temperature > 0, "--temperature", self.temperature, "positive")
        require(self.top_k >= 0, "--top-k", self.top_k, "at least 0")
        require(0.0 <= self.top_p <= 1.0, "--top-p", self.top_p, "in [0, 1]")
        if self.top_k > 0 and self.top_p > 0:
            raise ConfigError(
                f"--top-k {self.top_k} and --top-p {self.top_p}: give one of them (megatron-core "
                "samples with either a top-k or a top-p cut, not both); --top-k 0 --top-p P "
                "samples with top-p alone"
            )

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @property
    def log_probs(self) -> bool:
        """Whether any log-probability is written."""
        return self.return_log_probs or self.top_n_logprobs > 0

    @property
    def prompt_log_probs(self) -> bool:
        """Whether the prefill materializes the logits at every prompt position."""
        return self.log_probs and not self.skip_prompt_log_probs


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that say which checkpoint to load, with which tokenizer, on which device."""
    parser.add_argument(
        "--load", required=True, help="save directory (follows its tracker) or iter_* directory"
    )
    parser.add_argument(
        "--ckpt-step", type=int, help="the iteration of --load to load (default: the latest)"
    )
    parser.add_argument(
        "--tokenizer-type", help="default: the one the checkpoint's training run recorded"
    )
    parser.add_argument(
        "--tokenizer-model", help="default: the one the checkpoint's training run recorded"
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto, cpu or cuda" + ADDITION_MARK,
    )


def check_checkpoint_arguments(args: argparse.Namespace) -> None:
    if args.ckpt_step is not None and args.ckpt_step < 0:
        raise ConfigError(f"--ckpt-step must be >= 0, got {args.ckpt_step}")


@dataclass(frozen=True)
class Prompt:
    """One prompt and what its output line repeats (a ``--prompts-file`` line's fields)."""

    text: str
    fields: dict
    source: str
    """Where it was given (``--prompt 2``, ``FILE:7``), for refusals that name it."""


def from_flags(texts: list[str]) -> list[Prompt]:
    return [Prompt(t, {PROMPT_FIELD: t}, f"--prompt {i + 1}") for i, t in enumerate(texts)]


def read_prompts_file(path: str) -> list[Prompt]:
    """The prompts of a JSONL file, one object with a string ``prompt`` per line (blank lines
    skipped); a line that is not one is refused naming the file and line."""
    file = Path(path)
    if not file.is_file():
        what = "a directory" if file.is_dir() else "no such file"
        raise ConfigError(f"--prompts-file {path}: {what}")
    try:
        lines = file.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError:
        raise ConfigError(f"--prompts-file {path}: not UTF-8 text") from None
    prompts = [
        _prompt_line(line, f"{path}:{number}")
        for number, line in enumerate(lines, 1)
        if line.strip()
    ]
    if not prompts:
        raise ConfigError(f"--prompts-file {path} holds no prompts")
    return prompts


def _prompt_line(line: str, where: str) -> Prompt:
    try:
        fields = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where}: not a JSON line ({err.msg})") from None
    if not isinstance(fields, dict) or not isinstance(fields.get(PROMPT_FIELD), str):
        raise ConfigError(f"{where}: not a JSON object with a string {PROMPT_FIELD!r} field")
    return Prompt(fields[PROMPT_FIELD], fields, where)
