"""Grouped-query causal self-attention with document-aware masking.

Shape legend: B batch, S sequence (queries), K keys attended (S in training, cached + new when decoding),
H hidden, N query heads, G key/value heads, D head_dim.
Packed sequences carry ``doc_ids [B, S]``; a token attends only to earlier tokens of the
same document, so packing never leaks context across documents.
"""
import math

import numpy as np
from mindspore import nn, ops
import mindspore as ms

from model.config import ModelConfig
from model.linear import Linear
from model.norm import RMSNorm
from model.rope import apply_rope

# Large negative instead of -inf: a fully masked row would otherwise give NaN in softmax.
MASK_VALUE = -1e9


def document_causal_mask(doc_ids_BS):
    """Additive mask ``[B, 1, S, S]``: 0 where key j <= query i and both are in one document."""
    seq_len = doc_ids_BS.shape[1]
    causal_SS = ops.tril(ops.ones((seq_len, seq_len), ms.bool_))
    same_doc_BSS = ops.equal(doc_ids_BS.expand_dims(2), doc_ids_BS.expand_dims(1))
    allowed_BSS = ops.logical_and(same_doc_BSS, causal_SS)
    mask_BSS = ops.select(allowed_BSS, ops.zeros_like(same_doc_BSS, dtype=ms.float32),
                          ops.fill(ms.float32, allowed_BSS.shape, MASK_VALUE))
    return mask_BSS.expand_dims(1)


class MaskedSoftmax(nn.Cell):
    """``softmax(scores + mask, -1)`` over ``[B, N, S, S]``, with a hand-written backward.

    The backward is the usual ``p * (dp - sum(dp * p, -1))``, but the row sum is a MatMul with
    a ones column: MindSpore 2.9's CPU ReduceSum over the last axis ran ~5x slower than that
    MatMul and than the whole softmax forward, and made up most of attention's non-MatMul time.
    The mask is a constant of the input ids, so it gets no gradient (the default backward also
    reduced the [B, N, S, S] gradient onto the [B, 1, S, S] mask).
    """

    def __init__(self):
        super().__init__()
        self.row_sum = ops.MatMul()

    def construct(self, scores_BNSS, mask_B1SS):
        return ops.softmax(scores_BNSS + mask_B1SS, -1)

    def bprop(self, scores_BNSS, mask_B1SS, probs_BNSS, dprobs_BNSS):
        seq_len = probs_BNSS.shape[-1]
        weighted_RS = (dprobs_BNSS * probs_BNSS).reshape(-1, seq_len)
        ones_S1 = ops.ones((seq_len, 1), weighted_RS.dtype)
        dot_BNS1 = self.row_sum(weighted_RS, ones_S1).reshape(probs_BNSS.shape[:-1] + (1,))
        return probs_BNSS * (dprobs_BNSS - dot_BNS1), ops.zeros_like(mask_B1SS)


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
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)
        self.bmm_pv = ops.BatchMatMul()
        self.masked_softmax = MaskedSoftmax()

    def construct(self, x_BSH, cos, sin, mask_B1SS):
        q_BNSD, k_BGSD, v_BGSD = self.project_qkv(x_BSH, cos, sin)
        return self.attend(q_BNSD, k_BGSD, v_BGSD, mask_B1SS)

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

    def attend(self, q_BNSD, k_BGKD, v_BGKD, mask_B1SK):
        """``softmax(q k^T / sqrt(D) + mask) v`` projected back to ``[B, S, H]``; K keys (K = S in training,
        cached + new ones when decoding)."""
        batch, _, seq_len, _ = q_BNSD.shape
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            # Query head n uses key/value head n // group (HF repeat_kv order).
            k_BGKD = ops.repeat_interleave(k_BGKD, group, 1)
            v_BGKD = ops.repeat_interleave(v_BGKD, group, 1)
        # Scaling q ([B, N, S, D]) instead of the scores ([B, N, S, K]) saves an S x K pass each way.
        scores_BNSK = self.bmm_qk(q_BNSD * self.scale, k_BGKD).astype(ms.float32)
        probs_BNSK = self.masked_softmax(scores_BNSK, mask_B1SK).astype(v_BGKD.dtype)
        out_BNSD = self.bmm_pv(probs_BNSK, v_BGKD)
        out_BSH = out_BNSD.transpose(0, 2, 1, 3).reshape(batch, seq_len, self.num_heads * self.head_dim)
        return self.o_proj(out_BSH)
