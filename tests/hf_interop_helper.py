"""Helper processes for tests/test_hf_interop.py (run as scripts, also under torchrun).

    python tests/hf_interop_helper.py save --save DIR --seed S [--tied] [--tp N]
    python tests/hf_interop_helper.py logits --load DIR --tokens T.json --out L.safetensors

``save`` writes a randomly initialised tiny-preset checkpoint with the real 131072 vocabulary.
With ``use_cpu_initialization`` megatron-core draws each full weight from the seeded CPU
generator and slices it per rank, so a TP=2 save holds the same model as a TP=1 save of the
same seed. ``logits`` runs our model (TP=1) on a token sequence and stores fp32 logits.
"""

from __future__ import annotations

import argparse
import json

import torch
from safetensors.torch import save_file

from megatron.apertus import parallel
from megatron.apertus.checkpoint import load_model, load_model_config, save_model
from megatron.apertus.model import ParallelConfig, preset
from megatron.apertus.model.builder import build_model


def save(args: argparse.Namespace) -> None:
    # A wider init than the 0.008944 default, so that attention (and so QKV layout and RoPE)
    # moves the logits well beyond the comparison tolerance.
    model = preset("tiny", init_method_std=0.05, untie_embeddings_and_output_weights=not args.tied)
    layout = ParallelConfig(tensor_model_parallel_size=args.tp)
    parallel.initialize(layout, device="cpu", seed=args.seed, model=model)
    chunks = build_model(model, layout, use_cpu_initialization=True)
    # Move the xIELU alphas off their init so that the export check sees distinct values.
    with torch.no_grad():
        for i, layer in enumerate(chunks[0].decoder.layers):
            layer.mlp.activation_func.alpha_p.add_(0.01 * (i + 1))
            layer.mlp.activation_func.alpha_n.sub_(0.02 * (i + 1))
    save_model(args.save, 0, chunks, model)
    parallel.shutdown()


def logits(args: argparse.Namespace) -> None:
    model = load_model_config(args.load)
    layout = ParallelConfig()
    parallel.initialize(layout, device="cpu", seed=0, model=model)
    chunks = build_model(model, layout, use_cpu_initialization=True)
    load_model(args.load, chunks)
    tokens = torch.tensor([json.loads(open(args.tokens).read())])
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    chunks[0].eval()
    with torch.no_grad():
        out = chunks[0](tokens, positions, None)
    save_file({"logits": out.float().contiguous()}, args.out)
    parallel.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("save")
    s.add_argument("--save", required=True)
    s.add_argument("--seed", type=int, required=True)
    s.add_argument("--tied", action="store_true")
    s.add_argument("--tp", type=int, default=1)
    g = sub.add_parser("logits")
    g.add_argument("--load", required=True)
    g.add_argument("--tokens", required=True)
    g.add_argument("--out", required=True)
    args = parser.parse_args()
    {"save": save, "logits": logits}[args.command](args)


if __name__ == "__main__":
    main()
