"""Token <-> expert dispatch with static shapes (no einsum: CPU has no kernel for it).

Shape legend: T tokens, H hidden, E experts, K choices per token, A = T*K assignments,
C capacity (rows per expert), X = E*C slots of the flattened expert buffer.

The dispatcher cells built on these functions are in :mod:`model.moe.token_dispatcher`.

``capacity``: assignments are ranked per expert in token order (earlier tokens win; a
token's K choices in rank order), the first C of each expert get a slot, the rest are
dropped. Slots are filled by *gathering* token rows and results are combined by
*gathering* slot rows, so forward and backward are plain gathers / segment sums.

``dropless``: every expert runs on every token and the outputs are combined with a
``[T, E]`` weight matrix that is zero off the chosen experts. Exact and static, at
E/K times the routed FLOPs; the grouped-matmul path belongs to Ascend.
"""

import math

import mindspore as ms
from mindspore import ops

_BMM = ops.BatchMatMul()


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(capacity_factor * T * K / E)``, at least 1."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def capacity_slots(topk_idx_TK, num_experts: int, capacity: int):
    """Slot of each assignment in the ``[E * C]`` buffer, or ``E * C`` when dropped.

    Returns ``(slot_A int32, kept_A bool)`` for the assignments in token-major order.
    """
    expert_A = topk_idx_TK.reshape(-1)
    one_hot_AE = ops.one_hot(expert_A, num_experts, ops.ones((), ms.int32), ops.zeros((), ms.int32))
    # Rank of each assignment among those of its expert, counted in token order.
    rank_A = (ops.cumsum(one_hot_AE, 0) * one_hot_AE).sum(-1) - 1
    kept_A = rank_A < capacity
    slot_A = ops.select(
        kept_A, expert_A * capacity + rank_A, ops.fill(ms.int32, expert_A.shape, num_experts * capacity)
    )
    return slot_A.astype(ms.int32), kept_A


def gather_to_slots(x_TH, slot_A, num_experts: int, capacity: int):
    """Fill the ``[E, C, H]`` expert input buffer; empty slots read a zero row."""
    num_tokens, hidden = x_TH.shape
    top_k = slot_A.shape[0] // num_tokens
    token_A = ops.arange(slot_A.shape[0], dtype=ms.int32) // top_k
    num_slots = num_experts * capacity
    # 1 + token index per filled slot (0 = empty); the extra last slot collects drops.
    token_plus_one_X = ops.scatter_nd(slot_A.expand_dims(-1), token_A + 1, (num_slots + 1,))[:num_slots]
    source_X = ops.select(
        token_plus_one_X > 0, token_plus_one_X - 1, ops.fill(ms.int32, token_plus_one_X.shape, num_tokens)
    )
    x_padded = ops.concat((x_TH, ops.zeros((1, hidden), x_TH.dtype)), 0)
    return ops.gather(x_padded, source_X, 0).reshape(num_experts, capacity, hidden)


def combine_from_slots(y_ECH, slot_A, weight_TK):
    """``out_t = sum_k weight_tk * y[slot(t, k)]``; dropped assignments contribute zero."""
    num_experts, capacity, hidden = y_ECH.shape
    num_tokens, top_k = weight_TK.shape
    y_padded = ops.concat((y_ECH.reshape(-1, hidden), ops.zeros((1, hidden), y_ECH.dtype)), 0)
    y_TKH = ops.gather(y_padded, slot_A, 0).reshape(num_tokens, top_k, hidden)
    # [1, K] x [K, H] per token: as a batched MatMul this ran (forward + backward) 2x faster on CPU
    # than a multiply and a ReduceSum over K, whose backward sums over H.
    return _BMM(weight_TK.astype(y_TKH.dtype).expand_dims(1), y_TKH).squeeze(1)


def dense_combine_weights(topk_idx_TK, weight_TK, num_experts: int):
    """``[T, E]`` weights: the routed weight at each chosen expert, zero elsewhere."""
    one_hot_TKE = ops.one_hot(topk_idx_TK, num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32))
    return (one_hot_TKE * weight_TK.expand_dims(-1)).sum(1)
