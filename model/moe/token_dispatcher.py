"""Token dispatchers: how the tokens of one MoE layer reach the routed experts and come back.

Shape legend: T tokens, H hidden, E experts, K experts per token, A = T * K assignments,
C rows per expert in the expert buffer, X = E * C slots.

A dispatcher is a parameter-free cell that subclasses :class:`TokenDispatcher`, whose four methods the
grouped routed part (:class:`model.moe.routed_part.GroupedRoutedPart`) calls inside the compiled graph:

- ``dispatch(x_TH, routing) -> (expert_inputs, state)``: ``routing = (topk_idx [T, K], weight [T, K])``;
  ``expert_inputs`` is the buffer the experts run on: ``[E, C, H]`` (row-block e for expert e), or for
  a grouped dispatcher (``grouped``) the expert-sorted rows ``[N, b, H]`` (:func:`model.kernels.grouped_matmul`);
- ``expert_args(state, scale_T) -> (group_sizes, row_scale)``: what the experts take beside their inputs:
  ``None`` for an ``[E, C, H]`` buffer, else the ``[E]`` int32 group sizes of the sorted rows; and the
  per-token factor ``scale_T`` moved to the buffer's rows, ``[E, C]`` or ``[N, b]`` (gradient isolation
  scales the expert weight gradient of locked tokens' rows), or ``None`` when ``scale_T`` is None;
- ``combine(expert_outputs, state) -> y_TH``: the weighted sum of each token's expert outputs;
- ``kept(state) -> kept_A`` fp32: 1 for each assignment an expert processed, 0 for a dropped one.

A dispatcher whose ``routes_tokens`` is true also has ``token_experts(x_TH, routing, experts, scale_T) -> y_TH``:
the experts' weighted outputs per token from their tokens-to-tokens kernel, which the host routed part
(:class:`model.moe.routed_part.HostTokenPart`, CPU training graphs with dropless dispatch) calls instead.

Which dispatcher a layer uses is fixed when the model is built (a compiled graph has one data path):
:func:`local_dispatcher` picks it from ``moe.dispatch``; an :class:`ExpertPlacement` (the
``expert_dispatcher`` argument of the model) decides which experts this process holds and may wrap
the local dispatcher (expert parallelism, ``mindmoe.train.parallel.expert_parallel``).
"""

import mindspore as ms
from mindspore import nn, ops

from mindmoe.model import kernels
from mindmoe.model.moe.dispatch import (
    capacity_slots,
    combine_from_slots,
    combine_rows,
    dense_combine_weights,
    expert_capacity,
    gather_rows,
    gather_to_slots,
    grouped_row_count,
    grouped_rows,
)
from mindmoe.model.moe_config import moe_policy


class TokenDispatcher(nn.Cell):
    """The dispatcher interface (module docstring); every dispatcher, expert-parallel ones included, subclasses it."""

    #: Whether :meth:`dispatch` gives expert-sorted rows with group sizes (else an ``[E, C, H]`` buffer).
    grouped = False
    #: Whether the experts may run from tokens to tokens (a ``token_experts`` method; module docstring).
    routes_tokens = False

    def dispatch(self, x_TH, routing):
        raise NotImplementedError(f"{type(self).__name__}.dispatch")

    def expert_args(self, state, scale_T):
        raise NotImplementedError(f"{type(self).__name__}.expert_args")

    def combine(self, expert_outputs, state):
        raise NotImplementedError(f"{type(self).__name__}.combine")

    def kept(self, state):
        raise NotImplementedError(f"{type(self).__name__}.kept")


def token_rows_scale(scale_T, row_A, top_k: int, num_rows: int):
    """``[num_rows]``: each token's factor at the rows of its assignments (``row_A [T * K]``, unique; a row past the
    last, ``num_rows``, collects nothing), 1 in every other row (empty, padding or dropped)."""
    num_tokens = scale_T.shape[0]
    scale_A = ops.broadcast_to(scale_T.expand_dims(-1), (num_tokens, top_k)).reshape(-1)
    return 1.0 + ops.scatter_nd(row_A.expand_dims(-1), scale_A - 1.0, (num_rows,))


