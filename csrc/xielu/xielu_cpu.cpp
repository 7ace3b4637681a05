// xIELU forward and backward on CPU: at::parallel_for over fixed chunks, each chunk one
// vectorised loop (the element math of xielu_math.h in fp32, bf16/fp16 converted in registers).
//
// Vectorisation: the loops are plain C++ that the compiler vectorises. On x86-64 each kernel is
// built three times (AVX-512, AVX2+FMA, baseline) and the loader picks the best one for the
// running CPU (GCC/Clang function multi-versioning), so one wheel is fast everywhere; other
// architectures get their baseline SIMD (NEON on aarch64).
//
// Determinism: the scalar-gradient partial sums belong to fixed chunks of kChunk elements (not to
// threads) and are added in chunk order in fp64, so the result does not depend on the number of
// threads and two runs are bitwise equal.
//
// Python module megatron.apertus.ops._xielu_cpu (pybind11):
//   forward(x, alpha_p, alpha_n, beta, eps) -> y
//   backward(dy, x, alpha_p, alpha_n, beta, eps) -> (dx, d_alpha_p, d_alpha_n)
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <vector>

#include "xielu_math.h"

namespace {

// Elements per scalar-gradient partial. Large enough that chunk bookkeeping is negligible,
// small enough that the fp32 lane accumulators stay accurate (about 500 terms per lane).
constexpr int64_t kChunk = 8192;

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define XIELU_MULTIVERSION \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef XIELU_MULTIVERSION
#define XIELU_MULTIVERSION
#endif

// Storage <-> fp32 conversions, written so that they vectorise.
struct F32 {
  using Storage = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};

struct BF16 {
  using Storage = uint16_t;
  static float load(uint16_t v) { return xielu::bits_to_float(static_cast<uint32_t>(v) << 16); }
  // Round to nearest even, NaN to the canonical quiet NaN: the same bits as c10::BFloat16.
  static uint16_t store(float v) {
    const uint32_t bits = xielu::float_to_bits(v);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return v != v ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  }
};

struct F16 {
  using Storage = _Float16;
  static float load(_Float16 v) { return static_cast<float>(v); }
  static _Float16 store(float v) { return static_cast<_Float16>(v); }
};

template <typename Codec>
inline void forward_span(const typename Codec::Storage* x, typename Codec::Storage* y, int64_t n,
                         xielu::Coeffs c) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    y[i] = Codec::store(xielu::forward(Codec::load(x[i]), c));
  }
}

struct Sums {
  float p;
  float n;
};

template <typename Codec>
inline Sums backward_span(const typename Codec::Storage* dy, const typename Codec::Storage* x,
                          typename Codec::Storage* dx, int64_t n, xielu::Coeffs c) {
  float sum_p = 0.0f;
  float sum_n = 0.0f;
#pragma omp simd reduction(+ : sum_p, sum_n)
  for (int64_t i = 0; i < n; ++i) {
    const xielu::Grad g = xielu::backward(Codec::load(x[i]), Codec::load(dy[i]), c);
    dx[i] = Codec::store(g.dx);
    sum_p += g.d_alpha_p;
    sum_n += g.d_alpha_n;
  }
  return {sum_p, sum_n};
}

// One multi-versioned entry per dtype (target_clones cannot be put on a template).
XIELU_MULTIVERSION void forward_f32(const float* x, float* y, int64_t n, xielu::Coeffs c) {
  forward_span<F32>(x, y, n, c);
}
XIELU_MULTIVERSION void forward_bf16(const uint16_t* x, uint16_t* y, int64_t n, xielu::Coeffs c) {
  forward_span<BF16>(x, y, n, c);
}
XIELU_MULTIVERSION void forward_f16(const _Float16* x, _Float16* y, int64_t n, xielu::Coeffs c) {
  forward_span<F16>(x, y, n, c);
}
XIELU_MULTIVERSION Sums backward_f32(const float* dy, const float* x, float* dx, int64_t n,
                                     xielu::Coeffs c) {
  return backward_span<F32>(dy, x, dx, n, c);
}
XIELU_MULTIVERSION Sums backward_bf16(const uint16_t* dy, const uint16_t* x, uint16_t* dx,
                                      int64_t n, xielu::Coeffs c) {
  return backward_span<BF16>(dy, x, dx, n, c);
}
XIELU_MULTIVERSION Sums backward_f16(const _Float16* dy, const _Float16* x, _Float16* dx,
                                     int64_t n, xielu::Coeffs c) {
  return backward_span<F16>(dy, x, dx, n, c);
}

