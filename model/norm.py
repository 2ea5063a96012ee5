"""RMSNorm, always computed in fp32 (the statistics of bf16/fp16 activations are not).

Shape legend (docs/architecture.md): Z rows (every leading axis flattened), H the normalised axis.
"""

import mindspore as ms
from mindspore import Parameter, nn

from mindmoe.model import kernels
from mindmoe.model.deferred_init import constant
from mindmoe.model.weights import add_seams


class RMSNorm(nn.Cell):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last axis."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = Parameter(constant((dim,), 1.0), name="weight")
        self.normalize = kernels.rms_norm(dim, eps)
        add_seams(self, "weight")

    def construct(self, x):
        shape = x.shape
        x_ZH = x.astype(ms.float32).reshape(-1, shape[-1])
        # fp32 statistics and gain (a half-precision stored weight, train.dtype, is cast up).
        return self.normalize(x_ZH, self.weight_full(self.weight).astype(ms.float32)).reshape(shape).astype(x.dtype)