class CapacityDispatcher(TokenDispatcher):
    """Gather/scatter slots of a fixed capacity ``C = ceil(capacity_factor * T * K / E)``: the first C
    assignments of each expert (in token order) are kept, the rest dropped (:func:`capacity_slots`)."""

    def __init__(self, num_experts: int, capacity_factor: float):
        super().__init__()
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.gather_slots = kernels.slot_gather()
        self.combine_slots = kernels.slot_combine()

    def capacity(self, num_tokens: int, top_k: int) -> int:
        return expert_capacity(num_tokens, top_k, self.num_experts, self.capacity_factor)

    def dispatch(self, x_TH, routing):
        topk_idx_TK, weight_TK = routing
        num_tokens, top_k = topk_idx_TK.shape
        capacity = self.capacity(num_tokens, top_k)
        slot_A, kept_mask_A = capacity_slots(topk_idx_TK, self.num_experts, capacity)
        x_ECH = gather_to_slots(x_TH, slot_A, self.num_experts, capacity, self.gather_slots)
        return x_ECH, (slot_A, kept_mask_A, weight_TK)

    def combine(self, y_ECH, state):
        slot_A, _, weight_TK = state
        return combine_from_slots(y_ECH, slot_A, weight_TK, self.combine_slots)

    def expert_args(self, state, scale_T):
        if scale_T is None:
            return None, None
        slot_A, _, weight_TK = state
        num_tokens, top_k = weight_TK.shape
        capacity = self.capacity(num_tokens, top_k)
        num_slots = self.num_experts * capacity
        # Slots are unique per kept assignment; the extra last slot collects the dropped ones.
        slot_scale_X = token_rows_scale(scale_T, slot_A, top_k, num_slots + 1)
        return None, slot_scale_X[:num_slots].reshape(self.num_experts, capacity)

    def kept(self, state):
        return state[1].astype(ms.float32)


class DroplessDispatcher(TokenDispatcher):
    """Grouped dropless dispatch: every assignment is kept. The T * K assignments are placed in an
    expert-sorted buffer (stable: token order within an expert), each expert's group padded with zero
    rows to a multiple of the grouped matmul's block size b (:func:`model.kernels.grouped_alignment`),
    so the buffer has a static ``floor((T * K + E * (b - 1)) / b) * b`` rows in blocks ``[N, b, H]``;
    the experts run one grouped matmul per projection and the outputs are combined per token. Padding
    rows are never combined.

    ``alignment`` fixes b (the serving graphs, whose token count is not known when they compile);
    by default it is chosen per call from the static number of assignments.
    """

    def __init__(self, num_experts: int, alignment: int = None, device_target: str = None):
        super().__init__()
        self.num_experts = num_experts
        self.alignment = alignment
        self.block_rule = kernels.grouped_alignment(device_target)
        self.grouped = True
        # A training dispatcher (static token count) may hand the tokens to a tokens-to-tokens expert kernel.
        self.routes_tokens = alignment is None

    def block(self, num_assignments):
        if self.alignment is None:
            return self.block_rule(num_assignments, self.num_experts)
        return self.alignment

    def dispatch(self, x_TH, routing):
        topk_idx_TK, weight_TK = routing
        block = self.block(topk_idx_TK.shape[0] * topk_idx_TK.shape[1])
        row_A, group_sizes_E, num_rows = grouped_rows(topk_idx_TK, self.num_experts, block)
        x_XH = gather_rows(x_TH, row_A, num_rows)
        return x_XH.reshape(-1, block, x_TH.shape[1]), (row_A, group_sizes_E, weight_TK)

    def token_experts(self, x_TH, routing, experts, scale_T, sources: int = 1):
        """``[T, H]``: the experts' weighted outputs per token from their tokens-to-tokens kernel (``experts.tokens``),
        given each assignment's row in this dispatcher's sorted buffer (:func:`grouped_rows`: the kernel's order and
        the key of the adapters' dropout masks); ``sources``: the ranks whose equal blocks of tokens ``x_TH``
        concatenates (the kernel multiplies each block's rows apart)."""
        topk_idx_TK, weight_TK = routing
        block = self.block(topk_idx_TK.shape[0] * topk_idx_TK.shape[1])
        row_A, _, num_rows = grouped_rows(topk_idx_TK, self.num_experts, block)
        sources_1 = ops.fill(ms.int32, (1,), sources)
        return experts.tokens(x_TH, topk_idx_TK.astype(ms.int32), row_A, sources_1, weight_TK, scale_T, num_rows)

    def combine(self, y_NbH, state):
        row_A, _, weight_TK = state
        return combine_rows(y_NbH.reshape(-1, y_NbH.shape[-1]), row_A, weight_TK)

    def expert_args(self, state, scale_T):
        row_A, group_sizes_E, weight_TK = state
        if scale_T is None:
            return group_sizes_E, None
        num_tokens, top_k = weight_TK.shape
        block = self.block(num_tokens * top_k)
        num_rows = grouped_row_count(num_tokens * top_k, self.num_experts, block)
        # Rows are unique per assignment; padding rows keep 1 (they are zero and carry no gradient).
        return group_sizes_E, token_rows_scale(scale_T, row_A, top_k, num_rows).reshape(-1, block)

    def kept(self, state):
        weight_TK = state[2]
        return ops.ones((weight_TK.shape[0] * weight_TK.shape[1],), ms.float32)