template <typename T>
T* data(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

void check_inputs(const at::Tensor& x, const at::Tensor& alpha_p, const at::Tensor& alpha_n) {
  TORCH_CHECK(x.device().is_cpu(), "xielu cpu kernel: x must be on the CPU, got ", x.device());
  TORCH_CHECK(x.is_contiguous(), "xielu cpu kernel: x must be contiguous");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "xielu cpu kernel: x must be float32, bfloat16 or float16, got ", dtype);
  for (const at::Tensor* a : {&alpha_p, &alpha_n}) {
    TORCH_CHECK(a->numel() == 1 && a->device().is_cpu(),
                "xielu cpu kernel: alpha_p and alpha_n must be one-element CPU tensors");
  }
}

xielu::Coeffs coeffs(const at::Tensor& alpha_p, const at::Tensor& alpha_n, double beta,
                     double eps) {
  return xielu::make_coeffs(alpha_p.item<float>(), alpha_n.item<float>(),
                            static_cast<float>(beta), static_cast<float>(eps));
}

at::Tensor forward(const at::Tensor& x, const at::Tensor& alpha_p, const at::Tensor& alpha_n,
                   double beta, double eps) {
  check_inputs(x, alpha_p, alpha_n);
  const xielu::Coeffs c = coeffs(alpha_p, alpha_n, beta, eps);
  at::Tensor y = at::empty_like(x);
  const auto dtype = x.scalar_type();
  // Elementwise with no reduction: any split is deterministic, so use ATen's grain.
  at::parallel_for(0, x.numel(), at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
    const int64_t n = end - begin;
    if (dtype == at::kFloat) {
      forward_f32(data<float>(x) + begin, data<float>(y) + begin, n, c);
    } else if (dtype == at::kBFloat16) {
      forward_bf16(data<uint16_t>(x) + begin, data<uint16_t>(y) + begin, n, c);
    } else {
      forward_f16(data<_Float16>(x) + begin, data<_Float16>(y) + begin, n, c);
    }
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& dy, const at::Tensor& x,
                                                        const at::Tensor& alpha_p,
                                                        const at::Tensor& alpha_n, double beta,
                                                        double eps) {
  check_inputs(x, alpha_p, alpha_n);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type() &&
                  dy.device() == x.device() && dy.is_contiguous(),
              "xielu cpu kernel: dy must be a contiguous tensor like x");
  const xielu::Coeffs c = coeffs(alpha_p, alpha_n, beta, eps);
  at::Tensor dx = at::empty_like(x);
  const int64_t numel = x.numel();
  const int64_t chunks = (numel + kChunk - 1) / kChunk;
  std::vector<Sums> partial(chunks);
  const auto dtype = x.scalar_type();
  // Threads only for tensors of several grains: waking them costs more than small work.
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / kChunk);
  at::parallel_for(0, chunks, grain, [&](int64_t first, int64_t last) {
    for (int64_t chunk = first; chunk < last; ++chunk) {
      const int64_t begin = chunk * kChunk;
      const int64_t n = std::min(kChunk, numel - begin);
      if (dtype == at::kFloat) {
        partial[chunk] = backward_f32(data<float>(dy) + begin, data<float>(x) + begin,
                                      data<float>(dx) + begin, n, c);
      } else if (dtype == at::kBFloat16) {
        partial[chunk] = backward_bf16(data<uint16_t>(dy) + begin, data<uint16_t>(x) + begin,
                                       data<uint16_t>(dx) + begin, n, c);
      } else {
        partial[chunk] = backward_f16(data<_Float16>(dy) + begin, data<_Float16>(x) + begin,
                                      data<_Float16>(dx) + begin, n, c);
      }
    }
  });
  double sum_p = 0.0;
  double sum_n = 0.0;
  for (const Sums& s : partial) {
    sum_p += s.p;
    sum_n += s.n;
  }
  const xielu::RawScale scale = xielu::make_raw_scale(alpha_p.item<float>(), alpha_n.item<float>());
  return {dx, at::full({1}, sum_p * scale.p, alpha_p.options()),
          at::full({1}, sum_n * scale.n, alpha_n.options())};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "xIELU CPU kernels (see csrc/xielu/xielu_cpu.cpp and docs/xielu.md)";
  m.def("forward", &forward, "xIELU forward", py::arg("x"), py::arg("alpha_p"),
        py::arg("alpha_n"), py::arg("beta"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("backward", &backward, "xIELU backward: dx, d alpha_p, d alpha_n (raw parameters)",
        py::arg("dy"), py::arg("x"), py::arg("alpha_p"), py::arg("alpha_n"), py::arg("beta"),
        py::arg("eps"), py::call_guard<py::gil_scoped_release>());
}
