"""Text generation: decoding over megatron-core's KV cache against recomputing the sequence.

The decoding loop of ``tools/generate_text.py`` and its server
(:class:`megatron.apertus.inference.generate.TextGenerator`: prefill once, then one token per
step through megatron-core's static KV cache) against the obvious baseline, the whole sequence
through the model at every step (what a generation loop without a cache does), greedy, same
model, same prompt, one process. Each row gives the wall time and tokens per second of
generating ``--tokens`` tokens, and whether both produced the same tokens (they must); a third
row times scoring a prompt of ``--score-tokens`` tokens (one prefill with every position's
logits, ``--num-tokens-to-generate 0 --return-log-probs``).

The model is a preset with seeded random weights (``--model-preset``, default the tiny one; a
Hugging Face-sized preset on a GPU: ``apertus-v1.1-0.5b``); a checkpoint's weights would change
the tokens, not the costs.

    python bench/bench_generate.py [--model-preset tiny] [--tokens 400] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import machine, write_results

from megatron.apertus import parallel
from megatron.apertus.inference.config import SamplingConfig
from megatron.apertus.inference.generate import TextGenerator, prompt_tokens
from megatron.apertus.model.config import preset
from megatron.apertus.tokenizer.tokenizers import load_tokenizer

PROMPT = "The lakes of Switzerland were carved by glaciers, and"


def seeded_weights(chunk: torch.nn.Module, seed: int) -> None:
    """Every weight drawn from N(0, 0.02) by one seeded generator (norm scales at 1), so that
    runs compare."""
    draws = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in chunk.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=draws) * 0.02)


def timed(fn, device: str) -> tuple[object, float]:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


@torch.no_grad()
def recompute(chunk: torch.nn.Module, prompt: list[int], tokens: int, eod: int) -> list[int]:
    """Greedy tokens with the whole sequence through the model at every step, no cache."""
    device = next(chunk.parameters()).device
    ids, generated = list(prompt), []
    while len(generated) < tokens:
        window = torch.tensor([ids], device=device)
        logits = chunk(window, torch.arange(len(ids), device=device)[None], None)
        token = int(logits[0, -1].argmax())
        generated.append(token)
        if token == eod:
            break
        ids.append(token)
    return generated


def rows_for(args: argparse.Namespace) -> list[dict]:
    tokenizer = load_tokenizer()
    model = preset(args.model_preset)
    with parallel.single_process_model(model, job="the benchmark", device=args.device) as chunk:
        seeded_weights(chunk, args.seed)
        chunk.eval()
        generator = TextGenerator(chunk, model, tokenizer)
        prompt = prompt_tokens(tokenizer, PROMPT)
        greedy = SamplingConfig(num_tokens_to_generate=args.tokens)
        generator.complete(prompt, SamplingConfig(num_tokens_to_generate=4), torch.Generator())
        cached, cached_s = timed(
            lambda: generator.complete(prompt, greedy, torch.Generator()), args.device
        )
        baseline, baseline_s = timed(
            lambda: recompute(chunk, prompt, args.tokens, tokenizer.eod), args.device
        )
        long_prompt = (prompt * (args.score_tokens // len(prompt) + 1))[: args.score_tokens]
        scoring = SamplingConfig(num_tokens_to_generate=0, return_log_probs=True)
        _, score_s = timed(
            lambda: generator.complete(long_prompt, scoring, torch.Generator()), args.device
        )
    same = cached.generated_tokens == baseline
    n = len(baseline)
    return [
        {"method": "KV cache (generate_text)", "tokens": n, "seconds": cached_s,
         "tokens_per_s": n / cached_s, "same_tokens": same},
        {"method": "recompute every step", "tokens": n, "seconds": baseline_s,
         "tokens_per_s": n / baseline_s, "same_tokens": same},
        {"method": "score a prompt (prefill)", "tokens": len(long_prompt), "seconds": score_s,
         "tokens_per_s": len(long_prompt) / score_s, "same_tokens": None},
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-preset", default="tiny")
    parser.add_argument("--tokens", type=int, default=400, help="tokens to generate")
    parser.add_argument("--score-tokens", type=int, default=1024, help="prompt tokens to score")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = rows_for(args)
    for row in rows:
        print(
            f"{row['method']:28s} {row['tokens']:5d} tokens {row['seconds']:8.2f} s "
            f"{row['tokens_per_s']:9.1f} tokens/s  same tokens: {row['same_tokens']}"
        )
    if not rows[0]["same_tokens"]:
        raise SystemExit("the KV cache and the recomputation generated different tokens")
    speedup = rows[1]["seconds"] / rows[0]["seconds"]
    print(f"KV cache {speedup:.1f}x faster than recomputing; machine: {machine()['cpu']}")
    extra = {"model_preset": args.model_preset, "speedup": speedup, "prompt": PROMPT}
    print(write_results(f"generate_{args.model_preset}", rows, extra))


if __name__ == "__main__":
    main()
