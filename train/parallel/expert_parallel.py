"""Expert parallelism (``parallel.ep``): a token dispatcher chosen when the model is built.

The model is written for one device; :class:`ExpertParallelDispatch` is the ``expert_dispatcher``
argument of ``MoETransformer``: every MoE layer then creates only this rank's ``E/ep`` experts and
wraps its local dispatcher (``moe.dispatch``) in an :class:`AllGatherDispatcher`. Nothing is
swapped after the build.

The ``ep`` ranks of an expert group form one data-parallel replica: they read the same
micro-batches and compute the same router decisions, and each holds and runs only ``E/ep`` of
every MoE layer's experts:

    x_ECH (every expert's rows from the local dispatcher, same on all ranks of the group)
      -> copy into the group      forward identity, backward all-reduce over the group
      -> this rank's rows x_eCH   e = E/ep local experts
      -> local experts y_eCH
      -> all-gather y_ECH         backward: this rank's rows of the (identical) upstream gradient
      -> the local dispatcher's combine

With the grouped ``dropless`` dispatcher (rows sorted by expert, a data-dependent number per expert)
every rank runs its experts on the whole sorted buffer, the other experts' groups with zero weights, and
the outputs are summed over the group (each row is produced by exactly one rank) instead of gathered. Where the
experts run from tokens to tokens (a CPU training graph, ``kernels.token_experts``) no sorted buffer exists: each
rank's kernel runs only its experts' rows, the ``[T, H]`` outputs are summed over the group, and the gradients of
the tokens and of the combine weights are summed back (:class:`CopyTokensToGroup`).

Capacity, dropping and the aux loss therefore stay per micro-batch, exactly as in one process.
Expert memory (weights, gradients, AdamW moments) is divided by ``ep``; attention and the router
run on every rank of a group. CPU has AllGather and AllReduce but no ReduceScatter (AllGather's
usual backward) or AlltoAll, hence the custom backwards. The token-routed ``alltoall`` dispatcher,
whose ranks read different micro-batches, is :mod:`train.parallel.token_exchange`.

Checkpoints hold each expert shard once, written by the rank of the first expert group holding it
(:class:`ShardedState`), and a run can resume with any ``ep`` (each rank reads its rows). LoRA adapters
of the routed experts (``A [e, r, in]``, ``B [e, out, r]``) are sharded with their experts and treated like
them everywhere: gradient reduction, gradient norm, checkpoints (and so the PEFT adapter files written from them).

Shape legend: T tokens, E experts, e = E/ep local experts, C rows per expert, H hidden.
"""

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindmoe.model.linear import numpy_of
from mindmoe.model.moe.experts import routed_expert_cells
from mindmoe.model.moe.layer import MoELayer
from mindmoe.model.moe.token_dispatcher import DroplessDispatcher, ExpertPlacement, TokenDispatcher, local_dispatcher
from mindmoe.train.parallel.exact_sum import ExactGroupSum
from mindmoe.train.parallel.grouped_exchange import GroupedExchange
from mindmoe.train.parallel.token_exchange import AllToAllDispatcher

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


class CopyTokensToGroup(nn.Cell):
    """:class:`CopyToGroup` of the tokens ``x [T, H]`` (float64: the expert kernel's input gradients are its float64
    partial sums) and their combine weights ``w [T, K]`` with one exact sum of both gradients over the group
    (train/parallel/exact_sum.py): two independent all-reduces of one backward may run in a different order on each rank
    (seen: with two, an expert-parallel LoRA run's losses left one process's from the second step)."""

    def __init__(self, group: str, group_size: int, rank_in_group: int):
        super().__init__()
        self.exact_sum = ExactGroupSum(group, group_size, rank_in_group)
        self.cast = ops.Cast()

    def construct(self, x_TH, weight_TK):
        return ops.identity(x_TH), ops.identity(weight_TK)

    def bprop(self, x_TH, weight_TK, out, dout):
        hidden = x_TH.shape[1]
        both = self.exact_sum(ops.concat((self.cast(dout[0], ms.float64), self.cast(dout[1], ms.float64)), 1))
        return self.cast(both[:, :hidden], x_TH.dtype), self.cast(both[:, hidden:], weight_TK.dtype)


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


