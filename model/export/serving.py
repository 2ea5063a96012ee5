"""Prefill and decode graphs for serving, built on the parts (and weights) of a :class:`MoETransformer`.

Shape legend: B batch, S prompt length, P key positions (the cache capacity when decoding), H hidden,
G key/value heads, D head_dim, V vocabulary, L layers, M MoE layers, T tokens, E experts, K experts
per token, W lock-state columns (:mod:`model.export.lock_state`).

Both graphs call the training model's own parts: :meth:`MoETransformer.embed` and
:meth:`~MoETransformer.final_logits`, the attention and FFN halves of each decoder layer, and each MoE
layer's router and experts, so there is one definition of the math; only the order of calls differs:
keys/values are kept instead of recomputed, and MoE routing can be overridden by the carried lock state.
What the cache holds is the attention's: :class:`GQACacheAttention` keeps each key/value head's keys and
values; MLA keeps its latent and shared RoPE key (:mod:`model.export.mla_serving`, absorbed-weights decode), and
with DeepSeek Sparse Attention the indexer's key, whose top-k selection prefill and decode run as training does.
``construct`` arguments carry no shape suffix because MindIR names the graph inputs after them
(``<graph>:input_ids``), which converters refer to.

- ``PrefillGraph(input_ids [B, S] int32)`` -> ``(logits [B, V] fp32 of the last position,
  kv_cache, lock_state [M, B, W] int32 if expert locking)``; ``kv_cache`` is ``[L, 2, B, G, S, D]``
  (GQA) or ``[L, B, S, kv_lora_rank + qk_rope_head_dim]`` (MLA; ``+ index_head_dim`` with DSA's selection).
- ``DecodeGraph(input_ids [B, 1] int32, kv_cache, position [B] int32, lock_state)`` -> ``(logits [B, V],
  kv_cache, lock_state)`` with the cache's S axis now P: the token at ``position`` (the number of tokens
  already cached for that sequence) attends to cache slots ``0..position`` and its cache values are
  written into slot ``position``; P is any capacity above the last position (the prefill cache padded
  with zeros along :func:`cache_length_axis`).

Every prompt is one document and the prompts of a batch have one length (no padding). MoE layers
run with the (grouped) :class:`~model.moe.token_dispatcher.DroplessDispatcher` whatever ``moe.dispatch``
is: which tokens an expert drops under a capacity would depend on the other requests in the batch, and a
served token's logits must not. It is exact and gives one graph for any token count: its block size is
fixed when the graph is built (``tokens_hint``: a typical prompt batch, or one token per sequence), and
the rows of its sorted buffer follow the token count.
"""

import mindspore as ms
from mindspore import nn, ops

from mindmoe.model import kernels
from mindmoe.model.attention import MASK_VALUE, document_causal_mask
from mindmoe.model.export.lock_state import decode_lock_step, prefill_lock_state
from mindmoe.model.export.mla_serving import MLALatentCacheAttention, serving_dsa_stage
from mindmoe.model.moe.token_dispatcher import DroplessDispatcher


def carries_lock_state(model) -> bool:
    """Whether the serving graphs of ``model`` take and return the expert-lock state (it was built with
    ``moe.expert_lock`` and has an MoE layer)."""
    return model.moe_config.expert_lock and model.config.num_moe_layers > 0


def cache_attention(cfg, dsa_stage: str = "sparse") -> nn.Cell:
    """The attention half the serving graphs run for ``cfg`` (DSA layers in ``dsa_stage``), which decides what the
    cache holds."""
    return MLALatentCacheAttention(cfg, dsa_stage) if cfg.attention_type == "mla" else GQACacheAttention()


def cache_length_axis(cfg) -> int:
    """Axis of ``kv_cache`` that counts positions (padded to the decode capacity)."""
    return MLALatentCacheAttention.cache_length_axis if cfg.attention_type == "mla" else 4


