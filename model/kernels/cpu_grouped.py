"""CPU grouped matmul: each expert's rows times that expert's weight, in blocks of ``b`` rows.

Shape legend (docs/architecture.md): E groups (experts), N blocks, b rows per block, X = N * b sorted
rows, F input features, O output features.

The token dispatcher pads every expert's group of sorted rows to a multiple of ``b`` (the alignment
:func:`block_rows` asks for), so each block of ``b`` rows belongs to one expert: the kernel gathers
each block's expert weight ``[N, O, F]`` and runs one BatchMatMul over the blocks. The cost is that of
the X <= A + E * (b - 1) rows it receives, i.e. near the routed FLOPs, with static shapes. The weight
gradient is the segment sum over blocks of the blocks' gradients (Gather's own backward).
"""

import mindspore as ms
from mindspore import nn, ops

#: Block sizes the CPU kernel uses (rows per block); larger blocks run BatchMatMul more efficiently.
BLOCK_SIZES = (2, 4, 8, 16, 32, 64)


def block_rows(num_rows: int, num_groups: int) -> int:
    """Rows per block for ``num_rows`` sorted rows over ``num_groups`` experts: the largest size in
    :data:`BLOCK_SIZES` that is at most 1/8 of the mean group, so the padding ``E * (b - 1)`` adds at
    most about 1/8 to the rows; 1 for few rows (decode steps)."""
    target = num_rows // (8 * num_groups)
    block = 1
    for size in BLOCK_SIZES:
        if size <= target:
            block = size
    return block


class BlockGroupedMatmul(nn.Cell):
    """``(x [N, b, F], weight [E, O, F], group_sizes [E] int32) -> [N, b, O]``: row r of group e times
    ``weight[e]^T``. Group sizes are multiples of b, in row order; rows past the last group are padding
    (zeros in, zeros out since they are computed with the last expert's weight)."""

    def __init__(self):
        super().__init__()
        self.bmm_nt = ops.BatchMatMul(transpose_b=True)
        self.cumsum = ops.CumSum()

    def block_experts(self, x_NbF, w_EOF, group_sizes_E):
        """The expert of every block: the number of groups that end at or before the block's first row."""
        num_blocks, block, _ = x_NbF.shape
        ends_1E = self.cumsum(group_sizes_E, 0).astype(ms.float32).expand_dims(0)
        starts_N1 = (ops.arange(num_blocks, dtype=ms.int32) * block).astype(ms.float32).expand_dims(1)
        expert_N = (ends_1E <= starts_N1).astype(ms.int32).sum(1)
        return ops.minimum(expert_N, w_EOF.shape[0] - 1)

    def construct(self, x_NbF, w_EOF, group_sizes_E):
        w_NOF = ops.gather(w_EOF, self.block_experts(x_NbF, w_EOF, group_sizes_E), 0)
        return self.bmm_nt(x_NbF, w_NOF)


class _RowScaledBlockMatmul(nn.Cell):
    """``x [N, b, F]`` times the weight of each block's expert ``expert_N``; backward scales row r's share
    of the weight gradient by ``scale [N, b]``. Primitives only: functional ops do not compile in a bprop."""

    def __init__(self):
        super().__init__()
        self.gather = ops.Gather()
        self.segment_sum = ops.UnsortedSegmentSum()
        self.bmm_nt = ops.BatchMatMul(transpose_b=True)
        self.bmm_nn = ops.BatchMatMul()
        self.bmm_tn = ops.BatchMatMul(transpose_a=True)

    def construct(self, x_NbF, w_EOF, expert_N, scale_Nb):
        return self.bmm_nt(x_NbF, self.gather(w_EOF, expert_N, 0))

    def bprop(self, x_NbF, w_EOF, expert_N, scale_Nb, out, dout_NbO):
        dx_NbF = self.bmm_nn(dout_NbO, self.gather(w_EOF, expert_N, 0))
        scaled_NbO = dout_NbO * scale_Nb.expand_dims(-1).astype(dout_NbO.dtype)
        dw_EOF = self.segment_sum(self.bmm_tn(scaled_NbO, x_NbF), expert_N, w_EOF.shape[0])
        return dx_NbF, dw_EOF, ops.zeros_like(expert_N), ops.zeros_like(scale_Nb)


class RowScaledBlockGroupedMatmul(BlockGroupedMatmul):
    """:class:`BlockGroupedMatmul` whose backward scales row r's share of the weight gradient by
    ``scale [N, b]`` (gradient isolation's ``token_grad``; see ``RowScaledWeightGradMatmul``)."""

    def __init__(self):
        super().__init__()
        self.scaled_matmul = _RowScaledBlockMatmul()

    def construct(self, x_NbF, w_EOF, group_sizes_E, scale_Nb):
        expert_N = ops.stop_gradient(self.block_experts(x_NbF, w_EOF, group_sizes_E))
        return self.scaled_matmul(x_NbF, w_EOF, expert_N, scale_Nb)
