"""Mixture-of-Experts block: router, token dispatchers, experts, locking and the layer that composes them."""

from mindmoe.model.moe.dispatch import capacity_slots, expert_capacity
from mindmoe.model.moe.experts import RoutedExperts
from mindmoe.model.moe.layer import MoELayer
from mindmoe.model.moe.locking import flip_rate, lock_routing, same_expert_set
from mindmoe.model.moe.router import (
    Router,
    aux_probs,
    expert_counts,
    gather_weights,
    router_scores,
    select_experts,
    seq_aux_loss,
    switch_aux_loss,
    topk_routing,
    updated_bias,
    z_loss,
)
from mindmoe.model.moe.token_dispatcher import (
    AllExpertsDispatcher,
    CapacityDispatcher,
    DroplessDispatcher,
    ExpertPlacement,
    local_dispatcher,
)

__all__ = [
    "AllExpertsDispatcher",
    "CapacityDispatcher",
    "DroplessDispatcher",
    "ExpertPlacement",
    "MoELayer",
    "RoutedExperts",
    "Router",
    "aux_probs",
    "capacity_slots",
    "expert_capacity",
    "expert_counts",
    "flip_rate",
    "gather_weights",
    "local_dispatcher",
    "lock_routing",
    "router_scores",
    "same_expert_set",
    "select_experts",
    "seq_aux_loss",
    "switch_aux_loss",
    "topk_routing",
    "updated_bias",
    "z_loss",
]
