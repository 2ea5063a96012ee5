"""Grouped-query causal self-attention with document-aware masking.

Shape legend: B batch, S sequence (queries), K keys attended (S in training, cached + new when decoding),
H hidden, N query heads, G key/value heads, D head_dim.
Packed sequences carry ``doc_ids [B, S]``; a token attends only to earlier tokens of the
same document, so packing never leaks context across documents.
"""

import math

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindmoe.model.config import ModelConfig
from mindmoe.model.linear import Linear
from mindmoe.model.norm import RMSNorm
from mindmoe.model.rope import apply_rope

# Large negative instead of -inf: a fully masked row would otherwise give NaN in softmax.
MASK_VALUE = -1e9


def document_causal_mask(doc_ids_BS, num_heads: int = 1, chunks: int = 1):
    """Additive mask ``[B, num_heads, S, S]``: 0 where key j <= query i and both are in one document.

    The model builds it once per forward with every query head's copy (``num_heads``): adding a
    mask of the scores' own shape ran about 3x faster on CPU than broadcasting one over the heads,
    and every layer adds it. With ``chunks`` > 1 (see :func:`causal_chunks`) it is a tuple instead:
    chunk c's queries ``[c S/chunks, (c+1) S/chunks)`` against the keys ``[0, (c+1) S/chunks)`` they
    can see, ``[B, num_heads, S/chunks, (c+1) S/chunks]`` each."""
    seq_len = doc_ids_BS.shape[1]
    if chunks == 1:
        return _document_causal_mask(doc_ids_BS, doc_ids_BS, 0, num_heads)
    size = seq_len // chunks
    return tuple(
        _document_causal_mask(
            doc_ids_BS[:, c * size : (c + 1) * size], doc_ids_BS[:, : (c + 1) * size], c * size, num_heads
        )
        for c in range(chunks)
    )


def _document_causal_mask(query_doc_ids_BQ, key_doc_ids_BK, offset: int, num_heads: int):
    """``[B, num_heads, Q, K]`` mask of queries at positions ``offset + i`` against keys at ``j``."""
    query_pos_Q1 = (ops.arange(query_doc_ids_BQ.shape[1], dtype=ms.int32) + offset).expand_dims(1)
    causal_QK = ops.arange(key_doc_ids_BK.shape[1], dtype=ms.int32).expand_dims(0) <= query_pos_Q1
    same_doc_BQK = ops.equal(query_doc_ids_BQ.expand_dims(2), key_doc_ids_BK.expand_dims(1))
    allowed_BQK = ops.logical_and(same_doc_BQK, causal_QK)
    mask_BQK = ops.select(
        allowed_BQK, ops.zeros_like(same_doc_BQK, dtype=ms.float32), ops.fill(ms.float32, allowed_BQK.shape, MASK_VALUE)
    )
    mask_B1QK = ops.stop_gradient(mask_BQK).expand_dims(1)
    if num_heads == 1:
        return mask_B1QK
    return ops.tile(mask_B1QK, (1, num_heads, 1, 1))


def causal_chunks(seq_len: int) -> int:
    """Query chunks a training sequence's causal attention is computed in (1, 2 or 4).

    Chunk c attends only to the keys before its end, which skips the fully masked blocks above the
    diagonal: 4 chunks compute 10/16 of the score matrix, 2 chunks 3/4. Chunks keep at least 128
    queries so the BatchMatMuls stay large."""
    for chunks in (4, 2):
        if seq_len % chunks == 0 and seq_len // chunks >= 128:
            return chunks
    return 1


