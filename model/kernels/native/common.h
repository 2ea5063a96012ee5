// Shared by the sources of mindmoe's CPU kernel library (model/kernels/native.py compiles every .cc file here into
// one library; MindSpore calls its kernels as ops.Custom(func_type="aot"), model/kernels/cpu_native.py).
//
// MindSpore's AOT calling convention: params holds the inputs then the outputs, shapes[i] and ndims[i] their shapes,
// dtypes[i] their type names; a non-zero return fails the op. The kernels are single-threaded (the caller's thread)
// and deterministic: the same inputs give the same bits on every process.
//
// Compiled with -O3 -march=native -fno-trapping-math -fopenmp-simd; no fast-math: NaN and inf propagate.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace mindmoe {

constexpr int kBadType = 1;
constexpr int kBadShape = 2;

inline bool all_float32(int count, const char **dtypes) {
  for (int i = 0; i < count; ++i) {
    if (std::strcmp(dtypes[i], "float32") != 0) return false;
  }
  return true;
}

inline int64_t leading_rows(int ndim, const int64_t *shape) {
  int64_t rows = 1;
  for (int i = 0; i + 1 < ndim; ++i) rows *= shape[i];
  return rows;
}

// exp(x) in float, as straight-line arithmetic the compiler vectorizes (libm's expf is a call per element; its vector
// variants need fast-math). Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial (Cephes expf
// coefficients) and 2^n applied as two factors, so subnormal results and overflow to inf come out as IEEE rounding
// gives them. The SwiGLU built on it is within 5e-7 (relative) of float64 for gates in [-87, 88]
// (tests/unit/test_native_kernels.py). A NaN stays NaN.
inline float exp_poly(float x) {
  const float clamped = std::min(std::max(x, -104.0f), 89.0f);  // a NaN x stays NaN (it is the first operand)
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t k = static_cast<int32_t>(n);
  const int32_t half = k >> 1;
  const int32_t bits_low = (half + 127) << 23, bits_high = (k - half + 127) << 23;
  float low, high;
  std::memcpy(&low, &bits_low, sizeof(low));
  std::memcpy(&high, &bits_high, sizeof(high));
  return p * low * high;
}

// sigmoid(x) = 1 / (1 + exp(-x)): 1 for large x, 0 (as exp(-x) = inf) for very negative x.
inline float sigmoid(float x) { return 1.0f / (1.0f + exp_poly(-x)); }

}  // namespace mindmoe
