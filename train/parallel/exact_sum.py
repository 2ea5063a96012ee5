"""Exact sums over an expert group of the CPU tokens-to-tokens experts' float64 partial sums.

Each rank's expert kernel (``kernels.token_experts``) returns, per token, the float64 sum of its own experts' weighted
outputs (and of their input gradients): exact, as a sum of a few float32 values is in float64. The group's total is
then the exact sum of all of the token's terms, whichever rank added which, and rounding it once to float32 gives what
one process holding every expert gives (model/kernels/cpu_token_experts.py, ``token_experts_forward``). A float32
all-reduce of rounded partial sums would not: with top-k > 2 the rounding depends on how the experts are split.

MindSpore 2.9's collectives take no float64 tensor, so a partial ``p`` travels as three float32 parts ``a + b + c = p``
(``a`` = ``p`` rounded, ``b`` = the rest rounded, ``c`` = what remains; 3 x 24 bits hold float64's 53), gathered
(AllGather or zero-padded AllReduce: every value crosses unchanged), put together per rank in float64 (exact: ``a +
b`` and then ``+ c`` give ``p``) and added over the ranks in float64. It moves and holds 3 G times the bytes of a
float32 all-reduce of the partials; the experts' rows, which dominate, are not exchanged at all.

Shape legend: G ranks of the group, N rows, F features.
"""

import mindspore as ms
from mindspore import nn, ops

from mindmoe.model import kernels


def float32_parts(x_NF):
    """``[3 N, F]`` float32: ``a``, ``b``, ``c`` with ``a + b + c == x`` exactly (``x`` float64, module docstring)."""
    a = x_NF.astype(ms.float32)
    rest = x_NF - a.astype(ms.float64)
    b = rest.astype(ms.float32)
    c = (rest - b.astype(ms.float64)).astype(ms.float32)
    return ops.concat((a, b, c))


class ExactGroupSum(nn.Cell):
    """``x [N, F]`` float64 -> ``[N, F]`` float64: the sum of every rank's ``x`` over the group (exact where the
    terms' exact sum is a float64 value); with ``keep_rows`` m, only rows ``rank_in_group * m`` .. of it (a
    reduce-scatter). No backward of its own (the callers define theirs)."""

    def __init__(self, group: str, group_size: int, rank_in_group: int, keep_rows: bool = False):
        super().__init__()
        self.gather = kernels.all_gather(group, group_size, rank_in_group)
        self.group_size = group_size
        self.rank_in_group = rank_in_group
        self.keep_rows = keep_rows

    def construct(self, x_NF):
        rows, features = x_NF.shape
        parts_G3NF = self.gather(float32_parts(x_NF)).reshape(self.group_size, 3, rows, features)
        if self.keep_rows:  # only this rank's rows are put together and added
            mine = rows // self.group_size
            parts_G3NF = parts_G3NF[:, :, self.rank_in_group * mine : (self.rank_in_group + 1) * mine]
        parts_G3NF = parts_G3NF.astype(ms.float64)
        # Per rank (a + b) + c first: exactly that rank's x; then the ranks' exact values.
        ranks_GNF = (parts_G3NF[:, 0] + parts_G3NF[:, 1]) + parts_G3NF[:, 2]
        return ranks_GNF.sum(0)


class Float64Gather(nn.Cell):
    """``x [m, F]`` (float32 values, any float dtype) -> ``[G m, F]`` float64: every rank's rows in rank order."""

    def __init__(self, group: str, group_size: int, rank_in_group: int):
        super().__init__()
        self.gather = kernels.all_gather(group, group_size, rank_in_group)

    def construct(self, x):
        return self.gather(x.astype(ms.float32)).astype(ms.float64)


class ExactReduceScatterToFloat32(nn.Cell):
    """:class:`ExactGroupSum` keeping this rank's rows, rounded to float32 once."""

    def __init__(self, group: str, group_size: int, rank_in_group: int):
        super().__init__()
        self.sum = ExactGroupSum(group, group_size, rank_in_group, keep_rows=True)

    def construct(self, x):
        return self.sum(x).astype(ms.float32)
