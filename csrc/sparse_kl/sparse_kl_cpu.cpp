// Sparse top-k distillation: the two passes over a chunk's logits [n, V_local] on CPU.
//
// The GEMMs (logits = x W^T, dx = dlogits W, dW += dlogits^T x) and the O(n*K) bookkeeping stay
// in ATen (megatron/apertus/ops/sparse_kl.py); this file does only what touches every logit:
//   row_stats:  per-row max m and sum_j exp(z_j - m), fp32, before the (optional) TP all-reduce;
//   write_grad: z_j <- coef * exp(z_j - lse) for every j, then z[idx[k]] <- val[k] for the
//               K+1 sparse entries (teacher ids and label, idx -1 = not on this rank), in place;
//   col_stats, write_grad_t: the same on logits_t [V_local, n], the layout the CPU chunks use.
// Rows are split over ATen's OpenMP pool; the inner loops are plain fp32 loops that the compiler
// vectorises (target_clones builds AVX-512, AVX2 and baseline copies, chosen when loaded).
// bf16/fp16 rows are widened into a per-thread fp32 row buffer, so accumulation is always fp32.

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SPARSE_KL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SPARSE_KL_CLONES
#endif

namespace {

// c ? a : b as bit arithmetic. A `?:` on computed values becomes a branch, and under the default
// -ftrapping-math the vectoriser does not speculate the FP operations back: the AVX2 and
// baseline loops would stay scalar (AVX-512 masks them; the same reason as in xielu_math.h).
inline float pick(bool c, float a, float b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  uint32_t a_bits, b_bits;
  std::memcpy(&a_bits, &a, sizeof(a));
  std::memcpy(&b_bits, &b, sizeof(b));
  const uint32_t bits = (a_bits & mask) | (b_bits & ~mask);
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

// exp(x) for x <= 0 without a libm call or a branch, so that loops over it vectorise: x = k*ln2
// + r with |r| <= ln2/2, exp(r) by its degree-7 Taylor polynomial (truncation error < 6e-9
// relative, below fp32 rounding), 2^k assembled in the exponent bits. Below -87 the result is 0
// (exp(-87) is already at the bottom of the normal fp32 range).
inline float exp_nonpositive(float x) {
  const float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the mantissa
  const bool underflow = x < -87.0f;
  const float clamped = pick(underflow, -87.0f, x);
  const float k = (clamped * 1.44269504088896341f + kRound) - kRound;
  float r = clamped - k * 0.693145751953125f;  // ln2 split into an exact high part ...
  r = r - k * 1.42860682030941723e-06f;        // ... and the remainder (Cody-Waite)
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return pick(underflow, 0.0f, p * scale);
}

SPARSE_KL_CLONES float row_max(const float* z, int64_t v) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < v; ++j) m = z[j] > m ? z[j] : m;
  return m;
}

// Summed in blocks whose fp32 partials are added in fp64: one long fp32 sum per vector lane
// would lose ~1e-5 relative over 131072 terms; this keeps it near fp32 rounding.
SPARSE_KL_CLONES float row_sumexp(const float* z, int64_t v, float m) {
  constexpr int64_t kBlock = 256;
  double total = 0.0;
  for (int64_t start = 0; start < v; start += kBlock) {
    const int64_t stop = start + kBlock < v ? start + kBlock : v;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = start; j < stop; ++j) s += exp_nonpositive(z[j] - m);
    total += s;
  }
  return static_cast<float>(total);
}

SPARSE_KL_CLONES void row_scaled_softmax(const float* z, float* out, int64_t v, float lse,
                                         float coef) {
#pragma omp simd
  for (int64_t j = 0; j < v; ++j) out[j] = coef * exp_nonpositive(z[j] - lse);
}

// Row widening/narrowing for 16-bit logits; bf16 narrowing rounds to nearest even (values are
// finite here: products of a coefficient and a probability).
template <typename T>
void widen(const T* src, float* dst, int64_t v) {
  for (int64_t j = 0; j < v; ++j) dst[j] = static_cast<float>(src[j]);
}

template <>
void widen<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t v) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t j = 0; j < v; ++j) {
    const uint32_t wide = static_cast<uint32_t>(bits[j]) << 16;
    std::memcpy(&dst[j], &wide, sizeof(float));
  }
}

template <typename T>
void narrow(const float* src, T* dst, int64_t v) {
  for (int64_t j = 0; j < v; ++j) dst[j] = static_cast<T>(src[j]);
}

template <>
void narrow<c10::BFloat16>(const float* src, c10::BFloat16* dst, int64_t v) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t j = 0; j < v; ++j) {
    uint32_t wide;
    std::memcpy(&wide, &src[j], sizeof(float));
    bits[j] = static_cast<uint16_t>((wide + 0x7fffu + ((wide >> 16) & 1u)) >> 16);
  }
}

