// Python module megatron.apertus.ops._xielu_cuda (pybind11): tensor checks, allocation on the
// caching allocator and the current stream around the raw-pointer launchers of xielu_cuda.cu.
//   forward(x, alpha_p, alpha_n, beta, eps) -> y
//   backward(dy, x, alpha_p, alpha_n, beta, eps) -> (dx, d_alpha_p, d_alpha_n)
// Nothing here synchronises with the GPU.
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "xielu_cuda.h"

namespace {

xielu::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return xielu::DType::kFloat32;
    case at::kBFloat16:
      return xielu::DType::kBFloat16;
    case at::kHalf:
      return xielu::DType::kFloat16;
    case at::kDouble:
      return xielu::DType::kFloat64;
    default:
      TORCH_CHECK(false, "xielu cuda kernel: unsupported dtype ", t.scalar_type());
  }
}

xielu::RawParams raw_params(const at::Tensor& x, const at::Tensor& alpha_p,
                            const at::Tensor& alpha_n) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), "xielu cuda kernel: x must be a contiguous "
              "CUDA tensor, got ", x.device());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "xielu cuda kernel: x must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(alpha_p.numel() == 1 && alpha_n.numel() == 1 &&
                  alpha_p.device() == x.device() && alpha_n.device() == x.device() &&
                  alpha_p.scalar_type() == alpha_n.scalar_type(),
              "xielu cuda kernel: alpha_p and alpha_n must be one-element tensors of one dtype "
              "on x's device");
  return {alpha_p.data_ptr(), alpha_n.data_ptr(), dtype_of(alpha_p)};
}

at::Tensor forward(const at::Tensor& x, const at::Tensor& alpha_p, const at::Tensor& alpha_n,
                   double beta, double eps) {
  const xielu::RawParams raw = raw_params(x, alpha_p, alpha_n);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  C10_CUDA_CHECK(xielu::launch_forward(x.data_ptr(), y.data_ptr(), x.numel(), dtype_of(x), raw,
                                       static_cast<float>(beta), static_cast<float>(eps),
                                       c10::cuda::getCurrentCUDAStream()));
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& dy, const at::Tensor& x,
                                                        const at::Tensor& alpha_p,
                                                        const at::Tensor& alpha_n, double beta,
                                                        double eps) {
  const xielu::RawParams raw = raw_params(x, alpha_p, alpha_n);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type() &&
                  dy.device() == x.device() && dy.is_contiguous(),
              "xielu cuda kernel: dy must be a contiguous tensor like x");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  at::Tensor d_alpha_p = at::empty(alpha_p.sizes(), alpha_p.options());
  at::Tensor d_alpha_n = at::empty(alpha_n.sizes(), alpha_n.options());
  const int num_partials = xielu::backward_partials(x.numel(), dtype_of(x));
  // float2 per block; at least one element so that the pointer is valid when x is empty.
  at::Tensor partials = at::empty({std::max(num_partials, 1) * 2}, x.options().dtype(at::kFloat));
  C10_CUDA_CHECK(xielu::launch_backward(
      dy.data_ptr(), x.data_ptr(), dx.data_ptr(), x.numel(), dtype_of(x), raw,
      static_cast<float>(beta), static_cast<float>(eps),
      reinterpret_cast<float2*>(partials.data_ptr<float>()), num_partials, d_alpha_p.data_ptr(),
      d_alpha_n.data_ptr(), c10::cuda::getCurrentCUDAStream()));
  return {dx, d_alpha_p, d_alpha_n};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "xIELU CUDA kernels (see csrc/xielu/xielu_cuda.cu and docs/xielu.md)";
  m.def("forward", &forward, "xIELU forward", py::arg("x"), py::arg("alpha_p"),
        py::arg("alpha_n"), py::arg("beta"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("backward", &backward, "xIELU backward: dx, d alpha_p, d alpha_n (raw parameters)",
        py::arg("dy"), py::arg("x"), py::arg("alpha_p"), py::arg("alpha_n"), py::arg("beta"),
        py::arg("eps"), py::call_guard<py::gil_scoped_release>());
}
