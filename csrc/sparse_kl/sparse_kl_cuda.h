// Launchers shared by sparse_kl_cuda.cu (kernels) and sparse_kl_binding_cuda.cpp (PyTorch
// binding; a sparse_kl_cuda.cpp would compile to the same object file as the .cu).
// Plain pointers and an explicit stream keep the .cu free of PyTorch headers (fast nvcc builds)
// and the binding free of CUDA-only PyTorch headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace sparse_kl {

enum LogitsType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Per-row max and sum_j exp(z_j - max) of logits [n, v] (fp32 outputs of length n).
cudaError_t row_stats(const void* logits, LogitsType type, int64_t n, int64_t v, float* row_max,
                      float* row_sum, cudaStream_t stream);

// In place: z <- coef[r] * exp(z - lse[r]); then z[r, idx[r, k]] <- val[r, k] where idx >= 0.
cudaError_t write_grad(void* logits, LogitsType type, int64_t n, int64_t v, const float* lse,
                       const float* coef, const int64_t* idx, const float* val, int64_t kp,
                       cudaStream_t stream);

}  // namespace sparse_kl
