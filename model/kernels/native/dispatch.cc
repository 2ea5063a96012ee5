// CPU kernels of the MoE capacity dispatch's buffers: the slot gather and the weighted combine, forward and backward
// (model/kernels/cpu.py gather_source_rows, combine_slot_rows). Conventions in common.h.

#include "common.h"

using namespace mindmoe;

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
