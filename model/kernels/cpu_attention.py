"""Blockwise document-causal attention for training on CPU: memory linear in the sequence length.

Shape legend (docs/architecture.md): B batch, N query heads, G key/value heads, S positions, D head
dim; per block: Q query positions, K key positions, R = group x Q rows of one key/value head.

The sequence is cut into blocks of ``block_size`` positions (the last one may be shorter). Query block
i meets key blocks 0..i only: the blocks above the diagonal are entirely in the future and are never
computed (a static choice, the loops are unrolled when the graph compiles). A key block below the
diagonal that shares no document with the query block (in no row of the batch: their ranges of
document ids are disjoint) is skipped too, forward and backward: the pair's work sits in a tensor
``if`` on that condition, which MindSpore 2.9 compiles on CPU into a branch that really is not run
(forward and backward at S=4096 with documents of 217-948 tokens: 0.50x the time of computing every
pair). The diagonal pair is never skipped and comes first, so it starts the running statistics.
Within a block pair the document-causal mask is built from the document ids of the two blocks (and,
on the diagonal, the positions), so no ``[S, S]`` tensor exists. The forward keeps a running row
maximum and row sum (online softmax) and saves only the output and the per-row log-sum-exp; the
backward recomputes each block's probabilities from the log-sum-exp (FlashAttention-2, Dao 2023):
``delta = rowsum(dout * out)``, ``dscores = probs * (dprobs - delta)``.

Memory on CPU (MindSpore 2.9, measured): the compiled graph reuses a block's buffers only if two
rules are kept, and every block pair stays alive without them. (1) No implicit broadcast on a
block-sized tensor: an elementwise op whose operand broadcasts (``scores - row_max``) kept its
output alive to the end of the graph, the same op after an explicit ``ops.broadcast_to`` did not.
(2) Nothing of a block pair may be computable from the inputs alone: the runtime starts a kernel as
soon as its inputs exist, so every block's mask (and, in the backward, ``dout v^T``) was computed
up front and held; each pair's mask and values are therefore made to wait (``ops.depend``) for the
previous pair's result.
With both, one compiled forward and backward at S=4096 (N=8, G=2, D=64) peaked 0.6 GB above the
imported process against 1.9 GB for the full-mask core (0.8 GB with the skipping branches, whether
or not a block is skipped); in the whole training graph the gain is smaller and the steps slower,
so the model does not run it on CPU (``model.attention.BLOCKWISE_DEVICES``).
"""

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

# Same value as model.attention.MASK_VALUE (kernels do not import the model): large negative instead
# of -inf, so a row whose keys of one block are all masked stays finite.
MASK_VALUE = -1e9


def block_bounds(seq_len: int, block_size: int):
    """``[(start, end), ...]`` of the blocks covering ``seq_len`` positions; the last may be shorter."""
    bounds = []
    for start in range(0, seq_len, block_size):
        end = start + block_size
        bounds.append((start, end if end < seq_len else seq_len))
    return bounds


