"""Ascend implementations: each is the MindSpore 2.9 op call and nothing else (the logic around it is shared
with the CPU path in the model). Shape legend as in :mod:`mindmoe.model.kernels.cpu`."""

import mindspore as ms
from mindspore import nn, ops
from mindspore.ops.function.math_func import gmm


class AscendRMSNorm(nn.Cell):
    """``ops.rms_norm`` (the RmsNorm kernel; its backward is MindSpore's). Takes and returns fp32 ``[Z, H]``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps

    def construct(self, x_ZH, weight_H):
        return ops.rms_norm(x_ZH, weight_H, self.eps)[0]


def swiglu(gate_ZI, up_ZI):
    """``ops.swiglu`` (the Swiglu kernel: ``silu`` of the first half of the last axis times the second half;
    its backward is MindSpore's), on gate and up joined on the last axis."""
    return ops.swiglu(ops.concat((gate_ZI, up_ZI), -1), -1)


class AscendRope(nn.Cell):
    """``ops.rotary_position_embedding`` (the RotaryPositionEmbedding kernel; its backward is MindSpore's).

    ``(x_rot [B, N, S, R], cos [S, R], sin [S, R]) -> [B, N, S, R]``; the tables go in as the ``11SD``
    layout, the one both modes take for a BNSD input. ``mode`` 0 is rotate-half (GPT-NeoX, GLM-4.5),
    1 interleaved (GPT-J).
    """

    def __init__(self, interleaved: bool):
        super().__init__()
        self.mode = 1 if interleaved else 0

    def construct(self, x_BNSR, cos_SR, sin_SR):
        cos_11SR = cos_SR.astype(x_BNSR.dtype).reshape((1, 1) + cos_SR.shape)
        sin_11SR = sin_SR.astype(x_BNSR.dtype).reshape((1, 1) + sin_SR.shape)
        return ops.rotary_position_embedding(x_BNSR, cos_11SR, sin_11SR, self.mode)


def alignment(num_rows: int, num_groups: int) -> int:
    """GroupedMatmul takes groups of any size: no padding rows."""
    return 1


class AscendGroupedMatmul(nn.Cell):
    """``gmm`` (GroupedMatmul, grouped on the row axis; its backward is MindSpore's).

    ``(x [N, 1, F], weight [E, O, F], group_sizes [E] int32) -> [N, 1, O]``; with alignment 1 the N
    rows are exactly the groups' rows (GroupedMatmul requires their sum to equal the rows of x).
    """

    #: ``weight`` must have ``x``'s dtype (the caller casts a half-precision one).
    takes_half_weights = False
    #: One group per weight: a process holding a share pads the weights with zeros for the others' groups.
    takes_outside_groups = False

    def __init__(self, weight_grad: bool = True, frozen_weight=None):
        # MindSpore's autodiff of gmm prunes the gradient of a weight nobody asks for: nothing to switch off.
        # The weight is a device input of gmm (no host copy to avoid): ``frozen_weight`` is not needed.
        super().__init__()

    def rows(self, x_NbF):
        return x_NbF.reshape(-1, x_NbF.shape[-1])

    def construct(self, x_NbF, w_EOF, group_sizes_E, scale_Nb=None):
        # ``scale_Nb``: the row scale a row-scaled product takes (:class:`AscendRowScaledGroupedMatmul`); unused here.
        group_list = group_sizes_E.astype(ms.int64)
        y_XO = gmm([self.rows(x_NbF)], [w_EOF.transpose(0, 2, 1)], group_list=group_list, group_list_type=1)[0]
        return y_XO.reshape(x_NbF.shape[:-1] + (w_EOF.shape[1],))


class AscendRowScaledGroupedMatmul(AscendGroupedMatmul):
    """:class:`AscendGroupedMatmul` whose weight gradient scales row r by ``scale [N, 1]``: the input
    gradient is ``gmm`` of the output gradient with the weights, the weight gradient ``gmm`` grouped on
    the reduction axis (``group_type=2``: per group, the transposed scaled output gradient times x)."""

    def construct(self, x_NbF, w_EOF, group_sizes_E, scale_Nb):
        group_list = group_sizes_E.astype(ms.int64)
        y_XO = gmm([self.rows(x_NbF)], [w_EOF.transpose(0, 2, 1)], group_list=group_list, group_list_type=1)[0]
        return y_XO.reshape(x_NbF.shape[:-1] + (w_EOF.shape[1],))

    def bprop(self, x_NbF, w_EOF, group_sizes_E, scale_Nb, out, dout_NbO):
        group_list = group_sizes_E.astype(ms.int64)
        dout_XO = self.rows(dout_NbO)
        dx_XF = gmm([dout_XO], [w_EOF], group_list=group_list, group_list_type=1)[0]
        scaled_OX = (dout_XO * scale_Nb.reshape(-1, 1).astype(dout_XO.dtype)).transpose(1, 0)
        dw_EOF = gmm([scaled_OX], [self.rows(x_NbF)], group_list=group_list, group_type=2, group_list_type=1)[0]
        return dx_XF.reshape(x_NbF.shape), dw_EOF, ops.zeros_like(group_sizes_E), ops.zeros_like(scale_Nb)


def expand(x, shape):
    """The operand as it is: the element-wise op broadcasts it (no extra tensor)."""
    return x
