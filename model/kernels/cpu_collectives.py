"""CPU all-to-all over an expert group: an exact emulation from AllGather (or AllReduce) and local selection.

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

    def construct(self, x_GnF):
        return self.sends(x_GnF)[:, self.rank_in_group]

    def bprop(self, x_GnF, out, dout_GnF):
        return (self.sends(dout_GnF)[:, self.rank_in_group],)
