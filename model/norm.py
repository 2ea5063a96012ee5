"""RMSNorm, always computed in fp32 (the statistics of bf16/fp16 activations are not).

Shape legend: R rows (every leading axis flattened), D normalised axis.
"""

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops


class RowRMSNormalize(nn.Cell):
    """``x * rsqrt(mean(x^2, -1) + eps) * weight`` on a 2-D fp32 ``[R, D]``, with a hand-written backward.

    Both row reductions are MatMuls with a ones column and the weight gradient a column sum of a
    2-D tensor: on CPU, MindSpore 2.9's ReduceMean/ReduceSum over an axis of a 3-D or 4-D tensor ran
    about 8x slower than over a 2-D one and than these MatMuls, and the automatic backward of the
    plain formula took four such reductions per norm. (A ``[1, R] x [R, D]`` MatMul for the column
    sum is as fast, but with it two data-parallel workers no longer reproduced the single process's
    losses to 1e-5.) With ``xhat = x r``, ``r = rsqrt(mean(x^2) + eps)``
    and ``g = dy * weight``::

        dx      = r * (g - xhat * mean(g * xhat, -1))
        dweight = sum_rows(dy * xhat)
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.inv_dim = 1.0 / dim
        self.row_dot = ops.MatMul()

    def inverse_rms(self, x_RD):
        ones_D1 = ops.ones((x_RD.shape[1], 1), ms.float32)
        return ops.rsqrt(self.row_dot(x_RD * x_RD, ones_D1) * self.inv_dim + self.eps)

    def construct(self, x_RD, weight_D):
        return x_RD * self.inverse_rms(x_RD) * weight_D

    def bprop(self, x_RD, weight_D, out_RD, dout_RD):
        inv_rms_R1 = self.inverse_rms(x_RD)
        xhat_RD = x_RD * inv_rms_R1
        dweight_D = (dout_RD * xhat_RD).sum(0)
        g_RD = dout_RD * weight_D
        ones_D1 = ops.ones((x_RD.shape[1], 1), ms.float32)
        mean_R1 = self.row_dot(g_RD * xhat_RD, ones_D1) * self.inv_dim
        return (g_RD - xhat_RD * mean_R1) * inv_rms_R1, dweight_D


class RMSNorm(nn.Cell):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last axis."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(dim, np.float32)), name="weight")
        self.normalize = RowRMSNormalize(dim, eps)

    def construct(self, x):
        shape = x.shape
        x_RD = x.astype(ms.float32).reshape(-1, shape[-1])
        return self.normalize(x_RD, self.weight).reshape(shape).astype(x.dtype)
