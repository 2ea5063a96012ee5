"""The MoE feed-forward block: router -> (locking) -> dispatch -> routed experts (+ shared experts).

Shape legend: B batch, S sequence, T = B*S tokens, H hidden, E experts, K top-k, C capacity,
A = T*K assignments.
"""

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindmoe.model.config import ModelConfig
from mindmoe.model.linear import normal_init
from mindmoe.model.mlp import SwiGLU
from mindmoe.model.moe.dispatch import (
    capacity_slots,
    combine_from_slots,
    dense_combine_weights,
    expert_capacity,
    gather_to_slots,
)
from mindmoe.model.moe.experts import RoutedExperts
from mindmoe.model.moe.locking import flip_rate, lock_routing
from mindmoe.model.moe.router import (
    aux_probs,
    gather_weights,
    router_scores,
    select_experts,
    seq_aux_loss,
    switch_aux_loss,
    z_loss,
)

#: Rows of the ``routing_stats`` output ``[ROUTING_STATS, E]`` of every MoE layer.
ROUTING_STATS = ("chosen", "kept", "locked_kept")
#: Entries of the ``layer_stats`` output ``[LAYER_STATS]``.
LAYER_STATS = ("dropped", "lock_rate", "flip_rate", "aux_loss", "z_loss")


class Router(nn.Cell):
    """Linear router ``[E, H]`` evaluated in fp32 whatever the compute dtype.

    ``e_score_correction_bias`` (if ``expert_bias``) is state, not a trained weight: the
    optimizer never sees it; the trainer moves it once per step from the observed load.
    """

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        self.weight = Parameter(
            normal_init((cfg.num_experts, cfg.hidden_size), cfg.initializer_range, rng), name="weight"
        )
        self.has_bias = cfg.expert_bias
        if cfg.expert_bias:
            self.e_score_correction_bias = Parameter(
                Tensor(np.zeros(cfg.num_experts, np.float32)), name="e_score_correction_bias", requires_grad=False
            )
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x_TH):
        return self.matmul(x_TH.astype(ms.float32), self.weight.astype(ms.float32))


