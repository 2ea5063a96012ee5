"""Routed experts stored as 3-D weights, one SwiGLU per expert.

Weights use the per-expert HF layout ``[E, out, in]`` (``gate_proj``/``up_proj``
``[E, I, H]``, ``down_proj`` ``[E, H, I]``) so a HF ``mlp.experts.{e}.*_proj.weight``
is row e of the stacked tensor.
"""
import numpy as np
from mindspore import Parameter, nn, ops

from model.linear import normal_init


class RoutedExperts(nn.Cell):
    """Applies expert e to row-block e of ``x [E, C, H]`` (one batched matmul per projection)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, std: float,
                 rng: np.random.Generator):
        super().__init__()
        self.gate_proj = Parameter(normal_init((num_experts, intermediate_size, hidden_size), std, rng),
                                   name="gate_proj")
        self.up_proj = Parameter(normal_init((num_experts, intermediate_size, hidden_size), std, rng),
                                 name="up_proj")
        self.down_proj = Parameter(normal_init((num_experts, hidden_size, intermediate_size), std, rng),
                                   name="down_proj")
        self.bmm = ops.BatchMatMul(transpose_b=True)

    def construct(self, x_ECH):
        hidden_ECI = ops.silu(self.bmm(x_ECH, self.gate_proj)) * self.bmm(x_ECH, self.up_proj)
        return self.bmm(hidden_ECI, self.down_proj)
