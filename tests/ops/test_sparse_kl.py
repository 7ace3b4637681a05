"""Sparse top-k distillation (megatron/apertus/ops/sparse_kl.py): the reference's gradients by
fp64 gradcheck; every implementation (chunked PyTorch, C++ CPU, CUDA) against the reference for
loss, dx and dW over shapes x dtypes x tail modes x alpha; vocabulary-parallel TP=2 against TP=1 on
two gloo processes; input validation; edge cases. CUDA cases are marked ``gpu`` and skipped
(reported) without a device; the C++ cases are skipped when the extension is not built.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.apertus.ops import sparse_kl
from megatron.apertus.ops.sparse_kl import fused_linear_sparse_kd, sparse_kd_reference
from tests.conftest import spawn

# Maximum error relative to the largest magnitude of each compared tensor. fp32 is compared with
# the fp64 reference; bf16 with the reference run on the same bf16 inputs (same bf16 logits),
# so what remains is the bf16 rounding of the logits gradient and GEMM accumulation order.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float64: 1e-10}
TP_TOL = 1e-5  # TP=2 vs TP=1, both fp32: only the order of the max/sum-exp reductions differs

# (N, H, V, K, chunk_size): odd sizes, several chunks, the default chunking, K = 1, and V both a
# multiple of 8 (vectorised CUDA path) and not.
SHAPES = [
    (1, 8, 64, 1, None),
    (37, 16, 301, 7, 10),
    (96, 32, 1024, 32, 40),
    (130, 24, 1023, 16, None),
]
ALPHAS = [0.0, 0.9, 1.0]


def _has_extension(kind: str) -> bool:
    return sparse_kl._load_extension(kind)[0] is not None


IMPLS = [
    pytest.param("torch", "cpu", id="torch-cpu"),
    pytest.param(
        "cpu",
        "cpu",
        id="cpu",
        marks=pytest.mark.skipif(not _has_extension("cpu"), reason="C++ extension not built"),
    ),
    pytest.param(
        "cuda",
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def make_case(
    n: int, hidden: int, vocab: int, k: int, *, seed: int = 0, dtype=torch.float64
) -> dict:
    """Peaked student logits (std ~3), distinct teacher ids, teacher mass S in [0.5, 1] (row 0 sums
    to exactly 1), labels inside the teacher's top-K on every other row, ~20% of tokens masked."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(n, vocab, generator=gen).argsort(dim=1)[:, :k]
    probs = torch.softmax(2 * torch.randn(n, k, generator=gen, dtype=torch.float64), dim=1)
    probs = probs * torch.empty(n, 1, dtype=torch.float64).uniform_(0.5, 1.0, generator=gen)
    if n:
        probs[0] /= probs[0].sum()
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::2] = ids[::2, k // 2]
    mask = torch.rand(n, generator=gen) > 0.2
    if n:
        mask[0] = True
    return {
        "x": torch.randn(n, hidden, generator=gen, dtype=torch.float64).to(dtype),
        "weight": (
            3 * torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) / hidden**0.5
        ).to(dtype),
        "teacher_ids": ids,
        "teacher_probs": probs.float(),
        "labels": labels,
        "loss_mask": mask,
    }


def _on(case: dict, device: str, dtype: torch.dtype) -> dict:
    moved = {name: t.to(device) for name, t in case.items()}
    moved["x"], moved["weight"] = moved["x"].to(dtype), moved["weight"].to(dtype)
    return moved


def loss_and_grads(fn, case: dict, **kwargs) -> tuple[torch.Tensor, ...]:
    x = case["x"].detach().requires_grad_()
    weight = case["weight"].detach().requires_grad_()
    loss, num = fn(
        x,
        weight,
        *[case[k] for k in ("teacher_ids", "teacher_probs", "labels", "loss_mask")],
        **kwargs,
    )
    grad_x, grad_w = torch.autograd.grad(loss, (x, weight))
    return loss.detach(), num, grad_x, grad_w


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    scale = expected.abs().max().clamp_min(1e-12)
    error = ((actual - expected).abs().max() / scale).item() if expected.numel() else 0.0
    assert (
        error <= tol
    ), f"{what}: max error {error:.3g} of the largest magnitude {scale.item():.3g} > {tol}"


