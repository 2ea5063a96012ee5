"""Routed experts stored as 3-D weights, one SwiGLU per expert.

Weights use the per-expert HF layout ``[E, out, in]`` (``gate_proj``/``up_proj``
``[E, I, H]``, ``down_proj`` ``[E, H, I]``) so a HF ``mlp.experts.{e}.*_proj.weight``
is row e of the stacked tensor.

Shape legend: E experts (``e`` when a process holds a share of them), C rows per expert (capacity
slots or all tokens), H hidden, I expert width, F / O input / output features of one projection.
"""

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindmoe.model.linear import normal_init


class RowScaledWeightGradMatmul(nn.Cell):
    """``x @ w^T`` per expert whose backward scales row c's share of ``dw`` by ``scale[e, c]``.

    This is gradient isolation's ``token_grad`` mode: a locked token still passes its full
    gradient back to the activations (and so to the router and earlier layers), but trains
    the expert weights it was locked to only with weight lambda. ``Cell.bprop`` is used
    because hooks are dropped under jit and ``ops.custom_vjp`` does not exist.
    """

    def __init__(self):
        super().__init__()
        self.forward_bmm = ops.BatchMatMul(transpose_b=True)
        self.input_grad_bmm = ops.BatchMatMul()
        self.weight_grad_bmm = ops.BatchMatMul(transpose_a=True)

    def construct(self, x_ECF, w_EOF, scale_EC):
        return self.forward_bmm(x_ECF, w_EOF)

    def bprop(self, x_ECF, w_EOF, scale_EC, out, dout_ECO):
        dx_ECF = self.input_grad_bmm(dout_ECO, w_EOF)
        dw_EOF = self.weight_grad_bmm(dout_ECO * scale_EC.expand_dims(-1).astype(dout_ECO.dtype), x_ECF)
        return dx_ECF, dw_EOF, ops.zeros_like(scale_EC)


def _held_rows(weight_EOF, held_experts):
    if held_experts is None or len(held_experts) == weight_EOF.shape[0]:
        return weight_EOF
    return Tensor(weight_EOF.asnumpy()[held_experts.start : held_experts.stop])


class RoutedExperts(nn.Cell):
    """Applies expert e to row-block e of ``x [E, C, H]`` (one batched matmul per projection).

    ``held_experts`` (a range of expert indices, default all): the experts this process holds. The
    initial weights are drawn for all ``num_experts`` and sliced, so a process holding a share starts
    from the rows a single process would (and the random stream of later parameters is the same).
    ``first_expert`` is the index of row 0 among all experts.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        std: float,
        rng: np.random.Generator,
        held_experts: range = None,
    ):
        super().__init__()
        self.first_expert = 0 if held_experts is None else held_experts.start
        self.gate_proj = Parameter(
            _held_rows(normal_init((num_experts, intermediate_size, hidden_size), std, rng), held_experts),
            name="gate_proj",
        )
        self.up_proj = Parameter(
            _held_rows(normal_init((num_experts, intermediate_size, hidden_size), std, rng), held_experts),
            name="up_proj",
        )
        self.down_proj = Parameter(
            _held_rows(normal_init((num_experts, hidden_size, intermediate_size), std, rng), held_experts),
            name="down_proj",
        )
        self.bmm = ops.BatchMatMul(transpose_b=True)
        self.scaled_bmm = RowScaledWeightGradMatmul()

    def construct(self, x_ECH):
        hidden_ECI = ops.silu(self.bmm(x_ECH, self.gate_proj)) * self.bmm(x_ECH, self.up_proj)
        return self.bmm(hidden_ECI, self.down_proj)

    def with_weight_grad_scale(self, x_ECH, scale_EC):
        """Same forward; row c contributes ``scale[e, c]`` times its gradient to the weights."""
        gate_ECI = self.scaled_bmm(x_ECH, self.gate_proj, scale_EC)
        up_ECI = self.scaled_bmm(x_ECH, self.up_proj, scale_EC)
        return self.scaled_bmm(ops.silu(gate_ECI) * up_ECI, self.down_proj, scale_EC)
