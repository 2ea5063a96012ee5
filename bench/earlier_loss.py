"""The LM loss cell before it computed its gradients in the forward (``model.lm_loss.TokenNLL`` until 2026-12-05),
kept for bench/kernel_ab.py's ``loss=recompute`` variant only: it keeps the log-sum-exp of each token (or, in
one chunk, the probabilities) and recomputes each chunk's logits in its backward. :class:`EarlierTokenNLL` gives
it today's interface (weights in, weighted sum out)."""

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindmoe.model import kernels
from mindmoe.model.lm_loss import _leading


class EarlierTokenNLL(nn.Cell):
    """Today's ``TokenNLL`` interface over :class:`RecomputingTokenNLL`: ``(sum_t w_t nll_t, nll [T], 0, 0)``,
    differentiated through the earlier cell's own backward."""

    def __init__(self, rows: int, head_trainable: bool = True, compute_dtype=ms.float32, grads: bool = True):
        super().__init__()
        self.rows = rows
        self.grads = grads
        self.head_trainable = head_trainable and grads
        self.compute_dtype = compute_dtype
        self.earlier = RecomputingTokenNLL(rows, self.head_trainable, compute_dtype)

    def construct(self, x_TH, head_VH, labels_T, weight_T):
        nll_T, _ = self.earlier(x_TH, head_VH, labels_T)
        zero = ops.zeros((), ms.float32)
        return (nll_T * weight_T.astype(ms.float32)).sum(), nll_T, zero, zero


