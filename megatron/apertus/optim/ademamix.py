"""AdEMAMix (Pagliardini et al., ICLR 2025): Adam plus a slow gradient EMA mixed into the numerator.

Per parameter, with step t counted from 1::

    m1 = b1 m1 + (1 - b1) g                        fast EMA (bias-corrected below)
    m2 = b3(t) m2 + (1 - b3(t)) g                  slow EMA, never bias-corrected
    v  = b2 v + (1 - b2) g^2
    p -= lr ((m1 / (1 - b1^t) + alpha(t) m2) / (sqrt(v / (1 - b2^t)) + eps) + wd p)

``alpha(t)`` rises linearly to ``alpha`` over ``alpha_warmup`` steps; ``b3(t)`` moves from b1 to
b3 over ``beta3_warmup`` steps linearly in the *half-life* ``ln(0.5) / ln(b) - 1`` (a linear ramp
of b itself would spend almost all the warmup at short memories). A warmup of 0 means none.
This is apple/ml-ademamix's algorithm, except that its half-life adds 1e-8 to b inside the log
(to allow b1 = 0); we use the exact formula and require b1 > 0 when beta3 is warmed up.

State per parameter (the names megatron-core's checkpointing sees): ``exp_avg`` (m1),
``exp_avg_slow`` (m2), ``exp_avg_sq`` (v), all of the parameter's shape and dtype, and ``step``,
a 0-dim fp32 CPU tensor as in ``torch.optim.AdamW`` (megatron-core reads and restores it). The
step tensor is replaced, never updated in place: after a load megatron-core may hand every
parameter the *same* step tensor.

:class:`AdEMAMix` updates all tensors of a group that share device, dtype and step with a dozen
``torch._foreach_*`` calls per chunk of at most ``chunk_numel`` elements (large tensors are cut
into flat views, which bounds the temporaries); ``foreach=False`` runs
:func:`ademamix_reference_step`, the formula written out per tensor, which tests and the benchmark
compare against. Chunking and foreach change the rounding only, never the arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

STATE_KEYS = ("exp_avg", "exp_avg_slow", "exp_avg_sq")
"""Moment tensors per parameter, in the order m1, m2, v."""


def alpha_at(step: float, alpha: float, warmup: int) -> float:
    """Weight of the slow EMA at ``step``: a linear ramp from 0 over ``warmup`` steps."""
    if warmup <= 0:
        return alpha
    return alpha * min(1.0, step / warmup)


def _half_life(beta: float) -> float:
    return math.log(0.5) / math.log(beta) - 1.0


def beta3_at(step: float, beta1: float, beta3: float, warmup: int) -> float:
    """Slow-EMA decay at ``step``: its half-life interpolated linearly from b1's to b3's."""
    if warmup <= 0 or step >= warmup:
        return beta3
    fraction = step / warmup
    half_life = (1.0 - fraction) * _half_life(beta1) + fraction * _half_life(beta3)
    return math.pow(0.5, 1.0 / (half_life + 1.0))


@dataclass(frozen=True)
class StepScalars:
    """Everything one update needs besides tensors: a group's hyperparameters at one step."""

    lr: float
    beta1: float
    beta2: float
    beta3: float
    alpha: float
    eps: float
    weight_decay: float
    bias_correction1: float
    bias_correction2: float

    @classmethod
    def of(cls, group: dict, step: float) -> "StepScalars":
        beta1, beta2, beta3 = group["betas"]
        return cls(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            beta3=beta3_at(step, beta1, beta3, group["beta3_warmup"]),
            alpha=alpha_at(step, group["alpha"], group["alpha_warmup"]),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            bias_correction1=1.0 - beta1**step,
            bias_correction2=1.0 - beta2**step,
        )


def ademamix_reference_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_slow: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    s: StepScalars,
) -> None:
    """One AdEMAMix update of one tensor, in the order the formula is written (the reference)."""
    exp_avg.mul_(s.beta1).add_(grad, alpha=1.0 - s.beta1)
    exp_avg_slow.mul_(s.beta3).add_(grad, alpha=1.0 - s.beta3)
    exp_avg_sq.mul_(s.beta2).addcmul_(grad, grad, value=1.0 - s.beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(s.bias_correction2)).add_(s.eps)
    update = (exp_avg / s.bias_correction1 + s.alpha * exp_avg_slow) / denom
    update.add_(param, alpha=s.weight_decay)
    param.add_(update, alpha=-s.lr)


def _foreach_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_slows: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    s: StepScalars,
) -> None:
    """The same update for many tensors at once: each line is one multi-tensor kernel.

    Differs from the reference only in rounding (lerp for the EMAs). The weight decay is added to
    the update as written, not folded into ``p *= 1 - lr wd`` (as torch's AdamW does): that
    saves a kernel but rounds differently, drifting by a few ulps from the reference in 20 steps.
    """
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - s.beta1)
    torch._foreach_lerp_(exp_avg_slows, grads, 1.0 - s.beta3)
    torch._foreach_mul_(exp_avg_sqs, s.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - s.beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(s.bias_correction2))
    torch._foreach_add_(denom, s.eps)
    update = torch._foreach_div(exp_avgs, s.bias_correction1)
    torch._foreach_add_(update, exp_avg_slows, alpha=s.alpha)
    if s.weight_decay == 0.0:
        torch._foreach_addcdiv_(params, update, denom, value=-s.lr)
        return
    torch._foreach_div_(update, denom)
    torch._foreach_add_(update, params, alpha=s.weight_decay)
    torch._foreach_add_(params, update, alpha=-s.lr)


