"""CPU collectives missing from MindSpore 2.9's CPU backend, emulated exactly from AllGather / AllReduce.

All-to-all over an expert group: AllGather (or AllReduce) and local selection.

Shape legend: G ranks of the group, n rows sent to each rank, F the trailing feature axes.

MindSpore 2.9 has no CPU AlltoAll kernel. Every rank gathers what every rank sends (``[G_src, G_dst, n, F]``)
and keeps the column addressed to it. The transpose of an all-to-all is the reverse all-to-all (the gradient
of the rows rank r sent to rank j is the gradient rank j received for them), so the backward is the same
exchange applied to the output gradient; AllGather's own backward would need ReduceScatter, which the CPU
backend lacks. The emulation moves G times the bytes of a real all-to-all.
"""

import numpy as np
from mindspore import Tensor, nn, ops


def all_gather_takes(group: str) -> bool:
    """MindSpore's CPU AllGather kernel only accepts the world group (AllReduce takes any group)."""
    from mindspore.communication import GlobalComm

    return group == GlobalComm.WORLD_COMM_GROUP


class GatherSends(nn.Cell):
    """``x [G, n, F]`` of every rank of the world group, stacked: ``[G_src, G, n, F]`` (AllGather)."""

    def __init__(self, group: str, group_size: int):
        super().__init__()
        self.all_gather = ops.AllGather(group=group)
        self.group_size = group_size

    def construct(self, x):
        return self.all_gather(x).reshape((self.group_size,) + x.shape)


class SumSends(nn.Cell):
    """The same stack for a group smaller than the world: each rank puts its ``x`` at its own source index of
    a zero buffer and the buffers are summed over the group (AllReduce)."""

    def __init__(self, group: str, group_size: int, rank_in_group: int):
        super().__init__()
        self.all_reduce = ops.AllReduce(group=group)
        self.mine_G = Tensor(np.eye(group_size, dtype=np.float32)[rank_in_group])

    def construct(self, x):
        mine = self.mine_G.astype(x.dtype).reshape((self.mine_G.shape[0],) + (1,) * x.ndim)
        return self.all_reduce(mine * x.expand_dims(0))


class EmulatedAllToAll(nn.Cell):
    """``x [G, n, F] -> [G, n, F]``: block j goes to rank j of the group; output block s came from rank s.

    ``sends``: the cell stacking every rank's ``x`` (default :class:`GatherSends` on the world group, else
    :class:`SumSends`); tests pass a stand-in to run the selection and its backward in one process.
    """

    def __init__(self, group: str, group_size: int, rank_in_group: int, sends=None):
        super().__init__()
        if sends is None:
            take_gather = all_gather_takes(group)
            sends = GatherSends(group, group_size) if take_gather else SumSends(group, group_size, rank_in_group)
        self.sends = sends
        self.rank_in_group = rank_in_group
        self.mine = Tensor(np.array([rank_in_group], np.int32))

    def take(self, stacked_SGnF):
        # A Gather of this rank's column, not ``stacked[:, rank]``: MindSpore 2.9's CPU StridedSlice copies such
        # a 4-D selection ~20x slower (30 ms against 1.3 ms for 4 MiB), which made this exchange cost more
        # than the dense work token routing saves.
        return ops.gather(stacked_SGnF, self.mine, 1).squeeze(1)

    def construct(self, x_GnF):
        return self.take(self.sends(x_GnF))

    def bprop(self, x_GnF, out, dout_GnF):
        return (self.take(self.sends(dout_GnF)),)


class EmulatedReduceScatter(nn.Cell):
    """``x [G * m, ...] -> [m, ...]``: rows ``rank_in_group * m`` .. of the sum of every rank's ``x`` over the group.

    MindSpore 2.9 has no CPU ReduceScatter kernel: the whole sum is all-reduced and this rank's rows kept, so
    it moves and holds G times the bytes of a real reduce-scatter (the values are the same). ``all_reduce``:
    the summing cell (default AllReduce over ``group``); tests pass a stand-in to run it in one process.
    """

    def __init__(self, group: str, group_size: int, rank_in_group: int, all_reduce=None):
        super().__init__()
        self.all_reduce = ops.AllReduce(group=group) if all_reduce is None else all_reduce
        self.group_size = group_size
        self.rank_in_group = rank_in_group

    def construct(self, x):
        rows = x.shape[0] // self.group_size
        start = self.rank_in_group * rows
        return self.all_reduce(x)[start : start + rows]


class EmulatedAllGather(nn.Cell):
    """``x [m, ...] -> [G * m, ...]``: every rank's ``x`` of the group in rank order. The world group takes
    AllGather; a smaller group (the CPU AllGather kernel accepts only the world group) sums zero-padded
    buffers, each rank's rows at its own place, with AllReduce."""

    def __init__(self, group: str, group_size: int, rank_in_group: int):
        super().__init__()
        self.use_all_gather = all_gather_takes(group)
        self.all_gather = ops.AllGather(group=group)
        self.all_reduce = ops.AllReduce(group=group)
        self.before = rank_in_group
        self.after = group_size - 1 - rank_in_group

    def construct(self, x):
        if self.use_all_gather:
            return self.all_gather(x)
        rows = x.shape[0]
        padding = (0, 0) * (x.ndim - 1) + (self.before * rows, self.after * rows)
        return self.all_reduce(ops.pad(x, padding))