class AllExpertsDispatcher(TokenDispatcher):
    """The all-experts reference of dropless dispatch (tests only; no ``moe.dispatch`` selects it):
    every expert runs on every token (``C = T``) and the outputs are combined with a ``[T, E]`` weight
    matrix that is zero off the chosen experts: exact and static, at E / K times the routed FLOPs."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts

    def dispatch(self, x_TH, routing):
        num_tokens, hidden = x_TH.shape
        x_ETH = ops.broadcast_to(x_TH.expand_dims(0), (self.num_experts, num_tokens, hidden))
        return x_ETH, routing

    def combine(self, y_ETH, state):
        topk_idx_TK, weight_TK = state
        combine_TE = dense_combine_weights(topk_idx_TK, weight_TK, self.num_experts).astype(y_ETH.dtype)
        return (y_ETH.transpose(1, 0, 2) * combine_TE.expand_dims(-1)).sum(1)

    def expert_args(self, state, scale_T):
        if scale_T is None:
            return None, None
        return None, ops.broadcast_to(scale_T.expand_dims(0), (self.num_experts, scale_T.shape[0]))

    def kept(self, state):
        topk_idx_TK = state[0]
        return ops.ones((topk_idx_TK.shape[0] * topk_idx_TK.shape[1],), ms.float32)


def local_dispatcher(cfg, moe=None):
    """The single-device dispatcher ``moe.dispatch`` names (``dropless``; ``capacity``, also for an unresolved
    ``auto``: a model initialised here) for the experts of model config ``cfg``."""
    moe = moe_policy(moe)
    if moe.dispatch == "dropless":
        return DroplessDispatcher(cfg.num_experts)
    return CapacityDispatcher(cfg.num_experts, moe.capacity_factor)


class ExpertPlacement:
    """Where the experts of every MoE layer live and how tokens reach them: the ``expert_dispatcher``
    argument of :class:`model.transformer.MoETransformer`. This one is a single process holding all
    experts; expert parallelism subclasses it (``mindmoe.train.parallel.expert_parallel``)."""

    def held_experts(self, num_experts: int) -> range:
        """The experts whose weights this process creates and runs."""
        return range(num_experts)

    def dispatcher(self, cfg, moe=None):
        """A new dispatcher for one MoE layer of ``cfg`` under policy ``moe`` (cells are not shared between
        layers)."""
        return local_dispatcher(cfg, moe)


SINGLE_DEVICE = ExpertPlacement()
