"""Multi-head latent attention (MLA; DeepSeek-V2 arXiv 2405.04434 §2.1, DeepSeek-V3; HF ``deepseek_v3``).

Queries and keys/values pass through low-rank latents; every head gets its own no-RoPE key and value from
the key/value latent, and one RoPE key per token is shared by all heads::

    q             = q_b_proj(RMSNorm(q_a_proj(x)))      or q_proj(x) when q_lora_rank is null
    c, k_rope     = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim])
    k_nope, v     = split(kv_b_proj(RMSNorm(c)), per head [qk_nope_head_dim, v_head_dim])
    q = [q_nope, RoPE(q_rope)], k = [k_nope, RoPE(k_rope) for every head]
    o             = o_proj(softmax(q k^T * scale + mask) v),  scale = qk_head_dim^-0.5 * yarn_softmax_scale

``rope_interleaved`` pairs channels (2i, 2i+1) of the RoPE slice (DeepSeek's released weights; HF's
``rope_interleave``). HF implements it by de-interleaving q and k and then rotating halves; rotating the
pairs in place, as here, gives the same channels in another order, applied alike to q and k, so every
score is the same. Shape legend (docs/architecture.md): B batch, S sequence, P key positions,
H hidden, N heads, D per-head width (q/k: ``qk_head_dim``; v: ``v_head_dim``).
"""

import math

import numpy as np
from mindspore import ops

from mindmoe.model import attention, kernels
from mindmoe.model.attention import AttentionHeads
from mindmoe.model.config import ModelConfig
from mindmoe.model.dsa import LightningIndexer, indexer_kl, select_top_k
from mindmoe.model.dsa_config import DSA_STAGES
from mindmoe.model.lora.layers import NO_LORA, AdapterScope, projection
from mindmoe.model.norm import RMSNorm
from mindmoe.model.rope import apply_rope
from mindmoe.model.rope_scaling import yarn_softmax_scale

#: Epsilon of the two latent RMSNorms (``q_a_layernorm``, ``kv_a_layernorm``): HF ``DeepseekV3Attention`` builds
#: them with its norm's default, never with ``rms_norm_eps`` (GLM-4.7-Flash has ``rms_norm_eps=1e-5``).
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """``qk_head_dim^-0.5``, times the YaRN ``mscale_all_dim`` factor squared when set (HF 4.57.1)."""
    return yarn_softmax_scale(cfg.rope_scaling) / math.sqrt(cfg.qk_head_dim)


