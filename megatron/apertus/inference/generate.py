"""Text from a checkpoint: prompts in, JSON lines out, decoded over megatron-core's KV cache.

The model is loaded as the Hugging Face export and the teacher-logit runner load it: built
with :func:`megatron.apertus.model.builder.build_model` (fp32) and filled by
:func:`megatron.apertus.checkpoint.load_model`, which reshards a checkpoint of any TP/PP
layout into the one process's TP=1/PP=1 model, on the CPU or one GPU.

What megatron-core provides and what is ours: its ``GPTInferenceWrapper`` prepares the inputs
(positions, the window of each step), runs the forward and advances its
``StaticInferenceContext``, the KV cache each attention layer fills; the prompt goes through
the model once (prefill), then one token per step (decode). The wrapper's constructor differs
between the megatron-core lines (:func:`megatron.apertus.mcore_compat.gpt_inference_wrapper`).
megatron-core's engines and ``TextGenerationController`` do not run on a CPU (megatron-core
0.16.1, tried): the controller builds its sampling generator on the current CUDA device and
its static-batch loop records ``torch.cuda.Event`` timings, neither of which the CPU stand-ins
of :mod:`megatron.apertus.cpu_compat` can replace. So the loop and the sampling are here, with
the controller's sampling rules (:mod:`megatron.apertus.inference.config`) and a CPU
generator: draws do not depend on the device.

Invariants: prompts are decoded one at a time (batch 1), so a prompt's output does not depend
on the others' lengths (no padding); every prompt starts with ``<s>``, as every training
document did and as the export's tokenizer encodes; generation stops after the end-of-document
token (kept in ``generated_tokens``, left out of ``generated_text``) or after
``--num-tokens-to-generate`` tokens; tokens are drawn among the tokenizer's ids only (not the
padding rows of a padded vocabulary). Greedy decoding equals transformers' greedy ``generate``
on the export, token for token (tests/inference/test_generate_text.py).

Log-probabilities (``--return-log-probs``, ``--top-n-logprobs``) are megatron-core's raw ones:
the log-softmax of the unmodified logits over every output row, the distribution the training
loss scores, whatever the sampling's temperature and cuts; a prompt's need the prefill to
materialize the logits at every position, which decoding does not.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, TextIO

import torch

from megatron.apertus import parallel
from megatron.apertus.checkpoint import (
    CheckpointMismatch,
    checkpoint_at,
    load_model,
    load_model_config,
    resolve_checkpoint,
)
from megatron.apertus.checkpoint_files import read_run_info
from megatron.apertus.cli import atomic_outputs
from megatron.apertus.errors import ConfigError
from megatron.apertus.inference.config import Prompt, SamplingConfig
from megatron.apertus.mcore_compat import gpt_inference_wrapper, materialize_every_position
from megatron.apertus.model.config import ApertusConfig
from megatron.apertus.tokenizer.tokenizers import Tokenizer, checked_tokenizer

EOS, LENGTH = "eos", "length"
"""``finish_reason`` of an output line: the end-of-document token came, or the token budget
ran out."""


@dataclass(frozen=True)
class Scores:
    """What the model gave a run of tokens: each token's log-probability and, with
    ``--top-n-logprobs``, the most likely tokens at its position."""

    log_probs: list[float]
    top_n: list[dict[str, float]]


@dataclass(frozen=True)
class Completion:
    prompt_tokens: list[int]
    generated_tokens: list[int]
    finish_reason: str
    prompt_scores: Scores | None = None
    """The prompt's tokens after the first (``--return-log-probs`` without
    ``--skip-prompt-log-probs``)."""
    generated_scores: Scores | None = None


@dataclass(kw_only=True, frozen=True)
class ModelSource:
    """A checkpoint to generate from, and how."""

    checkpoint: Path
    """The resolved ``iter_*`` directory."""
    model: ApertusConfig
    tokenizer: Tokenizer
    device: str
    """``cpu`` or ``cuda``."""


@dataclass(kw_only=True, frozen=True)
class GenerateConfig:
    source: ModelSource
    sampling: SamplingConfig
    prompts: list[Prompt]
    output: str | None
    """The JSONL file to write (None: standard output)."""


def model_source(
    load: str, ckpt_step: int | None, *, tokenizer: tuple[str | None, str | None], device: str
) -> ModelSource:
    """``--load`` (``--ckpt-step``: that iteration of it) with the tokenizer (type, model)
    given, else the one the checkpoint's training run recorded."""
    try:
        if ckpt_step is None:
            found = resolve_checkpoint(load)
        else:
            found = checkpoint_at(load, ckpt_step, f"--ckpt-step {ckpt_step}")
    except CheckpointMismatch as err:
        raise ConfigError(f"--load {err}") from None
    model = load_model_config(found)
    try:
        device = parallel.resolve_device(device)
    except RuntimeError as err:
        raise ConfigError(str(err)) from None
    return ModelSource(
        checkpoint=found, model=model, tokenizer=_tokenizer(found, model, *tokenizer), device=device
    )


