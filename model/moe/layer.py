"""The MoE feed-forward block: :class:`Router` -> routed part (a token dispatcher over the :class:`RoutedExperts`, or
their host kernel; :mod:`model.moe.routed_part`) + shared experts.

Shape legend: B batch, S sequence, T = B*S tokens, H hidden, E experts, K top-k, A = T*K assignments.
"""

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindmoe.model.config import ModelConfig
from mindmoe.model.lora.layers import NO_LORA, AdapterScope
from mindmoe.model.mlp import SwiGLU
from mindmoe.model.moe.locking import flip_rate
from mindmoe.model.moe.lora_experts import routed_experts
from mindmoe.model.moe.routed_part import dispatched_output, routed_part
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
    holding every expert) decides which experts this process holds and builds the layer's dispatcher, behind
    which :func:`model.moe.routed_part.routed_part` picks the layer's one routed part.
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
        isolate_token_grad = moe.expert_lock and moe.isolation_mode == "token_grad"
        # lambda scales a locked token's share of the expert weight gradients; 1 (exactly) without token_grad.
        self.isolation_decay = moe.isolation_decay if isolate_token_grad else 1.0
        self.router = Router(cfg, rng, moe)
        self.experts = routed_experts(
            cfg.num_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.initializer_range,
            rng,
            lora.child("experts"),
            held_experts=placement.held_experts(cfg.num_experts),
            row_scaled=isolate_token_grad,
        )
        self.routed = routed_part(placement.dispatcher(cfg, moe), self.experts, cfg.top_k)
        self.has_shared = cfg.num_shared_experts > 0
        if self.has_shared:
            self.shared_experts = SwiGLU(
                cfg.hidden_size,
                cfg.moe_intermediate_size * cfg.num_shared_experts,
                cfg.initializer_range,
                rng,
                lora.child("shared_experts"),
            )

    def dispatched(self, x_TH, routing, dispatcher):
        """Routed + shared output ``[T, H]`` of the experts behind another ``dispatcher`` (the serving graphs' grouped
        one, for any token count); no gradient isolation."""
        routed_TH, _ = dispatched_output(dispatcher, self.experts, x_TH, routing, None)
        if self.has_shared:
            return routed_TH + self.shared_experts(x_TH)
        return routed_TH

    def construct(self, x_BSH, doc_ids_BS):
        batch, seq_len, hidden = x_BSH.shape
        x_TH = x_BSH.reshape(-1, hidden)
        num_tokens = x_TH.shape[0]
        logits_TE, scores_TE, natural_TK = self.router.natural_routing(x_TH)
        topk_idx_TK, locked_T = self.router.locked_routing(natural_TK, doc_ids_BS)
        weight_TK = self.router.combine_weights(scores_TE, topk_idx_TK)
        # lambda for locked tokens, 1 otherwise: how much each token trains its experts.
        grad_scale_T = 1.0 - (1.0 - self.isolation_decay) * locked_T
        routed_TH, kept_A = self.routed(self.experts, x_TH, (topk_idx_TK, weight_TK), grad_scale_T)
        out_TH = routed_TH + self.shared_experts(x_TH) if self.has_shared else routed_TH

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
