"""Blockwise DeepSeek Sparse Attention for training (the ``indexed_attention`` kernel): the lightning indexer's
scores, the top-k selection, the main attention and the indexer's KL loss, one block of queries at a time, with a
hand-written backward that recomputes each block. Memory linear in the sequence length: no ``[S, S]`` tensor exists,
and nothing of a block is kept for the backward (it keeps the inputs, the output and the per-row log-sum-exp).

Shape legend (docs/architecture.md): B batch, N heads, S positions, D query/key width (``qk_head_dim``), E value
width (``v_head_dim``), I indexer heads, C ``index_head_dim``; per block: Q queries, P keys (the positions up to the
block's last query: every key a query of the block may see).

Query block ``[q0, q1)`` meets keys ``[0, q1)`` only (the later ones are all in the future). Per block::

    visible[t, s]  = 0 if s <= t and doc[s] == doc[t] else MASK_VALUE                  [B, Q, P]
    I[t, s]        = sum_j w[t, j] ReLU(iq[t, j] . ik[s]) * index_scale                [B, Q, P]  (model/dsa.py)
    sparse:  keep  = I + visible >= its topk-th largest value in the row; visible += MASK_VALUE where not keep
    scores         = q k^T * scale + visible;  probs = softmax(scores);  out = probs v  [B, N, Q, P]
    p[t]           = sum_n probs[n, t] L1-normalised;  KL += sum_t KL(p[t] || softmax(I[t] + visible[t]))

A query's whole row of keys is scored at once because its top-k is over the whole row; the block of queries bounds
the memory: ``B (N + I) Q P`` fp32 values at the last block (``P = S``). The backward recomputes a block's
indexer scores, selection and probabilities (from the saved log-sum-exp), then takes FlashAttention-2's gradients
of the main attention (``dS = probs * (dprobs - rowsum(dout * out))``) and the KL's gradient into the indexer
(``dI = g * (softmax(I + visible) * sum(p) - p)``, through the ReLU into ``iq``, ``ik`` and ``w``). The main
attention's probabilities are the KL's target (no gradient), and the selection is a comparison, so ``q, k, v`` get
gradients from the output only and ``iq, ik, w`` from the loss only, as in the full-mask path of model/mla.py.

The two CPU memory rules of :mod:`~.cpu_attention` hold here: explicit ``broadcast_to`` before every elementwise op
on a block-sized tensor, and each block's work waits (``ops.depend``) for the previous block's result.
"""

import mindspore as ms
from mindspore import ops

from mindmoe.model.kernels.cpu_attention import MASK_VALUE, BlockwiseAttentionCore, block_bounds


