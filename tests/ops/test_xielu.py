"""xIELU: the fp64 reference against finite differences, and each kernel against the reference
over odd shapes x dtypes (outputs, dx and both raw-parameter gradients), determinism,
torch.compile, the dispatch errors. CUDA tests are marked ``gpu`` and skipped without a device.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron.apertus.ops import xielu as xielu_ops
from megatron.apertus.ops.xielu import inverse_softplus, xielu, xielu_reference

# (atol, rtol) of y and dx against the reference run at the same dtype. fp32: a few ulp (the
# kernels' expm1 is a polynomial, accurate to ~1 ulp). bf16/fp16: both compute in fp32 and round
# once, so they differ by at most one ulp of the output dtype where fp32 rounding straddles a tie.
TOLERANCES = {
    torch.float32: (1e-6, 1e-6),
    torch.bfloat16: (1e-5, 2**-7),
    torch.float16: (1e-5, 2**-10),
}
# Raw-parameter gradients are sums over every element: compared with an fp64 reference, their
# error is bounded relative to the summed magnitudes (sum |term|), not to the possibly cancelling
# result. Parameters stored in bf16 also round the result itself.
SCALAR_MASS_RTOL = 1e-5
SCALAR_RTOL = {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}

SHAPES = [(1023,), (1,), (3, 1023), (2, 5, 7), (2, 3, 4, 5), (0,), (4, 0, 3), (5, 16411)]
DTYPES = list(TOLERANCES)
# Points where the function or its derivative switches: 0, eps and its neighbours, the fp32
# floor of expm1 (-87), far tails.
SPECIAL = [0.0, -1e-6, -5e-7, -2e-6, 1e-7, -87.5, -100.0, 12.0, -0.3466, 0.3466]


def make_inputs(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 3
    flat = x.view(-1)
    k = min(len(SPECIAL), flat.numel())
    flat[:k] = torch.tensor(SPECIAL[:k])
    dy = torch.randn(shape, generator=gen)
    alpha_p = torch.tensor([inverse_softplus(0.8) + 0.3])
    alpha_n = torch.tensor([inverse_softplus(0.3) - 0.2])
    return x.to(device, dtype), dy.to(device, dtype), alpha_p.to(device), alpha_n.to(device)


def grads(impl, x, dy, alpha_p, alpha_n):
    x, alpha_p, alpha_n = (t.detach().requires_grad_() for t in (x, alpha_p, alpha_n))
    y = xielu(x, alpha_p, alpha_n, impl=impl)
    dx, d_p, d_n = torch.autograd.grad(y, (x, alpha_p, alpha_n), dy)
    return y.detach(), dx, d_p, d_n


def scalar_truth(x, dy, alpha_p, alpha_n):
    """fp64 raw-parameter gradients and their summed magnitudes, on the same (rounded) inputs."""
    x64, dy64 = x.double().cpu(), dy.double().cpu()
    a_p, a_n = (t.detach().double().cpu().requires_grad_() for t in (alpha_p, alpha_n))
    y = xielu_reference(x64, a_p, a_n)
    d_p, d_n = torch.autograd.grad(y, (a_p, a_n), dy64)
    pos = x64 > 0
    mass_p = (dy64 * x64 * x64).abs()[pos].sum() * torch.sigmoid(a_p.detach())
    neg = torch.expm1(x64.clamp(max=-1e-6)) - x64
    mass_n = (dy64 * neg).abs()[~pos].sum() * torch.sigmoid(a_n.detach())
    return (d_p, mass_p), (d_n, mass_n)


def check_against_reference(impl, shape, dtype, device, alpha_dtype=torch.float32):
    x, dy, alpha_p, alpha_n = make_inputs(shape, dtype, device)
    alpha_p, alpha_n = alpha_p.to(alpha_dtype), alpha_n.to(alpha_dtype)
    y, dx, d_p, d_n = grads(impl, x, dy, alpha_p, alpha_n)
    y_ref, dx_ref, _, _ = grads("torch", x, dy, alpha_p, alpha_n)
    atol, rtol = TOLERANCES[dtype]
    assert y.dtype == dtype and y.shape == x.shape and dx.dtype == dtype
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(dx, dx_ref, atol=atol, rtol=rtol)
    for got, (want, mass) in zip((d_p, d_n), scalar_truth(x, dy, alpha_p, alpha_n)):
        assert got.shape == (1,) and got.dtype == alpha_dtype
        tol = SCALAR_MASS_RTOL * mass.item() + SCALAR_RTOL[alpha_dtype] * abs(want.item())
        assert abs(got.double().item() - want.item()) <= tol, (got, want, tol)


def test_reference_gradcheck_fp64():
    # Random points plus both sides of eps; not 0 itself, where the derivative jumps (beta vs
    # beta - alpha_n) and finite differences are meaningless.
    x = torch.cat([torch.randn(40, dtype=torch.float64) * 3, torch.tensor([-3e-6, -2e-6, 0.4])])
    a_p = torch.tensor([0.4], dtype=torch.float64)
    a_n = torch.tensor([-0.9], dtype=torch.float64)
    inputs = tuple(t.requires_grad_() for t in (x.view(43, 1), a_p, a_n))
    assert torch.autograd.gradcheck(xielu_reference, inputs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cpu_kernel_matches_reference(shape, dtype):
    check_against_reference("cpu", shape, dtype, "cpu")


def test_cpu_kernel_bf16_parameters():
    check_against_reference("cpu", (3, 1023), torch.bfloat16, "cpu", alpha_dtype=torch.bfloat16)


def test_cpu_kernel_propagates_nan():
    x = torch.tensor([float("nan"), 1.0, -1.0])
    y = xielu(x, torch.tensor([0.2]), torch.tensor([0.1]), impl="cpu")
    assert y[0].isnan() and not y[1:].isnan().any()


def test_cpu_backward_is_deterministic_across_thread_counts():
    x, dy, alpha_p, alpha_n = make_inputs((7, 50021), torch.float32, "cpu")
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, max(2, threads), max(2, threads)):
            torch.set_num_threads(n)
            runs.append(grads("cpu", x, dy, alpha_p, alpha_n))
    finally:
        torch.set_num_threads(threads)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


@pytest.mark.parametrize("impl", ["cpu", "auto"])
def test_compiled_function_matches_eager_kernel(impl):
    x, dy, alpha_p, alpha_n = make_inputs((4, 1023), torch.float32, "cpu")

    def f(x, alpha_p, alpha_n):
        return xielu(x, alpha_p, alpha_n, impl=impl)

    eager = grads(impl, x, dy, alpha_p, alpha_n)
    compiled_fn = torch.compile(f, fullgraph=True)
    x_, a_p, a_n = (t.clone().requires_grad_() for t in (x, alpha_p, alpha_n))
    y = compiled_fn(x_, a_p, a_n)
    compiled = (y.detach(), *torch.autograd.grad(y, (x_, a_p, a_n), dy))
    # Bitwise: the graph calls the same kernels (the reference would differ in the last bits).
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


@pytest.fixture
def missing_extensions(monkeypatch):
    """Pretend that neither compiled extension was built."""
    real_import = xielu_ops.importlib.import_module

    def fake_import(name, *args):
        if name.startswith("megatron.apertus.ops._xielu_"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(xielu_ops.importlib, "import_module", fake_import)
    monkeypatch.setattr(xielu_ops, "_extensions", {})
    monkeypatch.setattr(xielu_ops, "_warned", set())


@pytest.mark.parametrize("impl", ["cuda", "cpu"])
def test_missing_extension_error_says_how_to_build(missing_extensions, impl):
    with pytest.raises(RuntimeError, match=rf"_xielu_{impl} is not importable.*pip install"):
        xielu(torch.randn(3), torch.zeros(1), torch.zeros(1), impl=impl)


def test_auto_falls_back_to_reference_with_one_warning(missing_extensions):
    x, alpha_p, alpha_n = torch.randn(5), torch.zeros(1), torch.zeros(1)
    with pytest.warns(UserWarning, match="PyTorch reference on cpu"):
        y = xielu(x, alpha_p, alpha_n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xielu(x, alpha_p, alpha_n)
    torch.testing.assert_close(y, xielu_reference(x, alpha_p, alpha_n), atol=0, rtol=0)


def test_dispatch_errors():
    with pytest.raises(ValueError, match="impl must be one of"):
        xielu(torch.randn(3), torch.zeros(1), torch.zeros(1), impl="triton")
    with pytest.raises(TypeError, match="supports"):
        xielu(torch.randn(3, dtype=torch.float64), torch.zeros(1), torch.zeros(1), impl="cpu")


def test_layer_spec_passes_the_impl_to_the_activation():
    from megatron.apertus.model import preset
    from megatron.apertus.model.spec import apertus_layer_spec

    spec = apertus_layer_spec(preset("tiny", vocab_size=512), xielu_impl="cpu")
    assert spec.submodules.mlp.submodules.activation_func.params["impl"] == "cpu"


gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def on_gpu(fn):
    for mark in gpu:
        fn = mark(fn)
    return fn


@on_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(8, 4096, 1031)], ids=str)
def test_cuda_kernel_matches_reference(shape, dtype):
    check_against_reference("cuda", shape, dtype, "cuda")


@on_gpu
@pytest.mark.parametrize("alpha_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_kernel_low_precision_parameters(alpha_dtype):
    check_against_reference("cuda", (3, 1023), torch.bfloat16, "cuda", alpha_dtype=alpha_dtype)


@on_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_kernel_misaligned_views(dtype):
    """Views that start off a 16-byte boundary take the scalar path and still agree."""
    x, dy, alpha_p, alpha_n = make_inputs((4099,), dtype, "cuda")
    y, dx, d_p, d_n = grads("cuda", x[1:], dy[1:], alpha_p, alpha_n)
    y_ref, dx_ref, d_p_ref, d_n_ref = grads("torch", x[1:], dy[1:], alpha_p, alpha_n)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(dx, dx_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(d_p, d_p_ref, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(d_n, d_n_ref, atol=1e-3, rtol=1e-4)


@on_gpu
def test_cuda_backward_is_deterministic():
    x, dy, alpha_p, alpha_n = make_inputs((16, 4096, 257), torch.bfloat16, "cuda")
    first = grads("cuda", x, dy, alpha_p, alpha_n)
    second = grads("cuda", x, dy, alpha_p, alpha_n)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@on_gpu
def test_cuda_kernel_never_synchronises_with_the_host():
    x, dy, alpha_p, alpha_n = make_inputs((8, 1023), torch.bfloat16, "cuda")
    grads("cuda", x, dy, alpha_p, alpha_n)  # load the extension, warm the allocator
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads("cuda", x, dy, alpha_p, alpha_n)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@on_gpu
def test_cuda_compiled_function_matches_eager_kernel():
    x, dy, alpha_p, alpha_n = make_inputs((4, 1023), torch.bfloat16, "cuda")

    def f(x, alpha_p, alpha_n):
        return xielu(x, alpha_p, alpha_n, impl="cuda")

    eager = grads("cuda", x, dy, alpha_p, alpha_n)
    x_, a_p, a_n = (t.clone().requires_grad_() for t in (x, alpha_p, alpha_n))
    y = torch.compile(f, fullgraph=True)(x_, a_p, a_n)
    compiled = (y.detach(), *torch.autograd.grad(y, (x_, a_p, a_n), dy))
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
