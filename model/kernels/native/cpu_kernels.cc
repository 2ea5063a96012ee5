// CPU kernels of mindmoe, called by MindSpore as ops.Custom(func_type="aot") (model/kernels/cpu_native.py).
//
// Each kernel is one pass over its rows where MindSpore's graph formula (model/kernels/cpu.py) is a chain of
// element-wise kernels. MindSpore's AOT calling convention: params holds the inputs then the outputs, shapes[i] and
// ndims[i] their shapes, dtypes[i] their type names; a non-zero return fails the op. The kernels are single-threaded
// (the caller's thread) and deterministic: the same inputs give the same bits on every process.
//
// Compiled by model/kernels/native.py (-O3 -march=native -fno-trapping-math -fopenmp-simd; no fast-math: NaN and inf
// propagate).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kBadType = 1;
constexpr int kBadShape = 2;

bool all_float32(int count, const char **dtypes) {
  for (int i = 0; i < count; ++i) {
    if (std::strcmp(dtypes[i], "float32") != 0) return false;
  }
  return true;
}

int64_t leading_rows(int ndim, const int64_t *shape) {
  int64_t rows = 1;
  for (int i = 0; i + 1 < ndim; ++i) rows *= shape[i];
  return rows;
}

// 1 / sqrt(mean(x^2) + eps) of one row of h values.
inline float inverse_rms(const float *x, int64_t h, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t j = 0; j < h; ++j) squares += x[j] * x[j];
  return 1.0f / std::sqrt(squares / static_cast<float>(h) + eps);
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

}  // namespace

// RMSNorm forward: inputs x [..., H], weight [H], eps [1]; output y [..., H] = (x * r) * weight, r the row's
// inverse RMS.
extern "C" int MindmoeRmsNormForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                     void *stream, void *extra) {
  if (nparam != 4 || !all_float32(4, dtypes)) return kBadType;
  const int64_t h = shapes[0][ndims[0] - 1];
  if (ndims[1] != 1 || shapes[1][0] != h) return kBadShape;
  const int64_t rows = leading_rows(ndims[0], shapes[0]);
  const float *x = static_cast<const float *>(params[0]);
  const float *weight = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *y = static_cast<float *>(params[3]);
  for (int64_t z = 0; z < rows; ++z) {
    const float *xr = x + z * h;
    float *yr = y + z * h;
    const float r = inverse_rms(xr, h, eps);
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) yr[j] = (xr[j] * r) * weight[j];
  }
  return 0;
}

// RMSNorm backward: inputs x [..., H], weight [H], eps [1], dy [..., H]; outputs dx [..., H], dweight [H]. With
// xhat = x r and g = dy * weight: dx = r (g - xhat mean(g xhat)), dweight = sum over rows of dy xhat, summed in
// double (the same float result whatever the order of the rows).
extern "C" int MindmoeRmsNormBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                      void *stream, void *extra) {
  if (nparam != 6 || !all_float32(6, dtypes)) return kBadType;
  const int64_t h = shapes[0][ndims[0] - 1];
  if (ndims[1] != 1 || shapes[1][0] != h || ndims[5] != 1 || shapes[5][0] != h) return kBadShape;
  const int64_t rows = leading_rows(ndims[0], shapes[0]);
  const float *x = static_cast<const float *>(params[0]);
  const float *weight = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  const float *dy = static_cast<const float *>(params[3]);
  float *dx = static_cast<float *>(params[4]);
  float *dweight = static_cast<float *>(params[5]);
  std::vector<double> sums(h, 0.0);
  std::vector<float> xhat(h);
  const float inv_h = 1.0f / static_cast<float>(h);
  for (int64_t z = 0; z < rows; ++z) {
    const float *xr = x + z * h;
    const float *dyr = dy + z * h;
    float *dxr = dx + z * h;
    const float r = inverse_rms(xr, h, eps);
    float mean = 0.f;
#pragma omp simd reduction(+ : mean)
    for (int64_t j = 0; j < h; ++j) {
      xhat[j] = xr[j] * r;
      const float p = dyr[j] * xhat[j];
      mean += p * weight[j];
      sums[j] += static_cast<double>(p);
    }
    mean *= inv_h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) dxr[j] = (dyr[j] * weight[j] - xhat[j] * mean) * r;
  }
  for (int64_t j = 0; j < h; ++j) dweight[j] = static_cast<float>(sums[j]);
  return 0;
}

