"""Fused output layer + sparse top-k distillation loss (KL to a top-K teacher, plus CE).

For hidden states x [N, H], output weight W [V_local, H] (rows ``vocab_start ..`` of the
vocabulary under tensor parallelism), student logits z = x W^T, q = softmax(z), LSE = logsumexp(z),
teacher top-K ids with probabilities t (S = sum_K t <= 1) and label y, each kept token adds

    alpha * KL + (1 - alpha) * CE,        CE = LSE - z_y.

The teacher mass outside the top-K (1 - S) is handled by ``tail`` (docs/sparse_kl.md):

* ``"ignore"``:      KL = sum_K t_i (log t_i - z_i) + S * LSE
                     dKL/dz_j = S q_j - t_j [j in K]
* ``"renormalize"``: as ignore with p = t / S (a row with S = 0 has no KL term)
                     dKL/dz_j = q_j - p_j [j in K]
* ``"rest_bucket"``: ignore + P_rest log(P_rest / Q_rest), P_rest = 1 - S, Q_rest = 1 - sum_K q_i
                     dKL/dz_j = q_j - t_j on K,  (1 - P_rest / Q_rest) q_j off K   (on K this is
                     exactly the full-vocabulary KL gradient, and it keeps the teacher's tail mass
                     instead of teaching the student to drop it, but off K it only scales the
                     student's own tail). Q_rest is floored at REST_FLOOR in value and in the
                     1/Q_rest of the gradient.
* ``"label"``:       ignore + CE on the label when it is outside K: the observed next token
                     stands in for the teacher's tail (target t on K plus 1 at y if y not in K)
                     dKL/dz_j = (S + [y not in K]) q_j - t_j [j in K] - [j = y not in K]
                     (the default, because unbiased: its expectation over labels drawn from
                     the teacher is the full-vocabulary KL gradient q_j - p_j).

so dL/dz_j = c q_j + (sparse corrections at the <= K+1 ids in K and y). The [N, V] logits are never
materialised: tokens are processed in chunks, a chunk's logits come from one GEMM, two passes over
them (row statistics, then the gradient written in place) run in a kernel (C++ on CPU, CUDA on GPU;
this file's PyTorch version is the fallback), and dx_chunk = dz W, dW += dz^T x_chunk follow. The
gradients are thus computed in the forward pass (losses are scalars); backward only scales them.

Invariants: ids need not be sorted, must be distinct per kept row and inside the vocabulary;
probabilities are finite, >= 0, sum <= 1 + PROB_SUM_TOL and are not renormalised except by
``tail="renormalize"``; rows with loss_mask == 0 contribute nothing and their ids, probabilities
and labels are never read. Under TP each rank passes its W shard, the full ids/probs/labels, and
the same chunk size; the returned loss is the same on every rank, dW is the local shard's gradient
and dx the local partial sum (Megatron's copy-to-TP-region all-reduces it in backward). This layer
imports torch and our extensions only, never megatron-core.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from dataclasses import dataclass, fields
from types import ModuleType
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from megatron.apertus.ops.constants import DEFAULT_TAIL, TAIL_MODES

DEFAULT_ALPHA = 0.9
IMPLS = ("auto", "reference", "torch", "cpu", "cuda")

# Top-256 probabilities stored in 16 bits sum to 1 + a few 1e-3 at most; more is not a distribution.
PROB_SUM_TOL = 1e-2
# Q_rest = 1 - sum_K q_i is computed in fp32 (error ~1e-7 per term); below this floor it is noise.
REST_FLOOR = 1e-6
# Chunk budgets for the [n, V_local] logits buffer, from the sweeps in docs/sparse_kl.md.
CPU_CHUNK_BYTES = 64 * 2**20
GPU_CHUNK_BYTES = 1024 * 2**20
MIN_CHUNK_ROWS = 16

_EXTENSIONS = {
    "cpu": "megatron.apertus.ops._sparse_kl_cpu",
    "cuda": "megatron.apertus.ops._sparse_kl_cuda",
}
_BUILD_HINT = (
    "build it with `APERTUS_OPS=sparse_kl python setup.py build_ext --inplace` in the repository "
    "(add APERTUS_SKIP_CUDA=1 for the CPU kernel only), or reinstall with "
    "`pip install --no-build-isolation -e .`"
)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- reference


def sparse_kd_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    teacher_ids: torch.Tensor | None,
    teacher_probs: torch.Tensor | None,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    alpha: float = DEFAULT_ALPHA,
    tail: str = DEFAULT_TAIL,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager, full-logits loss (no TP); autograd gives dx and dW. The tests' ground truth.

    The GEMM runs in the input dtype, like the fused path's; everything after it in at least fp32
    (fp64 stays fp64, for gradcheck). Returns (loss_sum, num_tokens).
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    keep = loss_mask != 0
    logq = torch.log_softmax((x @ weight.T).to(compute), dim=-1)
    ce = -logq.gather(1, torch.where(keep, labels.long(), 0)[:, None]).squeeze(1)
    kl = torch.zeros_like(ce)
    if teacher_ids is not None and teacher_ids.shape[1] > 0:
        t = torch.where(keep[:, None], teacher_probs.to(compute), 0.0)
        logq_k = logq.gather(1, torch.where(keep[:, None], teacher_ids.long(), 0))
        mass = t.sum(1)
        if tail == "renormalize":
            t = torch.where(
                mass[:, None] > 0, t / mass.clamp_min(torch.finfo(compute).tiny)[:, None], 0.0
            )
        kl = (torch.xlogy(t, t) - t * logq_k).sum(1)
        if tail == "rest_bucket":
            p_rest = (1.0 - mass).clamp_min(0.0)
            q_rest = 1.0 - logq_k.exp().sum(1)
            # Floored in value; the gradient passes straight through (1/Q_rest at the floor).
            q_rest = q_rest + (q_rest.clamp_min(REST_FLOOR) - q_rest).detach()
            kl = kl + torch.xlogy(p_rest, p_rest) - p_rest * q_rest.log()
        if tail == "label":
            outside = ~(teacher_ids == labels[:, None]).any(1)
            kl = kl + torch.where(outside, ce, 0.0)
    loss = torch.where(keep, alpha * kl + (1.0 - alpha) * ce, 0.0).sum()
    return loss, keep.sum()


# --------------------------------------------------------------------------- validation


def _check_structure(
    x: torch.Tensor,
    weight: torch.Tensor,
    teacher_ids: torch.Tensor | None,
    teacher_probs: torch.Tensor | None,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    alpha: float,
    tail: str,
    impl: str,
) -> None:
    """Shapes, dtypes, devices and options: no data is read, so no host sync."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] (weight of KL vs CE), got {alpha}")
    if tail not in TAIL_MODES:
        raise ValueError(f"tail must be one of {TAIL_MODES}, got {tail!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating [N, H] matrix, got {x.dtype} {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.dtype != x.dtype:
        raise ValueError(
            f"weight must be [V_local, H={x.shape[1]}] of x's dtype {x.dtype}, "
            f"got {weight.dtype} {tuple(weight.shape)}"
        )
    n = x.shape[0]
    if labels.shape != (n,) or labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(
            f"labels must be integer ids of shape [{n}], got {labels.dtype} {tuple(labels.shape)}"
        )
    if loss_mask.shape != (n,):
        raise ValueError(f"loss_mask must have shape [{n}], got {tuple(loss_mask.shape)}")
    if (teacher_ids is None) != (teacher_probs is None):
        raise ValueError("teacher_ids and teacher_probs must be given together")
    if teacher_ids is None:
        if alpha != 0.0:
            raise ValueError(
                f"alpha={alpha} weighs a KL term but no teacher was given (only alpha=0 needs none)"
            )
    else:
        if (
            teacher_ids.dim() != 2
            or teacher_ids.shape[0] != n
            or teacher_ids.dtype not in (torch.int32, torch.int64)
        ):
            raise ValueError(
                f"teacher_ids must be int32/int64 [{n}, K], "
                f"got {teacher_ids.dtype} {tuple(teacher_ids.shape)}"
            )
        if teacher_probs.shape != teacher_ids.shape or not teacher_probs.is_floating_point():
            raise ValueError(
                "teacher_probs must be floating with teacher_ids' shape "
                f"{tuple(teacher_ids.shape)}, "
                f"got {teacher_probs.dtype} {tuple(teacher_probs.shape)}"
            )
    tensors = [t for t in (weight, teacher_ids, teacher_probs, labels, loss_mask) if t is not None]
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"all inputs must be on x's device {x.device}")


