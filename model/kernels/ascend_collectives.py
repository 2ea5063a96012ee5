"""Ascend collectives: each the MindSpore 2.9 op call (HCCL; a backward, where one exists, is MindSpore's).
Shape legend as in :mod:`mindmoe.model.kernels.cpu_collectives`."""

from mindspore import nn, ops


class AscendAllToAll(nn.Cell):
    """``ops.AlltoAll`` splitting axis 0 into the G blocks and concatenating the received ones on axis 0:
    ``x [G, n, F] -> [G, n, F]``, block j to rank j, output block s from rank s."""

    def __init__(self, group: str, group_size: int, rank_in_group: int):
        super().__init__()
        self.all_to_all = ops.AlltoAll(split_count=group_size, split_dim=0, concat_dim=0, group=group)

    def construct(self, x_GnF):
        return self.all_to_all(x_GnF)


class AscendReduceScatter(nn.Cell):
    """``ops.ReduceScatter`` summing over the group: ``x [G * m, ...] -> [m, ...]``, rank i keeps block i."""

    def __init__(self, group: str, group_size: int, rank_in_group: int):
        super().__init__()
        self.reduce_scatter = ops.ReduceScatter(op="sum", group=group)

    def construct(self, x):
        return self.reduce_scatter(x)


class AscendAllGather(nn.Cell):
    """``ops.AllGather`` over the group: ``x [m, ...] -> [G * m, ...]`` in rank order."""

    def __init__(self, group: str, group_size: int, rank_in_group: int):
        super().__init__()
        self.all_gather = ops.AllGather(group=group)

    def construct(self, x):
        return self.all_gather(x)
