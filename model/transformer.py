"""The decoder-only MoE transformer (GLM-4.5 layout, HF ``glm4_moe`` parameter names).

Parameter names are the checkpoint format (docs/checkpoints.md, "Parameter names"):

    embed_tokens.weight                                  [V, H]
    layers.{i}.input_layernorm.weight                    [H]
    layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}      [N*D | G*D, H], bias if qkv_bias
    layers.{i}.self_attn.{q,k}_norm.weight               [D] if qk_norm
    layers.{i}.self_attn.o_proj.weight                   [H, N*D]
    layers.{i}.self_attn.{q_a_proj,q_a_layernorm,q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
        kv_b_proj, o_proj}.weight                        instead with attention_type mla (model/mla.py)
    layers.{i}.self_attn.indexer.{wq_b,wk,weights_proj}.weight, .indexer.k_norm.{weight,bias}
                                                         model.dsa.index_n_heads > 0 (model/dsa.py)
    layers.{i}.post_attention_layernorm.weight           [H]
    layers.{i}.mlp.{gate,up,down}_proj.weight            dense layers (i < first_k_dense)
    layers.{i}.mlp.router.weight                         [E, H]            MoE layers
    layers.{i}.mlp.router.e_score_correction_bias        [E] if expert_bias (state, not trained)
    layers.{i}.mlp.experts.{gate,up}_proj                [E, I, H]
    layers.{i}.mlp.experts.down_proj                     [E, H, I]
    layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight
    norm.weight                                          [H]
    lm_head.weight                                       [V, H] unless tie_word_embeddings
    mtp_layers.{k}.{enorm,hnorm}.weight                  [H]      model.mtp_layers > 0 (model/mtp.py)
    mtp_layers.{k}.eh_proj.weight                        [H, 2H]
    mtp_layers.{k}.shared_head.norm.weight               [H]
    mtp_layers.{k}.{input_layernorm,self_attn,post_attention_layernorm,mlp}.*   an MoE decoder layer, as above
"""

import functools

import mindspore as ms
import numpy as np
from mindspore import lazy_inline, nn, ops

from mindmoe.model import outputs
from mindmoe.model.attention import Attention, document_causal_mask, training_attention_masks
from mindmoe.model.config import ModelConfig, validate_model_config
from mindmoe.model.dsa_config import DSATrainingConfig, dsa_training, validate_dsa_training
from mindmoe.model.embedding import Embedding
from mindmoe.model.lora.layers import NO_LORA, AdapterScope
from mindmoe.model.mla import MLAttention
from mindmoe.model.mlp import SwiGLU
from mindmoe.model.moe.layer import LAYER_STATS, ROUTING_STATS, MoELayer
from mindmoe.model.moe_config import MoEConfig, moe_policy, validate_moe_config
from mindmoe.model.mtp import mtp_layer_class
from mindmoe.model.norm import RMSNorm
from mindmoe.model.rope import RotaryEmbedding