# --------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("tail", sparse_kl.TAIL_MODES)
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_reference_gradcheck(tail: str, alpha: float) -> None:
    case = make_case(5, 4, 13, 3, seed=1)
    case["teacher_probs"] = case["teacher_probs"].double()
    x = case["x"].requires_grad_()
    weight = case["weight"].requires_grad_()
    rest = [case[k] for k in ("teacher_ids", "teacher_probs", "labels", "loss_mask")]

    def loss(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return sparse_kd_reference(x, weight, *rest, alpha=alpha, tail=tail)[0]

    assert torch.autograd.gradcheck(loss, (x, weight))


def test_reference_alpha0_is_cross_entropy() -> None:
    case = make_case(37, 16, 301, 7)
    keep = case["loss_mask"]
    logits = case["x"] @ case["weight"].T
    expected = torch.nn.functional.cross_entropy(
        logits[keep], case["labels"][keep], reduction="sum"
    )
    loss, num = sparse_kd_reference(
        case["x"], case["weight"], None, None, case["labels"], keep, alpha=0.0
    )
    fused, _ = fused_linear_sparse_kd(
        case["x"], case["weight"], None, None, case["labels"], keep, alpha=0.0
    )
    assert num.item() == keep.sum().item()
    assert_close(loss, expected, 1e-12, "reference CE")
    assert_close(fused, expected, 1e-12, "fused CE")


def test_only_rest_bucket_is_stationary_at_the_teacher() -> None:
    """A student equal to the teacher on its top-K (S < 1): the rest bucket has zero loss and zero
    gradient there; ignore and renormalize push the student's tail mass into the top-K."""
    logits = torch.tensor(
        [[2.0, 1.0, 0.5, -1.0, -3.0, 0.0]], dtype=torch.float64, requires_grad=True
    )
    ids = logits.detach().topk(3, dim=1).indices
    teacher = torch.softmax(logits.detach(), dim=1).gather(1, ids)
    identity = torch.eye(6, dtype=torch.float64)
    for tail in sparse_kl.TAIL_MODES:
        loss, _ = sparse_kd_reference(
            logits, identity, ids, teacher, ids[:, 0], torch.tensor([True]), alpha=1.0, tail=tail
        )
        grad = torch.autograd.grad(loss, logits)[0].abs().max().item()
        if tail == "rest_bucket":
            assert abs(loss.item()) < 1e-12 and grad < 1e-12
        else:
            assert grad > 1e-2, tail


def test_label_tail_is_unbiased_for_the_full_kl_gradient() -> None:
    """Averaged over labels drawn from the teacher, the label tail's gradient is the gradient of
    the KL to the teacher's whole distribution (q - p), which the top-K alone cannot give."""
    student = torch.tensor([[0.3, -1.0, 2.0, 0.0, 1.0, -0.5, 0.2]], dtype=torch.float64)
    teacher = torch.softmax(torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0, 0.0, 0.7]]).double(), 1)
    ids = teacher.topk(3, dim=1).indices
    identity = torch.eye(7, dtype=torch.float64)
    expected_grad = torch.zeros_like(student)
    for label in range(7):
        logits = student.clone().requires_grad_()
        loss, _ = sparse_kd_reference(
            logits,
            identity,
            ids,
            teacher.gather(1, ids),
            torch.tensor([label]),
            torch.tensor([True]),
            alpha=1.0,
            tail="label",
        )
        expected_grad += teacher[0, label] * torch.autograd.grad(loss, logits)[0]
    full_kl_grad = torch.softmax(student, 1) - teacher
    assert_close(expected_grad, full_kl_grad, 1e-12, "E_y[label-tail gradient]")


# --------------------------------------------------------------------------- implementations


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])))
@pytest.mark.parametrize("tail", sparse_kl.TAIL_MODES)
def test_matches_reference(
    impl: str, device: str, dtype: torch.dtype, shape: tuple, tail: str
) -> None:
    n, hidden, vocab, k, chunk = shape
    case = make_case(n, hidden, vocab, k, seed=n + vocab)
    truth_dtype = torch.float64 if dtype == torch.float32 else dtype
    for alpha in ALPHAS:
        options = dict(alpha=alpha, tail=tail)
        expected = loss_and_grads(sparse_kd_reference, _on(case, device, truth_dtype), **options)
        got = loss_and_grads(
            fused_linear_sparse_kd, _on(case, device, dtype), impl=impl, chunk_size=chunk, **options
        )
        assert got[1].item() == expected[1].item()
        for what, a, b in zip(
            ("loss", "dx", "dW"), (got[0], got[2], got[3]), (expected[0], expected[2], expected[3])
        ):
            assert_close(a, b, TOL[dtype], f"{impl} {dtype} alpha={alpha} {what}")


