"""``pretrain_gpt.py`` whose data-parallel rank 1 alone finds its gradients overflowing (NaN, the
loss finite) at the given iterations: how the fp16 tests make one rank of the distributed
optimizer overflow while the others' shards are finite.

    torchrun --nproc-per-node 2 tests/training/overflow_worker.py 3,5 PRETRAIN_FLAGS
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import pretrain_gpt  # noqa: E402
from megatron.apertus.cli import run  # noqa: E402
from tests.conftest import after_backward  # noqa: E402


def main() -> None:
    iterations = {int(it) for it in sys.argv[1].split(",")}

    def overflow(passes: int, model) -> None:
        if passes in iterations and torch.distributed.get_rank() == 1:
            for param in model[0].parameters():
                param.main_grad.fill_(math.nan)

    with after_backward(overflow):
        pretrain_gpt.main(sys.argv[2:])


if __name__ == "__main__":
    run(main)
