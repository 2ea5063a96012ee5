"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2 report, GLM-5): the lightning indexer, top-k selection and the
indexer's KL loss. The stages and keys are in :mod:`model.dsa_config`; :class:`model.mla.MLAttention` runs them.

Shape legend (docs/architecture.md): B batch, S queries, P key positions, H hidden, R ``q_lora_rank``,
I indexer heads, D ``index_head_dim``.

The indexer (HF ``GlmMoeDsaIndexer``; DeepSeek's V3.2 ``inference/model.py``) scores key s for query t as::

    q[t] = wq_b(q_resid[t])                [I, D]   q_resid = MLA's q_a_layernorm(q_a_proj(x)), R wide
    k[s] = LayerNorm(wk(x[s]))             [D]      one key shared by the indexer heads (weight and bias, eps 1e-6)
    q, k: RoPE on the first qk_rope_head_dim channels, pairs (2i, 2i+1) (GLM-5 interleaves; the rest pass)
    w[t] = weights_proj(x[t]) * I^-0.5     [I]
    I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s]) * D^-0.5

Each query keeps its ``min(index_topk, visible keys)`` best visible keys (earlier positions of its document) and
the main attention adds the mask value at every other key. A key whose score ties the k-th best is kept too, so
with exact ties a query may keep more than ``index_topk`` keys (transformers' ``torch.topk`` picks some of them;
random-valued scores do not tie).

The indexer's loss (the report's eq. 3 and 4): with ``p_t`` the main attention's probabilities summed over its
heads and L1-normalised (a target: no gradient flows through it),

    dense_warmup:  L_I = mean_t KL(p_t || softmax(I_t))                      over every visible key
    sparse:        L_I = mean_t KL(p_t[S_t] || softmax(I_t[S_t]))            over the selected keys S_t