def _check_values(
    teacher_ids: torch.Tensor | None,
    teacher_probs: torch.Tensor | None,
    labels: torch.Tensor,
    keep: torch.Tensor,
    vocab_size: int,
) -> None:
    """Value checks on kept rows, all decided by one host sync; raises ValueError naming the row.

    Checked: label and teacher ids in [0, vocab_size), teacher ids distinct per row (one sort of
    [N, K]), probabilities finite and >= 0, row sums <= 1 + PROB_SUM_TOL.
    """
    problems = {"labels: id outside [0, vocab_size)": (labels < 0) | (labels >= vocab_size)}
    if teacher_ids is not None and teacher_ids.shape[1] > 0:
        ordered = teacher_ids.sort(dim=1).values
        probs = teacher_probs.float()
        out_of_range = (ordered[:, 0] < 0) | (ordered[:, -1] >= vocab_size)
        duplicate = (ordered[:, 1:] == ordered[:, :-1]).any(1)
        not_probability = ((probs < 0) | ~probs.isfinite()).any(1)
        too_much_mass = probs.sum(1) > 1.0 + PROB_SUM_TOL
        problems["teacher_ids: id outside [0, vocab_size)"] = out_of_range
        problems["teacher_ids: duplicate id in a row"] = duplicate
        problems["teacher_probs: negative or non-finite probability"] = not_probability
        problems[f"teacher_probs: row sums to more than 1 + {PROB_SUM_TOL}"] = too_much_mass
    bad_rows = torch.stack(list(problems.values())) & keep
    found = bad_rows.any(1).tolist()
    for (message, _), is_bad, rows in zip(problems.items(), found, bad_rows):
        if is_bad:
            row = int(rows.nonzero()[0, 0])
            raise ValueError(f"{message} (first at token {row}; vocab_size={vocab_size})")


