"""LM head and next-token cross-entropy over chunks of tokens, with the gradients computed in the forward, so no
``[T, V]`` fp32 tensor outlives its chunk and no logit is computed twice.

Shape legend (docs/architecture.md): T tokens, H hidden size, V vocabulary, plus c for the rows of one chunk.

The plain loss (logits ``x W^T``, log-softmax, gather) keeps ``[T, V]`` fp32 logits, log-probabilities and their
gradient alive at once: 2.3 GiB each for 4k tokens at V = 151,552. :class:`TokenNLL` takes each token's loss
weight with its inputs (the loss mask, MTP's weights: known before the backward) and returns the weighted sum.
Chunk by chunk it computes the logits, the per-token negative log-likelihoods and, while the chunk's softmax is
at hand, the weighted logit gradient ``(softmax - onehot(label)) * w`` and what it gives: the rows' gradient
``[c, H]`` and the head's ``[V, H]`` summed over the chunks (the fused linear cross-entropy of Liger-Kernel,
Hsu et al. 2024). The backward only scales them by the incoming scalar. Its memory is one chunk's ``[c, V]``
buffers (a graph loop reuses them) plus the two gradients, which the backward would hold anyway; recomputing
each chunk's logits in the backward instead cost one ``[T, H] x [H, V]`` MatMul per step (83 ms, 3.6 % of the
benchmark's dense step; BENCHMARKS.md).
"""

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindmoe.model import kernels
from mindmoe.model.kernels.cpu import logits_nll

#: fp32 bytes of one chunk's ``[c, V]`` logits. The loss holds 4-7 buffers of that size at once on CPU (its
#: elementwise steps and their workspaces; ``python bench/loss_memory.py``), so this bounds them near 0.2 GiB; at
#: V = 151,552 a chunk is 55 rows; the default run (2,048 tokens, V = 4,096) is one chunk.
CHUNK_BYTES = 32 * 1024 * 1024


def _leading(x, rows: int):
    """The first ``rows`` rows of ``x``, which is ``x`` itself when it has no padding rows: MindSpore 2.9's CPU
    StridedSlice of a full range copied ``[2048, 512]`` fp32 in 30-35 ms (1.2 % of the benchmark's train step)."""
    return x if x.shape[0] == rows else x[:rows]


