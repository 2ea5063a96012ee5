"""Attention of the serving graphs for multi-head latent attention (MLA, :mod:`model.mla`): a latent cache
and absorbed-weights decoding (DeepSeek-V2 arXiv 2405.04434 §2.1.2).

Shape legend: B batch, S prompt length, P cache capacity, H hidden, N heads, R ``kv_lora_rank`` (the
latent), Y ``qk_rope_head_dim``, D ``qk_nope_head_dim`` (``_BND`` of queries) or ``v_head_dim`` (``_BNV``:
V is the value width here, not the vocabulary), L layers; ``RY`` is one cache row, the R latent values then the
Y RoPE values (``RYK`` with DSA's K = ``index_head_dim`` indexer values last; ``C`` either row). DSA: I indexer
heads, Q ``q_lora_rank``.

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

DeepSeek Sparse Attention (``model.dsa``, :mod:`model.dsa`; stage ``sparse``): each cache row also holds the
token's indexer key, ``[c_kv, k_rope, k_index]`` (K = ``index_head_dim`` more values, the key *after* the
indexer's LayerNorm and RoPE, as :meth:`LightningIndexer.queries_keys` returns it), so the cache is
``[L, B, P, R + Y + K]``. One tensor rather than a second ``indexer_cache`` input/output: the graphs keep the
inputs and outputs every MLA export has (prefill still takes only ``input_ids``), a runner pads one tensor along
one axis, and decode writes a token's whole row with one masked blend; the row widths are in the manifest's
``cache.row``. Prefill is the training attention itself (:meth:`MLAttention.indexed_attention_parts`: indexer,
top-k selection, masked attention), keeping the cache values it computed. Each decode step scores its indexer
query against every cached indexer key (its own written first) with the training formula
(:meth:`LightningIndexer.query_scores`), keeps the ``min(index_topk, position + 1)`` best visible slots with
:func:`model.dsa.select_top_k` (slots past ``position`` are masked before ranking, as training masks later keys)
and adds that selection to the visible mask of the absorbed attention. Stages ``off`` and ``dense_warmup`` attend
densely, as the model does in them, and cache no indexer key (the export command serves DSA models ``sparse``
unless ``dsa.stage=off``: :func:`train.export.exporter.build_serving_model`).
"""

import mindspore as ms
from mindspore import nn, ops

from mindmoe.model.dsa import select_top_k

#: Axis of the cache's positions in ``[L, B, P, R + Y (+ K)]`` (the runner pads the prefill cache along it).
CACHE_LENGTH_AXIS = 2


def caches_indexer_keys(cfg, dsa_stage: str = "sparse") -> bool:
    """Whether the serving graphs select keys with DSA's indexer (stage ``sparse``) and so cache its keys."""
    return cfg.dsa.enabled and dsa_stage == "sparse"


def mla_cache_row(cfg, dsa_stage: str = "sparse") -> list:
    """``(name, values, what)`` of each part of one layer's cache row, in order."""
    row = [
        ("c_kv", cfg.kv_lora_rank, "kv_lora_rank values: the key/value latent after kv_a_layernorm"),
        ("k_rope", cfg.qk_rope_head_dim, "qk_rope_head_dim values: the key shared by all heads, after RoPE"),
    ]
    if caches_indexer_keys(cfg, dsa_stage):
        row.append(
            (
                "index_k",
                cfg.dsa.index_head_dim,
                "index_head_dim values: the DSA indexer's key, after its LayerNorm and RoPE",
            )
        )
    return row


def mla_cache_width(cfg, dsa_stage: str = "sparse") -> int:
    """Values one layer caches per token: the latent and the shared RoPE key (not per head), and with DSA's
    selection the indexer's key."""
    return sum(values for _, values, _ in mla_cache_row(cfg, dsa_stage))


