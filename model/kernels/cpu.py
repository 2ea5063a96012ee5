"""CPU implementations of the kernel functions (also what every other device runs until it has its own).

Shape legend (docs/architecture.md): Z rows of a flattened input, H the normalised axis (the hidden
size, or the head dim D for QK-norm), B batch, G key/value heads, Q the query rows of one key/value
head (its query heads' positions of one attention block), P key positions, D head dim, I SwiGLU width.
"""

import mindspore as ms
from mindspore import nn, ops
from mindspore.ops import functional as F


class RowRMSNormalize(nn.Cell):
    """``x * rsqrt(mean(x^2, -1) + eps) * weight`` on a 2-D fp32 ``[Z, H]``, with a hand-written backward.

    Both row reductions are MatMuls with a ones column and the weight gradient a column sum of a
    2-D tensor: on CPU, MindSpore 2.9's ReduceMean/ReduceSum over an axis of a 3-D or 4-D tensor ran
    about 8x slower than over a 2-D one and than these MatMuls, and the automatic backward of the
    plain formula took four such reductions per norm. (A ``[1, Z] x [Z, H]`` MatMul for the column
    sum is as fast, but with it two data-parallel workers no longer reproduced the single process's
    losses to 1e-5.) With ``xhat = x r``, ``r = rsqrt(mean(x^2) + eps)``
    and ``g = dy * weight``::

        dx      = r * (g - xhat * mean(g * xhat, -1))
        dweight = sum_rows(dy * xhat)

    Every ``[Z, 1]`` and ``[H]`` operand is broadcast to ``[Z, H]`` before its multiplication (:func:`expand`:
    about 1 GiB less over the norms of the tiny model's 8k-token step). The products are the same.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.inv_dim = 1.0 / dim
        self.row_dot = ops.MatMul()

    def inverse_rms(self, x_ZH):
        ones_H1 = ops.ones((x_ZH.shape[1], 1), ms.float32)
        return ops.rsqrt(self.row_dot(x_ZH * x_ZH, ones_H1) * self.inv_dim + self.eps)

    def construct(self, x_ZH, weight_H):
        shape = x_ZH.shape
        return x_ZH * expand(self.inverse_rms(x_ZH), shape) * expand(weight_H, shape)

    def bprop(self, x_ZH, weight_H, out_ZH, dout_ZH):
        shape = x_ZH.shape
        inv_rms_ZH = expand(self.inverse_rms(x_ZH), shape)
        xhat_ZH = x_ZH * inv_rms_ZH
        dweight_H = (dout_ZH * xhat_ZH).sum(0)
        g_ZH = dout_ZH * expand(weight_H, shape)
        ones_H1 = ops.ones((x_ZH.shape[1], 1), ms.float32)
        mean_Z1 = self.row_dot(g_ZH * xhat_ZH, ones_H1) * self.inv_dim
        return (g_ZH - xhat_ZH * expand(mean_Z1, shape)) * inv_rms_ZH, dweight_H


class GroupedAttentionCore(nn.Cell):
    """``softmax(q k^T * scale + mask) v`` for queries grouped by their key/value head, with a hand-written backward.

    Shapes: q ``[B, G, Q, D]`` where the Q = group x S rows of a key/value head are its query
    heads' positions (a contiguous reshape of ``[B, N, S, D]``), k/v ``[B, G, P, D]`` (v may be narrower), mask
    ``[B, G, Q, P]`` fp32. Returns ``(out [B, G, Q, D], probs [B, G, Q, P])``; the probabilities
    are an output only so the backward can reuse them.

    Grouping the queries instead of repeating k/v per query head makes the gradients of k and v
    come out of the BatchMatMuls already summed over the group (the repeat's backward was a
    reduction over a 5-D tensor). The backward uses FlashAttention's identity
    ``sum_p prob_qp dprob_qp = dout_q . out_q`` (Dao et al. 2022): for fp32 the row term enters the
    ``dout v^T`` BatchMatMul as an extra column (``[dout, -delta] [v, 1]^T = dprob - delta``), so
    the softmax backward costs one elementwise pass over the scores instead of four. Scores,
    softmax and the score gradients are fp32 whatever the dtype of q/k/v.
    """

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        self.bmm_nt = ops.BatchMatMul(transpose_b=True)
        self.bmm_nn = ops.BatchMatMul()
        self.bmm_tn = ops.BatchMatMul(transpose_a=True)
        self.row_dot = ops.MatMul()

    def construct(self, q_BGQD, k_BGPD, v_BGPD, mask_BGQP):
        scores_BGQP = self.bmm_nt(q_BGQD * self.scale, k_BGPD).astype(ms.float32)
        probs_BGQP = ops.softmax(scores_BGQP + mask_BGQP, -1)
        out_BGQD = self.bmm_nn(probs_BGQP.astype(v_BGPD.dtype), v_BGPD)
        return out_BGQD, probs_BGQP

    def bprop(self, q_BGQD, k_BGPD, v_BGPD, mask_BGQP, out, dout):
        out_BGQD, probs_BGQP = out
        dout_BGQD = dout[0].astype(v_BGPD.dtype)
        value_dim = out_BGQD.shape[-1]  # MLA's values are narrower than its queries and keys
        rows_shape = out_BGQD.shape[:-1] + (1,)
        ones_D1 = ops.ones((value_dim, 1), ms.float32)
        products_ZD = (dout_BGQD.astype(ms.float32) * out_BGQD.astype(ms.float32)).reshape(-1, value_dim)
        delta_BGQ1 = self.row_dot(products_ZD, ones_D1).reshape(rows_shape)
        if v_BGPD.dtype == ms.float32:
            ones_BGP1 = ops.ones(k_BGPD.shape[:-1] + (1,), ms.float32)
            dprobs_shifted_BGQP = self.bmm_nt(
                ops.concat((dout_BGQD, -delta_BGQ1), -1), ops.concat((v_BGPD, ones_BGP1), -1)
            )
        else:
            dprobs_shifted_BGQP = self.bmm_nt(dout_BGQD, v_BGPD).astype(ms.float32) - delta_BGQ1
        dscores_BGQP = (probs_BGQP * dprobs_shifted_BGQP).astype(q_BGQD.dtype)
        dq_BGQD = self.bmm_nn(dscores_BGQP, k_BGPD) * self.scale
        dk_BGPD = self.bmm_tn(dscores_BGQP, q_BGQD) * self.scale
        dv_BGPD = self.bmm_tn(probs_BGQP.astype(v_BGPD.dtype), dout_BGQD)
        return dq_BGQD, dk_BGPD, dv_BGPD, ops.zeros_like(mask_BGQP)


_BMM = ops.BatchMatMul()


def gather_source_rows(x_TH, source_X):
    """``[X, H]``: row ``source_X[i]`` of ``x`` for each i, zeros where ``source_X[i] == T`` (no source)."""
    x_padded = ops.concat((x_TH, ops.zeros((1, x_TH.shape[1]), x_TH.dtype)), 0)
    return ops.gather(x_padded, source_X, 0)


def weighted_rows(y_XH, row_A, weight_TK):
    """``out_t = sum_k weight_tk * y[row(t, k)]`` for the rows of a 2-D buffer (every row index below X)."""
    hidden = y_XH.shape[-1]
    num_tokens, top_k = weight_TK.shape
    y_TKH = ops.gather(y_XH, row_A, 0).reshape(num_tokens, top_k, hidden)
    # [1, K] x [K, H] per token: as a batched MatMul this ran (forward + backward) 2x faster on CPU
    # than a multiply and a ReduceSum over K, whose backward sums over H.
    return _BMM(weight_TK.astype(y_TKH.dtype).expand_dims(1), y_TKH).squeeze(1)


def combine_slot_rows(y_XH, slot_A, weight_TK):
    """``out_t = sum_k weight_tk * y[slot(t, k)]``; slot X (a dropped assignment) adds nothing."""
    y_padded = ops.concat((y_XH, ops.zeros((1, y_XH.shape[-1]), y_XH.dtype)), 0)
    return weighted_rows(y_padded, slot_A, weight_TK)


_ROW_DOTS = ops.BatchMatMul(transpose_b=True)


def row_squares(x_Rn, piece):
    """``[R]`` fp32: each row's sum of squares, as ``n / piece`` dot products of ``piece`` elements (a batched
    ``[1, p] x [p, 1]`` MatMul) and their sum; ``piece`` divides ``n`` (None: one dot product per row). On CPU,
    MindSpore 2.9's ReduceSum of a squared ``[8192, 512]`` gradient ran 4-5x slower than one dot product of it."""
    rows = x_Rn.shape[0]
    x_Rn = x_Rn.astype(ms.float32)
    pieces_R1P = x_Rn.reshape(rows, 1, -1) if piece is None else x_Rn.reshape(-1, 1, piece)
    return _ROW_DOTS(pieces_R1P, pieces_R1P).reshape(rows, -1).sum(1)


