"""Prefill and decode graphs for serving, built on the cells (and weights) of a :class:`MoETransformer`.

Shape legend: B batch, S prompt length, C cache capacity, H hidden, G key/value heads,
D head_dim, V vocabulary, L layers, M MoE layers, T tokens, E experts, K experts per token,
W lock-state columns (:mod:`model.export.lock_state`).

Both graphs call the training model's own submodules (norms, :meth:`Attention.project_qkv` /
:meth:`Attention.attend`, router, experts, LM head), so there is one definition of the math;
only the order of calls differs: keys/values are kept instead of recomputed, and MoE routing can
be overridden by the carried lock state. ``construct`` arguments carry no shape suffix because
MindIR names the graph inputs after them (``<graph>:input_ids``), which converters refer to.

- ``PrefillGraph(input_ids [B, S] int32)`` -> ``(logits [B, V] fp32 of the last position,
  kv_cache [L, 2, B, G, S, D], lock_state [M, B, W] int32 if expert locking)``.
- ``DecodeGraph(input_ids [B, 1] int32, kv_cache [L, 2, B, G, C, D], position [B] int32, lock_state)``
  -> ``(logits [B, V], kv_cache [L, 2, B, G, C, D], lock_state)``: the token at ``position`` (the
  number of tokens already cached for that sequence) attends to cache slots ``0..position`` and its
  keys/values are written into slot ``position``; C is any capacity above the last position
  (the prefill cache padded with zeros).

Every prompt is one document and the prompts of a batch have one length (no padding). MoE layers
run dropless: which tokens an expert drops under a capacity would depend on the other requests
in the batch, and a served token's logits must not. The dropless form is the dense one of
:mod:`model.moe.dispatch` (every expert on every token, E/K times the routed FLOPs): exact, static
shapes, one graph for any token count; a grouped-matmul kernel is the Ascend-side improvement.
"""

import mindspore as ms
from mindspore import nn, ops

from mindmoe.model.attention import MASK_VALUE, document_causal_mask
from mindmoe.model.export.lock_state import decode_lock_step, prefill_lock_state
from mindmoe.model.moe.dispatch import dense_combine_weights
from mindmoe.model.moe.router import gather_weights, router_scores, select_experts


def carries_lock_state(cfg) -> bool:
    """Whether the serving graphs take and return the expert-lock state (locking on, some MoE layer)."""
    return cfg.expert_lock and cfg.num_moe_layers > 0


def stack_layers(tensors):
    """``ops.stack`` of a list built with ``append``, written as a concat: in a MindIR graph loaded with
    dynamic shapes, MindSpore 2.9's ``stack`` of such a list keeps the output shape of its first run."""
    return ops.concat([tensor.expand_dims(0) for tensor in tensors], 0)