(the report sums over t; a mean keeps the coefficient independent of the batch). The indexer reads the layer's
input and ``q_resid`` through ``stop_gradient``: it learns from its loss only, and its loss trains nothing else.
The selection is a comparison, so the language-model loss has no gradient into the indexer either.
"""

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops

from mindmoe.model import kernels
from mindmoe.model.attention import MASK_VALUE
from mindmoe.model.config import ModelConfig
from mindmoe.model.deferred_init import constant
from mindmoe.model.linear import Linear
from mindmoe.model.rope import apply_rope

#: Epsilon of the indexer key's LayerNorm (HF ``GlmMoeDsaIndexer.k_norm``).
INDEXER_NORM_EPS = 1e-6
#: Added to the scores of keys a query does not keep: the attention's own mask value.
UNSELECTED = MASK_VALUE


class LayerNorm(nn.Cell):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis, in fp32 (biased variance, as torch)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = Parameter(constant((dim,), 1.0), name="weight")
        self.bias = Parameter(constant((dim,), 0.0), name="bias")
        self.eps = eps

    def construct(self, x):
        x32 = x.astype(ms.float32)
        centred = x32 - x32.mean(-1, keep_dims=True)
        variance = (centred * centred).mean(-1, keep_dims=True)
        return (centred * ops.rsqrt(variance + self.eps) * self.weight + self.bias).astype(x.dtype)


class LightningIndexer(nn.Cell):
    """``construct(x [B, S, H], q_resid [B, S, R], cos, sin) -> scores [B, S, P]`` fp32 (P = S, unmasked); the
    HF ``GlmMoeDsaIndexer`` parameters ``wq_b``, ``wk``, ``k_norm`` (weight, bias), ``weights_proj``."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        dsa, std = cfg.dsa, cfg.initializer_range
        self.n_heads = dsa.index_n_heads
        self.head_dim = dsa.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, False, std, rng)
        self.wk = Linear(cfg.hidden_size, self.head_dim, False, std, rng)
        self.k_norm = LayerNorm(self.head_dim, INDEXER_NORM_EPS)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, False, std, rng)
        self.score_scale = 1.0 / math.sqrt(self.head_dim)
        self.head_scale = 1.0 / math.sqrt(self.n_heads)
        self.rotate = kernels.rope(True)
        self.bmm_nt = ops.BatchMatMul(transpose_b=True)

    def queries_keys(self, x_BSH, q_resid_BSR, cos, sin):
        """RoPE'd queries ``[B, I, S, D]`` and keys ``[B, 1, S, D]`` (what a decode cache keeps of the keys)."""
        batch, seq_len, _ = x_BSH.shape
        q_BISD = self.wq_b(q_resid_BSR).reshape(batch, seq_len, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k_B1SD = self.k_norm(self.wk(x_BSH)).expand_dims(1)
        return apply_rope(q_BISD, cos, sin, True, self.rotate), apply_rope(k_B1SD, cos, sin, True, self.rotate)

    def head_weights(self, x_BSH):
        """``w [B, I, S, 1]``: each query's weight of each indexer head."""
        return (self.weights_proj(x_BSH) * self.head_scale).transpose(0, 2, 1).expand_dims(-1)

    def scores(self, q_BISD, k_B1PD, w_BIS1):
        """``I [B, S, P]``: the head-weighted sum of ReLU'd query-key products."""
        relu_BISP = ops.relu(self.bmm_nt(q_BISD, ops.broadcast_to(k_B1PD, q_BISD.shape[:2] + k_B1PD.shape[2:])))
        return (relu_BISP * self.score_scale * w_BIS1).sum(1)

    def query_scores(self, x_BSH, q_BISD, k_B1PD):
        """``I [B, S, P]`` fp32 of the queries ``q`` of the inputs ``x`` (whose head weights they take) against the
        keys ``k``: every key of the sequence in training, the cached keys for one new query when decoding."""
        return self.scores(q_BISD.astype(ms.float32), k_B1PD.astype(ms.float32), self.head_weights(x_BSH))

    def scores_and_keys(self, x_BSH, q_resid_BSR, cos, sin):
        """``(scores [B, S, S] fp32, keys [B, 1, S, D])``: :meth:`construct` and what a decode cache keeps."""
        q_BISD, k_B1SD = self.queries_keys(x_BSH, q_resid_BSR, cos, sin)
        return self.query_scores(x_BSH, q_BISD, k_B1SD), k_B1SD

    def construct(self, x_BSH, q_resid_BSR, cos, sin):
        return self.scores_and_keys(x_BSH, q_resid_BSR, cos, sin)[0]


def select_top_k(scores_BSP, visible_BSP, topk: int):
    """Additive mask ``[B, S, P]`` fp32: 0 at the keys each query keeps, :data:`UNSELECTED` elsewhere.

    ``visible`` is the document-causal mask (0 where visible, a large negative value elsewhere); a query keeps
    its ``min(topk, visible keys)`` best visible keys (keys tied with the last one kept are kept too). ``S`` may be 1
    (a decode step ranks the cache for its one query)."""
    ranked_BSP = scores_BSP + visible_BSP
    if ops.is_sequence_value_unknown(ranked_BSP.shape):
        # A graph for any P (the serving graphs): no branch on P, which MindSpore 2.9 cannot run from a MindIR file
        # once several layers hold it ("The actor already exists"). topk floor values below every score join the
        # ranking, so a query that sees fewer keys keeps them all.
        floor_BSK = ops.zeros_like(ranked_BSP[..., :1]) + ops.full((topk,), float("-inf"), dtype=ranked_BSP.dtype)
        kth_BS1 = ops.topk(ops.concat((ranked_BSP, floor_BSK), -1), topk)[0][..., topk - 1 :]
    elif topk >= ranked_BSP.shape[-1]:
        return ops.zeros_like(ranked_BSP)
    else:
        kth_BS1 = ops.topk(ranked_BSP, topk)[0][..., topk - 1 :]
    keep_BSP = ranked_BSP >= kth_BS1
    return ops.stop_gradient(ops.select(keep_BSP, ops.zeros_like(ranked_BSP), ops.full_like(ranked_BSP, UNSELECTED)))


def indexer_kl(probs_BNSP, scores_BSP, mask_BSP):
    """Mean over queries of ``KL(p || softmax(scores + mask))``, ``p`` = ``probs`` summed over heads, L1-normalised,
    without gradient; ``mask`` holds the visible (and, sparse, selected) keys as 0 and the rest as large negatives,
    where ``p`` is 0."""
    p_BSP = ops.stop_gradient(probs_BNSP.sum(1))
    p_BSP = p_BSP / ops.maximum(p_BSP.sum(-1, keepdims=True), 1e-30)
    log_q_BSP = ops.log_softmax(scores_BSP + mask_BSP, -1)
    log_p_BSP = ops.log(ops.maximum(p_BSP, 1e-30))
    return (p_BSP * (log_p_BSP - log_q_BSP)).sum(-1).mean()