def logits_nll(logits_cV, labels_c, expand):
    """``(nll [c], exp [c, V], sum [c, 1])``: ``nll_t = logsumexp(logits_t) - logits_t[label_t]`` by the row max,
    and the exponentials shifted by it with their row sums (what the gradient scales). ``expand``: the device's
    ``kernels.expand``."""
    max_c1 = logits_cV.max(-1, keepdims=True)
    exp_cV = ops.exp(logits_cV - expand(max_c1, logits_cV.shape))
    sum_c1 = exp_cV.sum(-1, keepdims=True)
    label_c = ops.gather_elements(logits_cV, 1, labels_c.reshape(-1, 1)).reshape(-1)
    return (max_c1 + ops.log(sum_c1)).reshape(-1) - label_c, exp_cV, sum_c1


class SoftmaxNLL(nn.Cell):
    """``(logits [c, V] fp32, labels [c] int32, weight [c] fp32) -> (nll [c], dlogits [c, V])``: ``nll_t =
    logsumexp(logits_t) - logits_t[label_t]`` and ``dlogits = (softmax(logits_t) - onehot(label_t)) * w_t``, the LM
    loss's per-token loss and weighted logit gradient (``model/lm_loss.py``). The exponentials are scaled by ``w`` over
    their row sum and ``w`` is taken off at each label by a scatter of c values (instead of a ``[c, V]`` one-hot and
    its subtraction: 9 against 19-24 ms at ``[1024, 8192]``). ``expand``: the device's ``kernels.expand``."""

    def __init__(self, expand):
        super().__init__()
        self.expand = expand

    def construct(self, logits_cV, labels_c, weight_c):
        nll_c, exp_cV, sum_c1 = logits_nll(logits_cV, labels_c, self.expand)
        factor_c1 = weight_c.reshape(-1, 1) / sum_c1
        probs_cV = exp_cV * self.expand(factor_c1, exp_cV.shape)
        at_label_c2 = ops.stack((ops.arange(0, labels_c.shape[0], dtype=ms.int32), labels_c), 1)
        return nll_c, ops.tensor_scatter_add(probs_cV, at_label_c2, -weight_c)