def test_chunked_torch_is_exact_in_fp64() -> None:
    """Same math as the reference to fp64 round-off: the chunking and the gradient algebra."""
    case = make_case(37, 16, 301, 7, seed=3)
    for tail in sparse_kl.TAIL_MODES:
        expected = loss_and_grads(sparse_kd_reference, case, alpha=0.9, tail=tail)
        got = loss_and_grads(
            fused_linear_sparse_kd, case, alpha=0.9, tail=tail, impl="torch", chunk_size=8
        )
        for a, b, what in zip(got, expected, ("loss", "num", "dx", "dW")):
            assert_close(a, b, TOL[torch.float64], f"fp64 {tail} {what}")


def test_backward_scales_by_upstream_gradient_once() -> None:
    case = make_case(37, 16, 301, 7)
    x = case["x"].requires_grad_()
    rest = [case[k] for k in ("weight", "teacher_ids", "teacher_probs", "labels", "loss_mask")]
    loss, _ = fused_linear_sparse_kd(x, *rest, impl="torch")
    (2.5 * loss).backward(retain_graph=True)
    expected = torch.autograd.grad(2.5 * sparse_kd_reference(x, *rest)[0], x)[0]
    assert_close(x.grad, expected, 1e-10, "scaled dx")
    with pytest.raises(RuntimeError, match="first backward"):
        loss.backward()


def test_no_grad_returns_the_loss_only() -> None:
    case = make_case(37, 16, 301, 7)
    with torch.no_grad():
        loss, num = fused_linear_sparse_kd(**case)
    expected, _ = sparse_kd_reference(**case)
    assert not loss.requires_grad
    assert_close(loss, expected, 1e-10, "no-grad loss")


def test_default_chunk_rows_balances_chunks() -> None:
    rows = sparse_kl.default_chunk_rows(1000, 131072, torch.float32, torch.device("cpu"))
    chunks = math.ceil(1000 / rows)
    assert sparse_kl.MIN_CHUNK_ROWS <= rows <= 1000 and rows * chunks - 1000 < chunks
    assert sparse_kl.default_chunk_rows(5, 131072, torch.bfloat16, torch.device("cuda")) == 5


# --------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("tail", sparse_kl.TAIL_MODES)
def test_empty_and_fully_masked(impl: str, device: str, tail: str) -> None:
    empty = _on(make_case(0, 8, 64, 4), device, torch.float32)
    loss, num, grad_x, grad_w = loss_and_grads(fused_linear_sparse_kd, empty, impl=impl, tail=tail)
    assert loss.item() == 0.0 and num.item() == 0 and grad_x.shape == (0, 8)
    assert torch.equal(grad_w, torch.zeros_like(grad_w))

    case = make_case(9, 8, 64, 4)
    case["loss_mask"] = torch.zeros(9, dtype=torch.bool)
    case["teacher_probs"][1, 0] = float("nan")  # masked rows are never read, garbage included
    case["teacher_ids"][2, 0] = 10**6
    case["labels"][3] = -100
    loss, num, grad_x, grad_w = loss_and_grads(
        fused_linear_sparse_kd, _on(case, device, torch.float32), impl=impl, tail=tail
    )
    assert loss.item() == 0.0 and num.item() == 0
    assert torch.equal(grad_x, torch.zeros_like(grad_x)) and torch.equal(
        grad_w, torch.zeros_like(grad_w)
    )


@pytest.mark.parametrize("tail", sparse_kl.TAIL_MODES)
def test_zero_teacher_mass_and_full_teacher_mass(tail: str) -> None:
    """S = 0 (renormalize: no KL term) and S = 1 (P_rest = 0) are finite and match the reference."""
    case = make_case(6, 8, 50, 5)
    case["teacher_probs"][1] = 0.0
    case["teacher_probs"][2] /= case["teacher_probs"][2].sum()
    expected = loss_and_grads(sparse_kd_reference, case, tail=tail)
    got = loss_and_grads(fused_linear_sparse_kd, case, tail=tail, impl="torch")
    for a, b, what in zip(got, expected, ("loss", "num", "dx", "dW")):
        assert_close(a, b, 1e-10, f"{tail} {what}")


# --------------------------------------------------------------------------- validation


