"""CPU collectives missing from MindSpore 2.9's CPU backend, emulated exactly from AllGather / AllReduce.

All-to-all over an expert group: G - 1 rounds of AllGather (or AllReduce) and local selection.

Shape legend: G ranks of the group, n rows sent to each rank, F the trailing feature axes.

MindSpore 2.9 has no CPU AlltoAll kernel. Rank r keeps its own block ``x[r]``; in round k (1 .. G - 1) every
rank s contributes the block addressed to rank ``(s + k) % G`` and all ranks receive every contribution
(``[G_src, n, F]``), of which rank r keeps the one from rank ``(r - k) % G``, the block addressed to it. A
round moves G blocks to every rank where a real all-to-all moves one; at G = 2 (one round) that is the same
bytes as the real exchange, where gathering every rank's whole ``[G, n, F]`` once moved twice as many
(measured: the CPU collectives move about 3 ms per MiB, so the bytes are the cost). The transpose of an
all-to-all is the reverse all-to-all (the gradient of the rows rank r sent to rank j is the gradient rank j
received for them), so the backward is the same exchange applied to the output gradient; AllGather's own
backward would need ReduceScatter, which the CPU backend lacks.
"""

import numpy as np
from mindspore import Tensor, nn, ops


def all_gather_takes(group: str) -> bool:
    """MindSpore's CPU AllGather kernel only accepts the world group (AllReduce takes any group)."""
    from mindspore.communication import GlobalComm

    return group == GlobalComm.WORLD_COMM_GROUP


def _block(x_GnF, index_1):
    # A Gather of one block, not ``x[i]``: MindSpore 2.9's CPU StridedSlice copies such selections of
    # stacked blocks many times slower (30 ms against 1.3 ms for 4 MiB, seen for a column of ``[G, G, n, F]``).
    return ops.gather(x_GnF, index_1, 0).squeeze(0)


def _block_indices(group_size: int) -> tuple:
    """``[i]`` int32 for every block index i: the Gather indices of :func:`_block`."""
    return tuple(Tensor(np.array([i], np.int32)) for i in range(group_size))


class GatherSends(nn.Cell):
    """Round k of the exchange over the world group (AllGather): ``x [G, n, F]`` of this rank ->
    ``[G_src, n, F]``, entry s being rank s's block for rank ``(s + k) % G``."""

    def __init__(self, group: str, group_size: int, rank_in_group: int):
        super().__init__()
        self.all_gather = ops.AllGather(group=group)
        self.group_size = group_size
        self.rank_in_group = rank_in_group
        self.index = _block_indices(group_size)

    def construct(self, x_GnF, k):
        block_nF = _block(x_GnF, self.index[(self.rank_in_group + k) % self.group_size])
        return self.all_gather(block_nF).reshape((self.group_size,) + block_nF.shape)  # gathered on axis 0


class SumSends(nn.Cell):
    """:class:`GatherSends` for a group smaller than the world: each rank puts its block at its own source
    index of a zero buffer and the buffers are summed over the group (AllReduce)."""

    def __init__(self, group: str, group_size: int, rank_in_group: int):
        super().__init__()
        self.all_reduce = ops.AllReduce(group=group)
        self.group_size = group_size
        self.rank_in_group = rank_in_group
        self.index = _block_indices(group_size)
        self.mine_G = Tensor(np.eye(group_size, dtype=np.float32)[rank_in_group])

    def construct(self, x_GnF, k):
        block_nF = _block(x_GnF, self.index[(self.rank_in_group + k) % self.group_size])
        mine = self.mine_G.astype(x_GnF.dtype).reshape((self.group_size,) + (1,) * block_nF.ndim)
        return self.all_reduce(mine * block_nF.expand_dims(0))


class EmulatedAllToAll(nn.Cell):
    """``x [G, n, F] -> [G, n, F]``: block j goes to rank j of the group; output block s came from rank s.

    ``sends``: the cell of one round, ``(x, k) -> [G_src, n, F]`` (default :class:`GatherSends` on the world
    group, else :class:`SumSends`); tests pass a stand-in to run the selection and its backward in one
    process.
    """

    def __init__(self, group: str, group_size: int, rank_in_group: int, sends=None):
        super().__init__()
        if sends is None:
            take_gather = all_gather_takes(group)
            sends = (GatherSends if take_gather else SumSends)(group, group_size, rank_in_group)
        self.sends = sends
        self.group_size = group_size
        self.rank_in_group = rank_in_group
        self.index = _block_indices(group_size)

    def exchange(self, x_GnF):
        blocks = ()
        for source in range(self.group_size):
            k = (self.rank_in_group - source) % self.group_size  # the round in which it arrives
            # Its own block stays here; another rank's is entry ``source`` of round k.
            arrived = x_GnF if k == 0 else self.sends(x_GnF, k)
            blocks = blocks + (_block(arrived, self.index[source]),)
        return ops.stack(blocks, 0)

    def construct(self, x_GnF):
        return self.exchange(x_GnF)

    def bprop(self, x_GnF, out, dout_GnF):
        return (self.exchange(dout_GnF),)


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