class GQACacheAttention(nn.Cell):
    """The attention half of a decoder layer for the serving graphs with a per-head key/value cache
    ``[2, B, G, P, D]`` per layer (keys after QK-norm and RoPE, then values)."""

    def prefill(self, layer, x_BSH, cos, sin, mask_BNSP):
        q_BNSD, k_BGPD, v_BGPD = layer.attention_qkv(x_BSH, cos, sin)
        return layer.attention_residual(x_BSH, q_BNSD, k_BGPD, v_BGPD, mask_BNSP), ops.stack((k_BGPD, v_BGPD))

    def decode(self, layer, x_B1H, cache_2BGPD, cos, sin, write_BP, visible_BP):
        batch, capacity = write_BP.shape
        write_B1P1 = write_BP.astype(cache_2BGPD.dtype).reshape(batch, 1, capacity, 1)
        q_BN1D, k_BG1D, v_BG1D = layer.attention_qkv(x_B1H, cos, sin)
        k_BGPD = cache_2BGPD[0] * (1 - write_B1P1) + k_BG1D * write_B1P1
        v_BGPD = cache_2BGPD[1] * (1 - write_B1P1) + v_BG1D * write_B1P1
        x_B1H = layer.attention_residual(x_B1H, q_BN1D, k_BGPD, v_BGPD, visible_BP.reshape(batch, 1, 1, capacity))
        return x_B1H, ops.stack((k_BGPD, v_BGPD))


#: A layer's lock state in the serving graphs' layer step where there is none (a dense layer, no expert locking).
NO_LOCK_STATE = 0


def stack_layers(tensors):
    """``ops.stack`` of a list built with ``append``, written as a concat: in a MindIR graph loaded with
    dynamic shapes, MindSpore 2.9's ``stack`` of such a list keeps the output shape of its first run."""
    return ops.concat([tensor.expand_dims(0) for tensor in tensors], 0)


class _ServingGraph(nn.Cell):
    """What prefill and decode share: the layer step they pass to :meth:`MoETransformer.run_layers`. A subclass
    says how a layer attends (:meth:`attend`) and how the carried lock state overrides routing (:meth:`lock`)."""

    #: Tokens per call the grouped dispatcher's block size is chosen for.
    tokens_hint = 1024

    def __init__(self, model):
        super().__init__()
        cfg = model.config
        dsa_stage = serving_dsa_stage(model)
        self.model = model
        self.attention = cache_attention(cfg, dsa_stage)
        self.cache_axis = cache_length_axis(cfg)
        self.num_dense = cfg.first_k_dense
        self.top_k = cfg.top_k
        self.expert_lock = carries_lock_state(model)
        self.lock_run_length = model.moe_config.lock_run_length
        self.lock_span = model.moe_config.lock_span
        block = kernels.grouped_alignment()(self.tokens_hint * cfg.top_k, cfg.num_experts)
        self.dispatcher = DroplessDispatcher(cfg.num_experts, alignment=block)

    def layer_step(self, layer_idx, layer, x_BSH, inputs):
        """One layer with the cache: ``(x, (its cache, its lock state))``; ``inputs`` ``(attention inputs, lock
        inputs)``. Dense layers and graphs without expert locking return ``NO_LOCK_STATE``."""
        attention_inputs, lock_inputs = inputs
        x_BSH, layer_cache = self.attend(layer_idx, layer, x_BSH, attention_inputs)
        if layer_idx < self.num_dense:
            return layer.ffn_block(x_BSH), (layer_cache, NO_LOCK_STATE)
        h_TH, scores_TE, topk_idx_TK = layer.ffn_routing(x_BSH)
        if self.expert_lock:
            topk_idx_TK, state_BW = self.lock(layer_idx - self.num_dense, topk_idx_TK, lock_inputs)
            x_BSH = layer.routed_ffn_residual(x_BSH, h_TH, scores_TE, topk_idx_TK, self.dispatcher)
            return x_BSH, (layer_cache, state_BW)
        x_BSH = layer.routed_ffn_residual(x_BSH, h_TH, scores_TE, topk_idx_TK, self.dispatcher)
        return x_BSH, (layer_cache, NO_LOCK_STATE)

    def run_layers(self, x_BSH, attention_inputs, lock_inputs):
        """``(x after the last layer, kv_cache [L, ...], lock_state [M, B, W] or None)``."""
        x_BSH, outs = self.model.run_layers(x_BSH, self.layer_step, (attention_inputs, lock_inputs))
        kv_cache = stack_layers([out[0] for out in outs])
        if self.expert_lock:
            return x_BSH, kv_cache, stack_layers([out[1] for out in outs[self.num_dense :]])
        return x_BSH, kv_cache, None


