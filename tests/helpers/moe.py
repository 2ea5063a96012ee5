"""A tiny MoE layer config and a seeded layer with O(1) weights, shared by the MoE, locking and balancing tests;
NumPy transcriptions of DeepSeek-V3 ``Gate`` and Megatron-Core's balancing losses and bias update."""

import numpy as np
from mindspore import Tensor

from mindmoe.model.config import ModelConfig
from mindmoe.model.moe import ExpertPlacement, MoELayer
from mindmoe.model.moe_config import MOE_KEYS, MoEConfig, validate_moe_config

HIDDEN, EXPERTS, TOP_K, INTERMEDIATE = 16, 4, 2, 8
BATCH, SEQ = 2, 6  # T = 12 tokens, 24 assignments


def split_fields(fields):
    """``(model fields, moe fields)`` of one flat mapping: the ``moe.*`` keys go to the policy."""
    return (
        {key: value for key, value in fields.items() if key not in MOE_KEYS},
        {key: value for key, value in fields.items() if key in MOE_KEYS},
    )


def layer_configs(dispatch, capacity_factor=4.0, score_func="softmax", **overrides):
    """``(ModelConfig, MoEConfig)`` of the tiny layer; ``overrides`` may name keys of either."""
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
    model_fields, moe_fields = split_fields(fields)
    cfg, moe = ModelConfig(**model_fields), MoEConfig(**moe_fields)
    # A layer does not validate its policy (the model does): a typo here would test a policy no run can have.
    validate_moe_config(moe, cfg.expert_bias)
    return cfg, moe


class GivenDispatcher(ExpertPlacement):
    """A placement holding every expert whose layers route through ``make_dispatcher()`` (a new one per layer)."""

    def __init__(self, make_dispatcher):
        self.make_dispatcher = make_dispatcher

    def dispatcher(self, cfg, moe=None):
        return self.make_dispatcher()


def build_layer(cfg, moe, seed=7, placement=None):
    """A MoELayer with O(1) random weights (seeded, so every dispatch mode gets the same weights); ``placement``:
    its ``expert_dispatcher`` (e.g. :class:`GivenDispatcher`)."""
    layer = MoELayer(cfg, np.random.default_rng(0), expert_dispatcher=placement, moe=moe)
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


# ---- NumPy transcriptions (float64) of the published balancing code ------------------------------


def np_deepseek_v3_gate(logits, bias, top_k, n_groups, topk_groups, route_scale):
    """DeepSeek-V3 ``inference/model.py::Gate.forward`` (sigmoid, with bias), in NumPy."""
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    original_scores = scores
    scores = scores + bias
    tokens = scores.shape[0]
    if n_groups > 1:
        grouped = scores.reshape(tokens, n_groups, -1)
        group_scores = np.sort(grouped, -1)[..., -2:].sum(-1)  # topk(2).sum
        indices = np.argsort(-group_scores, -1, kind="stable")[:, :topk_groups]
        mask = np.ones((tokens, n_groups), bool)
        np.put_along_axis(mask, indices, False, 1)
        scores = np.where(mask[:, :, None], -np.inf, grouped).reshape(tokens, -1)
    indices = np.argsort(-scores, -1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(original_scores, indices, 1)
    weights = weights / weights.sum(-1, keepdims=True)
    return indices, weights * route_scale


def megatron_switch_load_balancing_loss(probs, tokens_per_expert, total_num_tokens, topk, num_experts, coeff):
    aggregated_probs_per_expert = probs.sum(0)
    return (aggregated_probs_per_expert * tokens_per_expert).sum() * (
        num_experts * coeff / (topk * total_num_tokens * total_num_tokens)
    )


def megatron_seq_aux_loss(probs_SBE, routing_map_SBE, topk, coeff):
    """Megatron-Core ``router.py::_apply_seq_aux_loss``: scores and routing map viewed as
    ``[S, B*E]``, the switch loss with ``T = S``, divided by B. Megatron's layout is ``[S, B, E]``."""
    seq_len, batch, num_experts = probs_SBE.shape
    probs = probs_SBE.reshape(seq_len, batch * num_experts)
    tokens_per_expert = routing_map_SBE.reshape(seq_len, batch * num_experts).sum(0)
    return megatron_switch_load_balancing_loss(probs, tokens_per_expert, seq_len, topk, num_experts, coeff) / batch


def np_plain_topk(scores, top_k):
    return np.argsort(-scores, -1, kind="stable")[:, :top_k]


def np_seq_aux(scores_BSE, score_func, top_k, coeff, topk_idx_BSK=None):
    """DeepSeek-V3 sequence-wise balance loss from the paper text: per sequence ``coeff * sum_i f_i P_i``
    with ``f_i = E / (k S) * count_i`` and ``P_i`` the mean normalised score; mean over sequences.
    The counts come from the plain top-k of the scores unless ``topk_idx_BSK`` is given."""
    batch, seq_len, num_experts = scores_BSE.shape
    losses = []
    for b in range(batch):
        scores = scores_BSE[b]
        probs = scores / scores.sum(-1, keepdims=True) if score_func == "sigmoid" else scores
        idx = np_plain_topk(scores, top_k) if topk_idx_BSK is None else topk_idx_BSK[b]
        counts = np.bincount(idx.reshape(-1), minlength=num_experts)
        f = num_experts / (top_k * seq_len) * counts
        losses.append(coeff * (f * probs.mean(0)).sum())
    return float(np.mean(losses))


def np_switch_aux(scores, top_k, coeff, topk_idx=None):
    """The switch loss is the sequence loss of the whole micro-batch as one sequence."""
    return np_seq_aux(scores[None], "sigmoid", top_k, coeff, None if topk_idx is None else topk_idx[None])


def np_updated_expert_bias(expert_bias, tokens_per_expert, rate):
    """Megatron-Core ``get_updated_expert_bias``."""
    average_tokens = tokens_per_expert.sum(-1, keepdims=True) / tokens_per_expert.shape[-1]
    return expert_bias + np.sign(average_tokens - tokens_per_expert) * rate