# --------------------------------------------------------------------------- per-token targets


@dataclass
class _Targets:
    """Per-token targets computed once for all chunks; masked rows are neutralised here."""

    keep: torch.Tensor  # [N] 1.0 for tokens in the loss, else 0.0
    ids: torch.Tensor  # [N, K] int64 global teacher ids (garbage in masked rows)
    labels: torch.Tensor  # [N] int64 global labels
    local_idx: torch.Tensor  # [N, K] column of each id in this shard, -1 if elsewhere/masked
    label_local: torch.Tensor  # [N] column of the label in this shard, -1 if elsewhere/masked
    label_in_k: torch.Tensor  # [N] bool: the label is one of the teacher ids
    weight: torch.Tensor  # [N, K] teacher weights p: t, or t / S when renormalised; 0 if masked
    mass: torch.Tensor  # [N] sum_K p
    rest: torch.Tensor  # [N] P_rest = max(1 - S, 0) for rest_bucket, else 0
    label_out: torch.Tensor  # [N] 1.0 for kept tokens whose label is outside K (tail=label), else 0
    teacher_term: torch.Tensor  # [N] sum_K p log p (+ P_rest log P_rest): the loss's constant

    def rows(self, start: int, stop: int) -> _Targets:
        return _Targets(**{f.name: getattr(self, f.name)[start:stop] for f in fields(self)})