class DecoderLayer(nn.Cell):
    """Pre-RMSNorm residual block: attention, then a dense or MoE FFN.

    ``construct(x, cos, sin, mask, doc_ids)`` -> ``(x, aux)``, ``aux`` a :class:`model.outputs.LayerAux` tuple
    (zeros for a dense layer, but the DSA indexer's loss). The halves are methods so the serving graphs
    (``model.export.serving``) run the same blocks with a KV cache: :meth:`attention_qkv` +
    :meth:`attention_residual` is :meth:`attention_block` with the keys/values in between; :meth:`ffn_block` is
    the dense FFN half.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        rng: np.random.Generator,
        expert_dispatcher=None,
        lora: AdapterScope = NO_LORA,
        moe: MoEConfig = None,
        dsa_stage: str = "sparse",
    ):
        super().__init__()
        self.is_moe = layer_idx >= cfg.first_k_dense
        self.num_experts = cfg.num_experts
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attention_type == "mla":
            self.self_attn = MLAttention(cfg, rng, lora.child("self_attn"), dsa_stage)
        else:
            self.self_attn = Attention(cfg, rng, lora.child("self_attn"))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_moe:
            self.mlp = MoELayer(cfg, rng, expert_dispatcher=expert_dispatcher, lora=lora.child("mlp"), moe=moe)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range, rng, lora.child("mlp"))

    def attention_block(self, x_BSH, cos, sin, mask):
        return x_BSH + self.self_attn(self.input_layernorm(x_BSH), cos, sin, mask)

    def indexed_attention_block(self, x_BSH, cos, sin, mask):
        """DSA (``self_attn.dsa_active``): the attention half and the indexer's KL loss (model/dsa.py)."""
        out_BSH, indexer_loss = self.self_attn.indexed_attention(self.input_layernorm(x_BSH), cos, sin, mask)
        return x_BSH + out_BSH, indexer_loss

    def attention_qkv(self, x_BSH, cos, sin):
        """Queries ``[B, N, S, D]``, keys and values ``[B, G, S, D]`` of the normalised input (MLA: G = N,
        values ``v_head_dim`` wide)."""
        return self.self_attn.project_qkv(self.input_layernorm(x_BSH), cos, sin)

    def attention_residual(self, x_BSH, q_BNSD, k_BGPD, v_BGPD, mask):
        """The attention half's output given its queries and the keys/values of every visible position."""
        return x_BSH + self.self_attn.attend(q_BNSD, k_BGPD, v_BGPD, mask)

    def ffn_block(self, x_BSH):
        return x_BSH + self.mlp(self.post_attention_layernorm(x_BSH))

    def attention_half(self, x_BSH, cos, sin, mask):
        """``(x after the attention half, the indexer's loss)``; the loss is 0 unless DSA runs
        (``self_attn.dsa_active``)."""
        if self.self_attn.dsa_active:
            return self.indexed_attention_block(x_BSH, cos, sin, mask)
        return self.attention_block(x_BSH, cos, sin, mask), ops.zeros((), ms.float32)

    def construct(self, x_BSH, cos, sin, mask, doc_ids_BS):
        """``(output, aux)``; ``doc_ids`` is for the MoE layers' routing statistics."""
        x_BSH, indexer_loss = self.attention_half(x_BSH, cos, sin, mask)
        aux = outputs.dense_layer_aux(len(ROUTING_STATS), len(LAYER_STATS), self.num_experts, indexer_loss)
        return self.ffn_block(x_BSH), aux


class MoEDecoderLayer(DecoderLayer):
    """A :class:`DecoderLayer` whose FFN is an MoE block; also returns the router's losses and statistics.

    Serving splits the MoE half at the routing decision (which the carried lock state may override):
    :meth:`ffn_routing` then :meth:`routed_ffn_residual`.
    """

    def ffn_routing(self, x_BSH):
        """``(normalised input [T, H], scores [T, E], natural top-K [T, K])`` of the FFN half."""
        h_TH = self.post_attention_layernorm(x_BSH).reshape(-1, x_BSH.shape[-1])
        _, scores_TE, natural_TK = self.mlp.router.natural_routing(h_TH)
        return h_TH, scores_TE, natural_TK

    def routed_ffn_residual(self, x_BSH, h_TH, scores_TE, topk_idx_TK, dispatcher):
        """The FFN half's output for tokens routed to ``topk_idx``, through ``dispatcher``."""
        routing = (topk_idx_TK, self.mlp.router.combine_weights(scores_TE, topk_idx_TK))
        return x_BSH + self.mlp.dispatched(h_TH, routing, dispatcher).reshape(x_BSH.shape)

    def construct(self, x_BSH, cos, sin, mask, doc_ids_BS):
        """``(output, aux)``: the router's losses and statistics, and the indexer's loss (0 without DSA)."""
        x_BSH, indexer_loss = self.attention_half(x_BSH, cos, sin, mask)
        return self.moe_ffn_block(x_BSH, doc_ids_BS, indexer_loss)

    def moe_ffn_block(self, x_BSH, doc_ids_BS, indexer_loss):
        """``(output, aux)`` of the MoE half; ``MoELayer`` returns its five outputs positionally."""
        ffn_BSH, aux, router_z, routing_stats, layer_stats = self.mlp(self.post_attention_layernorm(x_BSH), doc_ids_BS)
        return x_BSH + ffn_BSH, outputs.layer_aux(aux, router_z, routing_stats, layer_stats, indexer_loss)


