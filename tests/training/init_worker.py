"""Build a run's model as ``pretrain_gpt.py`` does and print, from rank 0, every rank's weights
(a fingerprint of them) as initialised and as the first step receives them.

    torchrun --nproc-per-node 2 tests/training/init_worker.py PRETRAIN_FLAGS

The model chunks are built twice from the same generator state: once bare
(:func:`runtime.model_chunks`: the weights as this rank initialised them), once as training
builds them (:func:`startup.build_model`: wrapped in DDP, with --data-parallel-random-init
rank 0's weights copied to the others). The line also holds each rank's torch generator state
afterwards: the random streams the ranks go on with.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import pretrain_gpt  # noqa: E402
from megatron.apertus import parallel  # noqa: E402
from megatron.apertus.training import runtime, startup  # noqa: E402


def fingerprint(tensors) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def every_rank(value: str) -> list[str]:
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def main() -> None:
    cfg = pretrain_gpt.parse_args(sys.argv[1:])
    started = runtime.start(cfg.parallel, model=cfg.model, training=cfg.training, engine=cfg.engine)
    seeded = torch.get_rng_state()
    bare = runtime.model_chunks(cfg.model, cfg.parallel, training=cfg.training, runtime=started)
    initial = fingerprint(p for chunk in bare for p in chunk.parameters())
    torch.set_rng_state(seeded)
    trained = startup.build_model(cfg, started)
    first_step = fingerprint(p for chunk in trained for p in chunk.module.parameters())
    line = {
        "initial": every_rank(initial),
        "first step": every_rank(first_step),
        "generator": every_rank(fingerprint([torch.get_rng_state()])),
    }
    if torch.distributed.get_rank() == 0:
        print(json.dumps(line))
    parallel.shutdown()


if __name__ == "__main__":
    main()
