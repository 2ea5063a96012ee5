"""MoE dispatch and the MoE layer vs a naive per-token NumPy loop (float64) and HF
``Glm4MoeMoE`` (transformers 4.57.1, torch autograd for the gradients).

The naive loop is the definition: ``out_t = shared(x_t) + sum_k w_tk * SwiGLU_{e_tk}(x_t)``; with a
capacity C, assignments are taken per expert in token order and the (C+1)-th and later are dropped.
"""

import math

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor
from transformers import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

from mindmoe.model.moe import capacity_slots, expert_capacity
from mindmoe.model.moe.dispatch import combine_from_slots, gather_to_slots
from tests.helpers.moe import (
    BATCH,
    EXPERTS,
    HIDDEN,
    INTERMEDIATE,
    SEQ,
    TOP_K,
    build_layer,
    layer_configs,
    layer_weights,
    np_swiglu,
)


def layer_input(seed=11):
    return np.random.default_rng(seed).normal(size=(BATCH, SEQ, HIDDEN)).astype(np.float32)


def single_document(x):
    """Document ids ``[B, S]`` putting each row in one document (no locking is configured here)."""
    return Tensor(np.zeros(x.shape[:2], np.int32))


# ---- NumPy reference -----------------------------------------------------------------------------


def np_route(x_TH, router_weight, score_func, top_k, norm, scaling):
    logits = x_TH @ router_weight.T
    if score_func == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    idx = np.argsort(-scores, -1, kind="stable")[:, :top_k]
    weight = np.take_along_axis(scores, idx, -1)
    if norm:
        weight = weight / weight.sum(-1, keepdims=True)
    return idx, weight * scaling


def naive_moe(x_BSH, weights, cfg, capacity=None):
    """Per-token loop; returns (out, counts of chosen assignments per expert, dropped assignments)."""
    x_TH = x_BSH.reshape(-1, HIDDEN).astype(np.float64)
    idx, weight = np_route(
        x_TH, weights["router.weight"], cfg.score_func, cfg.top_k, cfg.norm_topk_prob, cfg.routed_scaling_factor
    )
    out = np.zeros_like(x_TH)
    load = np.zeros(cfg.num_experts, int)
    dropped = 0
    for t in range(x_TH.shape[0]):
        for k in range(cfg.top_k):
            e = idx[t, k]
            if capacity is not None and load[e] >= capacity:
                dropped += 1
                continue
            load[e] += 1
            out[t] += weight[t, k] * np_swiglu(
                x_TH[t], weights["experts.gate_proj"][e], weights["experts.up_proj"][e], weights["experts.down_proj"][e]
            )
        out[t] += np_swiglu(
            x_TH[t],
            weights["shared_experts.gate_proj.weight"],
            weights["shared_experts.up_proj.weight"],
            weights["shared_experts.down_proj.weight"],
        )
    counts = np.bincount(idx.reshape(-1), minlength=cfg.num_experts)
    return out.reshape(x_BSH.shape), counts, dropped


def np_capacity_slots(idx_TK, num_experts, capacity):
    load = np.zeros(num_experts, int)
    slots = []
    for e in idx_TK.reshape(-1):
        slots.append(e * capacity + load[e] if load[e] < capacity else num_experts * capacity)
        load[e] += 1
    return np.array(slots)


# ---- dispatch primitives -----------------------------------------------------------------------


def random_topk_idx(seed, tokens=10):
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(tokens)]).astype(np.int32)


def test_expert_capacity_is_ceil_of_factor_times_assignments_per_expert():
    assert expert_capacity(12, 2, 4, 1.25) == math.ceil(1.25 * 12 * 2 / 4) == 8
    assert expert_capacity(12, 2, 4, 0.5) == 3
    assert expert_capacity(1, 1, 64, 0.1) == 1


def test_capacity_slots_rank_assignments_per_expert_in_token_order():
    idx = random_topk_idx(0)
    slot, kept = capacity_slots(Tensor(idx), EXPERTS, 3)
    expected = np_capacity_slots(idx, EXPERTS, 3)
    assert 0 < (expected == EXPERTS * 3).sum() < idx.size, "the case must overflow some experts"
    np.testing.assert_array_equal(slot.asnumpy(), expected)
    np.testing.assert_array_equal(kept.asnumpy(), expected < EXPERTS * 3)