def serving_dsa_stage(model) -> str:
    """The DSA stage every indexed layer of ``model`` runs (``sparse`` without an indexer), which the serving graphs,
    the cache layout and the manifest follow; ValueError for mixed stages or the training-only dense warm-up."""
    stages = {layer.self_attn.dsa_stage for layer in model.layers if getattr(layer.self_attn, "indexed", False)}
    if not stages:
        return "sparse"
    if len(stages) > 1 or stages & {"dense_warmup"}:
        raise ValueError(
            f"the DSA layers run {sorted(stages)}: serving graphs need one stage, sparse or off "
            "(model.mla.set_dsa_stage switches them; train.export.exporter.serve_dsa_sparse does it for an export)"
        )
    return stages.pop()


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

    def __init__(self, cfg, dsa_stage: str = "sparse"):
        super().__init__()
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.rank = cfg.kv_lora_rank
        self.indexed = caches_indexer_keys(cfg, dsa_stage)

    def prefill(self, layer, x_BSH, cos, sin, mask_BNSP):
        """``(x after the attention half [B, S, H], this layer's cache [B, S, RY] or, with DSA, [B, S, RYK])``."""
        attn = layer.self_attn
        h_BSH = layer.input_layernorm(x_BSH)
        if self.indexed:
            out_BSH, _, (c_kv_BSR, k_rope_B1SY, index_k_B1SK) = attn.indexed_attention_parts(h_BSH, cos, sin, mask_BNSP)
            return x_BSH + out_BSH, ops.concat((c_kv_BSR, k_rope_B1SY[:, 0], index_k_B1SK[:, 0]), -1)
        c_kv_BSR, k_rope_B1SY = attn.latent_kv(h_BSH, cos, sin)
        k_BNSD, v_BNSD = attn.expand_latent(c_kv_BSR, k_rope_B1SY)
        x_BSH = x_BSH + attn.attend(attn.rope_queries(h_BSH, cos, sin), k_BNSD, v_BNSD, mask_BNSP)
        return x_BSH, ops.concat((c_kv_BSR, k_rope_B1SY[:, 0]), -1)

    def decode(self, layer, x_B1H, cache_BPC, cos, sin, write_BP, visible_BP):
        """``(x after the attention half [B, 1, H], the layer's cache with this token at its position)``; ``C`` is
        a cache row (RY, or RYK with DSA)."""
        attn = layer.self_attn
        batch = x_B1H.shape[0]
        h_B1H = layer.input_layernorm(x_B1H)
        c_kv_B1R, k_rope_B11Y = attn.latent_kv(h_B1H, cos, sin)
        if self.indexed:
            q_resid_B1Q = attn.query_residual(h_B1H)
            q_BN1D = attn.rope_heads(attn.q_b_proj(q_resid_B1Q), cos, sin)
            index_q_BI1K, index_k_B11K = attn.indexer.queries_keys(h_B1H, q_resid_B1Q, cos, sin)
            entry_B1C = ops.concat((c_kv_B1R, k_rope_B11Y[:, 0], index_k_B11K[:, 0]), -1)
        else:
            q_BN1D = attn.rope_queries(h_B1H, cos, sin)
            entry_B1C = ops.concat((c_kv_B1R, k_rope_B11Y[:, 0]), -1)
        write_BP1 = write_BP.astype(cache_BPC.dtype).expand_dims(-1)
        cache_BPC = cache_BPC * (1 - write_BP1) + entry_B1C * write_BP1
        mask_B1P = visible_BP.expand_dims(1)
        latent_end = self.rank + self.rope
        if self.indexed:
            # This token's indexer query against every cached key (its own included); later slots are masked.
            index_k_B1PK = cache_BPC[..., latent_end:].expand_dims(1)
            scores_B1P = attn.indexer.query_scores(h_B1H, index_q_BI1K, index_k_B1PK)
            mask_B1P = mask_B1P + select_top_k(scores_B1P, mask_B1P, attn.index_topk)
        out_BNV = absorbed_attention(
            q_BN1D[:, :, 0],
            cache_BPC[..., : self.rank],
            cache_BPC[..., self.rank : latent_end],
            attn.kv_b_proj.base_weight(cache_BPC.dtype),
            mask_B1P,
            self.nope,
            attn.scale,
        )
        return x_B1H + attn.o_proj(out_BNV.reshape(batch, 1, -1)), cache_BPC