@functools.lru_cache(maxsize=None)
def reused_layer_class(layer_cls):
    """``layer_cls`` whose instances MindSpore compiles once per kind and calls for every layer (``lazy_inline``).

    Layers are built from the same config and differ only in being dense or MoE (``is_moe``), so
    that attribute is the reuse key: all MoE layers share one compiled body, all dense layers another.
    """

    class Reused(layer_cls):
        @lazy_inline(attrs=["is_moe"])
        def __init__(
            self,
            cfg: ModelConfig,
            layer_idx: int,
            rng: np.random.Generator,
            expert_dispatcher=None,
            lora=NO_LORA,
            moe: MoEConfig = None,
            dsa_stage: str = "sparse",
        ):
            super().__init__(
                cfg, layer_idx, rng, expert_dispatcher=expert_dispatcher, lora=lora, moe=moe, dsa_stage=dsa_stage
            )

    Reused.__name__ = Reused.__qualname__ = "Reused" + layer_cls.__name__
    return Reused


class MoETransformer(nn.Cell):
    """``construct(input_ids [B,S], doc_ids [B,S], hidden_only=False, future_ids=None)`` -> a
    :class:`model.outputs.ModelOutput` tuple (one layout whatever the model has): ``head`` the logits
    ``[B,S,V]`` fp32, or with ``hidden_only`` the final normed rows ``[B*S, H]`` for a loss that applies
    :meth:`head_weight` itself; the aux and z losses summed over MoE layers (each layer's balanced aux loss equals
    the coefficient); per-MoE-layer statistics rows named by ``model.moe.layer.ROUTING_STATS`` / ``LAYER_STATS``.
    Every layer runs in :meth:`run_layers`.

    ``cell_reuse`` (``train.cell_reuse``, Ascend only) builds the layers with :func:`reused_layer_class`.
    ``expert_dispatcher``: a :class:`model.moe.token_dispatcher.ExpertPlacement` that decides which
    experts this process holds and how tokens reach them (default: one process, ``moe.dispatch``);
    expert parallelism passes its own (``mindmoe.train.parallel.expert_parallel``).

    The serving graphs reuse the parts: :meth:`embed`, ``layers`` (see :class:`DecoderLayer`),
    ``rotary_emb`` and :meth:`final_logits`.

    ``lora``: a :class:`model.lora.plan.AdapterPlan`; its projections are built as LoRA layers and only
    the adapters (and ``lora.modules_to_save``) train. Kept as ``adapter_plan`` (None without LoRA).

    Multi-token prediction (``model.mtp_layers`` = U > 0, model/mtp.py): given ``future_ids [U, B, S]`` (depth k's
    input tokens ``t_{i+k}``, :func:`model.mtp.shifted_tokens` rows 0..U-1) and ``hidden_only``, ``mtp_hidden``
    holds each depth's ``shared_head.norm`` output ``[U, B*S, H]`` for the loss to apply the shared head to. The
    MTP layers' aux and z losses join the sums; their routing statistics are left out of the per-layer rows
    (whose layers the router updates and the metrics index), so an MTP router's correction bias stays fixed.
    Without ``future_ids`` (evaluation, generation, export) the MTP layers do not run (``mtp_hidden`` is empty).

    DeepSeek Sparse Attention (``model.dsa``, ``dsa.stage`` sparse or dense_warmup; model/dsa.py): every layer runs its
    indexer, and ``indexer_loss`` is the mean over the layers (and MTP depths) of its KL loss (0 without DSA). Those
    layers take the whole document-causal mask (no causal chunks, no blockwise attention).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        seed: int = 0,
        cell_reuse: bool = False,
        expert_dispatcher=None,
        lora=None,
        moe: MoEConfig = None,
        dsa: DSATrainingConfig = None,
    ):
        super().__init__()
        validate_model_config(cfg)
        moe = moe_policy(moe).resolved(trained_weights=False)
        validate_moe_config(moe, cfg.expert_bias)
        dsa = dsa_training(dsa)
        validate_dsa_training(dsa)
        #: The MoE training policy the layers were built with (``moe.*``; ``auto`` resolved).
        self.moe_config = moe
        #: How the DSA indexers train (``dsa.*``); the layers start in its stage (:func:`model.mla.set_dsa_stage`
        #: switches them, as the end of the dense warm-up does).
        self.dsa_training = dsa
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (the trainer takes it from the tokenizer)")
        self.config = cfg
        rng = np.random.default_rng(seed)
        adapters = NO_LORA if lora is None else lora.scope()  # one generator for every lora_A, in build order
        std = cfg.initializer_range
        self.embed_tokens = Embedding(
            cfg.vocab_size, cfg.hidden_size, std, rng, adapters.weight_dtype("embed_tokens.weight")
        )
        layers = []
        for layer_idx in range(cfg.num_layers):
            layer_cls = MoEDecoderLayer if layer_idx >= cfg.first_k_dense else DecoderLayer
            if cell_reuse:
                layer_cls = reused_layer_class(layer_cls)
            layer_lora = adapters.child(f"layers.{layer_idx}")
            layers.append(
                layer_cls(
                    cfg,
                    layer_idx,
                    rng,
                    expert_dispatcher=expert_dispatcher,
                    lora=layer_lora,
                    moe=moe,
                    dsa_stage=dsa.stage,
                )
            )
        self.layers = nn.CellList(layers)
        self.num_dense = cfg.first_k_dense
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = cfg.tie_word_embeddings
        if not cfg.tie_word_embeddings:
            self.lm_head = Embedding(cfg.vocab_size, cfg.hidden_size, std, rng, adapters.weight_dtype("lm_head.weight"))
        self.rotary_emb = RotaryEmbedding(
            cfg.rotary_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling, cfg.rope_interleaved
        )
        self.logits_matmul = ops.MatMul(transpose_b=True)
        self.num_mtp = cfg.mtp_layers
        if cfg.mtp_layers:  # built after the main parameters, so they draw the same initial values with or without
            mtp_cls = mtp_layer_class(MoEDecoderLayer)
            self.mtp_layers = nn.CellList(
                [
                    mtp_cls(
                        cfg,
                        cfg.num_layers + depth,
                        rng,
                        expert_dispatcher,
                        adapters.child(f"mtp_layers.{depth}"),
                        moe=moe,
                        dsa_stage=dsa.stage,
                    )
                    for depth in range(cfg.mtp_layers)
                ]
            )
        self.adapter_plan = lora
        if lora is not None:
            lora.freeze(self)

    def embed(self, input_ids_BS):
        return self.embed_tokens(input_ids_BS)

    def head_parameter(self):
        """The parameter of the LM head ``[V, H]``: the embedding's when ``tie_word_embeddings``."""
        return self.head_cell().weight

    def head_cell(self):
        return self.embed_tokens if self.tie_word_embeddings else self.lm_head

    def head_weight(self):
        """The LM head ``[V, H]`` as the forward reads it (the embedding when ``tie_word_embeddings``)."""
        return self.head_cell().table()

    def final_hidden(self, x_ZH):
        """Final norm: the LM head's input rows ``[rows of x, H]``, every leading axis of ``x`` flattened."""
        x_ZH = self.norm(x_ZH)
        return x_ZH.reshape(-1, x_ZH.shape[-1])

    def final_logits(self, x_ZH):
        """Final norm and LM head: logits ``[rows of x, V]`` fp32, every leading axis of ``x`` flattened."""
        hidden_ZH = self.final_hidden(x_ZH)
        return self.logits_matmul(hidden_ZH, self.head_weight().astype(hidden_ZH.dtype)).astype(ms.float32)

    def attention_masks(self, doc_ids_BS):
        """The attention masks every layer of a training or evaluation forward takes."""
        num_heads = self.config.num_heads
        if ops.is_sequence_value_unknown(doc_ids_BS.shape):  # a graph compiled for any length
            return document_causal_mask(doc_ids_BS, num_heads)
        if self.layers[0].self_attn.dsa_active:  # indexed_attention past attention.BLOCK_SIZE, else the [S, S] mask
            return training_attention_masks(doc_ids_BS, num_heads, True, chunked=False)
        return training_attention_masks(doc_ids_BS, num_heads, self.layers[0].self_attn.use_blockwise)

    def run_layers(self, x_BSH, layer_step, inputs):
        """The layer loop of training, evaluation, prefill and decode: ``(x after the last layer, [out of each
        layer])`` with ``x, out = layer_step(layer_idx, layer, x, inputs)`` for each decoder layer in order.
        Training's step is :meth:`train_layer_step`; the serving graphs pass theirs (model/export/serving.py)."""
        outs = []
        for layer_idx, layer in enumerate(self.layers):
            x_BSH, out = layer_step(layer_idx, layer, x_BSH, inputs)
            outs.append(out)
        return x_BSH, outs

    def train_layer_step(self, layer_idx, layer, x_BSH, inputs):
        """The layer's own ``construct`` on ``inputs`` ``(cos, sin, masks, doc_ids)``: ``(x, aux)``."""
        return layer(x_BSH, *inputs)

    def construct(self, input_ids_BS, doc_ids_BS, hidden_only=False, future_ids_UBS=None):
        batch, seq_len = input_ids_BS.shape
        cos, sin = self.rotary_emb(ops.arange(seq_len, dtype=ms.int32))
        masks = self.attention_masks(doc_ids_BS)
        layer_inputs = (cos, sin, masks, doc_ids_BS)
        x_BSH, auxes = self.run_layers(self.embed(input_ids_BS), self.train_layer_step, layer_inputs)
        indexer_losses = [aux[outputs.INDEXER_LOSS] for aux in auxes]
        moe_auxes = auxes[self.num_dense :]  # dense layers' zeros stay out of the sums and the per-MoE-layer rows
        aux_losses = [aux[outputs.AUX_LOSS] for aux in moe_auxes]
        z_losses = [aux[outputs.Z_LOSS] for aux in moe_auxes]
        if hidden_only:  # the loss applies the head itself, in chunks (model.lm_loss)
            head_out = self.final_hidden(x_BSH)
        else:
            head_out = self.final_logits(x_BSH).reshape(batch, seq_len, -1)
        mtp_UTH = ops.zeros((0,), ms.float32)
        if future_ids_UBS is not None and self.num_mtp:
            normed_TH = head_out if hidden_only else self.final_hidden(x_BSH)
            mtp_UTH, mtp_aux, mtp_z, mtp_indexer = self.mtp_hidden(
                normed_TH, future_ids_UBS, cos, sin, masks, doc_ids_BS
            )
            aux_losses.append(mtp_aux)
            z_losses.append(mtp_z)
            indexer_losses += mtp_indexer
        zero = ops.zeros((), ms.float32)
        if not moe_auxes:
            routing_stats = ops.zeros((0, len(ROUTING_STATS), self.config.num_experts), ms.float32)
            layer_stats = ops.zeros((0, len(LAYER_STATS)), ms.float32)
        else:
            routing_stats = ops.stack([aux[outputs.ROUTING_STATS] for aux in moe_auxes])
            layer_stats = ops.stack([aux[outputs.LAYER_STATS] for aux in moe_auxes])
        return outputs.model_output(
            head_out,
            ops.stack(aux_losses).sum() if aux_losses else zero,
            ops.stack(z_losses).sum() if z_losses else zero,
            routing_stats,
            layer_stats,
            mtp_UTH,
            ops.stack(indexer_losses).mean() if self.layers[0].self_attn.dsa_active else zero,
        )

    def mtp_hidden(self, hidden_TH, future_ids_UBS, cos, sin, masks, doc_ids_BS):
        """``(shared_head.norm outputs [U, T, H], summed aux loss, summed z loss, [indexer loss per depth] (DSA;
        else empty))`` of the MTP depths; depth 1 starts from ``hidden_TH``, the main model's final-normed rows
        (model/mtp.py)."""
        batch, seq_len = doc_ids_BS.shape
        previous_BSH = hidden_TH.reshape(batch, seq_len, -1)
        normed, aux_total, z_total, indexer_losses = [], 0.0, 0.0, []
        for depth, mtp_layer in enumerate(self.mtp_layers):
            embedded_BSH = self.embed(future_ids_UBS[depth])
            previous_BSH, aux = mtp_layer(embedded_BSH, previous_BSH, cos, sin, masks, doc_ids_BS)
            if mtp_layer.self_attn.dsa_active:
                indexer_losses.append(aux[outputs.INDEXER_LOSS])
            normed.append(mtp_layer.shared_head(previous_BSH).reshape(batch * seq_len, -1))
            aux_total = aux_total + aux[outputs.AUX_LOSS]
            z_total = z_total + aux[outputs.Z_LOSS]
        return ops.stack(normed), aux_total, z_total, indexer_losses
