"""A tiny MoE layer config and a seeded layer with O(1) weights, shared by the MoE, locking and balancing tests."""

import numpy as np
from mindspore import Tensor

from mindmoe.model.config import ModelConfig
from mindmoe.model.moe import MoELayer

HIDDEN, EXPERTS, TOP_K, INTERMEDIATE = 16, 4, 2, 8
BATCH, SEQ = 2, 6  # T = 12 tokens, 24 assignments


def moe_config(dispatch, capacity_factor=4.0, score_func="softmax", **overrides):
    fields = dict(
        hidden_size=HIDDEN,
        num_experts=EXPERTS,
        top_k=TOP_K,
        moe_intermediate_size=INTERMEDIATE,
        num_shared_experts=1,
        score_func=score_func,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        dispatch=dispatch,
        capacity_factor=capacity_factor,
        aux_loss="switch",
        aux_loss_coeff=0.1,
        z_loss_coeff=0.01,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def build_layer(cfg, seed=7):
    """A MoELayer with O(1) random weights (seeded, so every dispatch mode gets the same weights)."""
    layer = MoELayer(cfg, np.random.default_rng(0))
    rng = np.random.default_rng(seed)
    for _, param in layer.parameters_and_names():
        param.set_data(Tensor((0.4 * rng.normal(size=param.shape)).astype(np.float32)))
    return layer


def layer_weights(layer):
    return {name: param.asnumpy().astype(np.float64) for name, param in layer.parameters_and_names()}


def np_silu(x):
    return x / (1.0 + np.exp(-x))


def np_swiglu(x, gate, up, down):
    return (np_silu(x @ gate.T) * (x @ up.T)) @ down.T
