"""Mixture-of-Experts block: router math, dispatch, locking and the layer."""
from model.moe.dispatch import capacity_slots, expert_capacity
from model.moe.layer import MoELayer, Router
from model.moe.locking import flip_rate, lock_routing
from model.moe.router import (aux_probs, expert_counts, gather_weights, router_scores, select_experts,
                              seq_aux_loss, switch_aux_loss, topk_routing, updated_bias, z_loss)

__all__ = [
    "MoELayer", "Router", "aux_probs", "capacity_slots", "expert_capacity", "expert_counts", "flip_rate",
    "gather_weights", "lock_routing", "router_scores", "select_experts", "seq_aux_loss", "switch_aux_loss",
    "topk_routing", "updated_bias", "z_loss",
]
