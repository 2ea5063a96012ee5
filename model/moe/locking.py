"""Expert locking: routing stabilisation from a token's own recent routing history.

Shape legend: B batch, S sequence, K experts per token.

Definition (per MoE layer, per sequence, causal). ``N_t`` is the router's natural top-K set
at token t (unordered). ``run(t)`` counts the consecutive tokens ending at t, inside t's
document, whose set equals ``N_t``. Token t is *locked* when some earlier token s of the
same document with ``t - span <= s <= t - 1`` has ``run(s) >= run_length``; it is then routed
to ``N_{s*}`` of the most recent such s*.

Because only natural decisions enter the definition, every quantity is a prefix maximum
of positions (``cummax``), so the whole thing is a handful of vectorised ops with no loop
over tokens — it compiles into the graph, and a decoder can carry the same state
incrementally. Documents are the contiguous runs of equal ``doc_ids`` (packing's layout).
"""

import mindspore as ms
from mindspore import ops


def _prefix_last(flag_BS, positions_BS):
    """Position of the latest t' <= t with ``flag[t']``, or -1."""
    marked = ops.select(flag_BS, positions_BS, ops.full_like(positions_BS, -1))
    return ops.cummax(marked, 1)[0]


def same_expert_set(a_ZK, b_ZK):
    """Whether two top-K index lists hold the same experts, in any order: ``[Z...]`` bool."""
    # Sets compare equal iff their sorted members do (float sort is exact for expert indices).
    return ops.equal(ops.sort(a_ZK.astype(ms.float32), -1)[0], ops.sort(b_ZK.astype(ms.float32), -1)[0]).all(-1)


def same_set_as_previous(topk_idx_BSK):
    """``[B, S - 1]`` bool: token t's top-K set equals token t - 1's (each row's members sorted once)."""
    members_BSK = ops.sort(topk_idx_BSK.astype(ms.float32), -1)[0]
    return ops.equal(members_BSK[:, 1:], members_BSK[:, :-1]).all(-1)


def run_lengths(continues_run_BS, positions_BS):
    """``run(t)``: the tokens of the run ending at t, where ``continues_run[t]`` says t extends t - 1's run."""
    return positions_BS - _prefix_last(ops.logical_not(continues_run_BS), positions_BS) + 1


def lock_routing(topk_idx_BSK, doc_ids_BS, run_length: int, span: int):
    """Returns ``(locked bool [B, S], locked_topk_idx int32 [B, S, K])``.

    Unlocked tokens keep their own ``topk_idx``; locked tokens get the top-K indices of the
    most recent qualifying token s* (in s*'s order).
    """
    topk_idx_BSK = topk_idx_BSK.astype(ms.int32)
    doc_ids_BS = doc_ids_BS.astype(ms.int32)
    batch, seq_len, top_k = topk_idx_BSK.shape
    positions_BS = ops.broadcast_to(ops.arange(seq_len, dtype=ms.int32).expand_dims(0), (batch, seq_len))
    same_set_prev = same_set_as_previous(topk_idx_BSK)
    same_doc_prev = ops.equal(doc_ids_BS[:, 1:], doc_ids_BS[:, :-1])
    first_column = ops.zeros((batch, 1), ms.bool_)
    continues_run_BS = ops.concat((first_column, ops.logical_and(same_set_prev, same_doc_prev)), 1)
    continues_doc_BS = ops.concat((first_column, same_doc_prev), 1)

    run_BS = run_lengths(continues_run_BS, positions_BS)
    doc_start_BS = _prefix_last(ops.logical_not(continues_doc_BS), positions_BS)

    last_qualifying_BS = _prefix_last(run_BS >= run_length, positions_BS)
    # Strictly earlier tokens only: shift the prefix maximum right by one.
    source_BS = ops.concat((ops.full((batch, 1), -1, dtype=ms.int32), last_qualifying_BS[:, :-1]), 1)
    locked_BS = ops.logical_and(source_BS >= doc_start_BS, source_BS >= positions_BS - span)
    locked_BS = ops.logical_and(locked_BS, source_BS >= 0)

    source_BSK = ops.broadcast_to(ops.maximum(source_BS, 0).expand_dims(-1), (batch, seq_len, top_k))
    inherited_BSK = ops.gather_elements(topk_idx_BSK, 1, source_BSK)
    locked_topk_idx_BSK = ops.select(
        ops.broadcast_to(locked_BS.expand_dims(-1), (batch, seq_len, top_k)), inherited_BSK, topk_idx_BSK
    )
    return locked_BS, locked_topk_idx_BSK


def flip_rate(topk_idx_BSK, doc_ids_BS):
    """Share of adjacent same-document token pairs whose natural top-K set differs."""
    changed = ops.logical_not(same_set_as_previous(topk_idx_BSK)).astype(ms.float32)
    same_doc = ops.equal(doc_ids_BS[:, 1:], doc_ids_BS[:, :-1]).astype(ms.float32)
    return (changed * same_doc).sum() / ops.maximum(same_doc.sum(), 1.0)
