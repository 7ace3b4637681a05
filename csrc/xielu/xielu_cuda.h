// Launchers of the xIELU CUDA kernels, on raw pointers: the .cu file needs no torch headers
// (fast to compile, and the CI compile check stays cheap); xielu_module_cuda.cpp does the tensors.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace xielu {

enum class DType : int { kFloat32, kBFloat16, kFloat16, kFloat64 };

// The two raw (softplus-domain) parameters stay in device memory and are read by the kernels:
// reading them on the host would synchronise with the GPU on every call.
struct RawParams {
  const void* alpha_p;
  const void* alpha_n;
  DType dtype;
};

// y = xielu(x) elementwise, n elements of `dtype` (float32, bfloat16 or float16).
cudaError_t launch_forward(const void* x, void* y, int64_t n, DType dtype, RawParams raw,
                           float beta, float eps, cudaStream_t stream);

// How many float2 partial sums launch_backward needs in `partials` for n elements.
int backward_partials(int64_t n, DType dtype);

// dx, and the gradients of the two raw parameters written to d_alpha_p/d_alpha_n (one element
// each, in raw.dtype). Deterministic: one partial per block, reduced in a fixed order.
cudaError_t launch_backward(const void* dy, const void* x, void* dx, int64_t n, DType dtype,
                            RawParams raw, float beta, float eps, float2* partials,
                            int num_partials, void* d_alpha_p, void* d_alpha_n,
                            cudaStream_t stream);

}  // namespace xielu
