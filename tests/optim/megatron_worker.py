"""AdEMAMix through megatron-core's optimizer stack, on the DDP-wrapped tiny model (1 or 2 ranks).

Run by tests/optim/test_ademamix.py, alone or under torchrun; rank 0 writes a JSON report:

* ``weight_decay``: each parameter name's weight decay, from the built optimizer's param groups;
* ``max_abs_diff``: per step, the largest distance between the wrapped optimizer's parameters and
  the per-tensor reference AdEMAMix fed the same data-parallel-reduced gradients (all-reduced here:
  with two ranks a sum is exact in either order, so they are bitwise megatron-core's);
* ``resume``: per checkpoint format, whether every state tensor (m1, m2, v, step) on every rank
  was restored bitwise into a fresh model and optimizer, and whether running on from there
  reproduced the uninterrupted run bitwise.

megatron-core is imported inside functions: dist_checkpointing starts a helper process with the
"spawn" method, which re-imports this file.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

STEPS = 6
RESUME_AT = 3
TOKENS = (2, 32)  # per rank and step: sequences x length
VOCAB = 512
SEED = 11
SETTINGS = dict(alpha=5.0, beta3=0.999, alpha_warmup=4, beta3_warmup=4)
OPTIMIZER = dict(lr=3e-3, min_lr=0.0, weight_decay=0.1, adam_beta2=0.95, clip_grad=0.0)


def build(distributed_optimizer: bool):
    """A fresh DDP-wrapped tiny model (same initial weights every time) and its AdEMAMix."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron.apertus import parallel
    from megatron.apertus.model import ParallelConfig, preset
    from megatron.apertus.model.builder import build_model
    from megatron.apertus.optim import AdEMAMixSettings, get_apertus_optimizer
    from megatron.apertus.training.step import wrap_ddp

    model_config = preset("tiny", vocab_size=VOCAB)
    parallel.set_seed(SEED)
    # The step below divides the loss by the global batch's size itself: DDP must only sum.
    chunks = build_model(
        model_config, ParallelConfig(), use_cpu_initialization=True, calculate_per_token_loss=True
    )
    model = wrap_ddp(chunks, chunks[0].config, use_distributed_optimizer=distributed_optimizer)
    config = OptimizerConfig(
        optimizer="ademamix", use_distributed_optimizer=distributed_optimizer, **OPTIMIZER
    )
    return model, get_apertus_optimizer(config, model, AdEMAMixSettings(**SETTINGS))


def reference_optimizer(params: list):
    """Per-tensor AdEMAMix with the documented rule: no weight decay on 1-D parameters."""
    from megatron.apertus.optim import AdEMAMix

    return AdEMAMix(
        [
            {"params": [p for p in params if p.ndim > 1]},
            {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0},
        ],
        lr=OPTIMIZER["lr"],
        betas=(0.9, OPTIMIZER["adam_beta2"], SETTINGS["beta3"]),
        alpha=SETTINGS["alpha"],
        alpha_warmup=SETTINGS["alpha_warmup"],
        beta3_warmup=SETTINGS["beta3_warmup"],
        weight_decay=OPTIMIZER["weight_decay"],
        foreach=False,
    )


def train_step(model, optimizer, step: int) -> list:
    """Forward, backward and one optimizer step; returns the reduced gradients it used."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    rank, world = dist.get_rank(), dist.get_world_size()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    tokens = torch.randint(
        0, VOCAB, TOKENS, generator=torch.Generator().manual_seed(100 * step + rank)
    )
    positions = torch.arange(TOKENS[1]).expand(TOKENS)
    losses = model[0](tokens, positions, None, labels=tokens)
    (losses.sum() / (losses.numel() * world)).backward()
    grads = [p.main_grad.clone() for p in model[0].module.parameters()]
    for grad in grads:
        dist.all_reduce(grad, group=parallel_state.get_data_parallel_group())
    for chunk in model:
        chunk.finish_grad_sync()
    update_successful, _, _ = optimizer.step()
    assert update_successful
    return grads


def parameters(model) -> list:
    return [p.detach().clone() for p in model[0].module.parameters()]


def inner_states(optimizer) -> list[dict]:
    """Copies of this rank's AdEMAMix state tensors, in param-group order."""
    inner = optimizer.chained_optimizers[0].optimizer
    return [
        {key: value.clone() for key, value in inner.state[p].items()}
        for group in inner.param_groups
        for p in group["params"]
    ]


