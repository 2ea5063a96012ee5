// CPU kernels of the train step's reductions: the LM loss's softmax cross-entropy with its logit gradient and the
// global gradient norm's row sums of squares (model/kernels/cpu.py softmax_nll, row_squares). Conventions in
// common.h.

#include <limits>

#include "common.h"

using namespace mindmoe;

// Softmax cross-entropy of the LM loss with its weighted logit gradient: inputs logits [c, V], labels [c] int32,
// weight [c]; outputs nll [c] = logsumexp(logits_t) - logits_t[label_t] and dlogits [c, V] = (softmax(logits_t) -
// onehot(label_t)) w_t. Per row: the max, the exponentials (written into dlogits) and their sum, then the scaling; a
// NaN logit makes its row's outputs NaN. A label outside [0, V) fails the op.
extern "C" int MindmoeSoftmaxNll(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *stream, void *extra) {
  if (nparam != 5 || std::strcmp(dtypes[0], "float32") != 0 || std::strcmp(dtypes[1], "int32") != 0 ||
      !all_float32(3, dtypes + 2)) {
    return kBadType;
  }
  if (ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 1 || shapes[1][0] != shapes[0][0] || shapes[2][0] != shapes[0][0]) {
    return kBadShape;
  }
  const int64_t rows = shapes[0][0], vocab = shapes[0][1];
  const float *logits = static_cast<const float *>(params[0]);
  const int32_t *labels = static_cast<const int32_t *>(params[1]);
  const float *weight = static_cast<const float *>(params[2]);
  float *nll = static_cast<float *>(params[3]);
  float *dlogits = static_cast<float *>(params[4]);
  for (int64_t t = 0; t < rows; ++t) {
    if (labels[t] < 0 || labels[t] >= vocab) return kBadShape;
  }
  for (int64_t t = 0; t < rows; ++t) {
    const float *x = logits + t * vocab;
    float *d = dlogits + t * vocab;
    float top = x[0];
    bool nan = false;
    for (int64_t v = 0; v < vocab; ++v) {
      top = std::max(top, x[v]);
      nan = nan || std::isnan(x[v]);
    }
    if (nan) top = std::numeric_limits<float>::quiet_NaN();
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t v = 0; v < vocab; ++v) {
      d[v] = exp_poly(x[v] - top);
      sum += d[v];
    }
    const int64_t label = labels[t];
    nll[t] = top + std::log(sum) - x[label];
    const float factor = weight[t] / sum;
#pragma omp simd
    for (int64_t v = 0; v < vocab; ++v) d[v] *= factor;
    d[label] -= weight[t];
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
