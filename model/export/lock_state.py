"""Expert locking carried from token to token, for a decoder that sees one token at a time.

Shape legend: B batch, S sequence, K experts per token, W = 2K + 3 state columns.

:func:`model.moe.lock_routing` decides locking from natural top-K decisions alone, so what
a decoder must remember about a sequence's past, per MoE layer, is small and fixed:

=============  ==========================================================================
columns        meaning (after the latest token t of the sequence)
=============  ==========================================================================
[0, K)         ``N_t``: the natural top-K of token t, in the router's order
K              ``run(t)``: consecutive tokens ending at t whose natural set equals ``N_t``
K + 1          ``s*``: the latest position <= t with ``run(s*) >= run_length``, or -1
[K + 2, 2K+2)  ``N_{s*}`` (zeros while ``s* = -1``)
2K + 2         1 if token t itself was locked (the lock rate of served traffic), else 0
=============  ==========================================================================

The next token t + 1 is locked iff ``s* >= 0`` and ``s* >= t + 1 - span``, and is then routed
to ``N_{s*}`` — the full-sequence definition, with every sequence one document (serving never
packs). All state is int32 ``[B, W]``.
"""

import mindspore as ms
from mindspore import ops

from mindmoe.model.moe.locking import lock_routing, run_lengths, same_expert_set, same_set_as_previous


def lock_state_width(top_k: int) -> int:
    return 2 * top_k + 3


def prefill_lock_state(natural_BSK, run_length: int, span: int):
    """``(locked_topk_idx [B, S, K], state [B, W])`` for prompts of one document each."""
    natural_BSK = natural_BSK.astype(ms.int32)
    batch, seq_len, top_k = natural_BSK.shape
    doc_ids_BS = ops.zeros((batch, seq_len), ms.int32)
    locked_BS, locked_topk_BSK = lock_routing(natural_BSK, doc_ids_BS, run_length, span)

    positions_BS = ops.broadcast_to(ops.arange(seq_len, dtype=ms.int32).expand_dims(0), (batch, seq_len))
    continues_BS = ops.concat((ops.zeros((batch, 1), ms.bool_), same_set_as_previous(natural_BSK)), 1)
    run_BS = run_lengths(continues_BS, positions_BS)
    qualifying_BS = ops.select(run_BS >= run_length, positions_BS, ops.full_like(positions_BS, -1))
    source_B = qualifying_BS.max(1)
    source_BK = ops.broadcast_to(ops.maximum(source_B, 0).reshape(batch, 1, 1), (batch, 1, top_k))
    source_topk_BK = ops.gather_elements(natural_BSK, 1, source_BK).reshape(batch, top_k)
    source_topk_BK = source_topk_BK * (source_B >= 0).astype(ms.int32).expand_dims(-1)
    state_BW = ops.concat(
        (
            natural_BSK[:, -1],
            run_BS[:, -1:],
            source_B.expand_dims(-1),
            source_topk_BK,
            locked_BS[:, -1:].astype(ms.int32),
        ),
        1,
    )
    return locked_topk_BSK, state_BW


def decode_lock_step(natural_BK, state_BW, position_B, run_length: int, span: int):
    """``(topk_idx [B, K] to route with, next state [B, W])`` for the token at ``position`` (= t + 1)."""
    top_k = natural_BK.shape[-1]
    natural_BK = natural_BK.astype(ms.int32)
    previous_BK = state_BW[:, :top_k]
    run_B = state_BW[:, top_k]
    source_B = state_BW[:, top_k + 1]
    source_topk_BK = state_BW[:, top_k + 2 : 2 * top_k + 2]

    locked_B = ops.logical_and(source_B >= 0, source_B >= position_B - span)
    topk_BK = ops.select(ops.broadcast_to(locked_B.expand_dims(-1), natural_BK.shape), source_topk_BK, natural_BK)
    run_B = ops.select(same_expert_set(natural_BK, previous_BK), run_B + 1, ops.ones_like(run_B))
    qualifies_B = run_B >= run_length
    source_B = ops.select(qualifies_B, position_B, source_B)
    source_topk_BK = ops.select(
        ops.broadcast_to(qualifies_B.expand_dims(-1), natural_BK.shape), natural_BK, source_topk_BK
    )
    state_BW = ops.concat(
        (
            natural_BK,
            run_B.expand_dims(-1),
            source_B.expand_dims(-1),
            source_topk_BK,
            locked_B.astype(ms.int32).expand_dims(-1),
        ),
        1,
    )
    return topk_BK, state_BW
