"""SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

import numpy as np
from mindspore import nn, ops

from mindmoe.model.linear import Linear


class SwiGLU(nn.Cell):
    def __init__(self, hidden_size: int, intermediate_size: int, std: float, rng: np.random.Generator):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, False, std, rng)
        self.up_proj = Linear(hidden_size, intermediate_size, False, std, rng)
        self.down_proj = Linear(intermediate_size, hidden_size, False, std, rng)

    def construct(self, x):
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))