def test_capacity_slots_under_jit_match_numpy():
    @ms.jit
    def slots_capacity_3(idx):
        return capacity_slots(idx, EXPERTS, 3)

    idx = random_topk_idx(1)
    slot, _ = slots_capacity_3(Tensor(idx))
    np.testing.assert_array_equal(slot.asnumpy(), np_capacity_slots(idx, EXPERTS, 3))


def test_gather_to_slots_fills_each_slot_with_its_token_and_empty_slots_with_zeros():
    idx = random_topk_idx(2)
    capacity = 3
    x = np.random.default_rng(3).normal(size=(idx.shape[0], HIDDEN)).astype(np.float32)
    slot = np_capacity_slots(idx, EXPERTS, capacity)
    buffer = gather_to_slots(Tensor(x), Tensor(slot.astype(np.int32)), EXPERTS, capacity).asnumpy()
    expected = np.zeros((EXPERTS * capacity, HIDDEN), np.float32)
    for assignment, s in enumerate(slot):
        if s < EXPERTS * capacity:
            expected[s] = x[assignment // TOP_K]
    np.testing.assert_array_equal(buffer, expected.reshape(EXPERTS, capacity, HIDDEN))


def test_combine_from_slots_sums_weighted_slot_rows_and_skips_dropped_assignments():
    idx = random_topk_idx(4)
    capacity = 3
    rng = np.random.default_rng(5)
    y = rng.normal(size=(EXPERTS, capacity, HIDDEN)).astype(np.float32)
    weight = rng.uniform(size=idx.shape).astype(np.float32)
    slot = np_capacity_slots(idx, EXPERTS, capacity)
    out = combine_from_slots(Tensor(y), Tensor(slot.astype(np.int32)), Tensor(weight)).asnumpy()
    expected = np.zeros((idx.shape[0], HIDDEN))
    for assignment, s in enumerate(slot):
        if s < EXPERTS * capacity:
            t, k = divmod(assignment, TOP_K)
            expected[t] += weight[t, k] * y.reshape(-1, HIDDEN)[s]
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


# ---- the layer ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layers():
    """Compiled once per module: (dispatch, score_func) -> layer; plus an overflowing capacity layer."""
    built = {}
    for dispatch in ("capacity", "dropless"):
        for score_func in ("softmax", "sigmoid"):
            built[dispatch, score_func] = build_layer(*layer_configs(dispatch, 4.0, score_func))
    built["overflow"] = build_layer(*layer_configs("capacity", 0.5, "softmax"))
    return built


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_moe_layer_without_overflow_equals_naive_per_token_loop(layers, dispatch, score_func):
    layer = layers[dispatch, score_func]
    cfg, _ = layer_configs(dispatch, 4.0, score_func)
    assert expert_capacity(BATCH * SEQ, TOP_K, EXPERTS, 4.0) >= BATCH * SEQ  # nothing can overflow
    x = layer_input()
    out, _, _, routing_stats, layer_stats = layer(Tensor(x), single_document(x))
    counts, dropped = routing_stats[0], layer_stats[0]
    expected, expected_counts, _ = naive_moe(x, layer_weights(layer), cfg)
    np.testing.assert_allclose(out.asnumpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(counts.asnumpy(), expected_counts)
    assert float(dropped.asnumpy()) == 0.0


def test_moe_layer_drops_exactly_the_assignments_beyond_capacity_in_token_order(layers):
    layer = layers["overflow"]
    cfg, _ = layer_configs("capacity", 0.5, "softmax")
    capacity = expert_capacity(BATCH * SEQ, TOP_K, EXPERTS, 0.5)
    x = layer_input()
    out, _, _, routing_stats, layer_stats = layer(Tensor(x), single_document(x))
    counts, dropped = routing_stats[0], layer_stats[0]
    weights = layer_weights(layer)
    expected, expected_counts, expected_dropped = naive_moe(x, weights, cfg, capacity)
    assert 0 < expected_dropped < BATCH * SEQ * TOP_K, "the case must overflow some but not all"
    np.testing.assert_allclose(out.asnumpy(), expected, rtol=1e-5, atol=1e-5)
    assert float(dropped.asnumpy()) == expected_dropped
    # counts are the router's choices, before dropping.
    np.testing.assert_array_equal(counts.asnumpy(), expected_counts)
    # And dropping changed the output, so the comparison has teeth.
    unlimited, _, _ = naive_moe(x, weights, cfg)
    assert np.abs(unlimited - expected).max() > 1e-2


# ---- jit and gradients vs HF Glm4MoeMoE + torch autograd ------------------------------------------


def hf_moe_from(layer, cfg):
    config = Glm4MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
    module = Glm4MoeMoE(config)
    w = {name: torch.from_numpy(param.asnumpy().copy()) for name, param in layer.parameters_and_names()}
    state = {"gate.weight": w["router.weight"], "gate.e_score_correction_bias": torch.zeros(EXPERTS)}
    for e in range(EXPERTS):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            state[f"experts.{e}.{proj}.weight"] = w[f"experts.{proj}"][e]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        state[f"shared_experts.{proj}.weight"] = w[f"shared_experts.{proj}.weight"]
    module.load_state_dict(state, strict=True)
    return module


def torch_loss_and_grads(module, x, probe, moe):
    """sum(out * probe) + Megatron switch aux (sigmoid normalised) + z-loss, by torch autograd."""
    x_TH = torch.from_numpy(x).reshape(-1, HIDDEN)
    out = module(torch.from_numpy(x))
    logits = x_TH @ module.gate.weight.T
    scores = logits.sigmoid()
    probs = scores / scores.sum(-1, keepdim=True)
    idx = torch.topk(scores, TOP_K, dim=-1).indices
    fraction = torch.bincount(idx.reshape(-1), minlength=EXPERTS).float() / (TOP_K * x_TH.shape[0])
    aux = moe.aux_loss_coeff * EXPERTS * (fraction * probs.mean(0)).sum()
    z = moe.z_loss_coeff * (torch.logsumexp(logits, -1) ** 2).mean()
    loss = (out * torch.from_numpy(probe)).sum() + aux + z
    loss.backward()
    grads = {"router.weight": module.gate.weight.grad}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        grads[f"experts.{proj}"] = torch.stack(
            [module.experts[e].__getattr__(proj).weight.grad for e in range(EXPERTS)]
        )
        grads[f"shared_experts.{proj}.weight"] = module.shared_experts.__getattr__(proj).weight.grad
    return float(loss.detach()), {name: g.numpy() for name, g in grads.items()}


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_moe_layer_loss_and_gradients_under_jit_match_hf_glm4_moe_with_torch_autograd(dispatch):
    cfg, moe = layer_configs(dispatch, 4.0, "sigmoid", routed_scaling_factor=2.5)
    layer = build_layer(cfg, moe, seed=13)
    names = [name for name, _ in layer.parameters_and_names()]
    params = [param for _, param in layer.parameters_and_names()]

    def loss_fn(x, probe):
        out, aux, router_z, _, _ = layer(x, single_document(x))
        return (out * probe).sum() + aux + router_z

    grad_fn = ms.value_and_grad(loss_fn, None, params)

    @ms.jit
    def train_step(x, probe):
        return grad_fn(x, probe)

    x = layer_input(seed=17)
    probe = np.random.default_rng(19).normal(size=x.shape).astype(np.float32)
    loss, grads = train_step(Tensor(x), Tensor(probe))
    ref_loss, ref_grads = torch_loss_and_grads(hf_moe_from(layer, cfg), x, probe, moe)

    assert float(loss.asnumpy()) == pytest.approx(ref_loss, rel=1e-5, abs=1e-5)
    assert set(names) == set(ref_grads)
    for name, grad in zip(names, grads):
        grad = grad.asnumpy()
        assert np.abs(grad).max() > 1e-3, f"{name}: gradient is zero"
        np.testing.assert_allclose(grad, ref_grads[name], rtol=1e-4, atol=1e-5, err_msg=name)