class MLAttention(AttentionHeads):
    """MLA with the projections HF ``DeepseekV3Attention`` names (no biases: ``attention_bias`` is false in
    every released DeepSeek-V2/V3 checkpoint). The softmax, masks and ``o_proj`` are :class:`AttentionHeads`',
    with as many key/value heads as query heads."""

    def __init__(
        self, cfg: ModelConfig, rng: np.random.Generator, lora: AdapterScope = NO_LORA, dsa_stage: str = "sparse"
    ):
        super().__init__(cfg.num_heads, cfg.num_heads, mla_softmax_scale(cfg))
        hidden, heads, std = cfg.hidden_size, cfg.num_heads, cfg.initializer_range
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.qk_head_dim = cfg.qk_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.interleaved = cfg.rope_interleaved
        # Creation order is the checkpoint order (model.param_count._mla_attention).
        if cfg.q_lora_rank is None:
            self.q_proj = projection(hidden, heads * self.qk_head_dim, False, std, rng, lora, "q_proj")
        else:
            self.q_a_proj = projection(hidden, cfg.q_lora_rank, False, std, rng, lora, "q_a_proj")
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = projection(cfg.q_lora_rank, heads * self.qk_head_dim, False, std, rng, lora, "q_b_proj")
        self.kv_a_proj_with_mqa = projection(
            hidden, self.kv_lora_rank + self.qk_rope_head_dim, False, std, rng, lora, "kv_a_proj_with_mqa"
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = projection(
            self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim), False, std, rng, lora, "kv_b_proj"
        )
        self.o_proj = projection(heads * self.v_head_dim, hidden, False, std, rng, lora, "o_proj")
        self.rotate = kernels.rope(cfg.rope_interleaved)
        # DSA (model/dsa.py): built last, so a model without it draws the same initial values.
        self.indexed = cfg.dsa.enabled
        if self.indexed:
            self.indexer = LightningIndexer(cfg, rng)
            # Training past attention.BLOCK_SIZE positions (model/kernels/cpu_dsa.py).
            sparse = dsa_stage == "sparse"
            self.indexed_blockwise = kernels.indexed_attention(
                self.scale, self.indexer.score_scale, cfg.dsa.index_topk, attention.BLOCK_SIZE, sparse
            )
        self.index_topk = cfg.dsa.index_topk
        self.dsa_stage = dsa_stage
        self.dsa_active = self.indexed and dsa_stage != "off"

    def queries(self, x_BSH):
        """``[B, S, N * qk_head_dim]``, each head's no-RoPE channels first."""
        if self.q_lora_rank is None:
            return self.q_proj(x_BSH)
        return self.q_b_proj(self.query_residual(x_BSH))

    def query_residual(self, x_BSH):
        """The compressed query ``q_a_layernorm(q_a_proj(x))`` ``[B, S, q_lora_rank]``, which DSA's indexer reads."""
        return self.q_a_layernorm(self.q_a_proj(x_BSH))

    def rope_queries(self, x_BSH, cos, sin):
        """Queries ``[B, N, S, qk_head_dim]``: each head's no-RoPE channels, then its RoPE'd channels."""
        return self.rope_heads(self.queries(x_BSH), cos, sin)

    def rope_heads(self, q_BSX, cos, sin):
        """``[B, S, N * qk_head_dim]`` -> ``[B, N, S, qk_head_dim]`` with RoPE on each head's last channels."""
        batch, seq_len, _ = q_BSX.shape
        nope = self.qk_nope_head_dim
        q_BNSD = q_BSX.reshape(batch, seq_len, self.num_heads, self.qk_head_dim).transpose(0, 2, 1, 3)
        # Splits, not slices: a split's gradient is one concat (model.rope.apply_rope).
        q_nope_BNSD, q_rope_BNSD = ops.split(q_BNSD, (nope, self.qk_head_dim - nope), -1)
        return ops.concat((q_nope_BNSD, apply_rope(q_rope_BNSD, cos, sin, self.interleaved, self.rotate)), -1)

    def indexed_attention(self, x_BSH, cos, sin, mask):
        """DSA training attention (model/dsa.py): ``(output [B, S, H], the indexer's KL loss)``. ``mask`` is the full
        document-causal mask ``[B, N, S, S]``, or the document ids ``[B, S]`` for the blockwise kernel
        (:func:`model.attention.training_attention_masks`, past ``BLOCK_SIZE`` positions); stage ``sparse`` adds the
        top-k selection to it, ``dense_warmup`` attends to every visible key. Both stages return the KL of the
        indexer against the attention, the mean over the queries."""
        if mask.ndim == 2:
            return self.blockwise_indexed_attention(x_BSH, cos, sin, mask)
        out_BSH, loss_inputs, _ = self.indexed_attention_parts(x_BSH, cos, sin, mask)
        return out_BSH, indexer_kl(*loss_inputs)

    def blockwise_indexed_attention(self, x_BSH, cos, sin, doc_ids_BS):
        """:meth:`indexed_attention` through the ``indexed_attention`` kernel: no ``[S, S]`` tensor."""
        batch, seq_len, _ = x_BSH.shape
        q_resid_BSR = self.query_residual(x_BSH)
        q_BNSD = self.rope_heads(self.q_b_proj(q_resid_BSR), cos, sin)
        k_BNSD, v_BNSE = self.expand_latent(*self.latent_kv(x_BSH, cos, sin))
        x_detached_BSH = ops.stop_gradient(x_BSH)
        iq_BISC, ik_B1SC = self.indexer.queries_keys(x_detached_BSH, ops.stop_gradient(q_resid_BSR), cos, sin)
        w_BIS1 = self.indexer.head_weights(x_detached_BSH)
        out_BNSE, kl_sum = self.indexed_blockwise(q_BNSD, k_BNSD, v_BNSE, doc_ids_BS, iq_BISC, ik_B1SC, w_BIS1)
        out_BSH = out_BNSE.transpose(0, 2, 1, 3).reshape(batch, seq_len, self.num_heads * self.v_head_dim)
        return self.o_proj(out_BSH), kl_sum / (batch * seq_len)

    def indexed_attention_parts(self, x_BSH, cos, sin, mask_BNSP):
        """:meth:`indexed_attention` before its loss: ``(output [B, S, H], the loss's inputs (probabilities
        [B, N, S, P], indexer scores [B, S, P], the mask of the keys it is taken over [B, S, P]), what a decode
        cache keeps per token (c_kv [B, S, kv_lora_rank], k_rope [B, 1, S, qk_rope_head_dim], the indexer's
        keys [B, 1, S, index_head_dim]))``; the serving prefill (model/export/mla_serving.py) keeps the last."""
        batch, seq_len, _ = x_BSH.shape
        q_resid_BSR = self.query_residual(x_BSH)
        q_BNSD = self.rope_heads(self.q_b_proj(q_resid_BSR), cos, sin)
        c_kv_BSR, k_rope_B1SY = self.latent_kv(x_BSH, cos, sin)
        k_BNSD, v_BNSD = self.expand_latent(c_kv_BSR, k_rope_B1SY)
        if mask_BNSP.shape[1] != self.num_heads:
            mask_BNSP = ops.tile(mask_BNSP, (1, self.num_heads, 1, 1))
        visible_BSP = mask_BNSP[:, 0]
        scores_BSP, index_k_B1SD = self.indexer.scores_and_keys(
            ops.stop_gradient(x_BSH), ops.stop_gradient(q_resid_BSR), cos, sin
        )
        if self.dsa_stage == "sparse":
            selected_BSP = select_top_k(ops.stop_gradient(scores_BSP), visible_BSP, self.index_topk)
            mask_BNSP = mask_BNSP + selected_BSP.expand_dims(1)
            visible_BSP = visible_BSP + selected_BSP
        out_BNSD, probs_BNSP = self.core(q_BNSD, k_BNSD, v_BNSD, mask_BNSP)
        out_BSH = out_BNSD.transpose(0, 2, 1, 3).reshape(batch, seq_len, self.num_heads * self.v_head_dim)
        cache = (c_kv_BSR, k_rope_B1SY, index_k_B1SD)
        return self.o_proj(out_BSH), (probs_BNSP, scores_BSP, visible_BSP), cache

    def latent_kv(self, x_BSH, cos, sin):
        """What an MLA cache keeps per token: the normalised latent ``[B, S, kv_lora_rank]`` and the one
        RoPE'd key shared by all heads ``[B, 1, S, qk_rope_head_dim]``."""
        latent_BSD = self.kv_a_proj_with_mqa(x_BSH)
        c_kv_BSD, k_rope_BSD = ops.split(latent_BSD, (self.kv_lora_rank, self.qk_rope_head_dim), -1)
        k_rope_B1SD = apply_rope(k_rope_BSD.expand_dims(1), cos, sin, self.interleaved, self.rotate)
        return self.kv_a_layernorm(c_kv_BSD), k_rope_B1SD

    def expand_latent(self, c_kv_BSD, k_rope_B1SD):
        """Per-head keys ``[B, N, S, qk_head_dim]`` and values ``[B, N, S, v_head_dim]`` of :meth:`latent_kv`."""
        batch, seq_len, _ = c_kv_BSD.shape
        heads, nope = self.num_heads, self.qk_nope_head_dim
        kv_BNSD = self.kv_b_proj(c_kv_BSD).reshape(batch, seq_len, heads, nope + self.v_head_dim).transpose(0, 2, 1, 3)
        k_rope_BNSD = ops.broadcast_to(k_rope_B1SD, (batch, heads, seq_len, self.qk_rope_head_dim))
        k_nope_BNSD, v_BNSD = ops.split(kv_BNSD, (nope, self.v_head_dim), -1)
        return ops.concat((k_nope_BNSD, k_rope_BNSD), -1), v_BNSD

    def project_qkv(self, x_BSH, cos, sin):
        """Queries and keys ``[B, N, S, qk_head_dim]`` (RoPE applied), values ``[B, N, S, v_head_dim]``."""
        k_BNSD, v_BNSD = self.expand_latent(*self.latent_kv(x_BSH, cos, sin))
        return self.rope_queries(x_BSH, cos, sin), k_BNSD, v_BNSD


def set_dsa_stage(model, stage: str) -> None:
    """Switch every DSA layer of ``model`` to ``stage`` (model/dsa_config.py); compiled functions built before must
    be built again (the stage is read when a graph is compiled)."""
    if stage not in DSA_STAGES:
        raise ValueError(f"dsa.stage={stage!r}: must be one of {DSA_STAGES}")
    for _, cell in model.cells_and_names():
        if isinstance(cell, MLAttention) and cell.indexed:
            cell.dsa_stage = stage
            cell.dsa_active = stage != "off"
            cell.indexed_blockwise.sparse = stage == "sparse"
