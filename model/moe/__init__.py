"""Mixture-of-Experts block: router math, dispatch and the layer."""
from model.moe.dispatch import capacity_slots, expert_capacity
from model.moe.layer import MoELayer, Router
from model.moe.router import (aux_probs, expert_counts, router_scores, switch_aux_loss,
                              topk_routing, z_loss)

__all__ = [
    "MoELayer", "Router", "aux_probs", "capacity_slots", "expert_capacity", "expert_counts",
    "router_scores", "switch_aux_loss", "topk_routing", "z_loss",
]