class BlockwiseAttentionCore(nn.Cell):
    """``(q [B, N, S, D], k [B, G, S, D], v [B, G, S, D], doc_ids [B, S] int32) -> (out [B, N, S, D],
    lse [B, N, S, 1] fp32)`` with a hand-written backward; ``lse`` is an output only so the backward
    can use it. Query head n uses key/value head n // (N / G) (HF repeat_kv order): a query block
    ``[B, N, Q, D]`` is ``[B, G, R, D]`` by a reshape, so k/v are never repeated and their gradients
    come out of the BatchMatMuls summed over the group. Scores, softmax and score gradients are fp32
    whatever the dtype of q/k/v; for fp32 v the row sums ride on the value BatchMatMul as an extra
    ones column (``p [v, 1] = [p v, rowsum(p)]``), as the backward's ``delta`` does."""

    def __init__(self, scale: float, block_size: int):
        super().__init__()
        self.scale = scale
        self.block_size = block_size
        self.bmm_nt = ops.BatchMatMul(transpose_b=True)
        self.bmm_nn = ops.BatchMatMul()
        self.bmm_tn = ops.BatchMatMul(transpose_a=True)
        self.row_dot = ops.MatMul()
        self.row_max = ops.ReduceMax(keep_dims=True)
        self.doc_low = ops.ReduceMin()
        self.doc_high = ops.ReduceMax()
        self.positions = Tensor(np.arange(block_size, dtype=np.int32))

    def _causal(self, size):
        """``[Q, Q]`` bool: key position <= query position (a diagonal block of ``size`` positions)."""
        positions_Q = self.positions if size == self.block_size else self.positions[:size]
        return positions_Q.expand_dims(0) <= positions_Q.expand_dims(1)

    def _rows(self, x_BNQD, groups):
        """``[B, N, Q, D]`` -> ``[B, G, R, D]`` (the query heads of one key/value head stacked)."""
        batch, heads, queries, width = x_BNQD.shape
        return x_BNQD.reshape(batch, groups, heads // groups * queries, width)

    def _row_sum(self, x_ZX):
        return self.row_dot(x_ZX, ops.ones((x_ZX.shape[-1], 1), ms.float32))

    def _scores(self, q_BGRD, k_BGKD, mask_B1QK, heads):
        """Masked fp32 scores ``[B, G, R, K]`` (``q`` already scaled)."""
        batch, groups, rows, _ = q_BGRD.shape
        keys = k_BGKD.shape[2]
        scores_BNQK = self.bmm_nt(q_BGRD, k_BGKD).astype(ms.float32).reshape(batch, heads, rows * groups // heads, keys)
        return (scores_BNQK + ops.broadcast_to(mask_B1QK, scores_BNQK.shape)).reshape(batch, groups, rows, keys)

    def _mask(self, doc_ids_BS, query_block, key_block):
        """Additive ``[B, 1, Q, K]`` fp32 mask of a block pair: 0 where query and key share a document
        and (on the diagonal) the key is not after the query, MASK_VALUE elsewhere. (A method, as is
        everything the backward calls: MindSpore 2.9 failed to compile a bprop that called a module-level
        helper or ``ops.arange``/``ops.tile``, "The func graph is empty".)"""
        (q0, q1), (k0, k1) = query_block, key_block
        shape_BQK = (doc_ids_BS.shape[0], q1 - q0, k1 - k0)
        allowed_BQK = ops.equal(
            ops.broadcast_to(doc_ids_BS[:, q0:q1].expand_dims(2), shape_BQK),
            ops.broadcast_to(doc_ids_BS[:, k0:k1].expand_dims(1), shape_BQK),
        )
        if q0 == k0:
            allowed_BQK = ops.logical_and(allowed_BQK, ops.broadcast_to(self._causal(q1 - q0), shape_BQK))
        # (allowed - 1) * -MASK_VALUE: no constant block-sized tensors in the graph.
        return ((allowed_BQK.astype(ms.float32) - 1.0) * -MASK_VALUE).expand_dims(1)

    def _weighted_values(self, probs_BGRK, v_BGKD):
        """``[p v, rowsum(p)]`` ``[B, G, R, D + 1]`` fp32."""
        if v_BGKD.dtype == ms.float32:
            ones_BGK1 = ops.ones(v_BGKD.shape[:-1] + (1,), ms.float32)
            return self.bmm_nn(probs_BGRK, ops.concat((v_BGKD, ones_BGK1), -1))
        weighted_BGRD = self.bmm_nn(probs_BGRK.astype(v_BGKD.dtype), v_BGKD).astype(ms.float32)
        sums_Z1 = self._row_sum(probs_BGRK.reshape(-1, probs_BGRK.shape[-1]))
        return ops.concat((weighted_BGRD, sums_Z1.reshape(probs_BGRK.shape[:-1] + (1,))), -1)

    def _shares_document(self, ranges, i, j):
        """0-d bool: some row of query block i and key block j may share a document (their ranges of
        document ids overlap). Never False for a pair that shares one, so skipping the others is exact
        for any document ids; with packed (non-decreasing) ids it is False for every pair that shares none."""
        (q_low_B, q_high_B), (k_low_B, k_high_B) = ranges[i], ranges[j]
        return ops.logical_not(ops.logical_or(k_high_B < q_low_B, k_low_B > q_high_B)).any()

    def _document_ranges(self, doc_ids_BS, blocks):
        """Per block, the lowest and highest document id of each row (``[B]`` int32 each)."""
        ranges = ()
        for k0, k1 in blocks:
            ranges = ranges + ((self.doc_low(doc_ids_BS[:, k0:k1], 1), self.doc_high(doc_ids_BS[:, k0:k1], 1)),)
        return ranges

    def _online_step(self, q_BGRD, k_BGSD, v_BGSD, doc_ids_BS, blocks, i, j, acc_BGRE, max_BGR1, heads):
        """The running ``[p v, rowsum(p)]`` and row maximum after key block j (the first when ``acc_BGRE``
        is None)."""
        k0, k1 = blocks[j]
        # Ordering only (module docstring, rule 2): this pair's mask waits for the previous pair.
        after = q_BGRD if acc_BGRE is None else acc_BGRE
        mask_B1QK = self._mask(ops.depend(doc_ids_BS, after), blocks[i], blocks[j])
        scores_BGRK = self._scores(q_BGRD, k_BGSD[:, :, k0:k1], mask_B1QK, heads)
        block_max_BGR1 = self.row_max(scores_BGRK.reshape(-1, k1 - k0), 1).reshape(q_BGRD.shape[:-1] + (1,))
        new_max_BGR1 = block_max_BGR1 if max_BGR1 is None else ops.maximum(max_BGR1, block_max_BGR1)
        shifted_BGRK = scores_BGRK - ops.broadcast_to(new_max_BGR1, scores_BGRK.shape)
        weighted_BGRE = self._weighted_values(ops.exp(shifted_BGRK), v_BGSD[:, :, k0:k1])
        if acc_BGRE is None:
            return weighted_BGRE, new_max_BGR1
        rescale_BGRE = ops.broadcast_to(ops.exp(max_BGR1 - new_max_BGR1), acc_BGRE.shape)
        return acc_BGRE * rescale_BGRE + weighted_BGRE, new_max_BGR1

    def _query_block(self, q_BGRD, kv, doc_ids_BS, ranges, blocks, i, heads):
        """Output ``[B, G, R, D]`` and log-sum-exp ``[B, G, R, 1]`` of query block i (online softmax)."""
        k_BGSD, v_BGSD = kv
        head_dim = q_BGRD.shape[-1]
        # The diagonal block first: it is never skipped (a query sees itself), so it starts the statistics.
        acc_BGRE, max_BGR1 = self._online_step(q_BGRD, k_BGSD, v_BGSD, doc_ids_BS, blocks, i, i, None, None, heads)
        for j in range(i):
            if self._shares_document(ranges, i, j):
                acc_BGRE, max_BGR1 = self._online_step(
                    q_BGRD, k_BGSD, v_BGSD, doc_ids_BS, blocks, i, j, acc_BGRE, max_BGR1, heads
                )
        sums_BGR1 = acc_BGRE[..., head_dim:]
        values_BGRD = acc_BGRE[..., :head_dim]
        return values_BGRD / ops.broadcast_to(sums_BGR1, values_BGRD.shape), max_BGR1 + ops.log(sums_BGR1)

    def construct(self, q_BNSD, k_BGSD, v_BGSD, doc_ids_BS):
        batch, heads, seq_len, head_dim = q_BNSD.shape
        groups = k_BGSD.shape[1]
        blocks = block_bounds(seq_len, self.block_size)
        ranges = self._document_ranges(doc_ids_BS, blocks)
        outs, lses = [], []
        for i in range(len(blocks)):
            q0, q1 = blocks[i]
            # Query block i starts after block i - 1 is done (module docstring, rule 2).
            q_BNQD = q_BNSD[:, :, q0:q1] if not outs else ops.depend(q_BNSD[:, :, q0:q1], outs[-1])
            q_BGRD = self._rows(q_BNQD * self.scale, groups)
            out_BGRD, lse_BGR1 = self._query_block(q_BGRD, (k_BGSD, v_BGSD), doc_ids_BS, ranges, blocks, i, heads)
            outs.append(out_BGRD.astype(q_BNSD.dtype).reshape(batch, heads, q1 - q0, head_dim))
            lses.append(lse_BGR1.reshape(batch, heads, q1 - q0, 1))
        return ops.concat(outs, 2), ops.concat(lses, 2)

    def bprop(self, q_BNSD, k_BGSD, v_BGSD, doc_ids_BS, out, dout):
        out_BNSD, lse_BNS1 = out
        dout_BNSD = dout[0]
        batch, heads, seq_len, head_dim = q_BNSD.shape
        blocks = block_bounds(seq_len, self.block_size)
        ranges = self._document_ranges(doc_ids_BS, blocks)
        products_ZD = (dout_BNSD.astype(ms.float32) * out_BNSD.astype(ms.float32)).reshape(-1, head_dim)
        delta_BNS1 = self._row_sum(products_ZD).reshape(batch, heads, seq_len, 1)
        dq_blocks, dk_blocks, dv_blocks = (), (), ()
        for i in range(len(blocks)):
            q_after_BNSD = q_BNSD if not dq_blocks else ops.depend(q_BNSD, dq_blocks[-1])
            dq_BNQD, dk_blocks, dv_blocks = self._backward_query_block(
                (q_after_BNSD, k_BGSD, v_BGSD, doc_ids_BS),
                (dout_BNSD, lse_BNS1, delta_BNS1),
                (blocks, ranges, i),
                dk_blocks,
                dv_blocks,
            )
            dq_blocks = dq_blocks + (dq_BNQD,)
        return ops.concat(dq_blocks, 2), ops.concat(dk_blocks, 2), ops.concat(dv_blocks, 2), ops.zeros_like(doc_ids_BS)

    def _backward_query_block(self, inputs, saved, where, dk_blocks, dv_blocks):
        """dq ``[B, N, Q, D]`` of query block i, and the dk/dv blocks with its contributions added (key
        block i is first reached here: it is appended). Key blocks sharing no document are skipped."""
        q_BNSD, k_BGSD, v_BGSD, doc_ids_BS = inputs
        dout_BNSD, lse_BNS1, delta_BNS1 = saved
        blocks, ranges, i = where
        batch, heads, _, head_dim = q_BNSD.shape
        groups = k_BGSD.shape[1]
        q0, q1 = blocks[i]
        rows = (
            self._rows(q_BNSD[:, :, q0:q1] * self.scale, groups),
            self._rows(dout_BNSD[:, :, q0:q1], groups),
            self._rows(lse_BNS1[:, :, q0:q1], groups),
            self._rows(delta_BNS1[:, :, q0:q1], groups),
        )
        dq_BGRD, dk_BGKD, dv_BGKD = self._backward_pair(rows, (k_BGSD, v_BGSD, doc_ids_BS), blocks, i, i, rows[0])
        dk_blocks, dv_blocks = dk_blocks + (dk_BGKD,), dv_blocks + (dv_BGKD,)
        for j in range(i):
            dk_BGKD, dv_BGKD = dk_blocks[j], dv_blocks[j]
            if self._shares_document(ranges, i, j):
                dq_part, dk_part, dv_part = self._backward_pair(
                    rows, (k_BGSD, v_BGSD, doc_ids_BS), blocks, i, j, dq_BGRD
                )
                dq_BGRD, dk_BGKD, dv_BGKD = dq_BGRD + dq_part, dk_BGKD + dk_part, dv_BGKD + dv_part
            dk_blocks = dk_blocks[:j] + (dk_BGKD,) + dk_blocks[j + 1 :]
            dv_blocks = dv_blocks[:j] + (dv_BGKD,) + dv_blocks[j + 1 :]
        return (dq_BGRD * self.scale).reshape(batch, heads, q1 - q0, head_dim), dk_blocks, dv_blocks

    def _backward_pair(self, rows, keys, blocks, i, j, after):
        """dq, dk, dv contributions ``[B, G, R, D]``, ``[B, G, K, D]``, ``[B, G, K, D]`` of block pair
        (i, j); its work waits for ``after`` (module docstring, rule 2)."""
        q_BGRD, dout_BGRD, lse_BGR1, delta_BGR1 = rows
        k_BGSD, v_BGSD, doc_ids_BS = keys
        heads = q_BGRD.shape[1] * q_BGRD.shape[2] // (blocks[i][1] - blocks[i][0])
        k0, k1 = blocks[j]
        k_BGKD, v_BGKD = k_BGSD[:, :, k0:k1], ops.depend(v_BGSD[:, :, k0:k1], after)
        mask_B1QK = self._mask(ops.depend(doc_ids_BS, after), blocks[i], blocks[j])
        scores_BGRK = self._scores(q_BGRD, k_BGKD, mask_B1QK, heads)
        probs_BGRK = ops.exp(scores_BGRK - ops.broadcast_to(lse_BGR1, scores_BGRK.shape))
        dscores_BGRK = (probs_BGRK * self._shifted_dprobs(dout_BGRD, delta_BGR1, v_BGKD)).astype(q_BGRD.dtype)
        # Taken against the scaled queries, so dk already carries the scale.
        return (
            self.bmm_nn(dscores_BGRK, k_BGKD),
            self.bmm_tn(dscores_BGRK, q_BGRD),
            self.bmm_tn(probs_BGRK.astype(v_BGKD.dtype), dout_BGRD),
        )

    def _shifted_dprobs(self, dout_BGRD, delta_BGR1, v_BGKD):
        """``dout v^T - delta`` ``[B, G, R, K]`` fp32 (for fp32 one BatchMatMul: ``[dout, -delta] [v, 1]^T``)."""
        if v_BGKD.dtype == ms.float32:
            ones_BGK1 = ops.ones(v_BGKD.shape[:-1] + (1,), ms.float32)
            return self.bmm_nt(ops.concat((dout_BGRD, -delta_BGR1), -1), ops.concat((v_BGKD, ones_BGK1), -1))
        dprobs_BGRK = self.bmm_nt(dout_BGRD, v_BGKD).astype(ms.float32)
        return dprobs_BGRK - ops.broadcast_to(delta_BGR1, dprobs_BGRK.shape)


class BlockwiseAttention(nn.Cell):
    """The ``blockwise_attention`` kernel on CPU: :class:`BlockwiseAttentionCore`'s output alone."""

    def __init__(self, scale: float, block_size: int):
        super().__init__()
        self.core = BlockwiseAttentionCore(scale, block_size)

    def construct(self, q_BNSD, k_BGSD, v_BGSD, doc_ids_BS):
        out_BNSD, _ = self.core(q_BNSD, k_BGSD, v_BGSD, doc_ids_BS)
        return out_BNSD