class BlockwiseIndexedAttention(BlockwiseAttentionCore):
    """``(q [B, N, S, D], k [B, N, S, D], v [B, N, S, E], doc_ids [B, S] int32, iq [B, I, S, C], ik [B, 1, S, C],
    w [B, I, S, 1]) -> (out [B, N, S, E], kl_sum [] fp32)``. ``kl_sum`` is the sum over the ``B * S`` queries of
    their KL (the caller takes the mean). The indexer's math is fp32 whatever the dtype of its inputs; the main
    attention's matmuls run in the dtype of q/k/v with fp32 scores. ``sparse`` (an attribute, read when the graph
    compiles) selects the top ``topk`` keys of each query; otherwise (DSA's dense warm-up) every visible key is
    attended to and the KL is over all of them."""

    def __init__(self, scale: float, index_scale: float, topk: int, block_size: int, sparse: bool = True):
        super().__init__(scale, block_size)
        self.index_scale = index_scale
        self.topk = topk
        self.sparse = sparse
        self.top_k = ops.TopK(sorted=True)
        self.relu = ops.ReLU()
        # Primitives, not ops.softmax: MindSpore 2.9 could not compile a bprop calling the functional form.
        self.softmax = ops.Softmax(-1)
        self.log_softmax = ops.LogSoftmax(-1)

    # ----- one block's masks, indexer scores and probabilities (forward and backward)

    def _keys(self, x_BXSY, q1):
        """Positions ``[0, q1)`` of ``x`` on axis 2 (not sliced when that is all of them: MindSpore 2.9's CPU
        StridedSlice of a whole axis is slow, model.attention)."""
        return x_BXSY if q1 == x_BXSY.shape[2] else x_BXSY[:, :, :q1]

    def _visible(self, doc_ids_BS, q0, q1, after):
        """Additive ``[B, Q, P]`` fp32 document-causal mask of queries ``[q0, q1)`` against keys ``[0, q1)``."""
        doc_ids_BS = ops.depend(doc_ids_BS, after)
        diagonal_BQQ = self._mask(doc_ids_BS, (q0, q1), (q0, q1)).squeeze(1)
        if q0 == 0:
            return diagonal_BQQ
        return ops.concat((self._mask(doc_ids_BS, (q0, q1), (0, q0)).squeeze(1), diagonal_BQQ), -1)

    def _indexer_products(self, iq_BIQC, ik_B1PC):
        """``iq . ik`` ``[B, I, Q, P]`` fp32 (one BatchMatMul: the indexer heads share their key)."""
        batch, heads, queries, width = iq_BIQC.shape
        keys = ik_B1PC.shape[2]
        rows_BZC = iq_BIQC.reshape(batch, heads * queries, width)
        return self.bmm_nt(rows_BZC, ik_B1PC.reshape(batch, keys, width)).reshape(batch, heads, queries, keys)

    def _select(self, index_BQP, visible_BQP):
        """``visible`` with MASK_VALUE added at every key outside the query's top ``topk`` (keys tied with the k-th
        are kept, as model.dsa.select_top_k does); unchanged when not sparse or the block has at most topk keys."""
        keys = visible_BQP.shape[-1]
        if not self.sparse or self.topk >= keys:
            return visible_BQP
        ranked_BQP = index_BQP + visible_BQP
        kth_BQ1 = self.top_k(ranked_BQP, self.topk)[0][..., self.topk - 1 :]
        keep_BQP = ranked_BQP >= ops.broadcast_to(kth_BQ1, ranked_BQP.shape)
        # (keep - 1) * -MASK_VALUE: 0 where kept, MASK_VALUE elsewhere, with no constant block-sized tensor.
        return visible_BQP + (keep_BQP.astype(ms.float32) - 1.0) * -MASK_VALUE

    def _block_indexer(self, indexer_inputs, doc_ids_BS, q0, q1, after):
        """``(relu'd products [B, I, Q, P], indexer scores [B, Q, P], the mask of the kept keys [B, Q, P])``."""
        iq_BISC, ik_B1SC, w_BIS1 = indexer_inputs
        iq_BIQC = ops.depend(iq_BISC[:, :, q0:q1], after).astype(ms.float32)
        relu_BIQP = self.relu(self._indexer_products(iq_BIQC, self._keys(ik_B1SC, q1).astype(ms.float32)))
        w_BIQ1 = w_BIS1[:, :, q0:q1].astype(ms.float32) * self.index_scale
        index_BQP = (relu_BIQP * ops.broadcast_to(w_BIQ1, relu_BIQP.shape)).sum(1)
        kept_BQP = self._select(ops.stop_gradient(index_BQP), self._visible(doc_ids_BS, q0, q1, after))
        return relu_BIQP, index_BQP, kept_BQP

    def _block_probs(self, q_BNSD, k_BNSD, kept_BQP, q0, q1):
        """Probabilities ``[B, N, Q, P]`` fp32 of queries ``[q0, q1)`` and those queries scaled ``[B, N, Q, D]``.
        (Softmax: on CPU exp, sum and a broadcast division ran at a quarter of its speed, and MindSpore
        2.9 kept every block's divided tensor alive to the end of the graph.)"""
        q_BNQD = q_BNSD[:, :, q0:q1] * self.scale
        scores_BNQP = self.bmm_nt(q_BNQD, self._keys(k_BNSD, q1)).astype(ms.float32)
        scores_BNQP = scores_BNQP + ops.broadcast_to(kept_BQP.expand_dims(1), scores_BNQP.shape)
        return self.softmax(scores_BNQP), q_BNQD

    def _target(self, probs_BNQP):
        """The KL's target ``p [B, Q, P]``: the probabilities summed over the heads, L1-normalised."""
        summed_BQP = probs_BNQP.sum(1)
        inverse_BQ1 = 1.0 / ops.maximum(summed_BQP.sum(-1, keepdims=True), 1e-30)
        return summed_BQP * ops.broadcast_to(inverse_BQ1, summed_BQP.shape)

    def _kl_sum(self, p_BQP, index_BQP, kept_BQP):
        """``sum_t KL(p_t || softmax(I_t + kept_t))`` of the block."""
        log_q_BQP = self.log_softmax(index_BQP + kept_BQP)
        log_p_BQP = ops.log(ops.maximum(p_BQP, 1e-30))
        return (p_BQP * (log_p_BQP - log_q_BQP)).sum()

    # ----- forward

    def construct(self, q_BNSD, k_BNSD, v_BNSD, doc_ids_BS, iq_BISC, ik_B1SC, w_BIS1):
        outs, kl_total = [], ops.zeros((), ms.float32)
        for q0, q1 in block_bounds(q_BNSD.shape[2], self.block_size):
            # Each block waits for the previous one's output and loss (module docstring).
            after = q_BNSD if not outs else ops.depend(outs[-1], kl_total)
            _, index_BQP, kept_BQP = self._block_indexer((iq_BISC, ik_B1SC, w_BIS1), doc_ids_BS, q0, q1, after)
            probs_BNQP, _ = self._block_probs(ops.depend(q_BNSD, after), k_BNSD, kept_BQP, q0, q1)
            outs.append(self.bmm_nn(probs_BNQP.astype(v_BNSD.dtype), self._keys(v_BNSD, q1)))
            kl_total = kl_total + self._kl_sum(self._target(probs_BNQP), index_BQP, kept_BQP)
        return ops.concat(outs, 2), kl_total

    # ----- backward

    def bprop(self, q_BNSD, k_BNSD, v_BNSD, doc_ids_BS, iq_BISC, ik_B1SC, w_BIS1, out, dout):
        dout_BNSE, dkl = dout
        seq_len = q_BNSD.shape[2]
        products_BNSE = dout_BNSE.astype(ms.float32) * out[0].astype(ms.float32)
        delta_BNS1 = products_BNSE.sum(-1, keepdims=True)
        dq_blocks, diq_blocks, dw_blocks = [], [], []
        dk_BNSD = ops.zeros(k_BNSD.shape, ms.float32)
        dv_BNSE = ops.zeros(v_BNSD.shape, ms.float32)
        dik_B1SC = ops.zeros(ik_B1SC.shape, ms.float32)
        for q0, q1 in block_bounds(seq_len, self.block_size):
            # Each block waits for every gradient of the previous one (module docstring).
            after = q_BNSD
            if dq_blocks:
                after = self._after((dq_blocks[-1], diq_blocks[-1], dw_blocks[-1], dv_BNSE, dik_B1SC), dk_BNSD)
            relu_BIQP, index_BQP, kept_BQP = self._block_indexer((iq_BISC, ik_B1SC, w_BIS1), doc_ids_BS, q0, q1, after)
            probs_BNQP, q_BNQD = self._block_probs(ops.depend(q_BNSD, after), k_BNSD, kept_BQP, q0, q1)
            # dout v^T would otherwise be computed for every block up front (it reads inputs only).
            dout_BNQE = ops.depend(dout_BNSE[:, :, q0:q1], after)
            dq_BNQD, dk_BNPD, dv_BNPE = self._attention_grads(
                probs_BNQP, q_BNQD, (k_BNSD, v_BNSD), (dout_BNQE, delta_BNS1[:, :, q0:q1])
            )
            dq_blocks.append(dq_BNQD)
            dk_BNSD = dk_BNSD + self._pad_keys(dk_BNPD, seq_len)
            dv_BNSE = dv_BNSE + self._pad_keys(dv_BNPE, seq_len)
            # d KL / d I = softmax(I + kept) * sum(p) - p, times the loss's upstream gradient
            p_BQP = self._target(probs_BNQP)
            total_BQ1 = p_BQP.sum(-1, keepdims=True)
            q_soft_BQP = self.softmax(index_BQP + kept_BQP)
            dindex_BQP = q_soft_BQP * ops.broadcast_to(total_BQ1, p_BQP.shape) - p_BQP
            dindex_BQP = dindex_BQP * ops.broadcast_to(dkl, p_BQP.shape)
            diq_BIQC, dik_B1PC, dw_BIQ1 = self._indexer_grads(dindex_BQP, relu_BIQP, (iq_BISC, ik_B1SC, w_BIS1), q0, q1)
            diq_blocks.append(diq_BIQC)
            dw_blocks.append(dw_BIQ1)
            dik_B1SC = dik_B1SC + self._pad_keys(dik_B1PC, seq_len)
        return (
            ops.concat(dq_blocks, 2).astype(q_BNSD.dtype),
            dk_BNSD.astype(k_BNSD.dtype),
            dv_BNSE.astype(v_BNSD.dtype),
            ops.zeros_like(doc_ids_BS),
            ops.concat(diq_blocks, 2).astype(iq_BISC.dtype),
            dik_B1SC.astype(ik_B1SC.dtype),
            ops.concat(dw_blocks, 2).astype(w_BIS1.dtype),
        )

    def _after(self, tensors, last):
        """``last`` once every tensor of ``tensors`` is computed (an ordering token)."""
        for tensor in tensors:
            last = ops.depend(last, tensor)
        return last

    def _attention_grads(self, probs_BNQP, q_BNQD, kv, upstream):
        """dq ``[B, N, Q, D]`` fp32 of the block's queries, dk ``[B, N, P, D]`` and dv ``[B, N, P, E]`` fp32 of keys
        ``[0, P)`` (FlashAttention-2's formulas on recomputed probabilities; ``q`` already scaled, so dk is too)."""
        k_BNSD, v_BNSE = kv
        dout_BNQE, delta_BNQ1 = upstream
        keys = probs_BNQP.shape[-1]
        k_BNPD, v_BNPE = self._keys(k_BNSD, keys), self._keys(v_BNSE, keys)
        dprobs_BNQP = self.bmm_nt(dout_BNQE, v_BNPE).astype(ms.float32)
        dscores_BNQP = probs_BNQP * (dprobs_BNQP - ops.broadcast_to(delta_BNQ1, dprobs_BNQP.shape))
        dscores_BNQP = dscores_BNQP.astype(q_BNQD.dtype)
        dq_BNQD = self.bmm_nn(dscores_BNQP, k_BNPD).astype(ms.float32) * self.scale
        dk_BNPD = self.bmm_tn(dscores_BNQP, q_BNQD).astype(ms.float32)
        dv_BNPE = self.bmm_tn(probs_BNQP.astype(v_BNPE.dtype), dout_BNQE.astype(v_BNPE.dtype)).astype(ms.float32)
        return dq_BNQD, dk_BNPD, dv_BNPE

    def _indexer_grads(self, dindex_BQP, relu_BIQP, indexer_inputs, q0, q1):
        """diq ``[B, I, Q, C]``, dik ``[B, 1, P, C]`` and dw ``[B, I, Q, 1]`` fp32 from the scores' gradient."""
        iq_BISC, ik_B1SC, w_BIS1 = indexer_inputs
        batch, heads, queries, keys = relu_BIQP.shape
        w_BIQ1 = w_BIS1[:, :, q0:q1].astype(ms.float32)
        dweighted_BIQP = ops.broadcast_to(dindex_BQP.expand_dims(1), relu_BIQP.shape) * self.index_scale
        dw_BIQ1 = (dweighted_BIQP * relu_BIQP).sum(-1, keepdims=True)
        active_BIQP = (relu_BIQP > 0).astype(ms.float32)
        dproducts_BIQP = dweighted_BIQP * ops.broadcast_to(w_BIQ1, relu_BIQP.shape) * active_BIQP
        width = iq_BISC.shape[-1]
        dproducts_BZP = dproducts_BIQP.reshape(batch, heads * queries, keys)
        ik_BPC = self._keys(ik_B1SC, keys).squeeze(1).astype(ms.float32)
        iq_BZC = iq_BISC[:, :, q0:q1].astype(ms.float32).reshape(batch, heads * queries, width)
        diq_BIQC = self.bmm_nn(dproducts_BZP, ik_BPC).reshape(batch, heads, queries, width)
        dik_B1PC = self.bmm_tn(dproducts_BZP, iq_BZC).expand_dims(1)
        return diq_BIQC, dik_B1PC, dw_BIQ1

    def _pad_keys(self, grad_BXPY, seq_len):
        """A gradient of keys ``[0, P)`` on axis 2, zero-padded to the S positions."""
        shape = grad_BXPY.shape
        if shape[2] == seq_len:
            return grad_BXPY
        zeros_BXFY = ops.zeros((shape[0], shape[1], seq_len - shape[2], shape[3]), grad_BXPY.dtype)
        return ops.concat((grad_BXPY, zeros_BXFY), 2)
