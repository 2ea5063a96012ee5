"""Ascend implementations: each is the MindSpore 2.9 op call and nothing else (the logic around it is shared
with the CPU path in the model). Shape legend as in :mod:`mindmoe.model.kernels.cpu`."""

from mindspore import nn, ops


class AscendRMSNorm(nn.Cell):
    """``ops.rms_norm`` (the RmsNorm kernel; its backward is MindSpore's). Takes and returns fp32 ``[Z, H]``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps

    def construct(self, x_ZH, weight_H):
        return ops.rms_norm(x_ZH, weight_H, self.eps)[0]