// SwiGLU forward: inputs gate, up (same shape, any rank); output y = silu(gate) * up = gate sigmoid(gate) up.
extern "C" int MindmoeSwigluForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                    void *stream, void *extra) {
  if (nparam != 3 || !all_float32(3, dtypes)) return kBadType;
  const int64_t count = leading_rows(ndims[0], shapes[0]) * shapes[0][ndims[0] - 1];
  if (leading_rows(ndims[1], shapes[1]) * shapes[1][ndims[1] - 1] != count) return kBadShape;
  const float *gate = static_cast<const float *>(params[0]);
  const float *up = static_cast<const float *>(params[1]);
  float *y = static_cast<float *>(params[2]);
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) y[i] = gate[i] * sigmoid(gate[i]) * up[i];
  return 0;
}

// SwiGLU backward: inputs gate, up, dy; outputs dgate = dy up s (1 + gate (1 - s)), dup = dy gate s, s = sigmoid(gate).
extern "C" int MindmoeSwigluBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                     void *stream, void *extra) {
  if (nparam != 5 || !all_float32(5, dtypes)) return kBadType;
  const int64_t count = leading_rows(ndims[0], shapes[0]) * shapes[0][ndims[0] - 1];
  const float *gate = static_cast<const float *>(params[0]);
  const float *up = static_cast<const float *>(params[1]);
  const float *dy = static_cast<const float *>(params[2]);
  float *dgate = static_cast<float *>(params[3]);
  float *dup = static_cast<float *>(params[4]);
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    const float g = gate[i];
    const float s = sigmoid(g);
    dgate[i] = dy[i] * up[i] * s * (1.0f + g * (1.0f - s));
    dup[i] = dy[i] * g * s;
  }
  return 0;
}

namespace {

// RoPE over rows of R channels, row z at position z % S of the [S, R] tables. Rotate-half pairs channel i with
// i + R/2, interleaved 2i with 2i + 1; rotate(v) = (-v_b, v_a) on each pair (a, b). forward: y = x cos + rotate(x) sin;
// backward: dx = dy cos + rotate^T(dy sin), rotate^T(u) = (u_b, -u_a).
template <bool kInterleaved, bool kBackward>
int rope(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != 4 || !all_float32(4, dtypes)) return kBadType;
  const int nd = ndims[0];
  if (nd < 2 || ndims[1] != 2 || ndims[2] != 2) return kBadShape;
  const int64_t positions = shapes[0][nd - 2], width = shapes[0][nd - 1];
  if (shapes[1][0] != positions || shapes[1][1] != width || shapes[2][0] != positions || shapes[2][1] != width ||
      width % 2 != 0) {
    return kBadShape;
  }
  const int64_t rows = leading_rows(nd, shapes[0]);
  const float *x = static_cast<const float *>(params[0]);
  const float *cos_table = static_cast<const float *>(params[1]);
  const float *sin_table = static_cast<const float *>(params[2]);
  float *y = static_cast<float *>(params[3]);
  const int64_t pairs = width / 2;
  const int64_t a_step = kInterleaved ? 2 : 1, b_offset = kInterleaved ? 1 : pairs;
  for (int64_t z = 0; z < rows; ++z) {
    const float *xr = x + z * width;
    const float *c = cos_table + (z % positions) * width;
    const float *s = sin_table + (z % positions) * width;
    float *yr = y + z * width;
#pragma omp simd
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t a = p * a_step, b = a + b_offset;
      const float xa = xr[a], xb = xr[b];
      if (kBackward) {
        yr[a] = xa * c[a] + xb * s[b];
        yr[b] = xb * c[b] - xa * s[a];
      } else {
        yr[a] = xa * c[a] + -xb * s[a];
        yr[b] = xb * c[b] + xa * s[b];
      }
    }
  }
  return 0;
}

}  // namespace

