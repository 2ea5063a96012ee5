"""RMSNorm, always computed in fp32 (the statistics of bf16/fp16 activations are not)."""
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
import mindspore as ms


class RMSNorm(nn.Cell):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last axis."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(Tensor(np.ones(dim, np.float32)), name="weight")

    def construct(self, x):
        x_fp32 = x.astype(ms.float32)
        variance = ops.mean(x_fp32 * x_fp32, -1, keep_dims=True)
        normed = x_fp32 * ops.rsqrt(variance + self.eps)
        return (normed * self.weight).astype(x.dtype)
