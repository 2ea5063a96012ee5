"""Dense projection with an explicit ``[out, in]`` weight (the HF layout, so checkpoints map 1:1)."""

import numpy as np
from mindspore import Parameter, Tensor, nn, ops


def normal_init(shape, std: float, rng: np.random.Generator) -> Tensor:
    return Tensor(rng.normal(0.0, std, size=shape).astype(np.float32))


class Linear(nn.Cell):
    """``y = x @ weight.T (+ bias)``; weight ``[out_features, in_features]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, std: float, rng: np.random.Generator):
        super().__init__()
        self.weight = Parameter(normal_init((out_features, in_features), std, rng), name="weight")
        self.bias = Parameter(Tensor(np.zeros(out_features, np.float32)), name="bias") if bias else None
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        shape = x.shape
        y = self.matmul(x.reshape(-1, shape[-1]), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(shape[:-1] + (y.shape[-1],))
