"""An optimizer that stores the gradient it is given instead of updating: a compiled step's gradient, exactly."""

import mindspore as ms
from mindspore import Parameter, ParameterTuple, nn, ops


class GradientCapture(nn.Optimizer):
    """Stores the gradient it is given instead of updating."""

    def __init__(self, params):
        super().__init__(0.0, params)
        self.captured = ParameterTuple(
            Parameter(ops.zeros(p.shape, ms.float32), name="captured." + p.name, requires_grad=False)
            for p in self.parameters
        )

    def construct(self, gradients):
        for captured, gradient in zip(self.captured, gradients):
            ops.assign(captured, gradient)
        return True
