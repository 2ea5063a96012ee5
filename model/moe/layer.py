"""The MoE feed-forward block: :class:`Router` -> token dispatcher -> :class:`RoutedExperts` (+ shared experts).

Shape legend: B batch, S sequence, T = B*S tokens, H hidden, E experts, K top-k, A = T*K assignments.
"""

import mindspore as ms
import numpy as np
from mindspore import nn, ops
from mindspore.ops import functional as F

from mindmoe.model.config import ModelConfig
from mindmoe.model.lora_layers import NO_LORA, AdapterScope
from mindmoe.model.mlp import SwiGLU
from mindmoe.model.moe.locking import flip_rate
from mindmoe.model.moe.lora_experts import routed_experts
from mindmoe.model.moe.router import Router
from mindmoe.model.moe.token_dispatcher import SINGLE_DEVICE
from mindmoe.model.moe_config import MoEConfig, moe_policy

#: Rows of the ``routing_stats`` output ``[ROUTING_STATS, E]`` of every MoE layer.
ROUTING_STATS = ("chosen", "kept", "locked_kept")
#: Entries of the ``layer_stats`` output ``[LAYER_STATS]``.
LAYER_STATS = ("dropped", "lock_rate", "flip_rate", "aux_loss", "z_loss")


def routing_stats(topk_idx_TK, kept_A, locked_T, num_experts: int):
    """``[ROUTING_STATS, E]``: assignments per expert after locking, those kept, the kept ones of locked tokens."""
    num_tokens, top_k = topk_idx_TK.shape
    locked_A = ops.broadcast_to(locked_T.expand_dims(-1), (num_tokens, top_k)).reshape(-1)
    one_hot_AE = ops.one_hot(topk_idx_TK.reshape(-1), num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32))
    kept_E = (one_hot_AE * kept_A.expand_dims(-1)).sum(0)
    locked_kept_E = (one_hot_AE * (kept_A * locked_A).expand_dims(-1)).sum(0)
    return ops.stack((one_hot_AE.sum(0), kept_E, locked_kept_E))


class MoELayer(nn.Cell):
    """``construct(x [B,S,H], doc_ids [B,S])`` -> ``(out, aux_loss, z_loss, routing_stats [3, E],
    layer_stats [5])`` for one micro-batch (rows named by ``ROUTING_STATS`` / ``LAYER_STATS``).

    ``chosen`` counts the assignments after locking, ``kept`` those that found capacity (the
    effective load, which drives the bias update), ``locked_kept`` the kept ones made by locked
    tokens (for ``expert_update`` isolation).

    ``expert_dispatcher`` (a :class:`model.moe.token_dispatcher.ExpertPlacement`, default one process
    holding every expert) decides which experts this process holds and builds the layer's dispatcher.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        rng: np.random.Generator,
        expert_dispatcher=None,
        lora: AdapterScope = NO_LORA,
        moe: MoEConfig = None,
    ):
        super().__init__()
        placement = SINGLE_DEVICE if expert_dispatcher is None else expert_dispatcher
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        moe = moe_policy(moe)
        self.isolate_token_grad = moe.expert_lock and moe.isolation_mode == "token_grad"
        self.isolation_decay = moe.isolation_decay
        self.router = Router(cfg, rng, moe)
        self.experts = routed_experts(
            cfg.num_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.initializer_range,
            rng,
            lora.child("experts"),
            held_experts=placement.held_experts(cfg.num_experts),
        )
        self.dispatcher = placement.dispatcher(cfg, moe)
        # CPU training with dropless dispatch: the experts run from tokens to tokens in one host kernel, so no
        # expert row lives in the graph (kernels.token_experts; Ascend keeps the grouped path).
        self.routes_tokens = self.dispatcher.routes_tokens and self.experts.build_token_kernel(cfg.top_k)
        self.has_shared = cfg.num_shared_experts > 0
        if self.has_shared:
            self.shared_experts = SwiGLU(
                cfg.hidden_size,
                cfg.moe_intermediate_size * cfg.num_shared_experts,
                cfg.initializer_range,
                rng,
                lora.child("shared_experts"),
            )

    def expert_output(self, x_TH, routing, dispatcher, grad_scale_T=None):
        """``(routed + shared output [T, H], kept [A] fp32)`` for ``routing = (topk_idx [T, K], weight [T, K])``.

        ``grad_scale_T`` (``token_grad`` isolation): how much each token trains the expert weights.
        The serving graphs call this with their own (dropless) dispatcher.
        """
        expert_inputs, state = dispatcher.dispatch(x_TH, routing)
        group_sizes = dispatcher.group_sizes(state)
        if self.isolate_token_grad and grad_scale_T is not None:
            row_scale = dispatcher.row_scale(grad_scale_T, state)
            if group_sizes is None:
                expert_outputs = self.experts.with_weight_grad_scale(expert_inputs, row_scale)
            else:
                expert_outputs = self.experts.grouped(expert_inputs, group_sizes, row_scale)
        elif group_sizes is None:
            expert_outputs = self.experts(expert_inputs)
        else:
            expert_outputs = self.experts.grouped(expert_inputs, group_sizes)
        out_TH = dispatcher.combine(expert_outputs, state)
        if self.has_shared:
            out_TH = out_TH + self.shared_experts(x_TH)
        return out_TH, dispatcher.kept(state)

    def token_output(self, x_TH, routing, grad_scale_T):
        """:meth:`expert_output` of the training dispatcher on the experts' tokens-to-tokens kernel."""
        num_tokens = x_TH.shape[0]
        scale_T = grad_scale_T if self.isolate_token_grad else ops.ones((num_tokens,), ms.float32)
        out_TH = self.dispatcher.token_experts(x_TH, routing, self.experts, scale_T)
        if self.has_shared:
            out_TH = out_TH + self.shared_experts(x_TH)
        return out_TH, ops.ones((num_tokens * self.top_k,), ms.float32)

    def construct(self, x_BSH, doc_ids_BS):
        batch, seq_len, hidden = x_BSH.shape
        x_TH = x_BSH.reshape(-1, hidden)
        num_tokens = x_TH.shape[0]
        logits_TE, scores_TE, natural_TK = self.router.natural_routing(x_TH)
        topk_idx_TK, locked_T = self.router.locked_routing(natural_TK, doc_ids_BS)
        weight_TK = self.router.combine_weights(scores_TE, topk_idx_TK)
        # lambda for locked tokens, 1 otherwise: how much each token trains its experts.
        grad_scale_T = 1.0 - (1.0 - self.isolation_decay) * locked_T
        # Static token counts only (a host kernel's shapes are fixed when it compiles); a test may set another
        # dispatcher after the build.
        if self.routes_tokens and self.dispatcher.routes_tokens and F.isconstant(num_tokens):
            out_TH, kept_A = self.token_output(x_TH, (topk_idx_TK, weight_TK), grad_scale_T)
        else:
            out_TH, kept_A = self.expert_output(x_TH, (topk_idx_TK, weight_TK), self.dispatcher, grad_scale_T)

        aux = self.router.balance_loss(scores_TE, natural_TK, batch, seq_len)
        router_z = self.router.router_z_loss(logits_TE)
        layer_stats = ops.stack(
            (
                num_tokens * self.top_k - kept_A.sum(),
                locked_T.mean(),
                flip_rate(natural_TK.reshape(batch, seq_len, self.top_k), doc_ids_BS),
                aux,
                router_z,
            )
        )
        stats = routing_stats(topk_idx_TK, kept_A, locked_T, self.num_experts)
        return out_TH.reshape(batch, seq_len, hidden), aux, router_z, stats, layer_stats