def _prepare_targets(
    teacher_ids: torch.Tensor | None,
    teacher_probs: torch.Tensor | None,
    labels: torch.Tensor,
    keep: torch.Tensor,
    *,
    tail: str,
    vocab_start: int,
    vocab_local: int,
    compute: torch.dtype,
) -> _Targets:
    n = labels.shape[0]
    if teacher_ids is None:  # alpha = 0: plain cross-entropy, an empty teacher
        teacher_ids = labels.new_zeros((n, 0), dtype=torch.int64)
        teacher_probs = torch.zeros((n, 0), dtype=compute, device=labels.device)
    ids = teacher_ids.long()
    labels = labels.long()

    def local_column(global_ids: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        column = global_ids - vocab_start
        return torch.where(kept & (column >= 0) & (column < vocab_local), column, -1)

    t = torch.where(keep[:, None], teacher_probs.to(compute), 0.0)
    mass = t.sum(1)
    rest = torch.zeros_like(mass)
    if tail == "renormalize":
        t = torch.where(
            mass[:, None] > 0, t / mass.clamp_min(torch.finfo(compute).tiny)[:, None], 0.0
        )
        mass = t.sum(1)
    teacher_term = torch.xlogy(t, t).sum(1)
    if tail == "rest_bucket":
        rest = (1.0 - mass).clamp_min(0.0) * keep
        teacher_term = teacher_term + torch.xlogy(rest, rest)
    label_in_k = (ids == labels[:, None]).any(1)
    label_out = (keep & ~label_in_k).to(compute) if tail == "label" else torch.zeros_like(mass)
    return _Targets(
        keep=keep.to(compute),
        ids=ids,
        labels=labels,
        local_idx=local_column(ids, keep[:, None]),
        label_local=local_column(labels, keep),
        label_in_k=label_in_k,
        weight=t,
        mass=mass,
        rest=rest,
        label_out=label_out,
        teacher_term=teacher_term,
    )


# --------------------------------------------------------------------------- one chunk


class _ChunkTerms(NamedTuple):
    loss: torch.Tensor  # [n] per-token loss (0 for masked tokens)
    lse: torch.Tensor  # [n] global logsumexp
    coef: torch.Tensor  # [n] dense gradient coefficient c: dL/dz_j = c q_j off the sparse ids
    idx: torch.Tensor  # [n, K+1] local columns of the sparse entries (-1: none here)
    val: torch.Tensor  # [n, K+1] their final dL/dz values


def _chunk_terms(
    logits: torch.Tensor,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    tg: _Targets,
    *,
    alpha: float,
    tail: str,
    tp_group: dist.ProcessGroup | None,
) -> _ChunkTerms:
    """Loss and gradient description of one chunk from its row statistics and O(n*K) gathers.

    Under TP: one MAX all-reduce of the row max, then one SUM all-reduce of the stacked
    (sum-exp, sum_K p z, z_y, sum_K exp(z - max)) partials; every rank owns a disjoint id range,
    so each sparse term is counted once.
    """
    if tp_group is not None:
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
        row_sum = row_sum * torch.exp(row_max - global_max)
        row_max = global_max
    here = tg.local_idx >= 0
    z_k = logits.gather(1, tg.local_idx.clamp_min(0)).to(row_sum.dtype)
    label_here = tg.label_local >= 0
    z_y_here = logits.gather(1, tg.label_local.clamp_min(0)[:, None]).squeeze(1).to(row_sum.dtype)
    partial = torch.stack(
        [
            row_sum,
            torch.where(here, tg.weight * z_k, 0.0).sum(1),
            torch.where(label_here, z_y_here, 0.0),
            torch.where(here, torch.exp(z_k - row_max[:, None]), 0.0).sum(1),
        ]
    )
    if tp_group is not None:
        dist.all_reduce(partial, group=tp_group)
    sum_exp, weighted_z, z_y, sum_exp_k = partial.unbind(0)
    lse = row_max + torch.log(sum_exp)

    # The label tail adds the CE of labels outside K (label_out = 0 for the other modes).
    kl = tg.teacher_term - weighted_z + (tg.mass + tg.label_out) * lse - tg.label_out * z_y
    # dKL/dz_j = kl_dense q_j off the teacher ids, kl_sparse q_j - p_j on them (- [j = y] for a
    # label outside K); the rest bucket adds P_rest/Q_rest * q_j ([j in K] - Q_K) (r = 0 for
    # the other modes).
    q_k = sum_exp_k / sum_exp
    r = torch.zeros_like(q_k)
    if tail == "rest_bucket":
        q_rest = (1.0 - q_k).clamp_min(REST_FLOOR)
        kl = kl - tg.rest * torch.log(q_rest)
        r = tg.rest / q_rest
    kl_dense = tg.mass + tg.label_out - r * q_k
    kl_sparse = tg.mass + tg.label_out + r * (1.0 - q_k)
    keep = tg.keep
    loss = keep * (alpha * kl + (1.0 - alpha) * (lse - z_y))
    coef = keep * (alpha * kl_dense + (1.0 - alpha))

    is_label = (tg.ids == tg.labels[:, None]).to(z_k.dtype)
    val_k = keep[:, None] * (
        (alpha * kl_sparse + (1.0 - alpha))[:, None] * torch.exp(z_k - lse[:, None])
        - alpha * tg.weight
        - (1.0 - alpha) * is_label
    )
    val_y = coef * torch.exp(z_y_here - lse) - keep * (1.0 - alpha) - alpha * tg.label_out
    idx_y = torch.where(label_here & ~tg.label_in_k, tg.label_local, -1)
    idx = torch.cat([tg.local_idx, idx_y[:, None]], dim=1)
    val = torch.cat([val_k, val_y[:, None]], dim=1)
    return _ChunkTerms(loss, lse, coef, idx, val)


# --------------------------------------------------------------------------- row passes


class _Passes(NamedTuple):
    """The two passes over a chunk's logits that an implementation provides."""

    row_stats: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    write_grad: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
    ]


