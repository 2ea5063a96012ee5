"""The scaled keep mask of one LoRA dropout draw (:mod:`model.lora.dropout` defines the hash): from the odd row
factors ``row [Z]`` and column factors ``col [F]`` (int32 bit patterns), ``[Z, F]`` fp32 with
``1 / (1 - p)`` where ``h * h + h >= threshold`` for ``h = row_z * col_f`` (int32 products wrap), else 0.

:func:`graph_scaled_keep` computes it with MindSpore ops (Ascend). On CPU MindSpore 2.9 keeps 16 bytes per
output element, for as long as the compiled graph lives, in every int32 element-wise kernel and in every
element-wise kernel whose operands differ in shape other than by a scalar (measured: 51 MiB per op on a
6528 x 512 output, none for fp32 operands of one shape or with a scalar); the mask's outer product, square
and sum are three such kernels per adapted projection and draw. :class:`HostScaledKeep` (CPU) computes the
same bits on the host in one ``pyfunc`` kernel, whose inputs (the two factor vectors) are all it copies.
"""

import mindspore as ms
import numpy as np
from mindspore import nn, ops


def host_scaled_keep(row_Z, col_F, threshold: int, scale: float):
    """NumPy: the ``[Z, F]`` fp32 scaled keep mask of int32 factors ``row_Z`` and ``col_F`` (uint32 products
    wrap as int32 ones do; the comparison reads the bits as signed)."""
    h_ZF = np.multiply.outer(row_Z.astype(np.int32).view(np.uint32), col_F.astype(np.int32).view(np.uint32))
    g_ZF = h_ZF * h_ZF
    g_ZF += h_ZF
    keep_ZF = g_ZF.view(np.int32) >= np.int32(threshold)
    return keep_ZF.astype(np.float32) * np.float32(scale)


def graph_scaled_keep(threshold: int, scale: float):
    """The mask with MindSpore ops: ``(row [Z] int32, col [F] int32) -> [Z, F] fp32``."""

    def scaled_keep(row_Z, col_F):
        h_ZF = row_Z.expand_dims(-1) * col_F  # uniform odd; the only per-element work is below
        return (h_ZF * h_ZF + h_ZF >= threshold).astype(ms.float32) * scale

    return scaled_keep


class HostScaledKeep(nn.Cell):
    """The mask as one host kernel: ``(row [Z] int32, col [F] int32) -> [Z, F] fp32`` (no gradient: the
    factors are hashes of counters)."""

    def __init__(self, threshold: int, scale: float):
        super().__init__()
        threshold, scale = int(threshold), float(scale)

        def mask(row_Z, col_F):
            return host_scaled_keep(row_Z, col_F, threshold, scale)

        self.mask = ops.Custom(
            mask,
            out_shape=lambda row_shape, col_shape: (row_shape[0], col_shape[0]),
            out_dtype=lambda row_dtype, col_dtype: ms.float32,
            func_type="pyfunc",
        )

    def construct(self, row_Z, col_F):
        return self.mask(row_Z, col_F)

    def bprop(self, row_Z, col_F, out, dout):
        return ops.zeros_like(row_Z), ops.zeros_like(col_F)