def _tokenizer(
    checkpoint: Path, model: ApertusConfig, kind: str | None, path: str | None
) -> Tokenizer:
    recorded = (read_run_info(checkpoint) or {}).get("tokenizer") or {}
    if kind is None:  # the run's tokenizer, unless another file of its type is given
        kind, path = recorded.get("type"), path or recorded.get("model")
    if kind is None:
        raise ConfigError(
            f"{checkpoint} records no training run (no apertus_run.json), so its tokenizer is "
            "unknown; pass --tokenizer-type (and --tokenizer-model)"
        )
    tokenizer = checked_tokenizer(kind, path)
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(
            f"the tokenizer's vocabulary ({tokenizer.vocab_size}) is larger than the model's "
            f"({model.vocab_size}): pass the tokenizer the checkpoint was trained with"
        )
    return tokenizer


@contextlib.contextmanager
def loaded_model(checkpoint: Path, model: ApertusConfig, device: str) -> Iterator[torch.nn.Module]:
    """The checkpoint's model in one process (TP=1/PP=1, any saved layout resharded into it),
    in eval mode; the process groups are torn down on exit."""
    with parallel.single_process_model(model, job="text generation", device=device) as chunk:
        load_model(checkpoint, [chunk])
        yield chunk.eval()


def next_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> int:
    """The token after ``logits`` [vocabulary]: the argmax when greedy, else a draw from the
    tempered distribution cut to its top-k or top-p (megatron-core's rules); the draw is made
    on the CPU with ``generator``."""
    if sampling.greedy:
        return int(logits.argmax())
    scaled = logits.detach().float().cpu() / sampling.temperature
    if sampling.top_k > 1:
        kth = torch.topk(scaled, sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    elif sampling.top_p > 0:
        scaled = _top_p_cut(scaled, sampling.top_p)
    return int(torch.multinomial(scaled.softmax(-1), 1, generator=generator))


def _top_p_cut(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` without the tokens after the smallest most-likely set whose probability
    reaches ``top_p`` (the most likely token always stays)."""
    ordered, order = logits.sort(descending=True)
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs  # probability of the more likely tokens
    dropped = torch.zeros_like(before, dtype=torch.bool)
    dropped[order] = before > top_p
    dropped[order[0]] = False
    return logits.masked_fill(dropped, float("-inf"))


def prompt_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """``<s>`` and the text's ids, as the start of a training document."""
    return [tokenizer.bos, *tokenizer.encode(text)]


class TextGenerator:
    """Decodes prompts with one loaded model (:func:`loaded_model`)."""

    def __init__(self, chunk: torch.nn.Module, model: ApertusConfig, tokenizer: Tokenizer):
        self.chunk = chunk
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(chunk.parameters()).device

    @torch.no_grad()
    def complete(
        self, prompt: list[int], sampling: SamplingConfig, generator: torch.Generator
    ) -> Completion:
        """Prefill ``prompt`` (token ids), then decode one token per step until the
        end-of-document token or the token budget."""
        budget = sampling.num_tokens_to_generate
        tokens = torch.zeros(1, len(prompt) + budget, dtype=torch.long, device=self.device)
        tokens[0, : len(prompt)] = torch.tensor(prompt)
        wrapper = gpt_inference_wrapper(self.chunk, tokens.shape[1])
        wrapper.prep_model_for_inference()
        inputs = wrapper.prep_inference_input(tokens)
        materialize_every_position(wrapper.inference_context, sampling.prompt_log_probs)
        logits = self._forward(wrapper, inputs, 0, len(prompt))
        materialize_every_position(wrapper.inference_context, False)
        prompt_scores = None
        if sampling.prompt_log_probs:
            prompt_scores = self.scores(logits[:-1], prompt[1:], sampling)
        end, generated, rows, finish = len(prompt), [], [], LENGTH
        for step in range(budget):
            if step:  # decode: the last token in, its successor's logits out
                tokens[0, end] = generated[-1]
                logits = self._forward(wrapper, inputs, end, end + 1)
                end += 1
            token = next_token(logits[-1, : self.tokenizer.vocab_size], sampling, generator)
            generated.append(token)
            rows.append(logits[-1])
            if token == self.tokenizer.eod:
                finish = EOS
                break
        generated_scores = None
        if sampling.log_probs:
            generated_scores = (
                self.scores(torch.stack(rows), generated, sampling) if rows else Scores([], [])
            )
        return Completion(prompt, generated, finish, prompt_scores, generated_scores)

    @staticmethod
    def _forward(wrapper, inputs: dict, start: int, end: int) -> torch.Tensor:
        """The logits [positions, padded vocabulary] of positions ``start:end`` (all of them, or
        the last only, as the context materializes), the KV cache filled for them."""
        window = wrapper.get_batch_for_context_window(inputs, start, end)
        logits = wrapper.run_one_forward_step(window)
        wrapper.inference_context.enable_decode_mode()
        return logits[0]

    def scores(self, logits: torch.Tensor, targets: list[int], sampling: SamplingConfig) -> Scores:
        """Each target's log-probability under its row of ``logits`` [n, padded vocabulary]:
        the softmax over every row of the output layer, as the training loss (and
        megatron-core's raw log-probabilities) normalize; the top-n among the tokenizer's ids,
        keyed by their text as megatron-core's are."""
        log_probs = logits.float().log_softmax(-1)
        targets_tensor = torch.tensor(targets, dtype=torch.long, device=log_probs.device)[:, None]
        chosen = log_probs.gather(1, targets_tensor).squeeze(1).tolist()
        top_n = []
        if sampling.top_n_logprobs:
            best = log_probs[:, : self.tokenizer.vocab_size].topk(sampling.top_n_logprobs, dim=-1)
            for values, ids in zip(best.values.tolist(), best.indices.tolist()):
                top_n.append({self.tokenizer.decode([i]): v for i, v in zip(ids, values)})
        return Scores(chosen if sampling.return_log_probs else [], top_n)

    def output_line(self, prompt: Prompt, completion: Completion, sampling: SamplingConfig) -> dict:
        """The prompt's fields, what was generated for it and, as asked, the log-probabilities
        under megatron-core's field names."""
        text_ids = [t for t in completion.generated_tokens if t != self.tokenizer.eod]
        line = {
            **prompt.fields,
            "generated_text": self.tokenizer.decode(text_ids),
            "prompt_tokens": completion.prompt_tokens,
            "generated_tokens": completion.generated_tokens,
            "finish_reason": completion.finish_reason,
        }
        for part, scores in (
            ("prompt", completion.prompt_scores),
            ("generated", completion.generated_scores),
        ):
            if scores is None:
                continue
            if sampling.return_log_probs:
                line[f"{part}_log_probs"] = scores.log_probs
            if sampling.top_n_logprobs:
                line[f"{part}_top_n_logprobs"] = scores.top_n
        return line


def check_request(
    source: ModelSource, sampling: SamplingConfig, prompt: list[int], where: str
) -> None:
    """Refuse a prompt (token ids, given at ``where``) that with the token budget exceeds the
    positions the model was built for, or a top-k above the vocabulary."""
    limit, budget = source.model.max_position_embeddings, sampling.num_tokens_to_generate
    if len(prompt) + budget > limit:
        raise ConfigError(
            f"{where}: {len(prompt)} prompt tokens + --num-tokens-to-generate {budget} "
            f"exceed the model's --max-position-embeddings {limit}"
        )
    if sampling.top_k > source.tokenizer.vocab_size:
        raise ConfigError(
            f"--top-k {sampling.top_k} exceeds the vocabulary ({source.tokenizer.vocab_size})"
        )


def _write_lines(
    generator: TextGenerator, cfg: GenerateConfig, prompts: list[list[int]], out: TextIO
) -> None:
    draws = torch.Generator().manual_seed(cfg.sampling.seed)
    for prompt, ids in zip(cfg.prompts, prompts):
        completion = generator.complete(ids, cfg.sampling, draws)
        line = generator.output_line(prompt, completion, cfg.sampling)
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
        out.flush()


def generate(cfg: GenerateConfig) -> None:
    """Write one JSON line per prompt, in order, to ``cfg.output`` (under a temporary name until
    every prompt is done) or to standard output as each is done."""
    source = cfg.source
    prompts = [prompt_tokens(source.tokenizer, p.text) for p in cfg.prompts]
    for prompt, ids in zip(cfg.prompts, prompts):  # before the model loads
        check_request(source, cfg.sampling, ids, prompt.source)
    with loaded_model(source.checkpoint, source.model, source.device) as chunk:
        generator = TextGenerator(chunk, source.model, source.tokenizer)
        if cfg.output is None:
            _write_lines(generator, cfg, prompts, sys.stdout)
            return
        with atomic_outputs(cfg.output) as (temporary,):
            with open(temporary, "w", encoding="utf-8") as out:
                _write_lines(generator, cfg, prompts, out)
