"""Token-routed expert parallelism (``parallel.ep_dispatcher=alltoall``): every rank of an expert group reads
its own micro-batches, routes its own tokens and sends each assignment only to the rank holding its expert.

Shape legend: T tokens of this rank's micro-batch, E experts, G = ep ranks of the group, e = E/G local
experts, C rows per expert and source, H hidden.

    x_ECH   this rank's buffer from its local capacity dispatcher (capacity counted on this micro-batch)
      -> [G, e, C, H]             block j: the rows of the experts rank j holds
      -> all_to_all               block s: the rows rank s sent for this rank's experts
      -> local experts [e, G*C, H]
      -> all_to_all back          block j: this rank's rows, computed by rank j
      -> [E, C, H] -> the local dispatcher's combine

The exchange has fixed sizes (``[e, C, H]`` from every rank to every rank), so it is one
:func:`model.kernels.all_to_all` each way on both devices, and its backward is the reverse exchange.
Capacity, dropping, the aux loss and the statistics are the local dispatcher's, per micro-batch, exactly
as one process computes them for that micro-batch.

``moe.dispatch=dropless`` does not go through this fixed exchange (it would need ``C = T`` slots, the
all-experts cost): :mod:`train.parallel.grouped_exchange` sends each rank only its routed rows.
"""

from mindspore import ops

from mindmoe.model import kernels
from mindmoe.model.moe.token_dispatcher import TokenDispatcher


class AllToAllDispatcher(TokenDispatcher):
    """A local capacity dispatcher whose expert rows travel to the ranks holding the experts and back."""

    routes_tokens = False  # the rows travel: no tokens-to-tokens expert kernel

    def __init__(self, local, num_local: int, rank_in_group: int, ep: int, group: str):
        super().__init__()
        self.local = local
        self.num_local = num_local
        self.ep = ep
        self.to_experts = kernels.all_to_all(group, ep, rank_in_group)
        self.scale_to_experts = kernels.all_to_all(group, ep, rank_in_group)
        self.from_experts = kernels.all_to_all(group, ep, rank_in_group)

    def to_owners(self, x_EC, exchange):
        """``[E, C, ...]`` of this rank -> ``[e, G * C, ...]``: this rank's experts' rows from every source."""
        x_GeC = x_EC.reshape((self.ep, self.num_local) + x_EC.shape[1:])
        received_GeC = exchange(x_GeC)
        order = (1, 0) + tuple(range(2, received_GeC.ndim))
        return received_GeC.transpose(order).reshape((self.num_local, -1) + x_EC.shape[2:])

    def dispatch(self, x_TH, routing):
        x_ECH, state = self.local.dispatch(x_TH, routing)
        return self.to_owners(x_ECH, self.to_experts), state

    def combine(self, y_eXH, state):
        num_local, rows, hidden = y_eXH.shape
        capacity = rows // self.ep
        y_GeCH = y_eXH.reshape(num_local, self.ep, capacity, hidden).transpose(1, 0, 2, 3)
        returned_GeCH = self.from_experts(y_GeCH)
        return self.local.combine(returned_GeCH.reshape(-1, capacity, hidden), state)

    def expert_args(self, state, scale_T):
        _, row_scale = self.local.expert_args(state, scale_T)
        if row_scale is None:
            return None, None
        # A factor of the weight gradient only: nothing flows back through it.
        return None, self.to_owners(ops.stop_gradient(row_scale), self.scale_to_experts)

    def kept(self, state):
        return self.local.kept(state)