def _torch_row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fallback: per-row max and sum exp(z - max) at >= fp32 (one fp32 temporary of the chunk)."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    row_max = logits.amax(1).to(compute)
    return row_max, torch.exp(logits.to(compute) - row_max[:, None]).sum(1)


def _torch_write_grad(
    logits: torch.Tensor,
    lse: torch.Tensor,
    coef: torch.Tensor,
    idx: torch.Tensor,
    val: torch.Tensor,
) -> None:
    """Fallback: logits <- coef * exp(logits - lse), then the sparse entries, in place.

    The entries with idx = -1 are scattered into a spare column that is then dropped, which
    avoids a data-dependent (host-synchronising) selection.
    """
    n, v = logits.shape
    grad = torch.empty((n, v + 1), dtype=lse.dtype, device=logits.device)
    dense = grad[:, :v]
    torch.sub(logits, lse[:, None], out=dense)
    dense.exp_().mul_(coef[:, None])
    grad.scatter_(1, torch.where(idx >= 0, idx, v), val.to(grad.dtype))
    logits.copy_(dense)


_TORCH_PASSES = _Passes(_torch_row_stats, _torch_write_grad)


@functools.cache
def _load_extension(kind: str) -> tuple[ModuleType | None, str]:
    """The compiled extension for ``kind`` (cpu/cuda), imported on first use, or why it is not."""
    try:
        return importlib.import_module(_EXTENSIONS[kind]), ""
    except ImportError as error:
        return None, str(error)


def _is_transposed(logits: torch.Tensor) -> bool:
    """[n, V] logits stored as the transpose of a contiguous [V, n] matrix (CPU chunks)."""
    return not logits.is_contiguous() and logits.T.is_contiguous()


def _extension_passes(kind: str) -> _Passes:
    """The compiled passes; they take fp32 row vectors, and the CUDA ones the current stream."""
    module, _ = _load_extension(kind)

    def extra(logits: torch.Tensor) -> tuple[int, ...]:
        return (torch.cuda.current_stream(logits.device).cuda_stream,) if kind == "cuda" else ()

    def row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if kind == "cpu" and _is_transposed(logits):
            return tuple(module.col_stats(logits.T))
        row_max, row_sum = module.row_stats(logits, *extra(logits))
        return row_max, row_sum

    def write_grad(
        logits: torch.Tensor,
        lse: torch.Tensor,
        coef: torch.Tensor,
        idx: torch.Tensor,
        val: torch.Tensor,
    ) -> None:
        if kind == "cpu" and _is_transposed(logits):
            module.write_grad_t(logits.T, lse.float(), coef.float(), idx, val.float())
        else:
            module.write_grad(logits, lse.float(), coef.float(), idx, val.float(), *extra(logits))

    return _Passes(row_stats, write_grad)