def weight_decay_by_name(model, optimizer) -> dict[str, float]:
    """Each parameter's weight decay, from the group holding it (or, sharded, its shard)."""
    import torch.distributed as dist

    wrapped = optimizer.chained_optimizers[0]
    decay = {id(p): g["weight_decay"] for g in wrapped.optimizer.param_groups for p in g["params"]}
    shard_of = {}
    for model_group, shard_group in zip(
        getattr(wrapped, "model_fp32_groups", []), getattr(wrapped, "shard_fp32_groups", [])
    ):
        shard_of.update({id(m): id(s) for m, s in zip(model_group, shard_group)})
    local = {}
    for name, p in model[0].module.named_parameters():
        key = shard_of.get(id(p), id(p))
        if key in decay:
            local[name] = decay[key]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {name: wd for part in parts for name, wd in part.items()}


def sharded_state(model, optimizer, fmt: str, *, is_loading: bool) -> dict:
    metadata = {"distrib_optim_sharding_type": fmt}
    model_state = model[0].module.sharded_state_dict(metadata=metadata)
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=metadata
        ),
    }


def resume_report(model, optimizer, saved_states: list[dict], final: list) -> dict:
    """Compare the restored state with the saved one, then run on and compare with ``final``."""
    import torch
    import torch.distributed as dist

    loaded = inner_states(optimizer)
    states_equal = len(loaded) == len(saved_states) and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(loaded, saved_states)
    )
    for step in range(RESUME_AT + 1, STEPS + 1):
        train_step(model, optimizer, step)
    resumed_equal = all(torch.equal(a, b) for a, b in zip(parameters(model), final))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (states_equal, sorted(loaded[0]) if loaded else []))
    return {
        "state_keys": parts[0][1],
        "states_bitwise_equal": all(equal for equal, _ in parts),
        "resumed_bitwise_equal": resumed_equal,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--formats", nargs="*", default=[], help="dist_checkpointing round trips")
    parser.add_argument("--state-dict-round-trip", action="store_true")
    parser.add_argument("--out", required=True, help="report; checkpoints go beside it")
    args = parser.parse_args()

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron.apertus import parallel
    from megatron.apertus.model import ParallelConfig

    parallel.initialize(ParallelConfig(), device="cpu", seed=SEED)
    rank = dist.get_rank()
    root = Path(args.out).parent / f"{Path(args.out).stem}_checkpoints"

    model, optimizer = build(args.distributed_optimizer)
    report: dict = {"weight_decay": weight_decay_by_name(model, optimizer), "max_abs_diff": []}
    references = parameters(model)
    reference = reference_optimizer(references)
    saved_states = in_memory = None
    for step in range(1, STEPS + 1):
        for ref, grad in zip(references, train_step(model, optimizer, step)):
            ref.grad = grad
        reference.step()
        diff = max((p - r).abs().max().item() for p, r in zip(parameters(model), references))
        report["max_abs_diff"].append(diff)
        if step != RESUME_AT:
            continue
        saved_states = inner_states(optimizer)
        for fmt in args.formats:
            _mkdir(root / fmt)
            dist_checkpointing.save(
                sharded_state(model, optimizer, fmt, is_loading=False), str(root / fmt)
            )
        if args.state_dict_round_trip:
            in_memory = (parameters(model), copy.deepcopy(optimizer.state_dict()))
    final = parameters(model)

    report["resume"] = {}
    for fmt in args.formats:
        model, optimizer = build(args.distributed_optimizer)
        loaded = dist_checkpointing.load(
            sharded_state(model, optimizer, fmt, is_loading=True), str(root / fmt)
        )
        model[0].module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        report["resume"][fmt] = resume_report(model, optimizer, saved_states, final)
    if in_memory is not None:
        model, optimizer = build(args.distributed_optimizer)
        for p, saved in zip(model[0].module.parameters(), in_memory[0]):
            p.data.copy_(saved)
        optimizer.load_state_dict(in_memory[1])
        report["resume"]["state_dict"] = resume_report(model, optimizer, saved_states, final)
    if rank == 0:
        Path(args.out).write_text(json.dumps(report, indent=1))
    parallel.shutdown()


def _mkdir(path: Path) -> None:
    """Create ``path`` on rank 0; every rank waits for it."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        path.mkdir(parents=True)
    dist.barrier()


if __name__ == "__main__":
    main()