def chunk_rows(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk for a vocabulary of ``vocab_size``: ``chunk_bytes`` of fp32 logits, at least 1."""
    return max(1, chunk_bytes // (4 * vocab_size))


class TokenNLL(nn.Cell):
    """``(loss, nll [T], dx [T, H], dhead)``: ``loss = sum_t w_t nll_t`` with ``nll_t = logsumexp_v(x_t W^T) -
    (x_t W^T)[label_t]``; hand-written backward.

    Inputs: the final normed hidden rows ``x [T, H]``, the head ``W [V, H]`` (a graph input, not a parameter of
    this cell, so a tied embedding gets the head's gradient added to its own), ``labels [T]`` int32 and the
    tokens' loss weights ``w [T]`` fp32 (a token of zero weight gets zero gradient). Only ``loss`` carries a
    gradient: ``nll`` is for statistics (evaluation, logs), and ``dx``/``dhead`` are the gradients of ``loss``
    computed in the forward, outputs only so the backward can scale them (fp32; ``dhead`` a scalar 0 when the head
    is frozen or no gradient is taken).

    ``rows``: tokens per chunk (static; the last chunk may be smaller). ``head_trainable=False`` (a frozen head,
    as in LoRA without the head in ``modules_to_save``) skips the head-gradient MatMuls; ``grads=False``
    (evaluation) skips every gradient MatMul, and the cell then cannot be differentiated. ``compute_dtype`` is
    the dtype of the MatMuls (the model's compute dtype under mixed precision, as the model's own head runs it);
    logits, softmax, reductions and the accumulated gradients are fp32 whatever it is.
    """

    def __init__(self, rows: int, head_trainable: bool = True, compute_dtype=ms.float32, grads: bool = True):
        super().__init__()
        if rows < 1:
            raise ValueError(f"TokenNLL: rows={rows} must be >= 1")
        self.rows = rows
        self.offsets_c = Tensor(np.arange(rows, dtype=np.int32))  # a chunk's rows, shifted per chunk
        self.grads = grads
        self.head_trainable = head_trainable and grads
        self.compute_dtype = compute_dtype
        self.matmul_nt = ops.MatMul(transpose_b=True)
        self.matmul_nn = ops.MatMul()
        self.matmul_tn = ops.MatMul(transpose_a=True)
        self.expand = kernels.expand()
        self.softmax_nll = kernels.softmax_nll()

    def construct(self, x_TH, head_VH, labels_T, weight_T):
        head_VH = head_VH.astype(self.compute_dtype)
        weight_T = weight_T.astype(ms.float32)
        if x_TH.shape[0] <= self.rows:
            nll_T, dx_TH, dhead_VH = self.chunk(x_TH, head_VH, labels_T, weight_T)
        else:
            nll_T, dx_TH, dhead_VH = self.chunked(x_TH, head_VH, labels_T, weight_T)
        return (nll_T * weight_T).sum(), nll_T, dx_TH, dhead_VH

    def chunk(self, x_cH, head_VH, labels_c, weight_c):
        """``(nll [c], dx [c, H] or 0, dhead [V, H] or 0)`` of one chunk; gradients of ``sum_c w_c nll_c``."""
        logits_cV = self.matmul_nt(x_cH.astype(self.compute_dtype), head_VH).astype(ms.float32)
        zero = ops.zeros((), ms.float32)
        if not self.grads:  # the loss alone, by the kernel's formula
            return logits_nll(logits_cV, labels_c, self.expand)[0], zero, zero
        # (softmax - onehot) * w while the chunk's softmax is at hand (kernels.softmax_nll).
        nll_c, dlogits_cV = self.softmax_nll(logits_cV, labels_c, weight_c)
        dlogits_cV = dlogits_cV.astype(self.compute_dtype)
        dx_cH = self.matmul_nn(dlogits_cV, head_VH).astype(ms.float32)
        if not self.head_trainable:
            return nll_c, dx_cH, zero
        return nll_c, dx_cH, self.matmul_tn(dlogits_cV, x_cH.astype(self.compute_dtype)).astype(ms.float32)

    def padded(self, x_TH, labels_T, weight_T):
        """``(chunks, x, labels, w)`` padded with zero rows (zero weight) to ``chunks * rows`` tokens."""
        tokens = x_TH.shape[0]
        chunks = (tokens + self.rows - 1) // self.rows
        pad = chunks * self.rows - tokens
        if pad == 0:
            return chunks, x_TH, labels_T, weight_T
        x_TH = ops.concat((x_TH, ops.zeros((pad, x_TH.shape[1]), x_TH.dtype)))
        labels_T = ops.concat((labels_T, ops.zeros((pad,), labels_T.dtype)))
        return chunks, x_TH, labels_T, ops.concat((weight_T, ops.zeros((pad,), ms.float32)))

    def chunked(self, x_TH, head_VH, labels_T, weight_T):
        """:meth:`chunk` over the chunks in a graph loop, ``dx`` scattered to its rows and ``dhead`` summed.

        A loop, not unrolled chunks: on CPU MindSpore 2.9 kept the ``[c, V]`` intermediates of every unrolled
        chunk that fed two ops, so peak memory grew with T as without chunks; a loop body's buffers are reused.
        """
        tokens = x_TH.shape[0]
        chunks, x_TH, labels_T, weight_T = self.padded(x_TH, labels_T, weight_T)
        nll_T = ops.zeros((chunks * self.rows,), ms.float32)
        dx_TH = ops.zeros(x_TH.shape, ms.float32) if self.grads else ops.zeros((), ms.float32)
        dhead_VH = ops.zeros(head_VH.shape, ms.float32) if self.head_trainable else ops.zeros((), ms.float32)
        offsets_c = self.offsets_c
        chunk = Tensor(0, ms.int32)
        while chunk < chunks:
            index_c = offsets_c + chunk * self.rows
            nll_c, dx_cH, dhead_c = self.chunk(
                ops.gather(x_TH, index_c, 0),
                head_VH,
                ops.gather(labels_T, index_c, 0),
                ops.gather(weight_T, index_c, 0),
            )
            nll_T = ops.tensor_scatter_update(nll_T, index_c.reshape(-1, 1), nll_c)
            if self.grads:
                dx_TH = ops.tensor_scatter_update(dx_TH, index_c.reshape(-1, 1), dx_cH)
            if self.head_trainable:
                dhead_VH = dhead_VH + dhead_c
            chunk = chunk + 1
        if self.grads:
            dx_TH = _leading(dx_TH, tokens)
        return _leading(nll_T, tokens), dx_TH, dhead_VH

    def bprop(self, x_TH, head_VH, labels_T, weight_T, out, dout):
        if not self.grads:
            raise ValueError("TokenNLL(grads=False) computes no gradient: build it with grads=True to train")
        scale = dout[0].astype(ms.float32)
        dx_TH = (out[2] * scale).astype(x_TH.dtype)
        dhead_VH = (out[3] * scale).astype(head_VH.dtype) if self.head_trainable else ops.zeros_like(head_VH)
        return dx_TH, dhead_VH, ops.zeros_like(labels_T), ops.zeros_like(weight_T)
