"""Attention of the serving graphs for multi-head latent attention (MLA, :mod:`model.mla`): a latent cache
and absorbed-weights decoding (DeepSeek-V2 arXiv 2405.04434 §2.1.2).

Shape legend: B batch, S prompt length, P cache capacity, H hidden, N heads, R ``kv_lora_rank`` (the
latent), Y ``qk_rope_head_dim``, D ``qk_nope_head_dim`` (``_BND`` of queries) or ``v_head_dim`` (``_BNV``:
V is the value width here, not the vocabulary), L layers; ``RY`` is one cache row, the R latent values then the
Y RoPE values.

The cache of a layer holds, per token, ``kv_lora_rank + qk_rope_head_dim`` values shared by every head:
``[c_kv, k_rope]`` with ``c_kv`` the latent *after* ``kv_a_layernorm`` and ``k_rope`` the shared key *after*
RoPE (what DeepSeek's inference code caches). Caching after the norm keeps decode free of a per-step norm
over the whole cache, and the RoPE'd key is the one every later query is scored against; both are exactly
what :meth:`MLAttention.latent_kv` returns, so prefill and decode write the same values training computes.
The whole cache is ``[L, B, P, R + Y]`` (:data:`CACHE_LENGTH_AXIS` is P).

Prefill attends the plain way (per-head keys/values expanded by ``kv_b_proj``; the training model's own
:meth:`~model.attention.AttentionHeads.attend`) and writes only the latent layout. Decode never expands
the cache: with ``kv_b_proj``'s weight viewed as ``[N, D_nope + D_v, R]``, its key rows ``W_UK [N, D_nope, R]``
fold into the query and its value rows ``W_UV [N, D_v, R]`` into the output, because
``q_nope . (W_UK c) = (q_nope W_UK) . c`` and ``sum_p a_p (W_UV c_p) = W_UV (sum_p a_p c_p)``::

    q_latent = q_nope @ W_UK                                  # [B, N, R], per head
    score    = (q_latent . c_kv + q_rope . k_rope) * scale    # [B, N, P]
    out      = (softmax(score) @ c_kv) @ W_UV^T               # [B, N, D_v], then o_proj
"""

import mindspore as ms
from mindspore import nn, ops

#: Axis of the cache's positions in ``[L, B, P, R + Y]`` (the runner pads the prefill cache along it).
CACHE_LENGTH_AXIS = 2


def mla_cache_width(cfg) -> int:
    """Values one layer caches per token: the latent and the shared RoPE key (not per head)."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def absorbed_attention(q_BND, c_kv_BPR, k_rope_BPY, kv_b_weight, visible_B1P, nope: int, scale: float):
    """Per-head output ``[B, N, D_v]`` of one query per sequence against a latent cache, with ``kv_b_proj``'s
    weight ``kv_b_weight [N * (D_nope + D_v), R]`` absorbed into the query and the output (module docstring).
    ``q_BND``: queries ``[B, N, D_nope + Y]`` (RoPE applied); ``visible_B1P``: additive mask (0 or MASK_VALUE).
    """
    batch, heads, _ = q_BND.shape
    rank = c_kv_BPR.shape[-1]
    w_NDR = kv_b_weight.reshape(heads, -1, rank)
    w_uk_NDR = w_NDR[:, :nope]
    w_uv_NDR = w_NDR[:, nope:]
    # Heads lead so each head's query meets its own W_UK rows in one batched matmul.
    q_nope_NBD = q_BND[..., :nope].transpose(1, 0, 2)
    q_latent_BNR = ops.bmm(q_nope_NBD, w_uk_NDR).transpose(1, 0, 2)
    scores_BNP = ops.bmm(q_latent_BNR, c_kv_BPR.transpose(0, 2, 1)) + ops.bmm(
        q_BND[..., nope:], k_rope_BPY.transpose(0, 2, 1)
    )
    # Softmax in fp32 whatever the export dtype, as the training attention core does.
    scores_BNP = scores_BNP.astype(ms.float32) * scale + visible_B1P
    probs_BNP = ops.softmax(scores_BNP, -1).astype(c_kv_BPR.dtype)
    out_latent_NBR = ops.bmm(probs_BNP, c_kv_BPR).transpose(1, 0, 2)
    return ops.bmm(out_latent_NBR, w_uv_NDR.transpose(0, 2, 1)).transpose(1, 0, 2)


class MLALatentCacheAttention(nn.Cell):
    """The attention half of a decoder layer for the serving graphs, with the latent cache (no parameters:
    every weight is the layer's own)."""

    cache_length_axis = CACHE_LENGTH_AXIS

    def __init__(self, cfg):
        super().__init__()
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim

    def prefill(self, layer, x_BSH, cos, sin, mask_BNSP):
        """``(x after the attention half [B, S, H], this layer's cache [B, S, RY])``."""
        attn = layer.self_attn
        h_BSH = layer.input_layernorm(x_BSH)
        c_kv_BSR, k_rope_B1SY = attn.latent_kv(h_BSH, cos, sin)
        k_BNSD, v_BNSD = attn.expand_latent(c_kv_BSR, k_rope_B1SY)
        x_BSH = x_BSH + attn.attend(attn.rope_queries(h_BSH, cos, sin), k_BNSD, v_BNSD, mask_BNSP)
        return x_BSH, ops.concat((c_kv_BSR, k_rope_B1SY[:, 0]), -1)

    def decode(self, layer, x_B1H, cache_BPRY, cos, sin, write_BP, visible_BP):
        """``(x after the attention half [B, 1, H], the layer's cache with this token at its position)``."""
        attn = layer.self_attn
        batch = x_B1H.shape[0]
        h_B1H = layer.input_layernorm(x_B1H)
        c_kv_B1R, k_rope_B11Y = attn.latent_kv(h_B1H, cos, sin)
        entry_B1RY = ops.concat((c_kv_B1R, k_rope_B11Y[:, 0]), -1)
        write_BP1 = write_BP.astype(cache_BPRY.dtype).expand_dims(-1)
        cache_BPRY = cache_BPRY * (1 - write_BP1) + entry_B1RY * write_BP1
        rank = cache_BPRY.shape[-1] - self.rope
        q_BND = attn.rope_queries(h_B1H, cos, sin)[:, :, 0]
        out_BNV = absorbed_attention(
            q_BND,
            cache_BPRY[..., :rank],
            cache_BPRY[..., rank:],
            attn.kv_b_proj.base_weight(cache_BPRY.dtype),
            visible_BP.expand_dims(1),
            self.nope,
            attn.scale,
        )
        return x_B1H + attn.o_proj(out_BNV.reshape(batch, 1, -1)), cache_BPRY