class ServingMoE(nn.Cell):
    """Dropless forward of one trained :class:`MoELayer` with the routing decided outside it."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def natural_routing(self, x_TH):
        """``(scores [T, E] fp32, natural top-K [T, K])`` exactly as the training layer selects."""
        moe = self.moe
        scores_TE = router_scores(moe.router(x_TH), moe.score_func)
        bias_E = moe.router.e_score_correction_bias if moe.router.has_bias else None
        return scores_TE, select_experts(scores_TE, moe.top_k, bias_E, moe.n_group, moe.topk_group)

    def construct(self, x_TH, scores_TE, topk_idx_TK):
        moe = self.moe
        num_tokens, hidden = x_TH.shape
        weight_TK = gather_weights(scores_TE, topk_idx_TK, moe.norm_topk_prob, moe.routed_scaling_factor)
        x_ETH = ops.broadcast_to(x_TH.expand_dims(0), (moe.num_experts, num_tokens, hidden))
        y_ETH = moe.experts(x_ETH)
        combine_TE = dense_combine_weights(topk_idx_TK, weight_TK, moe.num_experts).astype(x_TH.dtype)
        out_TH = (y_ETH.transpose(1, 0, 2) * combine_TE.expand_dims(-1)).sum(1)
        if moe.has_shared:
            out_TH = out_TH + moe.shared_experts(x_TH)
        return out_TH


class _ServingGraph(nn.Cell):
    def __init__(self, model):
        super().__init__()
        cfg = model.config
        self.model = model
        self.num_dense = cfg.first_k_dense
        self.top_k = cfg.top_k
        self.expert_lock = carries_lock_state(cfg)
        self.lock_run_length = cfg.lock_run_length
        self.lock_span = cfg.lock_span
        self.moe_layers = nn.CellList([ServingMoE(layer.mlp) for layer in model.layers if layer.is_moe])

    def last_logits(self, x_BH):
        model = self.model
        x_BH = model.norm(x_BH)
        head = model.embed_tokens.weight if model.tie_word_embeddings else model.lm_head.weight
        return model.logits_matmul(x_BH, head).astype(ms.float32)


class PrefillGraph(_ServingGraph):
    """``construct(input_ids [B, S])`` -> last-position logits, KV cache (and lock state)."""

    def construct(self, input_ids):
        batch, seq_len = input_ids.shape
        model = self.model
        cos, sin = model.rotary_emb(ops.arange(seq_len, dtype=ms.int32))
        # Built at every query head's shape once, not tiled again by each layer's attention.
        mask_BNSS = document_causal_mask(ops.zeros_like(input_ids), model.config.num_heads)
        x_BSH = model.embed_tokens(input_ids)
        kv_cache = []
        lock_states = []
        for layer_idx, layer in enumerate(model.layers):
            q_BNSD, k_BGSD, v_BGSD = layer.self_attn.project_qkv(layer.input_layernorm(x_BSH), cos, sin)
            x_BSH = x_BSH + layer.self_attn.attend(q_BNSD, k_BGSD, v_BGSD, mask_BNSS)
            kv_cache.append(ops.stack((k_BGSD, v_BGSD)))
            h_BSH = layer.post_attention_layernorm(x_BSH)
            if layer_idx < self.num_dense:
                x_BSH = x_BSH + layer.mlp(h_BSH)
            else:
                moe = self.moe_layers[layer_idx - self.num_dense]
                h_TH = h_BSH.reshape(batch * seq_len, -1)
                scores_TE, topk_idx_TK = moe.natural_routing(h_TH)
                if self.expert_lock:
                    locked_BSK, state_BW = prefill_lock_state(
                        topk_idx_TK.reshape(batch, seq_len, self.top_k), self.lock_run_length, self.lock_span
                    )
                    topk_idx_TK = locked_BSK.reshape(batch * seq_len, self.top_k)
                    lock_states.append(state_BW)
                x_BSH = x_BSH + moe(h_TH, scores_TE, topk_idx_TK).reshape(x_BSH.shape)
        logits_BV = self.last_logits(x_BSH[:, -1])
        if self.expert_lock:
            return logits_BV, stack_layers(kv_cache), stack_layers(lock_states)
        return logits_BV, stack_layers(kv_cache)


class DecodeGraph(_ServingGraph):
    """``construct(input_ids [B, 1], kv_cache [L, 2, B, G, C, D], position [B])`` -> logits, the cache with the
    new token's keys/values written at ``position``.

    The cache has a fixed capacity C (any size > every position, chosen by the caller): slots past a
    sequence's position are masked out, so each step has the same shapes and a converter for Ascend
    only has to compile batch sizes, not every cache length.
    """

    def step(self, input_ids_B1, kv_cache, position_B, lock_state_MBW):
        model = self.model
        batch = input_ids_B1.shape[0]
        capacity = kv_cache.shape[4]
        cos_BR, sin_BR = model.rotary_emb(position_B)
        # [B, 1, 1, R] broadcasts over heads and the single query of each sequence.
        cos = cos_BR.expand_dims(1).expand_dims(1)
        sin = sin_BR.expand_dims(1).expand_dims(1)
        slots_BC = ops.arange(capacity, dtype=ms.int32).expand_dims(0)
        position_B1 = position_B.expand_dims(1)
        write_B1C1 = ops.equal(slots_BC, position_B1).astype(kv_cache.dtype).reshape(batch, 1, capacity, 1)
        visible_B11C = ops.select(
            slots_BC <= position_B1,
            ops.zeros((batch, capacity), ms.float32),
            ops.fill(ms.float32, (batch, capacity), MASK_VALUE),
        ).reshape(batch, 1, 1, capacity)
        x_B1H = model.embed_tokens(input_ids_B1)
        new_cache = []
        new_states = []
        for layer_idx, layer in enumerate(model.layers):
            q_BN1D, k_BG1D, v_BG1D = layer.self_attn.project_qkv(layer.input_layernorm(x_B1H), cos, sin)
            k_BGCD = kv_cache[layer_idx, 0] * (1 - write_B1C1) + k_BG1D * write_B1C1
            v_BGCD = kv_cache[layer_idx, 1] * (1 - write_B1C1) + v_BG1D * write_B1C1
            x_B1H = x_B1H + layer.self_attn.attend(q_BN1D, k_BGCD, v_BGCD, visible_B11C)
            new_cache.append(ops.stack((k_BGCD, v_BGCD)))
            h_BH = layer.post_attention_layernorm(x_B1H).reshape(batch, -1)
            if layer_idx < self.num_dense:
                x_B1H = x_B1H + layer.mlp(h_BH).expand_dims(1)
            else:
                moe_idx = layer_idx - self.num_dense
                moe = self.moe_layers[moe_idx]
                scores_BE, topk_idx_BK = moe.natural_routing(h_BH)
                if self.expert_lock:
                    topk_idx_BK, state_BW = decode_lock_step(
                        topk_idx_BK, lock_state_MBW[moe_idx], position_B, self.lock_run_length, self.lock_span
                    )
                    new_states.append(state_BW)
                x_B1H = x_B1H + moe(h_BH, scores_BE, topk_idx_BK).expand_dims(1)
        logits_BV = self.last_logits(x_B1H.reshape(batch, -1))
        if self.expert_lock:
            return logits_BV, stack_layers(new_cache), stack_layers(new_states)
        return logits_BV, stack_layers(new_cache)

    def construct(self, input_ids, kv_cache, position):
        return self.step(input_ids, kv_cache, position, None)


class LockedDecodeGraph(DecodeGraph):
    """:class:`DecodeGraph` that also carries the expert-lock state ``[M, B, W]`` in and out."""

    def construct(self, input_ids, kv_cache, position, lock_state):
        return self.step(input_ids, kv_cache, position, lock_state)


def decode_graph(model):
    """The decode graph matching ``model``'s config (with lock state iff expert locking is on)."""
    cfg = model.config
    return LockedDecodeGraph(model) if carries_lock_state(cfg) else DecodeGraph(model)