def _bad(edit) -> dict:
    case = make_case(8, 8, 64, 4)
    edit(case)
    return case


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c["teacher_ids"].__setitem__((3, 1), c["teacher_ids"][3, 0]), "duplicate id"),
        (lambda c: c["teacher_ids"].__setitem__((3, 1), 64), "teacher_ids: id outside"),
        (lambda c: c["teacher_ids"].__setitem__((3, 1), -1), "teacher_ids: id outside"),
        (lambda c: c["teacher_probs"].__setitem__((3, 1), -0.1), "negative or non-finite"),
        (lambda c: c["teacher_probs"].__setitem__((3, 1), float("nan")), "negative or non-finite"),
        (lambda c: c["teacher_probs"].__setitem__((3, 1), 1.5), "sums to more than"),
        (lambda c: c["labels"].__setitem__(3, 64), "labels: id outside"),
    ],
    ids=[
        "duplicate",
        "id-too-large",
        "id-negative",
        "prob-negative",
        "prob-nan",
        "sum-over-1",
        "label",
    ],
)
def test_bad_values_are_refused(edit, message: str) -> None:
    case = _bad(edit)
    case["loss_mask"][3] = True
    with pytest.raises(ValueError, match=message) as error:
        fused_linear_sparse_kd(**case)
    assert "token 3" in str(error.value)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(alpha=1.5), "alpha must be in"),
        (dict(tail="drop"), "tail must be one of"),
        (dict(impl="triton"), "impl must be one of"),
        (dict(teacher_ids=None, teacher_probs=None), "no teacher was given"),
        (dict(teacher_probs=None), "given together"),
        (dict(labels=torch.zeros(8)), "labels must be integer"),
        (dict(teacher_ids=torch.zeros(8, 4)), "teacher_ids must be int32/int64"),
        (dict(weight=torch.zeros(64, 7, dtype=torch.float64)), "weight must be"),
        (dict(vocab_start=1), "vocab_start"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(impl="cuda"), "cannot run on cpu"),
        (dict(impl="cpu"), "supports"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fused_linear_sparse_kd(**{**make_case(8, 8, 64, 4), **kwargs})


def test_missing_extension_names_the_build_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sparse_kl, "_load_extension", lambda kind: (None, "No module named x"))
    case = _on(make_case(8, 8, 64, 4), "cpu", torch.float32)
    with pytest.raises(RuntimeError, match="setup.py build_ext"):
        fused_linear_sparse_kd(**case, impl="cpu")
    sparse_kl._warn_fallback.cache_clear()
    with pytest.warns(UserWarning, match="using the PyTorch passes"):
        loss, _ = fused_linear_sparse_kd(**case, impl="auto")
    assert torch.isfinite(loss)


# --------------------------------------------------------------------------- tensor parallel


def _tp_worker(rank: int, world: int, init_file: str, impls: list[str]) -> None:
    """Each rank holds rows [rank*V/2, (rank+1)*V/2) of W; compare with the unsharded result."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        case = _on(make_case(41, 16, 2 * 151, 9, seed=7), "cpu", torch.float32)
        vocab_local = case["weight"].shape[0] // world
        shard = dict(case, weight=case["weight"][rank * vocab_local : (rank + 1) * vocab_local])
        for impl in impls:
            for tail in sparse_kl.TAIL_MODES:
                for alpha in ALPHAS:
                    options = dict(alpha=alpha, tail=tail, impl=impl, chunk_size=16)
                    full = loss_and_grads(fused_linear_sparse_kd, case, **options)
                    loss, num, grad_x, grad_w = loss_and_grads(
                        fused_linear_sparse_kd,
                        shard,
                        tp_group=dist.group.WORLD,
                        vocab_start=rank * vocab_local,
                        **options,
                    )
                    dist.all_reduce(grad_x)  # Megatron's copy-to-TP-region does this in backward
                    shards = [torch.empty_like(grad_w) for _ in range(world)]
                    dist.all_gather(shards, grad_w)
                    where = f"rank {rank} {impl} {tail} alpha={alpha}"
                    assert num.item() == full[1].item(), where
                    assert_close(loss, full[0], TP_TOL, f"{where} loss")
                    assert_close(grad_x, full[2], TP_TOL, f"{where} dx")
                    assert_close(torch.cat(shards), full[3], TP_TOL, f"{where} dW")
    finally:
        dist.destroy_process_group()


def test_tp2_matches_tp1(tmp_path: Path) -> None:
    impls = ["torch"] + (["cpu"] if _has_extension("cpu") else [])
    spawn(_tp_worker, args=(2, str(tmp_path / "init"), impls), nprocs=2)