class _Batch:
    """Tensors of one group that share one set of multi-tensor kernels: five aligned lists,
    parameters, gradients, m1, m2, v."""

    def __init__(self) -> None:
        self.lists: tuple[list[torch.Tensor], ...] = ([], [], [], [], [])
        self.numel = 0

    def append(self, tensors: tuple[torch.Tensor, ...]) -> None:
        for tensor_list, tensor in zip(self.lists, tensors):
            tensor_list.append(tensor)
        self.numel += tensors[0].numel()


def _pieces(tensors: tuple[torch.Tensor, ...], size: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """A parameter's five tensors, or aligned flat views of at most ``size`` elements of them."""
    if tensors[0].numel() <= size or not all(t.is_contiguous() for t in tensors):
        yield tensors
        return
    yield from zip(*(t.view(-1).split(size) for t in tensors))


def _chunked(batch: _Batch, size: int) -> Iterator[_Batch]:
    """The batch re-cut into batches of at most ``size`` elements (large tensors split).

    Bounds the two full-size temporaries of :func:`_foreach_step` to ``size`` elements each: on
    a GPU they would otherwise cost 8 bytes per parameter of the shard; on a CPU, temporaries
    below glibc's mmap threshold are reused from the heap instead of page-faulted in each step.
    """
    current = _Batch()
    for tensors in zip(*batch.lists):
        for piece in _pieces(tensors, size):
            if current.numel and current.numel + piece[0].numel() > size:
                yield current
                current = _Batch()
            current.append(piece)
    if current.lists[0]:
        yield current


def _default_chunk_numel(device: torch.device) -> int:
    """Measured (docs/ademamix_wsd.md): on an H100 smaller batches get launch-bound; on CPU,
    4 MB temporaries stay under glibc's mmap threshold and in the last-level cache."""
    return 2**24 if device.type == "cuda" else 2**20


class AdEMAMix(torch.optim.Optimizer):
    """AdEMAMix with decoupled weight decay (see the module docstring for the update).

    Param-group keys: ``lr``, ``betas`` (b1, b2, b3), ``alpha``, ``alpha_warmup``,
    ``beta3_warmup`` (steps, 0 = none), ``eps``, ``weight_decay``. Extra keys (megatron-core's
    ``wd_mult``, ``max_lr``, ...) are kept untouched. ``foreach=False`` selects the per-tensor
    reference; ``chunk_numel`` caps the elements per multi-tensor batch (default by device).
    """

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        alpha: float = 8.0,
        alpha_warmup: int = 0,
        beta3_warmup: int = 0,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        foreach: bool = True,
        chunk_numel: int | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            alpha=alpha,
            alpha_warmup=alpha_warmup,
            beta3_warmup=beta3_warmup,
            eps=eps,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults)
        self.foreach = foreach
        self.chunk_numel = chunk_numel

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        _validate_group(self.param_groups[-1])

    def initialize_state(self) -> None:
        """Allocate zero moments and step 0 for every parameter that has none yet.

        Equivalent to the lazy initialisation in :meth:`step`; megatron-core calls it (as the
        ``init_state_fn``) before loading a checkpoint into a fresh optimizer.
        """
        for group in self.param_groups:
            for param in group["params"]:
                self._state_of(param)

    def _state_of(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in STATE_KEYS:
                state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _batches(self, group: dict) -> dict[tuple, _Batch]:
        """Advance the step of every parameter with a gradient and group them for the update."""
        batches: dict[tuple, _Batch] = {}
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise RuntimeError("AdEMAMix does not support sparse gradients")
            state = self._state_of(param)
            state["step"] = state["step"] + 1.0
            key = (param.device, param.dtype, state["step"].item())
            batch = batches.setdefault(key, _Batch())
            batch.append((param, param.grad, *(state[k] for k in STATE_KEYS)))
        return batches

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for (device, _, step), batch in self._batches(group).items():
                scalars = StepScalars.of(group, step)
                if not self.foreach:
                    for tensors in zip(*batch.lists):
                        ademamix_reference_step(*tensors, scalars)
                    continue
                size = self.chunk_numel or _default_chunk_numel(device)
                for chunk in _chunked(batch, size):
                    _foreach_step(*chunk.lists, scalars)
        return loss


def _validate_group(group: dict) -> None:
    """Reject hyperparameters the update cannot use, naming the group key."""
    if len(group["betas"]) != 3:
        raise ValueError(f"AdEMAMix betas are (b1, b2, b3), got {group['betas']!r}")
    for name, beta in zip(("b1", "b2", "b3"), group["betas"]):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"AdEMAMix {name} must be in [0, 1), got {beta}")
    if group["beta3_warmup"] > 0 and group["betas"][0] == 0.0:
        raise ValueError("AdEMAMix beta3 warmup starts from b1's half-life: b1 must be > 0")
    for name in ("lr", "alpha", "eps", "weight_decay", "alpha_warmup", "beta3_warmup"):
        if group[name] < 0:
            raise ValueError(f"AdEMAMix {name} must be >= 0, got {group[name]}")
