"""Token-routed experts from tokens to tokens over an expert group (``parallel.ep_dispatcher=alltoall`` where the
experts run as one tokens-to-tokens kernel, ``kernels.token_experts``: a CPU training graph).

Every rank of the group reads its own micro-batch. Instead of sending each assignment's row to its expert's rank
(:mod:`train.parallel.grouped_exchange`, whose fixed slots hold the worst case), the ranks gather the group's tokens,
each rank's kernel runs only its own experts' assignments among them, and the partial outputs are summed back to the
ranks the tokens came from:

    [x_TH | weight_TK | topk_TK | scale_T] of this rank      one packed buffer, one exchange
      -> all_gather          [G * T, F]: the group's tokens in rank order (as float64); backward: reduce-scatter
                             (sum over the group, this rank's rows) of the tokens' and combine weights' gradients
      -> this rank's experts [G * T, H]: each token's float64 sum of the outputs of the experts held here
      -> reduce_scatter      [T, H]: this rank's tokens summed over the group's experts; backward: all-gather of
                             the output gradient

Each rank therefore holds and runs the rows of its own experts only (about T * K over the group, the routed rows,
with no worst-case padding), and the exchanges move ``G * T`` tokens where the row exchange's slots move
``G * T * min(K, e)`` rows. Routing, the balancing loss and the statistics stay per micro-batch, as in
:mod:`train.parallel.grouped_exchange`. On CPU the gather is AllGather (world group) or a masked AllReduce, and the
reduce-scatter an exact float64 sum of the gathered partial sums (:mod:`train.parallel.exact_sum`): one process's
float32 sums, whichever rank holds which of a token's experts.

Shape legend: T tokens of this rank's micro-batch, K experts per token, G ranks of the group, H hidden, F packed
columns (H + 2K + 1).
"""

import mindspore as ms
from mindspore import nn, ops

from mindmoe.train.parallel.exact_sum import ExactGroupSum, ExactReduceScatterToFloat32, Float64Gather


class Adjoint(nn.Cell):
    """``forward(x)`` with ``backward(dout)`` as its gradient: the all-gather and the reduce-scatter over a group are
    each other's adjoints (the gathered rows feed every rank's experts, so their gradients are summed back to the
    rank that sent them; a rank's summed rows came from every rank, so its gradient goes to all of them)."""

    def __init__(self, forward, backward):
        super().__init__()
        self.forward = forward
        self.backward = backward

    def construct(self, x):
        return self.forward(x)

    def bprop(self, x, out, dout):
        return (self.backward(dout),)


class GroupTokenExperts(nn.Cell):
    """The experts of this rank on the group's tokens (module docstring). ``local``: a dispatcher over all E
    experts with a ``token_experts`` method (:class:`~mindmoe.model.moe.token_dispatcher.DroplessDispatcher`)."""

    def __init__(self, local, group: str, group_size: int, rank_in_group: int):
        super().__init__()
        self.local = local
        self.group_size = group_size
        # [T, F] -> [G * T, F] in rank order, and [G * T, H] -> this rank's [T, H] of the sum over the group: the
        # kernel's float64 partial sums (outputs forward, input gradients backward) added exactly
        # (train/parallel/exact_sum.py).
        self.gather_tokens = Adjoint(
            Float64Gather(group, group_size, rank_in_group),
            ExactReduceScatterToFloat32(group, group_size, rank_in_group),
        )
        self.scatter_tokens = Adjoint(
            ExactGroupSum(group, group_size, rank_in_group, keep_rows=True),
            Float64Gather(group, group_size, rank_in_group),
        )

    def construct(self, x_TH, routing, experts, scale_T):
        topk_idx_TK, weight_TK = routing
        hidden, top_k = x_TH.shape[1], weight_TK.shape[1]
        # One exchange of everything (independent collectives may run in another order on each rank); expert ids
        # and token factors carry no gradient, and the ids are exact integers in float32 (below 2**24).
        packed = ops.concat(
            (
                x_TH.astype(ms.float32),
                weight_TK.astype(ms.float32),
                ops.stop_gradient(topk_idx_TK).astype(ms.float32),
                ops.stop_gradient(scale_T).astype(ms.float32).expand_dims(-1),
            ),
            1,
        )
        gathered = self.gather_tokens(packed)  # float64: the kernel then sums in float64 and returns the sums
        x_all = gathered[:, :hidden]
        weight_all = gathered[:, hidden : hidden + top_k].astype(weight_TK.dtype)
        topk_all = ops.stop_gradient(ops.round(gathered[:, hidden + top_k : hidden + 2 * top_k])).astype(ms.int32)
        scale_all = ops.stop_gradient(gathered[:, hidden + 2 * top_k]).astype(ms.float32)
        y_all = self.local.token_experts(x_all, (topk_all, weight_all), experts, scale_all, self.group_size)
        return self.scatter_tokens(y_all).astype(x_TH.dtype)
