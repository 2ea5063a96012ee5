"""Expert parallelism, applied to a single-device model from outside (``parallel.ep``).

The ``ep`` ranks of an expert group form one data-parallel replica: they read the same
micro-batches and compute the same router decisions, and each holds and runs only ``E/ep`` of
every MoE layer's experts (``allgather`` dispatcher):

    x_ECH (every expert's capacity slots, same on all ranks of the group)
      -> copy into the group      forward identity, backward all-reduce over the group
      -> this rank's rows x_eCH   e = E/ep local experts
      -> local experts y_eCH
      -> all-gather y_ECH         backward: this rank's rows of the (identical) upstream gradient

Capacity, dropping and the aux loss therefore stay per micro-batch, exactly as in one process.
Expert memory (weights, gradients, AdamW moments) is divided by ``ep``; attention and the router
run on every rank of a group. CPU has AllGather and AllReduce but no ReduceScatter (AllGather's
usual backward) or AlltoAll, hence the custom backwards. A token-splitting ``alltoall``
dispatcher for Ascend is not written.

Checkpoints always hold full expert tensors: :class:`ShardedState` gathers on save and slices on
load, so a run can resume with any ``ep``.

Shape legend: E experts, e = E/ep local experts, C rows per expert, H hidden.
"""

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindmoe.model.moe.experts import RoutedExperts

#: Prefixes mindformers' AdamW gives the moments of a parameter.
MOMENT_PREFIXES = ("adam_m.", "adam_v.")


class CopyToGroup(nn.Cell):
    """Identity forward; backward sums the gradient over the group, so every rank's input gets the
    contributions of all experts, not only of its own."""

    def __init__(self, group: str):
        super().__init__()
        self.all_reduce = ops.AllReduce(group=group)

    def construct(self, x):
        return ops.identity(x)

    def bprop(self, x, out, dout):
        return (self.all_reduce(dout),)


def all_gather_supported(group: str) -> bool:
    """MindSpore's CPU AllGather kernel only accepts the world group (AllReduce takes any group)."""
    from mindspore.communication import GlobalComm

    return group == GlobalComm.WORLD_COMM_GROUP or ms.get_context("device_target") != "CPU"


class GatherFromGroup(nn.Cell):
    """All-gather along axis 0; backward keeps this rank's rows. The upstream gradient is the same
    on every rank of the group (same tokens, same loss), so no reduction is needed.

    Where AllGather cannot take the group (CPU, group smaller than the world), each rank places its
    rows in a zero buffer of the gathered size and the buffers are summed with AllReduce.
    """

    def __init__(self, group: str, rank_in_group: int, rows: int, group_size: int):
        super().__init__()
        self.use_all_gather = all_gather_supported(group)
        self.all_gather = ops.AllGather(group=group)
        self.all_reduce = ops.AllReduce(group=group)
        self.first = rank_in_group * rows
        self.last = self.first + rows
        self.rows_after = (group_size - 1 - rank_in_group) * rows

    def construct(self, y):
        if self.use_all_gather:
            return self.all_gather(y)
        padding = (0, 0) * (y.ndim - 1) + (self.first, self.rows_after)
        return self.all_reduce(ops.pad(y, padding))

    def bprop(self, y, out, dout):
        return (dout[self.first : self.last],)


class ExpertParallelExperts(nn.Cell):
    """Drop-in for :class:`RoutedExperts` holding experts ``first_expert .. first_expert + e - 1``."""

    def __init__(self, full: RoutedExperts, rank_in_group: int, ep: int, group: str):
        super().__init__()
        num_experts, intermediate, hidden = full.gate_proj.shape
        self.num_local = num_experts // ep
        self.first_expert = rank_in_group * self.num_local
        rows = slice(self.first_expert, self.first_expert + self.num_local)
        self.local = RoutedExperts(self.num_local, hidden, intermediate, 0.0, np.random.default_rng(0))
        self.full_names = {}
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(self.local, name).set_data(Tensor(getattr(full, name).asnumpy()[rows]))
            self.full_names[name] = getattr(full, name).name
        self.copy_in = CopyToGroup(group)
        self.gather_out = GatherFromGroup(group, rank_in_group, self.num_local, ep)

    def _local_rows(self, x_ECH):
        return self.copy_in(x_ECH)[self.first_expert : self.first_expert + self.num_local]

    def construct(self, x_ECH):
        return self.gather_out(self.local(self._local_rows(x_ECH)))

    def with_weight_grad_scale(self, x_ECH, scale_EC):
        scale_eC = scale_EC[self.first_expert : self.first_expert + self.num_local]
        return self.gather_out(self.local.with_weight_grad_scale(self._local_rows(x_ECH), scale_eC))


def parallelize_experts(model, rank_in_group: int, ep: int, group: str) -> dict:
    """Swap every MoE layer's experts for this rank's share; returns ``{parameter name: first row}``."""
    sharded = {}
    for layer in model.layers:
        if not layer.is_moe:
            continue
        experts = ExpertParallelExperts(layer.mlp.experts, rank_in_group, ep, group)
        layer.mlp.experts = experts
        for name, full_name in experts.full_names.items():
            param = getattr(experts.local, name)
            # Same names as the single-device model: checkpoints and the optimizer see one layout.
            param.name = full_name
            sharded[full_name] = experts.first_expert
    return sharded


class ShardedState:
    """A local expert tensor seen as the full one by checkpoint code (``name``, ``shape``,
    ``dtype``, ``asnumpy``, ``set_data``). ``asnumpy`` is a collective: every rank of the
    group must call it, in the same order."""

    def __init__(self, local, first_row: int, ep: int, gather):
        self.local = local
        self.name = local.name
        self.dtype = local.dtype
        self.first_row = first_row
        self.rows = local.shape[0]
        self.shape = (local.shape[0] * ep,) + tuple(local.shape[1:])
        self._gather = gather

    def asnumpy(self) -> np.ndarray:
        return self._gather(self.local.value()).asnumpy()

    def set_data(self, tensor) -> None:
        full = tensor.asnumpy() if isinstance(tensor, Tensor) else np.asarray(tensor)
        self.local.set_data(Tensor(full[self.first_row : self.first_row + self.rows], dtype=self.local.dtype))


def _base_name(name: str) -> str:
    for prefix in MOMENT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def sharded_views(params, sharded: dict, rank_in_group: int, ep: int, group: str) -> list:
    """``params`` with each expert parameter (or its AdamW moment) replaced by a :class:`ShardedState`."""
    params = list(params)
    local = [p for p in params if _base_name(p.name) in sharded]
    if not local:
        return params
    # Every expert tensor holds the same number of local experts on axis 0.
    gather_cell = GatherFromGroup(group, rank_in_group, local[0].shape[0], ep)

    @ms.jit
    def gather(local_tensor):
        return gather_cell(local_tensor)

    return [
        ShardedState(p, sharded[_base_name(p.name)], ep, gather) if _base_name(p.name) in sharded else p for p in params
    ]