@functools.cache
def _warn_fallback(kind: str) -> None:
    """Once per device kind: the slower PyTorch passes run because the extension is missing."""
    warnings.warn(
        f"fused_linear_sparse_kd: {_EXTENSIONS[kind]} is not built ({_load_extension(kind)[1]}); "
        f"using the PyTorch passes. To use the kernel, {_BUILD_HINT}.",
        stacklevel=4,
    )


def _select_passes(impl: str, x: torch.Tensor) -> _Passes:
    """auto: the device's kernel if built and the dtype is supported, else the PyTorch passes."""
    device_kind = "cuda" if x.is_cuda else "cpu"
    if impl == "torch":
        return _TORCH_PASSES
    if impl == "auto":
        if x.dtype not in _KERNEL_DTYPES:
            return _TORCH_PASSES
        if _load_extension(device_kind)[0] is None:
            _warn_fallback(device_kind)
            return _TORCH_PASSES
        return _extension_passes(device_kind)
    if impl != device_kind:
        raise ValueError(f"impl={impl!r} cannot run on {x.device} tensors")
    if x.dtype not in _KERNEL_DTYPES:
        raise ValueError(
            f"impl={impl!r} supports {_KERNEL_DTYPES}, got {x.dtype}; use impl='torch'"
        )
    module, error = _load_extension(impl)
    if module is None:
        raise RuntimeError(
            f"impl={impl!r} needs the extension {_EXTENSIONS[impl]} ({error}); {_BUILD_HINT}"
        )
    return _extension_passes(impl)


def row_max_and_sum_exp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row max and sum exp(z - max) of [n, V] logits, in fp32, read in their own dtype by
    the device's compiled pass when built (no fp32 copy of the logits), else by PyTorch."""
    return _select_passes("auto", logits).row_stats(logits.contiguous())


# --------------------------------------------------------------------------- chunk loop