class AttentionCore(nn.Cell):
    """``softmax(q k^T * scale + mask) v`` for queries grouped by their key/value head, with a hand-written backward.

    Shapes: q ``[B, G, R, D]`` where the R = group x S rows of a key/value head are its query
    heads' positions (a contiguous reshape of ``[B, N, S, D]``), k/v ``[B, G, K, D]``, mask
    ``[B, G, R, K]`` fp32. Returns ``(out [B, G, R, D], probs [B, G, R, K])``; the probabilities
    are an output only so the backward can reuse them.

    Grouping the queries instead of repeating k/v per query head makes the gradients of k and v
    come out of the BatchMatMuls already summed over the group (the repeat's backward was a
    reduction over a 5-D tensor). The backward uses FlashAttention's identity
    ``sum_k p_rk dp_rk = dout_r . out_r`` (Dao et al. 2022): for fp32 the row term enters the
    ``dout v^T`` BatchMatMul as an extra column (``[dout, -delta] [v, 1]^T = dp - delta``), so
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

    def construct(self, q_BGRD, k_BGKD, v_BGKD, mask_BGRK):
        scores_BGRK = self.bmm_nt(q_BGRD * self.scale, k_BGKD).astype(ms.float32)
        probs_BGRK = ops.softmax(scores_BGRK + mask_BGRK, -1)
        out_BGRD = self.bmm_nn(probs_BGRK.astype(v_BGKD.dtype), v_BGKD)
        return out_BGRD, probs_BGRK

    def bprop(self, q_BGRD, k_BGKD, v_BGKD, mask_BGRK, out, dout):
        out_BGRD, probs_BGRK = out
        dout_BGRD = dout[0]
        head_dim = q_BGRD.shape[-1]
        rows_shape = out_BGRD.shape[:-1] + (1,)
        ones_D1 = ops.ones((head_dim, 1), ms.float32)
        products_XD = (dout_BGRD.astype(ms.float32) * out_BGRD.astype(ms.float32)).reshape(-1, head_dim)
        delta_BGR1 = self.row_dot(products_XD, ones_D1).reshape(rows_shape)
        if v_BGKD.dtype == ms.float32:
            ones_BGK1 = ops.ones(k_BGKD.shape[:-1] + (1,), ms.float32)
            dprobs_shifted_BGRK = self.bmm_nt(
                ops.concat((dout_BGRD, -delta_BGR1), -1), ops.concat((v_BGKD, ones_BGK1), -1)
            )
        else:
            dprobs_shifted_BGRK = self.bmm_nt(dout_BGRD, v_BGKD).astype(ms.float32) - delta_BGR1
        dscores_BGRK = (probs_BGRK * dprobs_shifted_BGRK).astype(q_BGRD.dtype)
        dq_BGRD = self.bmm_nn(dscores_BGRK, k_BGKD) * self.scale
        dk_BGKD = self.bmm_tn(dscores_BGRK, q_BGRD) * self.scale
        dv_BGKD = self.bmm_tn(probs_BGRK.astype(v_BGKD.dtype), dout_BGRD)
        return dq_BGRD, dk_BGKD, dv_BGKD, ops.zeros_like(mask_BGRK)


class Attention(nn.Cell):
    """q/k/v projections (optional bias) -> optional QK RMSNorm -> partial RoPE -> softmax(qk/sqrt(D)) v."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.resolved_head_dim
        self.interleaved = cfg.rope_interleaved
        self.scale = 1.0 / math.sqrt(self.head_dim)
        std = cfg.initializer_range
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * self.head_dim, cfg.qkv_bias, std, rng)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, cfg.qkv_bias, std, rng)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, cfg.qkv_bias, std, rng)
        self.o_proj = Linear(cfg.num_heads * self.head_dim, cfg.hidden_size, False, std, rng)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.core = AttentionCore(self.scale)

    def construct(self, x_BSH, cos, sin, mask):
        q_BNSD, k_BGSD, v_BGSD = self.project_qkv(x_BSH, cos, sin)
        return self.attend(q_BNSD, k_BGSD, v_BGSD, mask)

    def project_qkv(self, x_BSH, cos, sin):
        """Queries ``[B, N, S, D]`` and keys/values ``[B, G, S, D]`` after QK-norm and RoPE (what a KV cache holds)."""
        batch, seq_len, _ = x_BSH.shape
        q_BNSD = self.q_proj(x_BSH).reshape(batch, seq_len, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        k_BGSD = self.k_proj(x_BSH).reshape(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v_BGSD = self.v_proj(x_BSH).reshape(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if self.qk_norm:
            q_BNSD = self.q_norm(q_BNSD)
            k_BGSD = self.k_norm(k_BGSD)
        q_BNSD = apply_rope(q_BNSD, cos, sin, self.interleaved)
        k_BGSD = apply_rope(k_BGSD, cos, sin, self.interleaved)
        return q_BNSD, k_BGSD, v_BGSD

    def attend(self, q_BNSD, k_BGKD, v_BGKD, mask):
        """``softmax(q k^T / sqrt(D) + mask) v`` projected back to ``[B, S, H]``; K keys (K = S in training,
        cached + new ones when decoding). ``mask`` is ``[B, M, S, K]``, per query head (M = N) or shared
        (M = 1), or the causal chunks of :func:`document_causal_mask` (training, K = S)."""
        batch, _, seq_len, head_dim = q_BNSD.shape
        if isinstance(mask, tuple):
            chunks = len(mask)
            size = seq_len // chunks
            outs = []
            for c, mask_c in enumerate(mask):
                keys = (c + 1) * size
                # The last chunk sees every key: MindSpore 2.9's CPU StridedSlice ran a full-range
                # slice ~50x slower than a partial one, so it is not sliced at all.
                k_c = k_BGKD if c == chunks - 1 else k_BGKD[:, :, :keys]
                v_c = v_BGKD if c == chunks - 1 else v_BGKD[:, :, :keys]
                outs.append(self._attend_heads(q_BNSD[:, :, c * size : keys], k_c, v_c, mask_c))
            out_BNSD = ops.concat(outs, 2)
        else:
            out_BNSD = self._attend_heads(q_BNSD, k_BGKD, v_BGKD, mask)
        out_BSH = out_BNSD.transpose(0, 2, 1, 3).reshape(batch, seq_len, self.num_heads * head_dim)
        return self.o_proj(out_BSH)

    def _attend_heads(self, q_BNSD, k_BGKD, v_BGKD, mask_BMSK):
        """``[B, N, S, D]`` attention output of every query head."""
        batch, _, seq_len, head_dim = q_BNSD.shape
        num_keys = k_BGKD.shape[2]
        group = self.num_heads // self.num_kv_heads
        if mask_BMSK.shape[1] != self.num_heads:
            mask_BMSK = ops.tile(mask_BMSK, (1, self.num_heads, 1, 1))
        # Query head n uses key/value head n // group (HF repeat_kv order), so [B, N, S, D] is
        # [B, G, group * S, D] without moving data.
        rows = group * seq_len
        out_BGRD, _ = self.core(
            q_BNSD.reshape(batch, self.num_kv_heads, rows, head_dim),
            k_BGKD,
            v_BGKD,
            mask_BMSK.reshape(batch, self.num_kv_heads, rows, num_keys),
        )
        return out_BGRD.reshape(batch, self.num_heads, seq_len, head_dim)