def swiglu(gate_ZI, up_ZI):
    """``silu(gate) * up``, the SwiGLU activation (Shazeer 2020), on any matching shapes."""
    return ops.silu(gate_ZI) * up_ZI


def expand(x, shape):
    """``x`` broadcast to ``shape`` before an element-wise op with a tensor of that shape: MindSpore 2.9's CPU
    element-wise kernels keep 16 bytes per output element for the compiled graph's life when they broadcast an
    operand themselves (52 MiB per multiplication on ``[6528, 512]``), none with same-shape operands.

    A static ``shape`` is reached with ``Tile``: the same values and memory as ``BroadcastTo``, which on CPU copied
    at about 1.6 GB/s (3.9 ms for ``[2048, 1] -> [2048, 512]`` against 0.5 ms tiled; 9.5 % of the benchmark's
    dense step). A dynamic one (a serving graph's length) keeps ``BroadcastTo``, which takes it as it is."""
    multiples = ()
    padded = (1,) * (len(shape) - x.ndim) + x.shape
    for i in range(len(shape)):
        if not F.isconstant(shape[i]):
            return ops.broadcast_to(x, shape)
        multiples = multiples + ((shape[i] if padded[i] == 1 else 1),)
    if x.ndim < len(shape):
        x = x.reshape(padded)
    return ops.tile(x, multiples)
