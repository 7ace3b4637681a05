// xIELU element math shared by the CPU (g++) and CUDA (nvcc) kernels, so both compute the
// same fp32 function.
//
//   alpha_p = softplus(a_p)   alpha_n = beta + softplus(a_n)
//   y = alpha_p * x * x + beta * x                      x > 0
//   y = alpha_n * (expm1(min(x, eps)) - x) + beta * x   x <= 0
//
// Everything here is branch-free (bitwise selects, no libm calls) so that g++ vectorises the CPU
// loops and a CUDA warp never diverges.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define XIELU_HD __host__ __device__ __forceinline__
#else
#define XIELU_HD inline
#endif

namespace xielu {

// The fp32 coefficients of one call. The raw parameters become alpha_p/alpha_n once per call
// (CPU) or once per thread (CUDA, where they are read from device memory to avoid a host sync).
struct Coeffs {
  float alpha_p;
  float alpha_n;
  float beta;
  float eps;
};

// d alpha / d raw = sigmoid(raw): the chain rule from the summed element gradients to the
// learnable raw parameters.
struct RawScale {
  float p;
  float n;
};

XIELU_HD double softplus(double a) {
  return a > 20.0 ? a : log1p(exp(a));  // torch's threshold: above it softplus(a) == a in fp32
}

XIELU_HD double sigmoid(double a) { return 1.0 / (1.0 + exp(-a)); }

XIELU_HD Coeffs make_coeffs(float raw_p, float raw_n, float beta, float eps) {
  return {static_cast<float>(softplus(raw_p)), static_cast<float>(beta + softplus(raw_n)), beta,
          eps};
}

XIELU_HD RawScale make_raw_scale(float raw_p, float raw_n) {
  return {static_cast<float>(sigmoid(raw_p)), static_cast<float>(sigmoid(raw_n))};
}

XIELU_HD float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

XIELU_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

// c ? a : b as bit arithmetic. A `?:` on computed values can become a branch (g++ even
// specialises the constant path of a clamp), and under the default -ftrapping-math the
// vectoriser then refuses to speculate the FP operations back: the loop would stay scalar.
// (nvcc turns this into one select instruction.)
XIELU_HD float pick(bool c, float a, float b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return bits_to_float((float_to_bits(a) & mask) | (float_to_bits(b) & ~mask));
}

// expm1(m) for m <= 0 to ~1 ulp, without libm calls (which would stop vectorisation):
// m = k ln2 + r with |r| <= ln2/2, expm1(m) = 2^k expm1(r) + (2^k - 1). For k = 0 this is the
// polynomial alone, so there is no cancellation near 0. Below -87, expm1 is -1 in fp32.
XIELU_HD float expm1_nonpositive(float m) {
  m = pick(m > -87.0f, m, -87.0f);
  // Adding 1.5 * 2^23 rounds m * log2(e) to the integer k, held in the low mantissa bits of
  // `shifted`; integer bit arithmetic then builds 2^k (no rint/int-conversion calls, which
  // would stop vectorisation).
  const float shifted = m * 1.44269504088896341f + 12582912.0f;
  const float k = shifted - 12582912.0f;
  const float r = (m - k * 0.693145751953125f) - k * 1.42860682030941723e-6f;  // ln2 hi + lo
  // Taylor series to r^7: the truncation error at |r| = ln2/2 is below half an fp32 ulp.
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r * r + r;
  const float scale = bits_to_float((float_to_bits(shifted) - 0x4B400000u + 127u) << 23);
  return scale * p + (scale - 1.0f);
}

XIELU_HD float forward(float x, const Coeffs& c) {
  const float m = pick(x < c.eps, x, c.eps);  // NaN compares false: NaN x still gives NaN y
  const float negative = c.alpha_n * (expm1_nonpositive(m) - x) + c.beta * x;
  const float positive = c.alpha_p * x * x + c.beta * x;
  return pick(x > 0.0f, positive, negative);
}

// Per element: dx and the element's contributions to d alpha_p and d alpha_n (before sigmoid).
struct Grad {
  float dx;
  float d_alpha_p;
  float d_alpha_n;
};

XIELU_HD Grad backward(float x, float dy, const Coeffs& c) {
  const bool pos = x > 0.0f;
  const float m = pick(x < c.eps, x, c.eps);
  const float e = expm1_nonpositive(m);
  // d/dx expm1(min(x, eps)) is exp(x) for x <= eps (torch's clamp passes the boundary) and 0
  // above it, so the negative branch's slope is alpha_n * (x <= eps ? expm1(x) : -1) + beta.
  const float slope_neg = c.alpha_n * pick(x <= c.eps, e, -1.0f) + c.beta;
  const float slope_pos = 2.0f * c.alpha_p * x + c.beta;
  return {dy * pick(pos, slope_pos, slope_neg), pick(pos, dy * x * x, 0.0f),
          pick(pos, 0.0f, dy * (e - x))};
}

}  // namespace xielu
