// PyTorch binding of the CUDA passes (kernels in sparse_kl_cuda.cu). The caller passes the raw
// handle of the current CUDA stream (torch.cuda.current_stream().cuda_stream) and has made the
// logits' device current, so that this file needs no CUDA-specific PyTorch headers.

#include <torch/extension.h>

#include <vector>

#include "sparse_kl_cuda.h"

namespace {

sparse_kl::LogitsType logits_type(const at::Tensor& logits) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.is_contiguous(),
              "sparse_kl_cuda: logits must be a contiguous [n, V] CUDA matrix");
  switch (logits.scalar_type()) {
    case at::kFloat: return sparse_kl::kFloat32;
    case at::kBFloat16: return sparse_kl::kBFloat16;
    case at::kHalf: return sparse_kl::kFloat16;
    default:
      TORCH_CHECK(false, "sparse_kl_cuda: logits must be float32, bfloat16 or float16, got ",
                  logits.scalar_type());
  }
}

void check(const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef sizes, const at::Tensor& like,
           const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.sizes() == sizes && t.is_contiguous() &&
                  t.device() == like.device(),
              "sparse_kl_cuda: ", name, " must be a contiguous ", dtype, " tensor of shape ", sizes,
              " on ", like.device());
}

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "sparse_kl_cuda: ", what, " failed: ", cudaGetErrorString(err));
}

cudaStream_t as_stream(int64_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

std::vector<at::Tensor> row_stats(const at::Tensor& logits, int64_t stream) {
  const auto type = logits_type(logits);
  const int64_t n = logits.size(0), v = logits.size(1);
  auto row_max = at::empty({n}, logits.options().dtype(at::kFloat));
  auto row_sum = at::empty({n}, logits.options().dtype(at::kFloat));
  check_cuda(sparse_kl::row_stats(logits.data_ptr(), type, n, v, row_max.data_ptr<float>(),
                                  row_sum.data_ptr<float>(), as_stream(stream)),
             "row_stats launch");
  return {row_max, row_sum};
}

void write_grad(at::Tensor logits, const at::Tensor& lse, const at::Tensor& coef,
                const at::Tensor& idx, const at::Tensor& val, int64_t stream) {
  const auto type = logits_type(logits);
  const int64_t n = logits.size(0), v = logits.size(1);
  check(lse, at::kFloat, {n}, logits, "lse");
  check(coef, at::kFloat, {n}, logits, "coef");
  TORCH_CHECK(idx.dim() == 2 && idx.size(0) == n, "sparse_kl_cuda: idx must be [n, K+1]");
  check(idx, at::kLong, idx.sizes(), logits, "idx");
  check(val, at::kFloat, idx.sizes(), logits, "val");
  check_cuda(sparse_kl::write_grad(logits.data_ptr(), type, n, v, lse.data_ptr<float>(),
                                   coef.data_ptr<float>(), idx.data_ptr<int64_t>(),
                                   val.data_ptr<float>(), idx.size(1), as_stream(stream)),
             "write_grad launch");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Sparse top-k distillation on CUDA: per-row softmax statistics, in-place gradient";
  m.def("row_stats", &row_stats, "Per-row (max, sum exp(z - max)) in fp32", py::arg("logits"),
        py::arg("stream"));
  m.def("write_grad", &write_grad,
        "In place: logits <- coef * exp(logits - lse), then logits[r, idx] <- val",
        py::arg("logits"), py::arg("lse"), py::arg("coef"), py::arg("idx"), py::arg("val"),
        py::arg("stream"));
}