class PrefillGraph(_ServingGraph):
    """``construct(input_ids [B, S])`` -> last-position logits, KV cache (and lock state)."""

    def attend(self, layer_idx, layer, x_BSH, attention_inputs):
        cos, sin, mask_BNSP = attention_inputs
        return self.attention.prefill(layer, x_BSH, cos, sin, mask_BNSP)

    def lock(self, moe_idx, topk_idx_TK, lock_inputs):
        batch, seq_len = lock_inputs
        locked_BSK, state_BW = prefill_lock_state(
            topk_idx_TK.reshape(batch, seq_len, self.top_k), self.lock_run_length, self.lock_span
        )
        return locked_BSK.reshape(batch * seq_len, self.top_k), state_BW

    def construct(self, input_ids):
        batch, seq_len = input_ids.shape
        model = self.model
        cos, sin = model.rotary_emb(ops.arange(seq_len, dtype=ms.int32))
        # Built at every query head's shape once, not tiled again by each layer's attention.
        mask_BNSP = document_causal_mask(ops.zeros_like(input_ids), model.config.num_heads)
        x_BSH, kv_cache, lock_state = self.run_layers(model.embed(input_ids), (cos, sin, mask_BNSP), (batch, seq_len))
        logits_BV = model.final_logits(x_BSH[:, -1])
        if self.expert_lock:
            return logits_BV, kv_cache, lock_state
        return logits_BV, kv_cache


class DecodeGraph(_ServingGraph):
    """``construct(input_ids [B, 1], kv_cache, position [B])`` -> logits, the cache with the new token's
    values written at ``position``.

    The cache has a fixed capacity P (any size > every position, chosen by the caller): slots past a
    sequence's position are masked out, so each step has the same shapes and a converter for Ascend
    only has to compile batch sizes, not every cache length.
    """

    tokens_hint = 1

    def attend(self, layer_idx, layer, x_B1H, attention_inputs):
        kv_cache, cos, sin, write_BP, visible_BP = attention_inputs
        return self.attention.decode(layer, x_B1H, kv_cache[layer_idx], cos, sin, write_BP, visible_BP)

    def lock(self, moe_idx, topk_idx_BK, lock_inputs):
        lock_state_MBW, position_B = lock_inputs
        return decode_lock_step(topk_idx_BK, lock_state_MBW[moe_idx], position_B, self.lock_run_length, self.lock_span)

    def step(self, input_ids_B1, kv_cache, position_B, lock_state_MBW):
        model = self.model
        batch = input_ids_B1.shape[0]
        capacity = kv_cache.shape[self.cache_axis]
        cos_BR, sin_BR = model.rotary_emb(position_B)
        # [B, 1, 1, R] broadcasts over heads and the single query of each sequence.
        cos = cos_BR.expand_dims(1).expand_dims(1)
        sin = sin_BR.expand_dims(1).expand_dims(1)
        slots_1P = ops.arange(capacity, dtype=ms.int32).expand_dims(0)
        position_B1 = position_B.expand_dims(1)
        write_BP = ops.broadcast_to(ops.equal(slots_1P, position_B1), (batch, capacity))
        visible_BP = ops.select(
            slots_1P <= position_B1,
            ops.zeros((batch, capacity), ms.float32),
            ops.fill(ms.float32, (batch, capacity), MASK_VALUE),
        )
        x_B1H, new_cache, new_state = self.run_layers(
            model.embed(input_ids_B1), (kv_cache, cos, sin, write_BP, visible_BP), (lock_state_MBW, position_B)
        )
        logits_BV = model.final_logits(x_B1H.reshape(batch, -1))
        if self.expert_lock:
            return logits_BV, new_cache, new_state
        return logits_BV, new_cache

    def construct(self, input_ids, kv_cache, position):
        return self.step(input_ids, kv_cache, position, None)


class LockedDecodeGraph(DecodeGraph):
    """:class:`DecodeGraph` that also carries the expert-lock state ``[M, B, W]`` in and out."""

    def construct(self, input_ids, kv_cache, position, lock_state):
        return self.step(input_ids, kv_cache, position, lock_state)


def decode_graph(model):
    """The decode graph matching ``model`` (with lock state iff it was built with expert locking)."""
    return LockedDecodeGraph(model) if carries_lock_state(model) else DecodeGraph(model)