// Calls fn with a null pointer of the logits' element type (the three types we accept).
template <typename Fn>
void dispatch_logits(at::ScalarType dtype, Fn fn) {
  switch (dtype) {
    case at::kFloat: return fn(static_cast<float*>(nullptr));
    case at::kBFloat16: return fn(static_cast<c10::BFloat16*>(nullptr));
    case at::kHalf: return fn(static_cast<c10::Half*>(nullptr));
    default:
      TORCH_CHECK(false, "sparse_kl_cpu: logits must be float32, bfloat16 or float16, got ", dtype);
  }
}

void check_logits(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu(), "sparse_kl_cpu: logits must be on the CPU");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(),
              "sparse_kl_cpu: logits must be a contiguous [n, V] matrix");
}

void check_rowvec(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1 &&
                  t.size(0) == n && t.device().is_cpu(),
              "sparse_kl_cpu: ", name, " must be a contiguous float32 CPU vector of length ", n);
}

// The per-token terms of write_grad / write_grad_t for n tokens on a shard of v logits: lse,
// coef [n] and the sparse entries idx (int64; -1: not on this rank), val (fp32) [n, K+1].
struct GradTerms {
  const float* lse;
  const float* coef;
  const int64_t* idx;
  const float* val;
  int64_t kp, v;

  // set(j, value) for each sparse entry of token c on this shard.
  template <typename Fn>
  void for_each_entry(int64_t c, Fn set) const {
    for (int64_t k = 0; k < kp; ++k) {
      const int64_t j = idx[c * kp + k];
      if (j >= 0) {
        TORCH_CHECK(j < v, "sparse_kl_cpu: sparse index ", j, " outside the shard of ", v);
        set(j, val[c * kp + k]);
      }
    }
  }
};

GradTerms grad_terms(const at::Tensor& lse, const at::Tensor& coef, const at::Tensor& idx,
                     const at::Tensor& val, int64_t n, int64_t v) {
  check_rowvec(lse, n, "lse");
  check_rowvec(coef, n, "coef");
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 2 && idx.size(0) == n &&
                  idx.is_contiguous() && idx.device().is_cpu(),
              "sparse_kl_cpu: idx must be a contiguous int64 CPU matrix [n, K+1]");
  TORCH_CHECK(val.scalar_type() == at::kFloat && val.sizes() == idx.sizes() && val.is_contiguous(),
              "sparse_kl_cpu: val must be a contiguous float32 matrix shaped like idx");
  return {lse.data_ptr<float>(), coef.data_ptr<float>(), idx.data_ptr<int64_t>(),
          val.data_ptr<float>(), idx.size(1), v};
}

// Applies fn(row, row_as_fp32, writable_fp32_or_null) to each row; 16-bit rows go through a
// per-thread buffer (grain: enough rows to amortise the buffer, few enough to balance threads).
template <typename T, typename Fn>
void for_each_row(T* data, int64_t n, int64_t v, bool write_back, Fn fn) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    if constexpr (!std::is_same_v<T, float>) buffer.resize(v);
    for (int64_t r = begin; r < end; ++r) {
      T* row = data + r * v;
      if constexpr (std::is_same_v<T, float>) {
        fn(r, row);
      } else {
        widen(row, buffer.data(), v);
        fn(r, buffer.data());
        if (write_back) narrow(buffer.data(), row, v);
      }
    }
  });
}

std::vector<at::Tensor> row_stats(const at::Tensor& logits) {
  check_logits(logits);
  const int64_t n = logits.size(0), v = logits.size(1);
  auto max = at::empty({n}, logits.options().dtype(at::kFloat));
  auto sum = at::empty({n}, logits.options().dtype(at::kFloat));
  float* max_p = max.data_ptr<float>();
  float* sum_p = sum.data_ptr<float>();
  dispatch_logits(logits.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for_each_row(static_cast<T*>(logits.data_ptr()), n, v, false, [&](int64_t r, float* z) {
      const float m = row_max(z, v);
      max_p[r] = m;
      sum_p[r] = v > 0 ? row_sumexp(z, v, m) : 0.0f;
    });
  });
  return {max, sum};
}

void write_grad(at::Tensor logits, const at::Tensor& lse, const at::Tensor& coef,
                const at::Tensor& idx, const at::Tensor& val) {
  check_logits(logits);
  const int64_t n = logits.size(0), v = logits.size(1);
  const GradTerms terms = grad_terms(lse, coef, idx, val, n, v);
  dispatch_logits(logits.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for_each_row(static_cast<T*>(logits.data_ptr()), n, v, true, [&](int64_t r, float* z) {
      row_scaled_softmax(z, z, v, terms.lse[r], terms.coef[r]);
      // The sparse entries are distinct per row (validated in Python), so order is irrelevant.
      terms.for_each_entry(r, [&](int64_t j, float value) { z[j] = value; });
    });
  });
}

// ---- the same two passes on the transposed layout: logits_t [V, n], one column per token.
// On CPU the GEMM W x^T (M = V) runs faster than x W^T (M = n) for the chunk sizes that keep the
// buffer small (docs/sparse_kl.md); here each V-row holds one logit of every token, so the loops
// run over tokens (contiguous) and a block of kColBlock V-rows stays in cache for its two passes.

constexpr int64_t kColBlock = 256;

