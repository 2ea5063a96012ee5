"""Token <-> expert dispatch with static shapes (no einsum: CPU has no kernel for it).

Shape legend: T tokens, H hidden, E experts, K choices per token, A = T*K assignments,
C capacity (rows per expert), X = E*C slots of the flattened expert buffer.

The dispatcher cells built on these functions are in :mod:`model.moe.token_dispatcher`.

``capacity``: assignments are ranked per expert in token order (earlier tokens win; a
token's K choices in rank order), the first C of each expert get a slot, the rest are
dropped. Slots are filled by *gathering* token rows and results are combined by
*gathering* slot rows, so forward and backward are plain gathers / segment sums.

``dropless`` (grouped): the same per-expert ranks place every assignment in its expert's group of
a sorted buffer; each group is padded with zero rows to a multiple of the grouped matmul's block
size b, so the buffer has a static ``floor((A + E * (b - 1)) / b) * b`` rows (:func:`grouped_rows`).
Nothing is dropped and the experts run on about the routed rows.

:func:`dense_combine_weights` is the ``[T, E]`` weight matrix of the all-experts reference.
"""

import math

import mindspore as ms
from mindspore import ops

from mindmoe.model.kernels.cpu import combine_slot_rows, gather_source_rows, weighted_rows


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(capacity_factor * T * K / E)``, at least 1."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def expert_ranks(topk_idx_TK, num_experts: int):
    """``(expert_A, rank_A, count_E)`` int32: each assignment's expert and its rank among that expert's
    assignments in token order (a token's K choices in rank order), and each expert's assignments."""
    expert_A = topk_idx_TK.reshape(-1)
    one_hot_AE = ops.one_hot(expert_A, num_experts, ops.ones((), ms.int32), ops.zeros((), ms.int32))
    rank_A = (ops.cumsum(one_hot_AE, 0) * one_hot_AE).sum(-1) - 1
    return expert_A, rank_A, one_hot_AE.sum(0)


def grouped_row_count(num_assignments: int, num_experts: int, block: int) -> int:
    """The static rows of the expert-sorted buffer: ``floor((A + E * (b - 1)) / b) * b``, room for every expert's
    group padded to a multiple of ``block``."""
    return (num_assignments + num_experts * (block - 1)) // block * block


def group_starts(group_sizes_E):
    """``[E]``: the first row of each expert's group in the expert-sorted buffer (the groups in expert order)."""
    return ops.cumsum(group_sizes_E, 0) - group_sizes_E


def grouped_rows(topk_idx_TK, num_experts: int, block: int):
    """``(row_A int32, group_sizes_E int32, num_rows)``: each assignment's row in the expert-sorted buffer
    (stable: token order within an expert), each expert's group size (its assignments rounded up to a
    multiple of ``block``) and the buffer's static row count, a multiple of ``block``.

    The one definition of the expert-sorted order: the grouped dispatchers, the expert-parallel exchange
    (``train/parallel/grouped_exchange.py``) and the tokens-to-tokens host kernel (which takes ``row_A`` as an input)
    all use these rows."""
    num_assignments = topk_idx_TK.shape[0] * topk_idx_TK.shape[1]
    expert_A, rank_A, count_E = expert_ranks(topk_idx_TK, num_experts)
    group_sizes_E = (count_E + (block - 1)) // block * block
    row_A = ops.gather(group_starts(group_sizes_E), expert_A, 0) + rank_A
    num_rows = grouped_row_count(num_assignments, num_experts, block)
    return row_A.astype(ms.int32), group_sizes_E.astype(ms.int32), num_rows


def capacity_slots(topk_idx_TK, num_experts: int, capacity: int):
    """Slot of each assignment in the ``[E * C]`` buffer, or ``E * C`` when dropped.

    Returns ``(slot_A int32, kept_A bool)`` for the assignments in token-major order.
    """
    expert_A, rank_A, _ = expert_ranks(topk_idx_TK, num_experts)
    kept_A = rank_A < capacity
    slot_A = ops.select(
        kept_A, expert_A * capacity + rank_A, ops.fill(ms.int32, expert_A.shape, num_experts * capacity)
    )
    return slot_A.astype(ms.int32), kept_A


def gather_to_slots(x_TH, slot_A, num_experts: int, capacity: int, gather=gather_source_rows):
    """Fill the ``[E, C, H]`` expert input buffer; empty slots read a zero row. ``gather``: the
    :func:`mindmoe.model.kernels.slot_gather` kernel (default its formula)."""
    return gather_rows(x_TH, slot_A, num_experts * capacity, gather).reshape(num_experts, capacity, x_TH.shape[1])


def gather_rows(x_TH, slot_A, num_slots, gather=gather_source_rows):
    """``[num_slots, H]``: slot ``slot_A[a]`` holds the row of assignment a's token; empty slots are zero;
    ``slot_A[a] == num_slots`` drops assignment a."""
    num_tokens = x_TH.shape[0]
    top_k = slot_A.shape[0] // num_tokens
    token_A = ops.arange(slot_A.shape[0], dtype=ms.int32) // top_k
    # 1 + token index per filled slot (0 = empty); the extra last slot collects drops.
    token_plus_one_X = ops.scatter_nd(slot_A.expand_dims(-1), token_A + 1, (num_slots + 1,))[:num_slots]
    source_X = ops.select(
        token_plus_one_X > 0, token_plus_one_X - 1, ops.fill(ms.int32, token_plus_one_X.shape, num_tokens)
    )
    return gather(x_TH, source_X)


def combine_from_slots(y_ECH, slot_A, weight_TK, combine=combine_slot_rows):
    """``out_t = sum_k weight_tk * y[slot(t, k)]``; dropped assignments contribute zero. ``combine``: the
    :func:`mindmoe.model.kernels.slot_combine` kernel (default its formula)."""
    return combine(y_ECH.reshape(-1, y_ECH.shape[-1]), slot_A, weight_TK)


def combine_rows(y_XH, row_A, weight_TK):
    """``out_t = sum_k weight_tk * y[row(t, k)]`` for the rows of a 2-D buffer."""
    return weighted_rows(y_XH, row_A, weight_TK)


def dense_combine_weights(topk_idx_TK, weight_TK, num_experts: int):
    """``[T, E]`` weights: the routed weight at each chosen expert, zero elsewhere."""
    one_hot_TKE = ops.one_hot(topk_idx_TK, num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32))
    return (one_hot_TKE * weight_TK.expand_dims(-1)).sum(1)
