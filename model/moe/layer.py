"""The MoE feed-forward block: router -> routed experts (+ shared experts).

Shape legend: B batch, S sequence, T = B*S tokens, H hidden, E experts, K top-k, C capacity.
"""
import numpy as np
from mindspore import Parameter, nn, ops
import mindspore as ms

from model.config import ModelConfig
from model.linear import normal_init
from model.mlp import SwiGLU
from model.moe.dispatch import (capacity_slots, combine_from_slots, dense_combine_weights,
                                expert_capacity, gather_to_slots)
from model.moe.experts import RoutedExperts
from model.moe.router import (aux_probs, expert_counts, router_scores, switch_aux_loss,
                              topk_routing, z_loss)


class Router(nn.Cell):
    """Linear router ``[E, H]`` evaluated in fp32 whatever the compute dtype."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        self.weight = Parameter(normal_init((cfg.num_experts, cfg.hidden_size), cfg.initializer_range, rng),
                                name="weight")
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x_TH):
        return self.matmul(x_TH.astype(ms.float32), self.weight.astype(ms.float32))


class MoELayer(nn.Cell):
    """Returns ``(out_BSH, aux_loss, z_loss, counts_E, dropped)`` for one micro-batch.

    ``counts_E`` are the router's chosen assignments per expert and ``dropped`` the number of
    assignments that found no capacity (always 0 for dropless).
    """

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.score_func = cfg.score_func
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.use_aux_loss = cfg.aux_loss == "switch"
        self.aux_loss_coeff = cfg.aux_loss_coeff
        self.z_loss_coeff = cfg.z_loss_coeff
        self.dropless = cfg.dispatch == "dropless"
        self.capacity_factor = cfg.capacity_factor
        self.router = Router(cfg, rng)
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                     cfg.initializer_range, rng)
        self.has_shared = cfg.num_shared_experts > 0
        if self.has_shared:
            self.shared_experts = SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts,
                                         cfg.initializer_range, rng)

    def construct(self, x_BSH):
        batch, seq_len, hidden = x_BSH.shape
        x_TH = x_BSH.reshape(-1, hidden)
        num_tokens = x_TH.shape[0]
        logits_TE = self.router(x_TH)
        scores_TE = router_scores(logits_TE, self.score_func)
        topk_idx_TK, weight_TK = topk_routing(scores_TE, self.top_k, self.norm_topk_prob,
                                              self.routed_scaling_factor)
        if self.dropless:
            y_ETH = self.experts(ops.broadcast_to(x_TH.expand_dims(0), (self.num_experts, num_tokens, hidden)))
            combine_TE = dense_combine_weights(topk_idx_TK, weight_TK, self.num_experts).astype(x_TH.dtype)
            routed_TH = (y_ETH.transpose(1, 0, 2) * combine_TE.expand_dims(-1)).sum(1)
            dropped = ops.zeros((), ms.float32)
        else:
            capacity = expert_capacity(num_tokens, self.top_k, self.num_experts, self.capacity_factor)
            slot_A, kept_A = capacity_slots(topk_idx_TK, self.num_experts, capacity)
            y_ECH = self.experts(gather_to_slots(x_TH, slot_A, self.num_experts, capacity))
            routed_TH = combine_from_slots(y_ECH, slot_A, weight_TK)
            dropped = (1 - kept_A.astype(ms.float32)).sum()
        out_TH = routed_TH
        if self.has_shared:
            out_TH = out_TH + self.shared_experts(x_TH)
        aux = ops.zeros((), ms.float32)
        if self.use_aux_loss:
            aux = switch_aux_loss(aux_probs(scores_TE, self.score_func), topk_idx_TK, self.aux_loss_coeff)
        router_z = ops.zeros((), ms.float32)
        if self.z_loss_coeff > 0:
            router_z = z_loss(logits_TE, self.z_loss_coeff)
        counts_E = expert_counts(topk_idx_TK, self.num_experts)
        return out_TH.reshape(batch, seq_len, hidden), aux, router_z, counts_E, dropped
