// CPU kernels of the model's layers: RMSNorm, SwiGLU and RoPE, forward and backward. Each is one pass over its rows
// where MindSpore's graph formula (model/kernels/cpu.py, cpu_rope.py) is a chain of element-wise kernels. Conventions
// in common.h.

#include <vector>

#include "common.h"

using namespace mindmoe;

namespace {

// 1 / sqrt(mean(x^2) + eps) of one row of h values.
inline float inverse_rms(const float *x, int64_t h, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t j = 0; j < h; ++j) squares += x[j] * x[j];
  return 1.0f / std::sqrt(squares / static_cast<float>(h) + eps);
}

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
