"""Check a parallel layout on a cluster and estimate its per-GPU memory and FLOPs per step.

    python tools/plan_layout.py --gpus 1024 --gpus-per-node 4 --gpu-memory-gib 96 -- \\
        --model-preset apertus-8b --tensor-model-parallel-size 2 --micro-batch-size 4 \\
        --global-batch-size 2048 --seq-length 4096 --train-iters 1000 --precision bf16 \\
        --optimizer ademamix --use-distributed-optimizer

The flags after ``--`` are the run's own (``pretrain_gpt.py``'s names; others are ignored).
Exits 1, listing every broken constraint, when the layout cannot run.

With ``--sweep-seq-lengths`` and ``--sweep-cp`` it prints one Markdown table instead: the run
at each sequence length and context-parallel size, its tokens per step kept (the global batch
becomes tokens / sequence length), as docs/long_context.md shows for Apertus 8B and 70B; with
``--hierarchical`` the table compares flat p2p with a2a+p2p (all-to-all inside a node, ring
between nodes).
"""

from __future__ import annotations

import argparse

from megatron.apertus.cli import ArgumentParser, run
from megatron.apertus.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, required=True, help="processes, one per GPU")
    parser.add_argument("--gpus-per-node", type=int, default=4)
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="memory of one GPU (omit for CPU runs: no fit check)",
    )
    parser.add_argument(
        "--usable-fraction", type=float, default=0.9, help="share of a GPU the estimate may fill"
    )
    parser.add_argument(
        "--entry",
        default="pretrain_gpt.py",
        help="entry point the flags are for (tools/generate_teacher_logits.py: " "forward only)",
    )
    parser.add_argument(
        "--sweep-seq-lengths",
        type=int,
        nargs="+",
        metavar="SEQ",
        help="plan the run at each of these sequence lengths (tokens per step "
        "kept) and print one table",
    )
    parser.add_argument(
        "--sweep-cp",
        type=int,
        nargs="+",
        default=[1],
        metavar="CP",
        help="context-parallel sizes for --sweep-seq-lengths",
    )
    parser.add_argument(
        "--hierarchical",
        action="store_true",
        help="with --sweep-seq-lengths: compare flat p2p with a2a+p2p, its all-to-all level "
        "inside a node (memory, traffic, traffic between nodes) instead",
    )
    parser.add_argument("run_flags", nargs=argparse.REMAINDER, help="-- then the run's flags")
    args = parser.parse_args(argv)
    # The planner's memory model needs torch: loaded after --help and argument errors.
    from megatron.apertus.launch.planner import (
        Cluster,
        format_hierarchical_sweep,
        format_plan,
        format_sweep,
        plan,
        run_from_command,
        sweep,
    )

    flags = args.run_flags[1:] if args.run_flags[:1] == ["--"] else args.run_flags
    preset = next((flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--model-preset"), "")
    try:
        cluster = Cluster(
            gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            gpu_memory_gib=args.gpu_memory_gib,
            usable_fraction=args.usable_fraction,
        )
        if args.sweep_seq_lengths:
            table = format_hierarchical_sweep if args.hierarchical else format_sweep
            rows = sweep(flags, cluster, args.sweep_seq_lengths, args.sweep_cp)
            print(table(rows, name=preset))
            return 0
        run = run_from_command([args.entry, *flags])
    except ConfigError as err:
        parser.error(str(err))
    result = plan(run, cluster)
    print(format_plan(result, name=preset))
    return 0 if result.ok else 1


if __name__ == "__main__":
    run(main)
