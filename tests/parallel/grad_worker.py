"""Run ``pretrain_gpt.py`` and keep every parameter's gradient of its first step.

    python tests/parallel/grad_worker.py GRADS_PREFIX -- PRETRAIN_FLAGS   (alone or under torchrun)

Each rank writes ``GRADS_PREFIX.rank<R>.pt``: ``{parameter name: gradient}`` as the optimizer
receives it after the first backward pass (DDP's ``main_grad``, reduced over the data- and
context-parallel ranks and divided by the step's token count), before the step updates the
weights. The run goes on as ``pretrain_gpt.py`` runs it (same flags, same exit status).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    prefix, separator, *flags = sys.argv[1:]
    assert separator == "--", "usage: grad_worker.py GRADS_PREFIX -- PRETRAIN_FLAGS"
    import torch

    from tests.conftest import after_backward

    def keep_first(passes: int, model: list) -> None:
        if passes != 1:
            return
        grads = {
            f"{i}.{name}": param.main_grad.detach().clone()
            for i, chunk in enumerate(model)
            for name, param in chunk.named_parameters()
        }
        torch.save(grads, f"{prefix}.rank{os.environ.get('RANK', '0')}.pt")

    sys.argv = [str(REPO / "pretrain_gpt.py"), *flags]
    with after_backward(keep_first):
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
