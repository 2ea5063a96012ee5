"""Ascend all-to-all over an expert group: the MindSpore 2.9 op call (HCCL; its backward is MindSpore's).
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