class SumOverGroup(nn.Cell):
    """All-reduce (sum) forward; backward passes the gradient through: it is the same on every rank of
    the group (same tokens, same loss), and each summed row came from one rank's experts. ``summing``: the
    summing cell (default AllReduce over ``group``; float64 partial sums: train/parallel/exact_sum.py's
    ExactGroupSum)."""

    def __init__(self, group: str, summing=None):
        super().__init__()
        self.summing = ops.AllReduce(group=group) if summing is None else summing

    def construct(self, y):
        return self.summing(y)

    def bprop(self, y, out, dout):
        return (dout,)


class AllGatherDispatcher(TokenDispatcher):
    """A local dispatcher whose expert rows are split over the expert group: this rank runs rows
    ``first_expert .. first_expert + e - 1`` of its buffer, and the results are all-gathered before
    the local combine. Dropping, capacity and statistics are the local dispatcher's, unchanged.
    A grouped local dispatcher (``grouped``) keeps the whole sorted buffer on every rank
    (the experts run only their own groups) and its outputs are summed over the group."""

    def __init__(self, local, first_expert: int, num_local: int, rank_in_group: int, ep: int, group: str):
        super().__init__()
        self.local = local
        self.first_expert = first_expert
        self.last_expert = first_expert + num_local
        self.routes_tokens = local.routes_tokens
        self.grouped = local.grouped
        self.copy_in = CopyToGroup(group)
        self.copy_tokens_in = CopyTokensToGroup(group, ep, rank_in_group)
        self.gather_out = GatherFromGroup(group, rank_in_group, num_local, ep)
        self.sum_out = SumOverGroup(group)
        self.exact_sum_out = SumOverGroup(group, ExactGroupSum(group, ep, rank_in_group))

    def dispatch(self, x_TH, routing):
        x_ECH, state = self.local.dispatch(x_TH, routing)
        if self.grouped:
            return self.copy_in(x_ECH), state
        return self.copy_in(x_ECH)[self.first_expert : self.last_expert], state

    def token_experts(self, x_TH, routing, experts, scale_T):
        """The local dispatcher's tokens-to-tokens experts on this rank's experts, summed over the group; the
        tokens and combine weights get their gradients summed over the group (each rank's covers its experts)."""
        topk_idx_TK, weight_TK = routing
        # In float64 through the group: each rank's kernel returns exact float64 sums of its experts' outputs (and of
        # their input gradients), the group adds them exactly, and rounding once gives one process's float32 sums
        # whatever the order (train/parallel/exact_sum.py).
        x_TH64, weight_TK = self.copy_tokens_in(x_TH.astype(ms.float64), weight_TK)
        y_TH64 = self.local.token_experts(x_TH64, (topk_idx_TK, weight_TK), experts, scale_T)
        return self.exact_sum_out(y_TH64).astype(x_TH.dtype)

    def expert_args(self, state, scale_T):
        group_sizes, row_scale = self.local.expert_args(state, scale_T)
        if self.grouped or row_scale is None:
            return group_sizes, row_scale
        return group_sizes, row_scale[self.first_expert : self.last_expert]

    def combine(self, y_eCH, state):
        if self.grouped:
            return self.local.combine(self.sum_out(y_eCH), state)
        return self.local.combine(self.gather_out(y_eCH), state)

    def kept(self, state):
        return self.local.kept(state)


class ExpertParallelDispatch(ExpertPlacement):
    """``expert_dispatcher`` of a model built on rank ``rank_in_group`` of an expert group of ``ep`` ranks;
    ``ep_dispatcher`` (``parallel.ep_dispatcher``): ``allgather`` or ``alltoall``
    (:mod:`train.parallel.token_exchange`)."""

    def __init__(self, rank_in_group: int, ep: int, group: str, ep_dispatcher: str = "allgather"):
        self.rank_in_group = rank_in_group
        self.ep = ep
        self.group = group
        self.ep_dispatcher = ep_dispatcher

    def held_experts(self, num_experts: int) -> range:
        num_local = num_experts // self.ep
        return range(self.rank_in_group * num_local, (self.rank_in_group + 1) * num_local)

    def dispatcher(self, cfg, moe=None):
        held = self.held_experts(cfg.num_experts)
        local = local_dispatcher(cfg, moe)
        if self.ep_dispatcher == "alltoall":
            if isinstance(local, DroplessDispatcher):
                return GroupedExchange(cfg.num_experts, self.rank_in_group, self.ep, self.group)
            return AllToAllDispatcher(local, len(held), self.rank_in_group, self.ep, self.group)
        return AllGatherDispatcher(local, held.start, len(held), self.rank_in_group, self.ep, self.group)


