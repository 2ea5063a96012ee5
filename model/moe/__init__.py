"""Mixture-of-Experts block: router math, dispatch, locking and the layer."""

from mindmoe.model.moe.dispatch import capacity_slots, expert_capacity
from mindmoe.model.moe.layer import MoELayer, Router
from mindmoe.model.moe.locking import flip_rate, lock_routing
from mindmoe.model.moe.router import (
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

__all__ = [
    "MoELayer",
    "Router",
    "aux_probs",
    "capacity_slots",
    "expert_capacity",
    "expert_counts",
    "flip_rate",
    "gather_weights",
    "lock_routing",
    "router_scores",
    "select_experts",
    "seq_aux_loss",
    "switch_aux_loss",
    "topk_routing",
    "updated_bias",
    "z_loss",
]
