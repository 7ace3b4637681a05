// Sparse top-k distillation: the two passes over a chunk's logits [n, V_local] on the GPU.
//
// One block per row. row_stats keeps an online (max, sum-exp) pair per thread and merges the
// pairs across the block; write_grad overwrites the row with coef * exp(z - lse), then (after a
// block barrier, so the dense values are in place) writes the <= K+1 sparse entries computed by
// the caller. Loads and stores are 16-byte vectors when the row allows it, four in flight per
// thread; arithmetic is fp32 whatever the storage type. No host synchronisation.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "sparse_kl_cuda.h"

namespace sparse_kl {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// VEC consecutive elements moved as one 16-byte access (VEC = 16 / sizeof(T)) or one scalar.
template <typename T, int VEC>
struct Pack {
  static_assert(VEC == 1 || VEC * sizeof(T) == 16, "a pack is one element or 16 bytes");
  union {
    uint4 raw;
    T e[VEC];
  };
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (VEC == 1) e[0] = *p; else raw = *reinterpret_cast<const uint4*>(p);
  }
  __device__ __forceinline__ void store(T* p) const {
    if constexpr (VEC == 1) *p = e[0]; else *reinterpret_cast<uint4*>(p) = raw;
  }
};

struct MaxSum {
  float m, s;
};

// Merge two partial (max, sum exp(z - max)); an empty partial has m = -inf.
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  if (a.m == -INFINITY) return b;
  if (b.m == -INFINITY) return a;
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

template <typename T, int VEC>
__device__ __forceinline__ MaxSum absorb(MaxSum acc, const Pack<T, VEC>& pack) {
  float hi = to_float(pack.e[0]);
#pragma unroll
  for (int k = 1; k < VEC; ++k) hi = fmaxf(hi, to_float(pack.e[k]));
  const float m = fmaxf(acc.m, hi);
  float s = acc.s * __expf(acc.m - m);
#pragma unroll
  for (int k = 0; k < VEC; ++k) s += __expf(to_float(pack.e[k]) - m);
  return {m, s};
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    row_stats_kernel(const T* __restrict__ logits, int64_t v, float* __restrict__ row_max,
                     float* __restrict__ row_sum) {
  const T* row = logits + static_cast<int64_t>(blockIdx.x) * v;
  const int64_t packs = v / VEC;
  MaxSum acc{-INFINITY, 0.0f};
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * kThreads < packs; i += kUnroll * kThreads) {
    Pack<T, VEC> p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) p[u].load(row + (i + u * kThreads) * VEC);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc = absorb(acc, p[u]);
  }
  for (; i < packs; i += kThreads) {
    Pack<T, VEC> p;
    p.load(row + i * VEC);
    acc = absorb(acc, p);
  }
  for (int64_t j = packs * VEC + threadIdx.x; j < v; j += kThreads) {
    Pack<T, 1> p;
    p.load(row + j);
    acc = absorb(acc, p);
  }

#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const MaxSum other{__shfl_xor_sync(0xffffffffu, acc.m, offset),
                       __shfl_xor_sync(0xffffffffu, acc.s, offset)};
    acc = merge(acc, other);
  }
  __shared__ MaxSum warp_acc[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_acc[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < kThreads / 32 ? warp_acc[lane] : MaxSum{-INFINITY, 0.0f};
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const MaxSum other{__shfl_xor_sync(0xffffffffu, acc.m, offset),
                         __shfl_xor_sync(0xffffffffu, acc.s, offset)};
      acc = merge(acc, other);
    }
    if (lane == 0) {
      row_max[blockIdx.x] = acc.m;
      row_sum[blockIdx.x] = acc.s;
    }
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void scale_pack(Pack<T, VEC>& pack, float lse, float coef) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) pack.e[k] = from_float<T>(coef * __expf(to_float(pack.e[k]) - lse));
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    write_grad_kernel(T* __restrict__ logits, int64_t v, const float* __restrict__ lse,
                      const float* __restrict__ coef, const int64_t* __restrict__ idx,
                      const float* __restrict__ val, int64_t kp) {
  const int64_t r = blockIdx.x;
  T* row = logits + r * v;
  const float row_lse = lse[r], row_coef = coef[r];
  const int64_t packs = v / VEC;
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * kThreads < packs; i += kUnroll * kThreads) {
    Pack<T, VEC> p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) p[u].load(row + (i + u * kThreads) * VEC);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      scale_pack(p[u], row_lse, row_coef);
      p[u].store(row + (i + u * kThreads) * VEC);
    }
  }
  for (; i < packs; i += kThreads) {
    Pack<T, VEC> p;
    p.load(row + i * VEC);
    scale_pack(p, row_lse, row_coef);
    p.store(row + i * VEC);
  }
  for (int64_t j = packs * VEC + threadIdx.x; j < v; j += kThreads) {
    Pack<T, 1> p;
    p.load(row + j);
    scale_pack(p, row_lse, row_coef);
    p.store(row + j);
  }
  // The sparse entries overwrite dense values written by other threads of this block; the
  // barrier orders those global writes. Entries are distinct per row (validated in Python).
  __syncthreads();
  for (int64_t k = threadIdx.x; k < kp; k += kThreads) {
    const int64_t j = idx[r * kp + k];
    if (j >= 0) row[j] = from_float<T>(val[r * kp + k]);
  }
}

template <typename T>
bool vectorisable(const void* ptr, int64_t v) {
  constexpr int vec = 16 / sizeof(T);
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && v % vec == 0;
}

template <typename T>
cudaError_t launch_row_stats(const void* logits, int64_t n, int64_t v, float* row_max,
                             float* row_sum, cudaStream_t stream) {
  const T* p = static_cast<const T*>(logits);
  if (vectorisable<T>(logits, v)) {
    row_stats_kernel<T, 16 / sizeof(T)><<<n, kThreads, 0, stream>>>(p, v, row_max, row_sum);
  } else {
    row_stats_kernel<T, 1><<<n, kThreads, 0, stream>>>(p, v, row_max, row_sum);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_write_grad(void* logits, int64_t n, int64_t v, const float* lse,
                              const float* coef, const int64_t* idx, const float* val,
                              int64_t kp, cudaStream_t stream) {
  T* p = static_cast<T*>(logits);
  if (vectorisable<T>(logits, v)) {
    write_grad_kernel<T, 16 / sizeof(T)><<<n, kThreads, 0, stream>>>(p, v, lse, coef, idx, val, kp);
  } else {
    write_grad_kernel<T, 1><<<n, kThreads, 0, stream>>>(p, v, lse, coef, idx, val, kp);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t row_stats(const void* logits, LogitsType type, int64_t n, int64_t v, float* row_max,
                      float* row_sum, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (type) {
    case kFloat32: return launch_row_stats<float>(logits, n, v, row_max, row_sum, stream);
    case kBFloat16: return launch_row_stats<__nv_bfloat16>(logits, n, v, row_max, row_sum, stream);
    case kFloat16: return launch_row_stats<__half>(logits, n, v, row_max, row_sum, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t write_grad(void* logits, LogitsType type, int64_t n, int64_t v, const float* lse,
                       const float* coef, const int64_t* idx, const float* val, int64_t kp,
                       cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (type) {
    case kFloat32:
      return launch_write_grad<float>(logits, n, v, lse, coef, idx, val, kp, stream);
    case kBFloat16:
      return launch_write_grad<__nv_bfloat16>(logits, n, v, lse, coef, idx, val, kp, stream);
    case kFloat16:
      return launch_write_grad<__half>(logits, n, v, lse, coef, idx, val, kp, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sparse_kl
