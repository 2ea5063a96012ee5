"""SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

import numpy as np
from mindspore import nn

from mindmoe.model import kernels
from mindmoe.model.lora.layers import NO_LORA, AdapterScope, projection


class SwiGLU(nn.Cell):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        std: float,
        rng: np.random.Generator,
        lora: AdapterScope = NO_LORA,
    ):
        super().__init__()
        self.gate_proj = projection(hidden_size, intermediate_size, False, std, rng, lora, "gate_proj")
        self.up_proj = projection(hidden_size, intermediate_size, False, std, rng, lora, "up_proj")
        self.down_proj = projection(intermediate_size, hidden_size, False, std, rng, lora, "down_proj")
        self.activation = kernels.swiglu()

    def construct(self, x):
        return self.down_proj(self.activation(self.gate_proj(x), self.up_proj(x)))
