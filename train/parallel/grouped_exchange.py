"""Grouped dropless dispatch over a token-routed expert group (for ``moe.dispatch=dropless`` with
``parallel.ep_dispatcher=alltoall``): each rank sends only its routed rows, so the experts run on about
ep times the routed rows of one micro-batch instead of every expert on every token.

Selected by :class:`train.parallel.expert_parallel.ExpertParallelDispatch` for ``moe.dispatch=dropless``; capacity
dispatch keeps the fixed ``[e, C, H]`` exchange of :mod:`train.parallel.token_exchange`. Where the experts run from
tokens to tokens (``kernels.token_experts``: a CPU training graph) the layer calls :meth:`GroupedExchange.token_experts`
instead, and the group's tokens travel rather than the rows (:mod:`train.parallel.token_gather`); the row exchange below
is the path of the devices with a grouped matmul (Ascend).

Shape legend: T tokens of this rank's micro-batch, K experts per token, A = T * K assignments, E experts,
G = ep ranks of the group, e = E / G local experts, b rows per block of the grouped matmul, X rows of one
slot, R = G * X received rows, N = R / b blocks, H hidden.

    source: grouped dispatch of its own assignments (stable sort by expert, groups padded to b rows);
            the rows of rank j's experts are one contiguous range, copied to the start of slot j
      -> x [G, X, H] (zero past each range) and the group sizes [G, e]
      -> all_to_all                     slot s: the rows rank s sent for this rank's experts
      -> re-sorted by local expert (then source, then token): [N, b, H], the e local groups
      -> local experts (one grouped matmul per projection)
      -> back to the slots, all_to_all back, the source's weighted combine

The exchange has fixed sizes: a slot holds the worst case, every assignment of the source on one rank's
experts (a token's K experts are distinct, so at most ``T * min(K, e)`` of them, plus the padding of e
groups): ``X = floor((T * min(K, e) + e * (b - 1)) / b) * b``. Every rank therefore runs its experts on
``G * X`` rows (about ``ep * T * K``, not ``E * T``). An exchange with per-rank counts (AlltoAllV; in
MindSpore 2.9 ``ops.AlltoAllV(group, block_size)`` takes the send and receive counts as a tuple, list or
Tensor, so the received length is data dependent) would send and compute only the routed rows: the next
step on Ascend. The group sizes travel as exact small integers (below 2**24 in float32) in extra rows of the
rows' own exchange.

The receiver's unused rows are one zero-weight group of the experts' :meth:`RoutedExperts.held_groups`
(after the local experts on rank 0, before them elsewhere), so the group sizes always sum to the rows, as
Ascend's GroupedMatmul requires. Gradients are exact: the exchanges' backward is the reverse exchange and
every copy is a gather of distinct rows (its backward a scatter).
"""

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mindmoe.model import kernels
from mindmoe.model.moe.dispatch import combine_rows, gather_rows, group_starts, grouped_rows
from mindmoe.model.moe.token_dispatcher import DroplessDispatcher, TokenDispatcher
from mindmoe.train.parallel.token_gather import GroupTokenExperts


def slot_rows(num_tokens: int, top_k: int, num_local: int, block: int) -> int:
    """X: the rows of one slot, the most grouped rows one source can have for one rank's experts."""
    return (num_tokens * min(top_k, num_local) + num_local * (block - 1)) // block * block


def slot_of_assignments(topk_idx_TK, num_experts: int, ep: int, block: int, num_slot_rows: int):
    """``(slot_A int32, sizes_Ge int32)``: each assignment's row in the ``[G * X]`` send buffer (its row of the
    grouped dispatch, moved from the start of its destination's range to the start of that rank's slot) and
    the group size of every (destination, local expert)."""
    row_A, group_sizes_E, _ = grouped_rows(topk_idx_TK, num_experts, block)
    num_local = num_experts // ep
    range_start_G = group_starts(group_sizes_E).reshape(ep, num_local)[:, 0]
    rank_A = topk_idx_TK.reshape(-1) // num_local
    slot_A = rank_A * num_slot_rows + row_A - ops.gather(range_start_G, rank_A, 0)
    return slot_A.astype(ms.int32), group_sizes_E.reshape(ep, num_local)


