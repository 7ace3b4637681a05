"""Serve completions from a checkpoint over HTTP (docs/inference.md).

    python tools/run_text_generation_server.py --load SAVE_DIR [--ckpt-step N] [--port 5000]

    curl -s localhost:5000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "The capital of Switzerland is", "max_tokens": 20, "temperature": 0}'

The OpenAI-style ``/completions`` request of Megatron-LM's text generation server, which
lm-evaluation-harness's ``local-completions`` model sends: ``prompt`` (text or token ids, one or
a list), ``max_tokens``, ``temperature`` (0: greedy), ``top_k``, ``top_p``, ``logprobs``,
``echo``, ``stop``, ``seed``. Decoding is ``tools/generate_text.py``'s (megatron-core's KV cache,
one process, any saved TP/PP layout), one request at a time. Runs until interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys

from megatron.apertus.cli import ArgumentParser, run
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import ADDITION_MARK
from megatron.apertus.inference.config import add_checkpoint_arguments, check_checkpoint_arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_checkpoint_arguments(parser)
    parser.add_argument(
        "--port", type=int, default=5000, help="the port to listen on (0: any free one)"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on; 0.0.0.0 for every interface, as Megatron-LM's server "
        "listens (default: this machine only)" + ADDITION_MARK,
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    args = parse_args(argv)
    check_checkpoint_arguments(args)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    from megatron.apertus.inference.generate import model_source  # torch: after the flags
    from megatron.apertus.inference.server import serve

    source = model_source(
        args.load,
        args.ckpt_step,
        tokenizer=(args.tokenizer_type, args.tokenizer_model),
        device=args.device,
    )
    serve(source, args.host, args.port)


if __name__ == "__main__":
    run(main)