EXPERT_PARALLEL_DISPATCHERS = (AllGatherDispatcher, AllToAllDispatcher, GroupedExchange)


def expert_shards(model, num_experts: int, ep: int) -> dict:
    """``{parameter name: first row}`` of the expert tensors ``model`` holds a share of (built with an
    :class:`ExpertParallelDispatch`): the stacked weights and their LoRA adapters ``A [e, r, in]``, ``B [e, out, r]``,
    in its MoE layers and its multi-token-prediction depths (``routed_expert_cells``); raises if its experts are
    whole, i.e. it was built without one."""
    for name, layer in model.cells_and_names():
        if isinstance(layer, MoELayer) and not isinstance(layer.routed.dispatcher, EXPERT_PARALLEL_DISPATCHERS):
            raise ValueError(
                f"parallel.ep={ep}: {name} routes its tokens with a {type(layer.routed.dispatcher).__name__}, not an "
                "expert-parallel dispatcher; build the model with MoETransformer(..., "
                "expert_dispatcher=dist.expert_dispatcher)"
            )
    sharded = {}
    for experts in routed_expert_cells(model):
        for param in experts.get_parameters():
            if param.shape[0] * ep != num_experts:
                raise ValueError(
                    f"parallel.ep={ep}: {param.name} holds {param.shape[0]} of {num_experts} experts; build the "
                    "model with MoETransformer(..., expert_dispatcher=dist.expert_dispatcher)"
                )
            sharded[param.name] = experts.first_expert
    return sharded


class ShardedState:
    """A local expert tensor seen as the full one by checkpoint code (``name``, ``shape``,
    ``dtype``, ``asnumpy``, ``set_data``). ``asnumpy`` is a collective: every rank of the
    group must call it, in the same order. Checkpoints written per rank use ``part`` (the flat element range
    of the full tensor held: whole rows), ``writer`` (only the first expert group writes: the other groups
    hold the same rows), ``local_part()`` (no collective) and ``set_part``."""

    def __init__(self, local, first_row: int, ep: int, gather, writer: bool = True):
        self.local = local
        self.name = local.name
        self.dtype = local.dtype
        self.first_row = first_row
        self.rows = local.shape[0]
        self.shape = (local.shape[0] * ep,) + tuple(local.shape[1:])
        row = int(np.prod(self.shape[1:]))
        self.part = ("flat", first_row * row, (first_row + self.rows) * row)
        self.writer = writer
        self._gather = gather

    def asnumpy(self) -> np.ndarray:
        return self._gather(self.local.value()).asnumpy()

    def local_part(self) -> np.ndarray:
        return numpy_of(self.local)

    def set_part(self, values) -> None:
        values = np.asarray(values).reshape(tuple(self.local.shape))
        self.local.set_data(Tensor(values, dtype=self.local.dtype))

    def set_data(self, tensor) -> None:
        full = tensor.asnumpy() if isinstance(tensor, Tensor) else np.asarray(tensor)
        self.local.set_data(Tensor(full[self.first_row : self.first_row + self.rows], dtype=self.local.dtype))


def _first_expert_group(ep: int) -> bool:
    """This process is one of the first ``ep`` ranks of the job (or the only process)."""
    from mindspore.communication import get_rank

    try:
        return get_rank() < ep
    except RuntimeError:  # communication not initialised: one process
        return True


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

    writer = _first_expert_group(ep)
    return [
        ShardedState(p, sharded[_base_name(p.name)], ep, gather, writer) if _base_name(p.name) in sharded else p
        for p in params
    ]