class RecomputingTokenNLL(nn.Cell):
    """``(nll [T] fp32, saved)``, ``nll_t = logsumexp_v(x_t W^T) - (x_t W^T)[label_t]``; hand-written backward.

    Inputs: the final normed hidden rows ``x [T, H]``, the head ``W [V, H]`` (a graph input, not a parameter of
    this cell, so a tied embedding gets the head's gradient added to its own), ``labels [T]`` int32. ``saved`` is
    for the backward only: the probabilities ``[T, V]`` when ``T <= rows`` (one chunk), else the log-sum-exp
    ``[T]``. Weight the tokens outside (``(nll * mask).sum()``): a token of zero weight gets zero gradient.

    ``rows``: tokens per chunk (static; the last chunk may be smaller). ``head_trainable=False`` (a frozen head,
    as in LoRA without the head in ``modules_to_save``) skips the weight-gradient MatMuls. ``compute_dtype`` is
    the dtype of the logits MatMul (the model's compute dtype under mixed precision, as the model's own head
    runs it); logits, softmax and reductions are fp32 whatever it is.
    """

    def __init__(self, rows: int, head_trainable: bool = True, compute_dtype=ms.float32):
        super().__init__()
        if rows < 1:
            raise ValueError(f"RecomputingTokenNLL: rows={rows} must be >= 1")
        self.rows = rows
        self.offsets_c = Tensor(np.arange(rows, dtype=np.int32))  # a chunk's rows, shifted per chunk
        self.head_trainable = head_trainable
        self.compute_dtype = compute_dtype
        self.matmul_nt = ops.MatMul(transpose_b=True)
        self.matmul_nn = ops.MatMul()
        self.matmul_tn = ops.MatMul(transpose_a=True)
        self.expand = kernels.expand()

    def logits(self, x_cH, head_VH):
        """fp32 logits ``[c, V]``; ``head_VH`` already in the compute dtype."""
        return self.matmul_nt(x_cH.astype(self.compute_dtype), head_VH).astype(ms.float32)

    def construct(self, x_TH, head_VH, labels_T):
        head_VH = head_VH.astype(self.compute_dtype)
        if x_TH.shape[0] <= self.rows:
            logits_TV = self.logits(x_TH, head_VH)
            max_T1 = logits_TV.max(-1, keepdims=True)
            exp_TV = ops.exp(logits_TV - self.expand(max_T1, logits_TV.shape))
            sum_T1 = exp_TV.sum(-1, keepdims=True)
            label_T = ops.gather_elements(logits_TV, 1, labels_T.reshape(-1, 1)).reshape(-1)
            nll_T = (max_T1 + ops.log(sum_T1)).reshape(-1) - label_T
            return nll_T, exp_TV / self.expand(sum_T1, exp_TV.shape)
        return self.chunked_nll(x_TH, head_VH, labels_T)

    def padded(self, x_TH, labels_T):
        """``(chunks, x [n*rows, H], labels [n*rows])``: the tokens padded with zero rows to whole chunks."""
        tokens = x_TH.shape[0]
        chunks = (tokens + self.rows - 1) // self.rows
        pad = chunks * self.rows - tokens
        if pad == 0:
            return chunks, x_TH, labels_T
        x_TH = ops.concat((x_TH, ops.zeros((pad, x_TH.shape[1]), x_TH.dtype)))
        return chunks, x_TH, ops.concat((labels_T, ops.zeros((pad,), labels_T.dtype)))

    def chunked_nll(self, x_TH, head_VH, labels_T):
        """``(nll [T], logsumexp [T])`` over the chunks in a graph loop.

        A loop, not unrolled chunks: on CPU MindSpore 2.9 kept the ``[c, V]`` intermediates of every unrolled
        chunk that fed two ops, so peak memory grew with T as without chunks; a loop body's buffers are reused.
        """
        tokens = x_TH.shape[0]
        chunks, x_TH, labels_T = self.padded(x_TH, labels_T)
        nll_T = ops.zeros((chunks * self.rows,), ms.float32)
        lse_T = ops.zeros((chunks * self.rows,), ms.float32)
        offsets_c = self.offsets_c
        chunk = Tensor(0, ms.int32)
        while chunk < chunks:
            index_c = offsets_c + chunk * self.rows
            logits_cV = self.logits(ops.gather(x_TH, index_c, 0), head_VH)
            max_c1 = logits_cV.max(-1, keepdims=True)
            shifted_cV = logits_cV - self.expand(max_c1, logits_cV.shape)
            lse_c = (max_c1 + ops.log(ops.exp(shifted_cV).sum(-1, keepdims=True))).reshape(-1)
            label_c = ops.gather_elements(logits_cV, 1, ops.gather(labels_T, index_c, 0).reshape(-1, 1)).reshape(-1)
            nll_T = ops.tensor_scatter_update(nll_T, index_c.reshape(-1, 1), lse_c - label_c)
            lse_T = ops.tensor_scatter_update(lse_T, index_c.reshape(-1, 1), lse_c)
            chunk = chunk + 1
        return _leading(nll_T, tokens), _leading(lse_T, tokens)

    def chunk_dlogits(self, probs_cV, labels_c, dnll_c):
        """``(softmax - onehot(label)) * dnll`` of one chunk, fp32 ``[c, V]``."""
        onehot_cV = ops.one_hot(labels_c, probs_cV.shape[1], 1.0, 0.0)
        return (probs_cV - onehot_cV) * self.expand(dnll_c.reshape(-1, 1), probs_cV.shape)

    def bprop(self, x_TH, head_VH, labels_T, out, dout):
        # Early returns only: MindSpore 2.9 failed to compile this backward with a branch that joins again
        # when the head is a Parameter ("parameters number of the function is 4, but ... 3").
        if x_TH.shape[0] <= self.rows:
            dlogits_TV = self.chunk_dlogits(out[1], labels_T, dout[0])
            return self.chunk_grads(x_TH, head_VH, labels_T, dlogits_TV)
        if self.head_trainable:
            return self.chunked_grads(x_TH, head_VH, labels_T, out[1], dout[0])
        return self.chunked_input_grads(x_TH, head_VH, labels_T, out[1], dout[0])

    def chunk_grads(self, x_TH, head_VH, labels_T, dlogits_TV):
        """All gradients from the whole ``[T, V]`` logit gradient (one chunk)."""
        head_c = head_VH.astype(self.compute_dtype)
        dlogits_c = dlogits_TV.astype(self.compute_dtype)
        dx_TH = self.matmul_nn(dlogits_c, head_c).astype(x_TH.dtype)
        if not self.head_trainable:
            return dx_TH, ops.zeros_like(head_VH), ops.zeros_like(labels_T)
        dhead_VH = self.matmul_tn(dlogits_c, x_TH.astype(self.compute_dtype)).astype(head_VH.dtype)
        return dx_TH, dhead_VH, ops.zeros_like(labels_T)

    def chunked_grads(self, x_TH, head_VH, labels_T, lse_T, dnll_T):
        """``dx`` chunk by chunk and ``dW`` summed over chunks, in a graph loop (see :meth:`chunked_nll`)."""
        tokens = x_TH.shape[0]
        head_c = head_VH.astype(self.compute_dtype)
        chunks, x_TH, labels_T, lse_T, dnll_T = self.padded_grad_inputs(x_TH, labels_T, lse_T, dnll_T)
        dx_TH = ops.zeros(x_TH.shape, x_TH.dtype)
        dhead_VH = ops.zeros(head_VH.shape, ms.float32)
        offsets_c = self.offsets_c
        chunk = Tensor(0, ms.int32)
        while chunk < chunks:
            index_c = offsets_c + chunk * self.rows
            x_cH = ops.gather(x_TH, index_c, 0)
            dlogits_cV = self.chunk_dlogits_recomputed(x_cH, head_c, labels_T, lse_T, dnll_T, index_c)
            dx_TH = ops.tensor_scatter_update(dx_TH, index_c.reshape(-1, 1), self.input_grad(dlogits_cV, head_c, x_TH))
            dhead_VH = dhead_VH + self.matmul_tn(dlogits_cV, x_cH.astype(self.compute_dtype)).astype(ms.float32)
            chunk = chunk + 1
        return _leading(dx_TH, tokens), dhead_VH.astype(head_VH.dtype), ops.zeros_like(_leading(labels_T, tokens))

    def chunked_input_grads(self, x_TH, head_VH, labels_T, lse_T, dnll_T):
        """``dx`` chunk by chunk of a frozen head (no weight-gradient MatMul)."""
        tokens = x_TH.shape[0]
        head_c = head_VH.astype(self.compute_dtype)
        chunks, x_TH, labels_T, lse_T, dnll_T = self.padded_grad_inputs(x_TH, labels_T, lse_T, dnll_T)
        dx_TH = ops.zeros(x_TH.shape, x_TH.dtype)
        offsets_c = self.offsets_c
        chunk = Tensor(0, ms.int32)
        while chunk < chunks:
            index_c = offsets_c + chunk * self.rows
            x_cH = ops.gather(x_TH, index_c, 0)
            dlogits_cV = self.chunk_dlogits_recomputed(x_cH, head_c, labels_T, lse_T, dnll_T, index_c)
            dx_TH = ops.tensor_scatter_update(dx_TH, index_c.reshape(-1, 1), self.input_grad(dlogits_cV, head_c, x_TH))
            chunk = chunk + 1
        return _leading(dx_TH, tokens), ops.zeros_like(head_VH), ops.zeros_like(_leading(labels_T, tokens))

    def padded_grad_inputs(self, x_TH, labels_T, lse_T, dnll_T):
        """:meth:`padded` plus the log-sum-exp and the incoming gradient, zero on the padding rows."""
        chunks, x_TH, labels_T = self.padded(x_TH, labels_T)
        pad = x_TH.shape[0] - lse_T.shape[0]
        if pad == 0:
            return chunks, x_TH, labels_T, lse_T, dnll_T
        zeros = ops.zeros((pad,), ms.float32)
        return chunks, x_TH, labels_T, ops.concat((lse_T, zeros)), ops.concat((dnll_T, zeros))

    def chunk_dlogits_recomputed(self, x_cH, head_c, labels_T, lse_T, dnll_T, index_c):
        """One chunk's logit gradient from its recomputed logits, in the compute dtype."""
        logits_cV = self.logits(x_cH, head_c)
        lse_c1 = ops.gather(lse_T, index_c, 0).reshape(-1, 1)
        probs_cV = ops.exp(logits_cV - self.expand(lse_c1, logits_cV.shape))
        dlogits_cV = self.chunk_dlogits(probs_cV, ops.gather(labels_T, index_c, 0), ops.gather(dnll_T, index_c, 0))
        return dlogits_cV.astype(self.compute_dtype)

    def input_grad(self, dlogits_cV, head_c, x_TH):
        return self.matmul_nn(dlogits_cV, head_c).astype(x_TH.dtype)