// RoPE: inputs x [..., S, R] (dy for the backward), cos [S, R], sin [S, R]; output [..., S, R].
extern "C" int MindmoeRopeHalfForward(int n, void **p, int *nd, int64_t **sh, const char **dt, void *, void *) {
  return rope<false, false>(n, p, nd, sh, dt);
}
extern "C" int MindmoeRopeHalfBackward(int n, void **p, int *nd, int64_t **sh, const char **dt, void *, void *) {
  return rope<false, true>(n, p, nd, sh, dt);
}
extern "C" int MindmoeRopeInterleavedForward(int n, void **p, int *nd, int64_t **sh, const char **dt, void *, void *) {
  return rope<true, false>(n, p, nd, sh, dt);
}
extern "C" int MindmoeRopeInterleavedBackward(int n, void **p, int *nd, int64_t **sh, const char **dt, void *, void *) {
  return rope<true, true>(n, p, nd, sh, dt);
}

// Row gather of the MoE dispatch: inputs x [T, H], source [X] int32; output [X, H]: row i is x[source[i]], or zeros
// where source[i] is outside [0, T) (an empty slot).
extern "C" int MindmoeGatherRowsForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                        void *stream, void *extra) {
  if (nparam != 3 || std::strcmp(dtypes[0], "float32") != 0 || std::strcmp(dtypes[1], "int32") != 0) return kBadType;
  if (ndims[0] != 2 || ndims[1] != 1) return kBadShape;
  const int64_t tokens = shapes[0][0], h = shapes[0][1], slots = shapes[1][0];
  const float *x = static_cast<const float *>(params[0]);
  const int32_t *source = static_cast<const int32_t *>(params[1]);
  float *out = static_cast<float *>(params[2]);
  for (int64_t i = 0; i < slots; ++i) {
    const int64_t t = source[i];
    if (t >= 0 && t < tokens) {
      std::memcpy(out + i * h, x + t * h, sizeof(float) * h);
    } else {
      std::memset(out + i * h, 0, sizeof(float) * h);
    }
  }
  return 0;
}

// Its backward: inputs x [T, H] (for its shape), source [X], dout [X, H]; output dx [T, H], the sum over the slots of
// each token (in slot order).
extern "C" int MindmoeGatherRowsBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                         void *stream, void *extra) {
  if (nparam != 4 || std::strcmp(dtypes[1], "int32") != 0 || !all_float32(1, dtypes) || !all_float32(2, dtypes + 2)) {
    return kBadType;
  }
  const int64_t tokens = shapes[0][0], h = shapes[0][1], slots = shapes[1][0];
  if (ndims[2] != 2 || shapes[2][0] != slots || shapes[2][1] != h) return kBadShape;
  const int32_t *source = static_cast<const int32_t *>(params[1]);
  const float *dout = static_cast<const float *>(params[2]);
  float *dx = static_cast<float *>(params[3]);
  std::memset(dx, 0, sizeof(float) * tokens * h);
  for (int64_t i = 0; i < slots; ++i) {
    const int64_t t = source[i];
    if (t < 0 || t >= tokens) continue;
    float *row = dx + t * h;
    const float *g = dout + i * h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) row[j] += g[j];
  }
  return 0;
}

