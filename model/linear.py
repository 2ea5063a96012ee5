"""Dense projection with an explicit ``[out, in]`` weight (the HF layout, so checkpoints map 1:1).

A frozen weight may be stored in half precision (``lora.base_dtype``); it is then up-cast per call to the
dtype of the input, so the MatMul runs in the compute dtype (CPU has no bf16 MatMul) and no fp32 copy is
stored.
"""

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindmoe.model.deferred_init import constant, deferring, provided
from mindmoe.model.weights import add_seams


def normal_init(shape, std: float, rng: np.random.Generator, dtype=ms.float32) -> Tensor:
    """``N(0, std)`` drawn in fp32 (the same stream whatever ``dtype``), stored rounded to ``dtype``."""
    if deferring():  # a checkpoint provides the value: nothing drawn (model.deferred_init)
        return provided(shape, dtype)
    return Tensor(rng.normal(0.0, std, size=shape).astype(np.float32), dtype=dtype)


def is_half(dtype) -> bool:
    return dtype in (ms.float16, ms.bfloat16)


def numpy_of(tensor):
    """``tensor`` as a numpy array; bf16, which numpy lacks, as fp32 (exactly: every bf16 value is an fp32 one)."""
    if tensor.dtype == ms.bfloat16:
        return tensor.astype(ms.float32).asnumpy()
    return tensor.asnumpy()


class Linear(nn.Cell):
    """``y = x @ weight.T (+ bias)``; weight ``[out_features, in_features]`` stored in ``dtype`` (the bias fp32)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, std: float, rng: np.random.Generator, dtype=ms.float32
    ):
        super().__init__()
        self.weight = Parameter(normal_init((out_features, in_features), std, rng, dtype), name="weight")
        self.bias = Parameter(constant((out_features,), 0.0), name="bias") if bias else None
        self.matmul = ops.MatMul(transpose_b=True)
        self.half_weight = is_half(dtype)
        add_seams(self, "weight", "bias")

    def base_weight(self, compute_dtype):
        """The weight in ``compute_dtype`` (a per-call cast when it is stored in half precision)."""
        weight = self.weight_full(self.weight)
        return weight.astype(compute_dtype) if self.half_weight else weight

    def construct(self, x):
        shape = x.shape
        y = self.matmul(x.reshape(-1, shape[-1]), self.base_weight(x.dtype))
        if self.bias is not None:
            y = y + self.bias_full(self.bias)
        return y.reshape(shape[:-1] + (y.shape[-1],))