class MoELayer(nn.Cell):
    """``construct(x [B,S,H], doc_ids [B,S])`` -> ``(out, aux_loss, z_loss, routing_stats [3, E],
    layer_stats [5])`` for one micro-batch (rows named by ``ROUTING_STATS`` / ``LAYER_STATS``).

    ``chosen`` counts the assignments after locking, ``kept`` those that found capacity (the
    effective load, which drives the bias update), ``locked_kept`` the kept ones made by locked
    tokens (for ``expert_update`` isolation).
    """

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.score_func = cfg.score_func
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.aux_loss_type = cfg.aux_loss
        self.aux_loss_coeff = cfg.aux_loss_coeff
        self.z_loss_coeff = cfg.z_loss_coeff
        self.dropless = cfg.dispatch == "dropless"
        self.capacity_factor = cfg.capacity_factor
        self.expert_lock = cfg.expert_lock
        self.lock_run_length = cfg.lock_run_length
        self.lock_span = cfg.lock_span
        self.isolate_token_grad = cfg.expert_lock and cfg.isolation_mode == "token_grad"
        self.isolation_decay = cfg.isolation_decay
        # Megatron computes the balancing loss on the plain top-K of the scores, whatever bias or
        # group limits did to selection; only then do the two differ.
        self.aux_needs_plain_topk = cfg.expert_bias or cfg.n_group > 1
        self.router = Router(cfg, rng)
        self.experts = RoutedExperts(
            cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.initializer_range, rng
        )
        self.has_shared = cfg.num_shared_experts > 0
        if self.has_shared:
            self.shared_experts = SwiGLU(
                cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts, cfg.initializer_range, rng
            )

    def construct(self, x_BSH, doc_ids_BS):
        batch, seq_len, hidden = x_BSH.shape
        x_TH = x_BSH.reshape(-1, hidden)
        num_tokens = x_TH.shape[0]
        logits_TE = self.router(x_TH)
        scores_TE = router_scores(logits_TE, self.score_func)
        bias_E = self.router.e_score_correction_bias if self.router.has_bias else None
        natural_TK = select_experts(scores_TE, self.top_k, bias_E, self.n_group, self.topk_group)
        topk_idx_TK = natural_TK
        locked_T = ops.zeros((num_tokens,), ms.float32)
        if self.expert_lock:
            locked_BS, locked_idx_BSK = lock_routing(
                natural_TK.reshape(batch, seq_len, self.top_k), doc_ids_BS, self.lock_run_length, self.lock_span
            )
            topk_idx_TK = locked_idx_BSK.reshape(num_tokens, self.top_k)
            locked_T = locked_BS.reshape(num_tokens).astype(ms.float32)
        weight_TK = gather_weights(scores_TE, topk_idx_TK, self.norm_topk_prob, self.routed_scaling_factor)
        # lambda for locked tokens, 1 otherwise: how much each token trains its experts.
        grad_scale_T = 1.0 - (1.0 - self.isolation_decay) * locked_T

        locked_A = ops.broadcast_to(locked_T.expand_dims(-1), (num_tokens, self.top_k)).reshape(-1)
        if self.dropless:
            x_ETH = ops.broadcast_to(x_TH.expand_dims(0), (self.num_experts, num_tokens, hidden))
            if self.isolate_token_grad:
                y_ETH = self.experts.with_weight_grad_scale(
                    x_ETH, ops.broadcast_to(grad_scale_T.expand_dims(0), (self.num_experts, num_tokens))
                )
            else:
                y_ETH = self.experts(x_ETH)
            combine_TE = dense_combine_weights(topk_idx_TK, weight_TK, self.num_experts).astype(x_TH.dtype)
            routed_TH = (y_ETH.transpose(1, 0, 2) * combine_TE.expand_dims(-1)).sum(1)
            kept_A = ops.ones(locked_A.shape, ms.float32)
        else:
            capacity = expert_capacity(num_tokens, self.top_k, self.num_experts, self.capacity_factor)
            slot_A, kept_mask_A = capacity_slots(topk_idx_TK, self.num_experts, capacity)
            x_ECH = gather_to_slots(x_TH, slot_A, self.num_experts, capacity)
            if self.isolate_token_grad:
                scale_A = ops.broadcast_to(grad_scale_T.expand_dims(-1), (num_tokens, self.top_k)).reshape(-1)
                num_slots = self.num_experts * capacity
                # Slots are unique per kept assignment; the extra last slot collects the dropped ones.
                slot_scale_S = 1.0 + ops.scatter_nd(slot_A.expand_dims(-1), scale_A - 1.0, (num_slots + 1,))
                y_ECH = self.experts.with_weight_grad_scale(
                    x_ECH, slot_scale_S[:num_slots].reshape(self.num_experts, capacity)
                )
            else:
                y_ECH = self.experts(x_ECH)
            routed_TH = combine_from_slots(y_ECH, slot_A, weight_TK)
            kept_A = kept_mask_A.astype(ms.float32)
        out_TH = routed_TH
        if self.has_shared:
            out_TH = out_TH + self.shared_experts(x_TH)

        aux = ops.zeros((), ms.float32)
        if self.aux_loss_type != "none":
            aux_topk_TK = natural_TK
            if self.aux_needs_plain_topk:
                aux_topk_TK = select_experts(scores_TE, self.top_k)
            probs_TE = aux_probs(scores_TE, self.score_func)
            if self.aux_loss_type == "seq":
                aux = seq_aux_loss(
                    probs_TE.reshape(batch, seq_len, -1), aux_topk_TK.reshape(batch, seq_len, -1), self.aux_loss_coeff
                )
            else:
                aux = switch_aux_loss(probs_TE, aux_topk_TK, self.aux_loss_coeff)
        router_z = ops.zeros((), ms.float32)
        if self.z_loss_coeff > 0:
            router_z = z_loss(logits_TE, self.z_loss_coeff)

        one_hot_AE = ops.one_hot(
            topk_idx_TK.reshape(-1), self.num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32)
        )
        kept_E = (one_hot_AE * kept_A.expand_dims(-1)).sum(0)
        locked_kept_E = (one_hot_AE * (kept_A * locked_A).expand_dims(-1)).sum(0)
        routing_stats = ops.stack((one_hot_AE.sum(0), kept_E, locked_kept_E))
        layer_stats = ops.stack(
            (
                num_tokens * self.top_k - kept_A.sum(),
                locked_T.mean(),
                flip_rate(natural_TK.reshape(batch, seq_len, self.top_k), doc_ids_BS),
                aux,
                router_z,
            )
        )
        return out_TH.reshape(batch, seq_len, hidden), aux, router_z, routing_stats, layer_stats