SPARSE_KL_CLONES void update_col_max(const float* z, float* m, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) m[c] = z[c] > m[c] ? z[c] : m[c];
}

SPARSE_KL_CLONES void add_col_sumexp(const float* z, const float* m, float* s, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) s[c] += exp_nonpositive(z[c] - m[c]);
}

SPARSE_KL_CLONES void col_scaled_softmax(float* z, const float* lse, const float* coef,
                                         int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) z[c] = coef[c] * exp_nonpositive(z[c] - lse[c]);
}

// Applies fn(block_index, block_as_fp32, rows) to blocks of kColBlock V-rows, in parallel;
// 16-bit blocks go through a per-thread fp32 buffer.
template <typename T, typename Fn>
void for_each_block(T* data, int64_t v, int64_t n, bool write_back, Fn fn) {
  const int64_t blocks = (v + kColBlock - 1) / kColBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    if constexpr (!std::is_same_v<T, float>) buffer.resize(kColBlock * n);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * kColBlock;
      const int64_t rows = first + kColBlock < v ? kColBlock : v - first;
      T* block = data + first * n;
      if constexpr (std::is_same_v<T, float>) {
        fn(b, block, rows);
      } else {
        widen(block, buffer.data(), rows * n);
        fn(b, buffer.data(), rows);
        if (write_back) narrow(buffer.data(), block, rows * n);
      }
    }
  });
}

// Per token: max over its V logits and sum exp(z - max). Each block keeps its own column max
// and sum (both passes while the block is in cache); blocks are merged in block order with the
// sums rescaled and added in fp64, so the result does not depend on the thread count.
std::vector<at::Tensor> col_stats(const at::Tensor& logits_t) {
  check_logits(logits_t);
  const int64_t v = logits_t.size(0), n = logits_t.size(1);
  const int64_t blocks = (v + kColBlock - 1) / kColBlock;
  std::vector<float> block_max(blocks * n, -std::numeric_limits<float>::infinity());
  std::vector<float> block_sum(blocks * n, 0.0f);
  dispatch_logits(logits_t.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for_each_block(static_cast<T*>(logits_t.data_ptr()), v, n, false,
                   [&](int64_t b, float* z, int64_t rows) {
                     float* m = block_max.data() + b * n;
                     float* sum = block_sum.data() + b * n;
                     for (int64_t r = 0; r < rows; ++r) update_col_max(z + r * n, m, n);
                     for (int64_t r = 0; r < rows; ++r) add_col_sumexp(z + r * n, m, sum, n);
                   });
  });
  auto max = at::empty({n}, logits_t.options().dtype(at::kFloat));
  auto sum = at::empty({n}, logits_t.options().dtype(at::kFloat));
  float* max_p = max.data_ptr<float>();
  float* sum_p = sum.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t b = 0; b < blocks; ++b) m = block_max[b * n + c] > m ? block_max[b * n + c] : m;
      double total = 0.0;
      for (int64_t b = 0; b < blocks; ++b) {
        const float bm = block_max[b * n + c];
        if (block_sum[b * n + c] > 0.0f) total += block_sum[b * n + c] * std::exp(double(bm - m));
      }
      max_p[c] = m;
      sum_p[c] = static_cast<float>(total);
    }
  });
  return {max, sum};
}

// In place on logits_t [V, n]: z <- coef * exp(z - lse) column-wise, then the sparse entries
// z[idx[c, k], c] <- val[c, k] (idx -1: not on this rank).
void write_grad_t(at::Tensor logits_t, const at::Tensor& lse, const at::Tensor& coef,
                  const at::Tensor& idx, const at::Tensor& val) {
  check_logits(logits_t);
  const int64_t v = logits_t.size(0), n = logits_t.size(1);
  const GradTerms terms = grad_terms(lse, coef, idx, val, n, v);
  dispatch_logits(logits_t.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* data = static_cast<T*>(logits_t.data_ptr());
    for_each_block(data, v, n, true, [&](int64_t, float* z, int64_t rows) {
      for (int64_t r = 0; r < rows; ++r) col_scaled_softmax(z + r * n, terms.lse, terms.coef, n);
    });
    for (int64_t c = 0; c < n; ++c) {
      terms.for_each_entry(c, [&](int64_t j, float value) {
        data[j * n + c] = static_cast<T>(value);
      });
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Sparse top-k distillation: per-row softmax statistics and in-place logits gradient";
  m.def("row_stats", &row_stats, "Per-row (max, sum exp(z - max)) in fp32", py::arg("logits"));
  m.def("write_grad", &write_grad,
        "In place: logits <- coef * exp(logits - lse), then logits[r, idx] <- val",
        py::arg("logits"), py::arg("lse"), py::arg("coef"), py::arg("idx"), py::arg("val"));
  m.def("col_stats", &col_stats, "row_stats of logits_t.T for logits_t [V, n] (one column per token)",
        py::arg("logits_t"));
  m.def("write_grad_t", &write_grad_t, "write_grad of logits_t.T, in place on logits_t [V, n]",
        py::arg("logits_t"), py::arg("lse"), py::arg("coef"), py::arg("idx"), py::arg("val"));
}
