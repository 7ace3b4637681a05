"""Measure what the planner estimates, on the real model (alone or under torchrun, on CPU).

    python tests/launch/memory_worker.py --mode saved|peak --out REPORT.json -- RUN_FLAGS

The run flags are parsed by the planner's own parser, and the model, DDP wrapper and optimizer
are built by the same functions as ``pretrain_gpt.py``'s trainer; batches are random tokens.

* ``saved``: bytes each transformer layer saves for backward in one forward pass of one
  micro-batch, counted as unique tensor storages through ``torch.autograd.graph`` saved-tensor
  hooks (parameters excluded), per rank; plus each rank's parameter count.
* ``peak``: growth of the process's peak resident memory (``VmHWM``, reset through
  ``/proc/self/clear_refs``) over its resident memory just before the model is built, across
  building the model, DDP and the optimizer and running ``--steps`` training steps. Allocations
  of 64 KiB and more are mapped on their own (``mallopt``), so that freed tensors leave the
  resident set at once. It needs no fresh interpreter: a process forked from a warm one starts
  with the pages it shares with its parent resident, and the growth is measured from there.

megatron-core is imported inside functions: dist_checkpointing's spawned helpers re-import files.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import re
from pathlib import Path

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter: the size from which an allocation gets its own mapping."""


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _local_positions(seq: int, cp: int, cp_rank: int):
    """Global positions of the tokens a context-parallel rank holds: chunks ``cp_rank`` and
    ``2 cp - 1 - cp_rank`` of ``2 cp`` (Megatron's load-balanced split; all of them at CP 1)."""
    import torch

    chunk = seq // (2 * cp)
    positions = torch.arange(seq).view(2 * cp, chunk)
    return positions[[cp_rank, 2 * cp - 1 - cp_rank]].flatten() if cp > 1 else positions.flatten()


def _random_batches(run, count: int, *, whole: bool = False):
    """Random tokens at this rank's share of each sequence (the planner's unit of activations),
    or with ``whole`` the whole sequences, as the trainer's forward step takes them (it keeps
    this rank's share itself)."""
    import torch
    from megatron.core import parallel_state

    from megatron.apertus.data.batches import Batch

    generator = torch.Generator().manual_seed(0)
    cp = 1 if whole else run.parallel.context_parallel_size
    cp_rank = parallel_state.get_context_parallel_rank() if cp > 1 else 0
    positions = _local_positions(run.model.seq_length, cp, cp_rank)
    b, s = run.training.micro_batch_size, positions.numel()
    for _ in range(count):
        tokens = torch.randint(0, run.model.vocab_size, (b, s), generator=generator)
        yield Batch(
            tokens=tokens,
            labels=torch.roll(tokens, -1, 1),
            loss_mask=torch.ones(b, s),
            position_ids=positions.expand(b, s).contiguous(),
        )


def _build(run):
    from megatron.apertus.model.builder import build_model
    from megatron.apertus.model.config import dtype_from_name

    chunks = build_model(
        run.model,
        run.parallel,
        fused_loss=True,
        use_cpu_initialization=True,
        params_dtype=dtype_from_name(run.training.precision),
        **run.training.recompute_overrides(),
    )
    return chunks, chunks[0].config


def saved(run) -> dict:
    """Per-layer saved bytes of this rank's first model chunk, and its parameter count."""
    import torch

    chunks, _ = _build(run)
    chunk = chunks[0]
    parameters = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
    current = {"layer": None}
    per_layer: dict[int, int] = {}
    seen: set[int] = set()

    def pack(tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in parameters and key not in seen and current["layer"] is not None:
            seen.add(key)
            per_layer[current["layer"]] = per_layer.get(current["layer"], 0) + storage.nbytes()
        return tensor

    for i, layer in enumerate(chunk.decoder.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: current.update(layer=i))
        layer.register_forward_hook(lambda *_: current.update(layer=None))
    batch = next(_random_batches(run, 1))
    hidden = None
    if not chunk.pre_process:  # a later pipeline stage: feed it a hidden state
        s, b, h = run.model.seq_length, run.training.micro_batch_size, run.model.hidden_size
        split = run.parallel.tensor_model_parallel_size if run.parallel.sequence_parallel else 1
        hidden = torch.randn(
            s // split, b, h, dtype=next(chunk.parameters()).dtype, requires_grad=True
        )
        chunk.set_input_tensor(hidden)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        chunk(
            batch.tokens, batch.position_ids, None, labels=batch.labels, loss_mask=batch.loss_mask
        )
    return {
        "layer_bytes": [per_layer[i] for i in sorted(per_layer)],
        "parameters": sum(p.numel() for c in chunks for p in c.parameters()),
    }


def _train(run, dp: int, steps: int) -> list[float]:
    """Build model, DDP and optimizer as the trainer does and run ``steps`` steps on random data."""
    from megatron.apertus.optim import AdEMAMixSettings, ScheduleConfig
    from megatron.apertus.training.optimizer import build_optimizer_and_scheduler
    from megatron.apertus.training.step import StepShape, train_step, wrap_ddp

    t = run.training
    microbatches = t.global_batch_size // (t.micro_batch_size * dp)
    shape = StepShape(
        num_microbatches=microbatches,
        seq_length=run.model.seq_length,
        micro_batch_size=t.micro_batch_size,
    )
    chunks, config = _build(run)
    model = wrap_ddp(
        chunks, config, use_distributed_optimizer=run.optimizer.use_distributed_optimizer
    )
    optimizer, _ = build_optimizer_and_scheduler(
        model, run.optimizer, ScheduleConfig(), AdEMAMixSettings(), t, precision=t.precision
    )
    losses = []
    for _ in range(steps):
        batches = list(_random_batches(run, microbatches, whole=True))
        losses.append(train_step(model, optimizer, batches, shape).loss)
    return losses


def peak(run, dp: int, steps: int) -> dict:
    """Peak resident-memory growth over building and training (see the module docstring).

    A one-layer model with a small vocabulary trains one step first, so that one-time costs of
    the code paths (loading our kernels' shared libraries, oneDNN's and gloo's first buffers)
    are in the baseline and not attributed to the model.
    """
    import dataclasses

    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    t = run.training
    init_num_microbatches_calculator(0, None, t.global_batch_size, t.micro_batch_size, dp)
    small = dataclasses.replace(
        run.model,
        num_layers=run.parallel.pipeline_model_parallel_size,
        vocab_size=512,
        seq_length=32,
    )
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    _train(dataclasses.replace(run, model=small), dp, steps=1)
    gc.collect()
    libc.malloc_trim(0)
    baseline = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    losses = _train(run, dp, steps)
    return {
        "peak_growth_bytes": _status("VmHWM") - baseline,
        "baseline_bytes": baseline,
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("saved", "peak"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    import torch.distributed as dist

    from megatron.apertus import parallel
    from megatron.apertus.launch.planner import run_from_args

    run = run_from_args(args.flags[1:] if args.flags[:1] == ["--"] else args.flags)
    dp = parallel.initialize(run.parallel, device="cpu", seed=run.training.seed, model=run.model)
    report = saved(run) if args.mode == "saved" else peak(run, dp, args.steps)
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(reports))
    parallel.shutdown()


if __name__ == "__main__":
    main()
