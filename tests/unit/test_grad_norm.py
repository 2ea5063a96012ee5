"""The global gradient norm of the train step (train.step.sum_of_squares) against NumPy."""

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mindmoe.train.step import sum_of_squares


def test_sum_of_squares_under_jit_matches_numpy_float64_for_any_rank():
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=shape).astype(np.float32) for shape in ((7,), (3, 4, 5), (1000, 33))]

    @ms.jit
    def global_norm(a, b, c):
        return ops.sqrt(ops.stack([sum_of_squares(g) for g in (a, b, c)]).sum())

    squares = [float(ms.jit(sum_of_squares)(Tensor(a)).asnumpy()) for a in arrays]
    for array, square in zip(arrays, squares):
        np.testing.assert_allclose(square, np.sum(array.astype(np.float64) ** 2), rtol=1e-5)
    expected = np.sqrt(sum(np.sum(a.astype(np.float64) ** 2) for a in arrays))
    np.testing.assert_allclose(float(global_norm(*map(Tensor, arrays)).asnumpy()), expected, rtol=1e-5)