// Weighted combine of the MoE dispatch: inputs y [X, H], row [T K] int32, weight [T, K]; output out [T, H],
// out_t = sum over k (in order) of weight_tk y[row_tk], where a row outside [0, X) (a dropped assignment) adds nothing.
extern "C" int MindmoeCombineRowsForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                         void *stream, void *extra) {
  if (nparam != 4 || std::strcmp(dtypes[0], "float32") != 0 || std::strcmp(dtypes[1], "int32") != 0 ||
      std::strcmp(dtypes[2], "float32") != 0) {
    return kBadType;
  }
  if (ndims[0] != 2 || ndims[2] != 2 || shapes[1][0] != shapes[2][0] * shapes[2][1]) return kBadShape;
  const int64_t slots = shapes[0][0], h = shapes[0][1], tokens = shapes[2][0], top_k = shapes[2][1];
  const float *y = static_cast<const float *>(params[0]);
  const int32_t *row = static_cast<const int32_t *>(params[1]);
  const float *weight = static_cast<const float *>(params[2]);
  float *out = static_cast<float *>(params[3]);
  for (int64_t t = 0; t < tokens; ++t) {
    float *o = out + t * h;
    std::memset(o, 0, sizeof(float) * h);
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t r = row[t * top_k + k];
      if (r < 0 || r >= slots) continue;
      const float w = weight[t * top_k + k];
      const float *yr = y + r * h;
#pragma omp simd
      for (int64_t j = 0; j < h; ++j) o[j] += w * yr[j];
    }
  }
  return 0;
}

// Its backward: inputs y [X, H], row [T K], weight [T, K], dout [T, H]; outputs dy [X, H] (w_tk dout_t added at
// row_tk, zero elsewhere) and dweight [T, K] (dout_t . y[row_tk], zero for a dropped assignment).
extern "C" int MindmoeCombineRowsBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                          void *stream, void *extra) {
  if (nparam != 6 || std::strcmp(dtypes[1], "int32") != 0 || !all_float32(1, dtypes) || !all_float32(4, dtypes + 2)) {
    return kBadType;
  }
  const int64_t slots = shapes[0][0], h = shapes[0][1], tokens = shapes[2][0], top_k = shapes[2][1];
  if (ndims[3] != 2 || shapes[3][0] != tokens || shapes[3][1] != h) return kBadShape;
  const float *y = static_cast<const float *>(params[0]);
  const int32_t *row = static_cast<const int32_t *>(params[1]);
  const float *weight = static_cast<const float *>(params[2]);
  const float *dout = static_cast<const float *>(params[3]);
  float *dy = static_cast<float *>(params[4]);
  float *dweight = static_cast<float *>(params[5]);
  std::memset(dy, 0, sizeof(float) * slots * h);
  for (int64_t t = 0; t < tokens; ++t) {
    const float *g = dout + t * h;
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t r = row[t * top_k + k];
      if (r < 0 || r >= slots) {
        dweight[t * top_k + k] = 0.f;
        continue;
      }
      const float w = weight[t * top_k + k];
      const float *yr = y + r * h;
      float *d = dy + r * h;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < h; ++j) {
        d[j] += w * g[j];
        dot += g[j] * yr[j];
      }
      dweight[t * top_k + k] = dot;
    }
  }
  return 0;
}

// Sum of squares of each row: input x [R, n]; output [R], row r's sum of x[r, j]^2 accumulated in double (each square
// of a float is exact in double) and rounded once to float. A row's value depends on its own elements only, so an
// expert row gives the same bits on whichever rank holds it (train/grad_norm.py). MindSpore's CPU MatMul of the
// global norm's [1, p] x [p, 1] row dots moved about 2.7 GB/s; this runs at memory speed.
extern "C" int MindmoeRowSquares(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *stream, void *extra) {
  if (nparam != 2 || !all_float32(2, dtypes)) return kBadType;
  if (ndims[0] != 2 || ndims[1] != 1 || shapes[1][0] != shapes[0][0]) return kBadShape;
  const int64_t rows = shapes[0][0], n = shapes[0][1];
  const float *x = static_cast<const float *>(params[0]);
  float *out = static_cast<float *>(params[1]);
  for (int64_t r = 0; r < rows; ++r) {
    const float *row = x + r * n;
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) sum += static_cast<double>(row[j]) * static_cast<double>(row[j]);
    out[r] = static_cast<float>(sum);
  }
  return 0;
}