def received_order(sizes_Ge, num_slot_rows: int, block: int, unused_first: bool):
    """``(dest_R int32, held_sizes_e int32, unused int32)``: where every received row goes in the buffer sorted
    by local expert, then source (``R`` for a slot's unused rows), each local group's size and the unused rows.

    Group sizes are multiples of b, so whole blocks move: the comparisons are per block, not per row."""
    ep, num_local = sizes_Ge.shape
    num_rows = ep * num_slot_rows
    blocks_Ge = sizes_Ge // block
    # Start of (s, l) in the sorted buffer: the blocks of the earlier experts, then of the earlier sources.
    blocks_eG = blocks_Ge.transpose(1, 0)
    sorted_start_eG = (ops.cumsum(blocks_eG.reshape(-1), 0) - blocks_eG.reshape(-1)).reshape(num_local, ep)
    sorted_start_Ge = sorted_start_eG.transpose(1, 0)
    slot_end_Ge = ops.cumsum(blocks_Ge, 1)
    slot_start_Ge = slot_end_Ge - blocks_Ge
    block_1N1 = ops.arange(num_slot_rows // block, dtype=ms.int32).reshape(1, -1, 1).astype(ms.float32)
    # The local expert of each block of each slot: the groups that end at or before it (e: unused).
    expert_GN = (slot_end_Ge.astype(ms.float32).expand_dims(1) <= block_1N1).astype(ms.int32).sum(-1)
    one_hot_GNe = ops.one_hot(expert_GN, num_local, ops.ones((), ms.int32), ops.zeros((), ms.int32))
    shift_Ge = sorted_start_Ge - slot_start_Ge
    dest_block_GN = (one_hot_GNe * shift_Ge.expand_dims(1)).sum(-1) + block_1N1.squeeze(-1).astype(ms.int32)
    held_sizes_e = sizes_Ge.sum(0)
    unused = num_rows - held_sizes_e.sum(keepdims=True)
    if unused_first:
        dest_block_GN = dest_block_GN + unused // block
    dest_GNb = dest_block_GN.expand_dims(-1) * block + ops.arange(block, dtype=ms.int32).reshape(1, 1, -1)
    used_GNb = ops.broadcast_to((expert_GN < num_local).expand_dims(-1), dest_GNb.shape)
    dest_R = ops.select(used_GNb, dest_GNb, ops.fill(ms.int32, dest_GNb.shape, num_rows)).reshape(-1)
    return dest_R, held_sizes_e, unused


class GroupedExchange(TokenDispatcher):
    """A token-routed dropless dispatcher (the dispatcher interface) over the all-to-all exchange.

    ``exchange``: a factory ``(group, G, rank_in_group) -> cell`` of the all-to-all (default
    :func:`model.kernels.all_to_all`); tests pass a stand-in. :meth:`send`, :meth:`receive`, :meth:`send_back`
    and :meth:`receive_back` are the steps between the exchanges, so a test can run the G ranks of a group in
    one process. ``alignment`` fixes b (tests; by default :func:`model.kernels.grouped_alignment` picks it)."""

    def __init__(self, num_experts: int, rank_in_group: int, ep: int, group: str, exchange=None, alignment=None):
        super().__init__()
        self.alignment = alignment
        self.grouped = True
        # Where the experts run from tokens to tokens (a CPU training graph) the tokens travel instead of the rows
        # (:meth:`token_experts`); a fixed alignment (tests of the row exchange) keeps the rows.
        self.routes_tokens = alignment is None
        make = kernels.all_to_all if exchange is None else exchange
        self.to_experts = make(group, ep, rank_in_group)
        self.scale_to_experts = make(group, ep, rank_in_group)
        self.from_experts = make(group, ep, rank_in_group)
        self.num_experts = num_experts
        self.num_local = num_experts // ep
        self.ep = ep
        self.unused_first = rank_in_group > 0
        self.block_rule = kernels.grouped_alignment()
        # Where the held_groups of the experts of this rank take their groups from in an [E] vector of sizes:
        # the unused rows as the expert just before the held ones (or rank 0: just after), then the held.
        first = rank_in_group * self.num_local
        unused_expert = first - 1 if self.unused_first else first + self.num_local
        held = list(range(first, first + self.num_local))
        self.sizes_index = Tensor(np.array([unused_expert] + held, np.int32).reshape(-1, 1))
        self.group_tokens = (
            GroupTokenExperts(DroplessDispatcher(num_experts), group, ep, rank_in_group) if self.routes_tokens else None
        )

    def block(self, num_assignments: int) -> int:
        if self.alignment is None:
            return self.block_rule(num_assignments, self.num_experts)
        return self.alignment

    def layout(self, weight_TK):
        """``(b, X)`` of this micro-batch (static: every rank of the group has the same T and K)."""
        num_tokens, top_k = weight_TK.shape
        block = self.block(num_tokens * top_k)
        return block, slot_rows(num_tokens, top_k, self.num_local, block)

    def send(self, x_TH, routing):
        """``(x [G, X, H], sizes [G, e] float32, slot_A)``: this rank's rows for every rank's experts."""
        topk_idx_TK, weight_TK = routing
        block, num_slot_rows = self.layout(weight_TK)
        slot_A, sizes_Ge = slot_of_assignments(topk_idx_TK, self.num_experts, self.ep, block, num_slot_rows)
        x_GXH = gather_rows(x_TH, slot_A, self.ep * num_slot_rows).reshape(self.ep, num_slot_rows, x_TH.shape[1])
        return x_GXH, sizes_Ge.astype(ms.float32), slot_A

    def attach_sizes(self, x_GXH, sizes_Ge):
        """``[G, X + r, H]``: the sizes ride in r extra rows of every slot (one exchange, not two: the CPU
        emulation's collectives of independent exchanges may run in a different order on different ranks)."""
        ep, _, hidden = x_GXH.shape
        extra_rows = -(-self.num_local // hidden)
        padded_Ge = ops.pad(ops.stop_gradient(sizes_Ge).astype(x_GXH.dtype), (0, extra_rows * hidden - self.num_local))
        return ops.concat((x_GXH, padded_Ge.reshape(ep, extra_rows, hidden)), 1)

    def detach_sizes(self, x_GYH, num_slot_rows: int):
        """``(x [G, X, H], sizes [G, e])`` of what :meth:`attach_sizes` sent."""
        ep = x_GYH.shape[0]
        return x_GYH[:, :num_slot_rows], x_GYH[:, num_slot_rows:].reshape(ep, -1)[:, : self.num_local]

    def receive(self, x_GXH, sizes_Ge, block: int):
        """``(x [N, b, H], group_sizes [E] int32, dest_R)``: the received rows sorted by local expert; the sizes
        are those of an [E] vector whose only non-zero entries are the held experts' and the unused rows'."""
        ep, num_slot_rows, hidden = x_GXH.shape
        sizes_Ge = ops.stop_gradient(ops.round(sizes_Ge)).astype(ms.int32)
        dest_R, held_sizes_e, unused = received_order(sizes_Ge, num_slot_rows, block, self.unused_first)
        x_NbH = gather_rows(x_GXH.reshape(-1, hidden), dest_R, ep * num_slot_rows).reshape(-1, block, hidden)
        sizes = ops.concat((unused, held_sizes_e), 0)
        group_sizes_E = ops.scatter_nd(self.sizes_index, sizes, (self.num_experts,))
        return x_NbH, group_sizes_E, dest_R

    def send_back(self, y_NbH, dest_R):
        """``[G, X, H]``: the outputs of the rows received from every source, in the source's slot layout."""
        hidden = y_NbH.shape[-1]
        y_padded = ops.concat((y_NbH.reshape(-1, hidden), ops.zeros((1, hidden), y_NbH.dtype)), 0)
        return ops.gather(y_padded, dest_R, 0).reshape(self.ep, -1, hidden)

    def receive_back(self, y_GXH, slot_A, weight_TK):
        """``[T, H]``: this rank's assignments' outputs, weighted and summed per token."""
        return combine_rows(y_GXH.reshape(-1, y_GXH.shape[-1]), slot_A, weight_TK)

    def send_scale(self, scale_T, slot_A, weight_TK):
        """``[G, X]``: each sent row's token factor (1 in unused rows)."""
        num_tokens, top_k = weight_TK.shape
        _, num_slot_rows = self.layout(weight_TK)
        num_rows = self.ep * num_slot_rows
        scale_A = ops.broadcast_to(scale_T.expand_dims(-1), (num_tokens, top_k)).reshape(-1)
        scale_X = 1.0 + ops.scatter_nd(slot_A.expand_dims(-1), scale_A - 1.0, (num_rows,))
        return scale_X.reshape(self.ep, num_slot_rows)

    def receive_scale(self, scale_GX, dest_R, block: int):
        """``[N, b]``: the received factors in the sorted order (1 in unused rows)."""
        num_rows = dest_R.shape[0]
        scale_R = 1.0 + ops.scatter_nd(dest_R.expand_dims(-1), scale_GX.reshape(-1) - 1.0, (num_rows + 1,))
        return scale_R[:num_rows].reshape(-1, block)

    def token_experts(self, x_TH, routing, experts, scale_T):
        """``[T, H]``: this rank's tokens' weighted expert outputs, the group's experts run from tokens to tokens on
        the group's gathered tokens (:class:`~mindmoe.train.parallel.token_gather.GroupTokenExperts`)."""
        return self.group_tokens(x_TH, routing, experts, scale_T)

    def dispatch(self, x_TH, routing):
        x_GXH, sizes_Ge, slot_A = self.send(x_TH, routing)
        block, num_slot_rows = self.layout(routing[1])
        received_GXH, received_sizes_Ge = self.detach_sizes(
            self.to_experts(self.attach_sizes(x_GXH, sizes_Ge)), num_slot_rows
        )
        x_NbH, group_sizes_E, dest_R = self.receive(received_GXH, received_sizes_Ge, block)
        return x_NbH, (slot_A, routing[1], dest_R, group_sizes_E)

    def combine(self, y_NbH, state):
        slot_A, weight_TK, dest_R, _ = state
        return self.receive_back(self.from_experts(self.send_back(y_NbH, dest_R)), slot_A, weight_TK)

    def expert_args(self, state, scale_T):
        slot_A, weight_TK, dest_R, group_sizes_E = state
        if scale_T is None:
            return group_sizes_E, None
        block, _ = self.layout(weight_TK)
        # A factor of the weight gradient only: nothing flows back through it.
        # After the rows' exchange (dest_R depends on it), so every rank runs the two in the same order.
        scale_GX = ops.depend(ops.stop_gradient(self.send_scale(scale_T, slot_A, weight_TK)), dest_R)
        return group_sizes_E, self.receive_scale(self.scale_to_experts(scale_GX), dest_R, block)

    def kept(self, state):
        weight_TK = state[1]
        return ops.ones((weight_TK.shape[0] * weight_TK.shape[1],), ms.float32)