def default_chunk_rows(
    num_tokens: int, vocab_local: int, dtype: torch.dtype, device: torch.device
) -> int:
    """Rows per chunk: the logits buffer [rows, V_local] fills a per-device byte budget.

    The budgets come from measured sweeps (docs/sparse_kl.md): on CPU the time is flat once a
    chunk has a few dozen rows, so a small buffer wins on memory; on GPU the three GEMMs need
    thousands of rows to run at full rate. Depends only on shapes, so all TP ranks agree (each
    chunk issues collectives); chunks are then evened out so that the last is not a sliver.
    """
    if num_tokens == 0:
        return 1
    budget = GPU_CHUNK_BYTES if device.type == "cuda" else CPU_CHUNK_BYTES
    element = torch.empty((), dtype=dtype).element_size()
    rows = max(MIN_CHUNK_ROWS, budget // max(1, vocab_local * element))
    chunks = -(-num_tokens // rows)
    return -(-num_tokens // chunks)


def _add_weight_grad(
    grad_weight: torch.Tensor, dlogits: torch.Tensor, x_chunk: torch.Tensor, *, first: bool
) -> None:
    """grad_weight = (first chunk) or += dlogits^T x_chunk; 16-bit products accumulate in fp32.

    The first chunk overwrites (beta = 0), so the accumulator needs no zero-fill pass.
    """
    beta = 0.0 if first else 1.0
    if grad_weight.dtype == dlogits.dtype:
        grad_weight.addmm_(dlogits.T, x_chunk, beta=beta)
    elif grad_weight.is_cuda:
        torch.addmm(
            grad_weight, dlogits.T, x_chunk, beta=beta, out_dtype=grad_weight.dtype, out=grad_weight
        )
    elif first:  # CPU has no mixed-dtype GEMM: a 16-bit product, then an fp32 copy or add
        grad_weight.copy_(dlogits.T @ x_chunk)
    else:
        grad_weight.add_(dlogits.T @ x_chunk)


def _chunk_step(
    x_chunk: torch.Tensor,
    weight: torch.Tensor,
    targets: _Targets,
    grad_x_chunk: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    logits_buffer: torch.Tensor | None,
    *,
    first: bool,
    alpha: float,
    tail: str,
    tp_group: dist.ProcessGroup | None,
    passes: _Passes,
) -> torch.Tensor:
    """One chunk: logits GEMM, the two passes, dx and dW GEMMs; returns the chunk's loss sum.

    A function of its own so that the chunk's temporaries are freed before the next chunk's
    exist; on CPU the logits go to ``logits_buffer`` (flat, at least V_local * n elements),
    which all chunks share.
    """
    if x_chunk.is_cuda:
        logits = x_chunk @ weight.T
    else:  # [V, n] in memory: on CPU this GEMM (M = V) and dx, dW from it run faster (docs)
        logits_t = logits_buffer[: weight.shape[0] * x_chunk.shape[0]].view(
            weight.shape[0], x_chunk.shape[0]
        )
        logits = torch.mm(weight, x_chunk.T, out=logits_t).T
    row_max, row_sum = passes.row_stats(logits)
    terms = _chunk_terms(
        logits, row_max, row_sum, targets, alpha=alpha, tail=tail, tp_group=tp_group
    )
    if grad_x_chunk is not None or grad_w is not None:
        passes.write_grad(logits, terms.lse, terms.coef, terms.idx, terms.val)
        if grad_x_chunk is not None:
            torch.mm(logits, weight, out=grad_x_chunk)
        if grad_w is not None:
            _add_weight_grad(grad_w, logits, x_chunk, first=first)
    return terms.loss.sum()


def _loss_and_grads(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: _Targets,
    *,
    chunk_rows: int,
    need_dx: bool,
    need_dw: bool,
    **options,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The chunk loop: loss sum and (when asked) dx and dW, never holding more than one chunk."""
    compute = torch.promote_types(x.dtype, torch.float32)
    loss = torch.zeros((), dtype=compute, device=x.device)
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx else None
    # One chunk: its GEMM already accumulates in fp32, so dW is written in W's dtype directly.
    # No chunk (N = 0): nothing overwrites the accumulator, so it starts at zero.
    grad_w = None
    if need_dw:
        dtype = weight.dtype if x.shape[0] <= chunk_rows else compute
        allocate = torch.zeros if x.shape[0] == 0 else torch.empty
        grad_w = allocate(weight.shape, dtype=dtype, device=x.device)
    # CPU: one logits buffer for all chunks. A chunk's [V_local, rows] (64 MiB) is above glibc's
    # mmap threshold, so a fresh one per chunk is mapped, faulted in page by page and unmapped
    # each time: the logits GEMM of a 128-row chunk ran at 63 GFLOP/s into fresh memory against
    # 110 into a reused buffer (2-core AMD EPYC, AVX2, fp32, H = 128). CUDA's caching allocator
    # already reuses its blocks.
    logits_buffer = None
    if not x.is_cuda:
        rows = min(chunk_rows, x.shape[0])
        logits_buffer = torch.empty(weight.shape[0] * rows, dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[0], chunk_rows):
        rows = slice(start, min(start + chunk_rows, x.shape[0]))
        grad_x_chunk = None if grad_x is None else grad_x[rows]
        loss += _chunk_step(
            x[rows],
            weight,
            targets.rows(rows.start, rows.stop),
            grad_x_chunk,
            grad_w,
            logits_buffer,
            first=start == 0,
            **options,
        )
    return loss, grad_x, None if grad_w is None else grad_w.to(weight.dtype)


class _FusedLinearSparseKD(torch.autograd.Function):
    """Gradients are computed in the forward (the loss is a scalar); backward scales them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, run: Callable) -> torch.Tensor:
        loss, grad_x, grad_w = run(ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.grads = (grad_x, grad_w)
        return loss

    @staticmethod
    def backward(
        ctx, grad_loss: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        if ctx.grads is None:
            raise RuntimeError(
                "fused_linear_sparse_kd: its gradients are consumed by the first backward"
            )
        grad_x, grad_w = ctx.grads
        ctx.grads = None  # scaled in place below: a second backward would see them scaled twice
        scale = lambda g: None if g is None else g.mul_(grad_loss.to(g.dtype))  # noqa: E731
        return scale(grad_x), scale(grad_w), None


# --------------------------------------------------------------------------- public entry


def fused_linear_sparse_kd(
    x: torch.Tensor,
    weight: torch.Tensor,
    teacher_ids: torch.Tensor | None,
    teacher_probs: torch.Tensor | None,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    alpha: float = DEFAULT_ALPHA,
    tail: str = DEFAULT_TAIL,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    chunk_size: int | None = None,
    impl: str = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over kept tokens of alpha*KL + (1-alpha)*CE for logits x W^T, without the [N, V] logits.

    Args:
        x: [N, H] hidden states (flatten [s, b, H] first); gradients flow to x and weight.
        weight: [V_local, H] output weight shard holding vocabulary rows vocab_start.. .
        teacher_ids, teacher_probs: [N, K] global top-K ids (int32/int64) and probabilities;
            both None for alpha=0 (plain fused linear cross-entropy, e.g. pretraining).
        labels: [N] next-token ids; loss_mask: [N], nonzero = token counts.
        tail: what to do with the teacher mass outside the top-K (module docstring).
        tp_group: the tensor-parallel group over which the vocabulary is split (None: no TP);
            shards are equal-sized, so the vocabulary size is V_local * TP.
        chunk_size: tokens per chunk (None: ``default_chunk_rows``); must agree across TP ranks.
        impl: "auto" (the device's compiled kernel; else, with one warning, the PyTorch passes),
            "torch", "cpu", "cuda", or "reference" (full logits, no TP).
        validate: check ids, probabilities and labels (one host sync; ``_check_values``).

    Returns:
        (loss_sum, num_tokens): a 0-dim fp32 (fp64 for fp64 inputs) sum, the same on all TP
        ranks, and the int64 count of kept tokens, for per-token normalisation across
        micro-batches.
    """
    _check_structure(x, weight, teacher_ids, teacher_probs, labels, loss_mask, alpha, tail, impl)
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    vocab_local = weight.shape[0]
    vocab_size = vocab_local * tp_size
    if not 0 <= vocab_start <= vocab_size - vocab_local:
        raise ValueError(
            f"vocab_start={vocab_start} does not start a shard of {vocab_local} rows "
            f"in a vocabulary of {vocab_size}"
        )
    keep = loss_mask != 0
    if validate:
        _check_values(teacher_ids, teacher_probs, labels, keep, vocab_size)
    if impl == "reference":
        if tp_size > 1:
            raise ValueError(
                "impl='reference' materialises the full vocabulary and does not support TP"
            )
        return sparse_kd_reference(
            x, weight, teacher_ids, teacher_probs, labels, loss_mask, alpha=alpha, tail=tail
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")

    passes = _select_passes(impl, x)
    compute = torch.promote_types(x.dtype, torch.float32)
    targets = _prepare_targets(
        teacher_ids,
        teacher_probs,
        labels,
        keep,
        tail=tail,
        vocab_start=vocab_start,
        vocab_local=vocab_local,
        compute=compute,
    )
    chunk_rows = chunk_size or default_chunk_rows(x.shape[0], vocab_local, x.dtype, x.device)

    def run(
        need_dx: bool, need_dw: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        options = dict(
            alpha=alpha, tail=tail, tp_group=tp_group, chunk_rows=chunk_rows, passes=passes
        )
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            return _loss_and_grads(x, weight, targets, need_dx=need_dx, need_dw=need_dw, **options)

    num_tokens = keep.sum()
    grads_wanted = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if not grads_wanted:
        return run(False, False)[0], num_tokens
    return _FusedLinearSparseKD.apply(x, weight, run), num_tokens
