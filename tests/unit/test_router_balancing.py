"""Aux-loss-free routing and balancing: correction bias, group-limited top-k, the sequence-wise aux
loss and the bias update, vs test vectors from the published code, HF ``Glm4MoeTopkRouter`` /
``Glm4MoeMoE`` (transformers 4.57.1), NumPy transcriptions of DeepSeek-V3 ``Gate`` and Megatron-Core
``seq_aux_loss`` / ``get_updated_expert_bias``, and a training step of a tiny model.
"""

import re

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor
from transformers import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE, Glm4MoeTopkRouter

from mindmoe.model.config import ModelConfig, validate_model_config
from mindmoe.model.moe import (
    aux_probs,
    gather_weights,
    router_scores,
    select_experts,
    seq_aux_loss,
    topk_routing,
    updated_bias,
)
from mindmoe.model.moe_config import MoEConfig, validate_moe_config
from mindmoe.model.transformer import MoETransformer
from tests.helpers.moe import (
    build_layer,
    layer_weights,
    megatron_seq_aux_loss,
    np_deepseek_v3_gate,
    np_plain_topk,
    np_seq_aux,
    np_switch_aux,
    np_updated_expert_bias,
    split_fields,
)
from tests.unit.test_isolation import np_model_routing, transformer_config
from tests.unit.test_moe_router import REF_LOGITS, REF_SWITCH_AUX_SIGMOID, np_sigmoid, sorted_by_expert

# Reference vectors from the published code, noaux_tc router: E = 8, k = 2, n_group 2, topk_group 1,
# normalised, scale 2.5.
NOAUX_LOGITS = np.array([[0.3, -0.2, 1.1, 0, -0.5, 0.9, 0.2, -1], [-0.7, 0.4, 0.1, 0.8, 1.2, -0.3, 0, 0.6]], np.float32)
NOAUX_BIAS = np.array([0, 0.1, -0.1, 0, 0.05, 0, 0, 0.2], np.float32)
NOAUX_INDICES = np.array([[5, 6], [4, 7]])
NOAUX_WEIGHTS = np.array([[1.4097374820107054, 1.0902625179892949], [1.3586039105652403, 1.1413960894347595]])
# Reference vectors from the published code: Megatron seq_aux, sigmoid, coeff 1, two sequences (rows 0-1 and rows 2-3).
REF_SEQ_AUX_SIGMOID = 1.234414848055857


def route(logits, top_k, bias=None, n_group=1, topk_group=1, norm=True, scale=2.5):
    scores = router_scores(Tensor(logits), "sigmoid")
    bias = None if bias is None else Tensor(bias.astype(np.float32))
    idx, weight = topk_routing(scores, top_k, norm, scale, bias, n_group, topk_group)
    return idx.asnumpy(), weight.asnumpy()


def hf_router(num_experts, top_k, n_group, topk_group, weight, bias, scale=2.5):
    config = Glm4MoeConfig(
        hidden_size=weight.shape[1],
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=True,
        routed_scaling_factor=scale,
    )
    router = Glm4MoeTopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(weight))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
    return router


# ---- selection with bias and groups ------------------------------------------------------------


def test_noaux_tc_router_matches_reference_vector_and_hf():
    idx, weight = route(NOAUX_LOGITS, 2, NOAUX_BIAS, n_group=2, topk_group=1)
    ours_idx, ours_weight = sorted_by_expert(idx, weight)
    ref_idx, ref_weight = sorted_by_expert(NOAUX_INDICES, NOAUX_WEIGHTS)
    np.testing.assert_array_equal(ours_idx, ref_idx)
    np.testing.assert_allclose(ours_weight, ref_weight, rtol=1e-6)
    # HF on the same logits (identity router weight, hidden = E) gives the vector too.
    with torch.no_grad():
        hf_idx, hf_weight = hf_router(8, 2, 2, 1, np.eye(8, dtype=np.float32), NOAUX_BIAS)(
            torch.from_numpy(NOAUX_LOGITS)
        )
    hf_idx, hf_weight = sorted_by_expert(hf_idx.numpy(), hf_weight.numpy())
    np.testing.assert_array_equal(hf_idx, ref_idx)
    np.testing.assert_allclose(hf_weight, ref_weight, rtol=1e-6)


def test_grouped_biased_selection_matches_hf_glm4_moe_topk_router():
    experts, top_k, n_group, topk_group, hidden, tokens = 16, 4, 4, 2, 16, 48
    rng = np.random.default_rng(31)
    weight = (0.3 * rng.normal(size=(experts, hidden))).astype(np.float32)
    bias = rng.uniform(-0.1, 0.1, size=experts).astype(np.float32)
    x = rng.normal(size=(tokens, hidden)).astype(np.float32)
    logits = x.astype(np.float64) @ weight.T.astype(np.float64)
    ref_idx, _ = np_deepseek_v3_gate(logits, bias, top_k, n_group, topk_group, 2.5)
    # HF masks experts of dropped groups with 0.0, not -inf: identical only while every chosen biased
    # score is positive; the bias and the groups must both change some selections.
    chosen_biased = np.take_along_axis(np_sigmoid(logits) + bias, ref_idx, 1)
    assert (chosen_biased > 0).all()
    ungrouped_idx, _ = np_deepseek_v3_gate(logits, bias, top_k, 1, 1, 2.5)
    unbiased_idx, _ = np_deepseek_v3_gate(logits, 0 * bias, top_k, n_group, topk_group, 2.5)
    assert (np.sort(ungrouped_idx) != np.sort(ref_idx)).any(-1).sum() >= 3
    assert (np.sort(unbiased_idx) != np.sort(ref_idx)).any(-1).sum() >= 3

    with torch.no_grad():
        hf_idx, hf_weight = hf_router(experts, top_k, n_group, topk_group, weight, bias)(torch.from_numpy(x))
    idx, ours = route((x @ weight.T).astype(np.float32), top_k, bias, n_group, topk_group)
    ours_idx, ours_weight = sorted_by_expert(idx, ours)
    hf_idx, hf_weight = sorted_by_expert(hf_idx.numpy(), hf_weight.numpy())
    np.testing.assert_array_equal(ours_idx, hf_idx)
    np.testing.assert_allclose(ours_weight, hf_weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("experts,top_k,n_group,topk_group", [(16, 4, 4, 2), (8, 3, 4, 2), (12, 2, 3, 1)])
def test_grouped_biased_selection_matches_numpy_deepseek_v3_gate(experts, top_k, n_group, topk_group):
    rng = np.random.default_rng(experts + top_k)
    logits = rng.normal(scale=1.5, size=(64, experts)).astype(np.float32)
    bias = rng.uniform(-0.2, 0.2, size=experts).astype(np.float32)
    ref_idx, ref_weight = np_deepseek_v3_gate(logits, bias, top_k, n_group, topk_group, 2.5)
    idx, weight = route(logits, top_k, bias, n_group, topk_group)
    assert idx.dtype == np.int32
    np.testing.assert_array_equal(np.sort(idx), np.sort(ref_idx))
    np.testing.assert_allclose(
        *[sorted_by_expert(i, w)[1] for i, w in ((idx, weight), (ref_idx, ref_weight))], rtol=1e-5
    )


def test_grouped_biased_selection_under_jit_matches_numpy_deepseek_v3_gate():
    @ms.jit
    def select_e16_k4_g4_top2(scores, bias):
        return select_experts(scores, 4, bias, 4, 2)

    rng = np.random.default_rng(41)
    logits = rng.normal(scale=1.5, size=(64, 16)).astype(np.float32)
    bias = rng.uniform(-0.2, 0.2, size=16).astype(np.float32)
    idx = select_e16_k4_g4_top2(router_scores(Tensor(logits), "sigmoid"), Tensor(bias)).asnumpy()
    ref_idx, _ = np_deepseek_v3_gate(logits, bias, 4, 4, 2, 2.5)
    np.testing.assert_array_equal(np.sort(idx), np.sort(ref_idx))


def test_bias_steers_selection_but_weights_are_the_unbiased_scores_at_the_selected_experts():
    rng = np.random.default_rng(43)
    logits = rng.normal(size=(32, 8)).astype(np.float32)
    bias = np.zeros(8, np.float32)
    bias[6] = 5.0  # forces expert 6 into every token's top-2 whatever its score
    scores = np_sigmoid(logits.astype(np.float64))
    idx, weight = route(logits, 2, bias, norm=False, scale=1.0)
    assert (idx == 6).any(-1).all()
    assert (np.argsort(-scores, -1)[:, :2] != 6).all(-1).sum() >= 16  # mostly not chosen on merit
    np.testing.assert_allclose(weight, np.take_along_axis(scores, idx, 1), rtol=1e-5, atol=1e-7)
    # gather_weights on the same selection: normalised unbiased scores times the scaling factor.
    normalised = gather_weights(router_scores(Tensor(logits), "sigmoid"), Tensor(idx), True, 2.5).asnumpy()
    chosen = np.take_along_axis(scores, idx, 1)
    np.testing.assert_allclose(normalised, chosen / chosen.sum(-1, keepdims=True) * 2.5, rtol=1e-5)


# ---- sequence-wise aux loss and the bias update ---------------------------------------------------


def our_seq_aux(logits_BSE, top_k, coeff, score_func="sigmoid"):
    batch, seq_len, experts = logits_BSE.shape
    scores = router_scores(Tensor(logits_BSE.reshape(-1, experts)), score_func)
    idx = select_experts(scores, top_k)
    probs = aux_probs(scores, score_func)
    return float(
        seq_aux_loss(probs.reshape(batch, seq_len, experts), idx.reshape(batch, seq_len, top_k), coeff).asnumpy()
    )


def test_seq_aux_loss_matches_megatron_test_vector():
    # Sequence 0 = rows 0-1, sequence 1 = rows 2-3, i.e. our [B=2, S=2, E] layout.
    assert our_seq_aux(REF_LOGITS.reshape(2, 2, 4), 2, 1.0) == pytest.approx(REF_SEQ_AUX_SIGMOID, rel=1e-6)
    # One sequence of all four rows is the switch loss, which is different here.
    assert our_seq_aux(REF_LOGITS.reshape(1, 4, 4), 2, 1.0) == pytest.approx(REF_SWITCH_AUX_SIGMOID, rel=1e-6)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_seq_aux_loss_matches_megatron_seq_aux_and_the_paper_formula(score_func):
    batch, seq_len, experts, top_k, coeff = 3, 10, 8, 2, 1e-2
    logits = np.random.default_rng(47).normal(scale=1.5, size=(batch, seq_len, experts)).astype(np.float32)
    logits64 = logits.astype(np.float64)
    if score_func == "sigmoid":
        scores = np_sigmoid(logits64)
    else:
        scores = np.exp(logits64) / np.exp(logits64).sum(-1, keepdims=True)
    probs = scores / scores.sum(-1, keepdims=True)
    routing_map = np.zeros(scores.shape, bool)
    np.put_along_axis(routing_map.reshape(-1, experts), np_plain_topk(scores.reshape(-1, experts), top_k), True, 1)
    megatron = megatron_seq_aux_loss(probs.transpose(1, 0, 2), routing_map.transpose(1, 0, 2), top_k, coeff)
    paper = np_seq_aux(scores, score_func, top_k, coeff)
    assert megatron == pytest.approx(paper, rel=1e-12)
    assert our_seq_aux(logits, top_k, coeff, score_func) == pytest.approx(megatron, rel=1e-5)


def test_seq_aux_loss_of_sequence_balanced_routing_is_exactly_the_coefficient():
    # Each sequence uses every expert equally often with uniform probabilities, although the two
    # sequences' routings differ.
    probs = Tensor(np.full((2, 4, 4), 0.25, np.float32))
    idx = Tensor(np.array([[[0, 1], [2, 3], [1, 0], [3, 2]], [[0, 2], [1, 3], [3, 1], [2, 0]]], np.int32))
    for coeff in (1.0, 1e-3):
        assert float(seq_aux_loss(probs, idx, coeff).asnumpy()) == pytest.approx(coeff, rel=1e-7)


def test_updated_bias_matches_megatron_test_vector_and_formula():
    updated = updated_bias(Tensor(np.zeros(4, np.float32)), Tensor(np.array([10, 2, 4, 0], np.float32)), 1e-3)
    np.testing.assert_allclose(updated.asnumpy(), [-0.001, 0.001, 0.0, 0.001], rtol=1e-6, atol=0)
    bias = np.random.default_rng(53).normal(scale=0.01, size=8).astype(np.float32)
    load = np.array([12, 3, 7, 8, 0, 15, 8, 11], np.float32)  # mean 8: experts 3 and 6 must not move
    np.testing.assert_allclose(
        updated_bias(Tensor(bias), Tensor(load), 0.01).asnumpy(),
        np_updated_expert_bias(bias.astype(np.float64), load.astype(np.float64), 0.01),
        rtol=1e-6,
    )


# ---- the MoE layer ------------------------------------------------------------------------------

LAYER_BATCH, LAYER_SEQ, LAYER_EXPERTS, LAYER_HIDDEN = 2, 8, 8, 16


def aux_layer_config(aux_loss, **overrides):
    """``(ModelConfig, MoEConfig)`` of a sigmoid layer; ``overrides`` may name keys of either."""
    fields = dict(
        hidden_size=LAYER_HIDDEN,
        num_experts=LAYER_EXPERTS,
        top_k=2,
        moe_intermediate_size=8,
        num_shared_experts=1,
        score_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        dispatch="dropless",
        aux_loss=aux_loss,
        aux_loss_coeff=0.1,
        z_loss_coeff=0.01,
    )
    fields.update(overrides)
    model_fields, moe_fields = split_fields(fields)
    return ModelConfig(**model_fields), MoEConfig(**moe_fields)


def hf_moe_from(layer, cfg):
    config = Glm4MoeConfig(
        hidden_size=cfg.hidden_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        n_shared_experts=1,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
    module = Glm4MoeMoE(config)
    w = {name: torch.from_numpy(param.asnumpy().copy()) for name, param in layer.parameters_and_names()}
    state = {"gate.weight": w["router.weight"], "gate.e_score_correction_bias": w["router.e_score_correction_bias"]}
    for e in range(cfg.num_experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            state[f"experts.{e}.{proj}.weight"] = w[f"experts.{proj}"][e]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        state[f"shared_experts.{proj}.weight"] = w[f"shared_experts.{proj}.weight"]
    module.load_state_dict(state, strict=True)
    return module


def test_seq_aux_loss_of_the_layer_equals_numpy_formula_on_its_own_routing():
    cfg, moe = aux_layer_config("seq", score_func="softmax", dispatch="capacity", capacity_factor=2.0)
    layer = build_layer(cfg, moe, seed=59)
    x = np.random.default_rng(61).normal(size=(LAYER_BATCH, LAYER_SEQ, LAYER_HIDDEN)).astype(np.float32)
    _, aux, _, _, layer_stats = layer(Tensor(x), Tensor(np.zeros(x.shape[:2], np.int32)))
    logits = x.reshape(-1, LAYER_HIDDEN).astype(np.float64) @ layer_weights(layer)["router.weight"].T
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores = (scores / scores.sum(-1, keepdims=True)).reshape(LAYER_BATCH, LAYER_SEQ, -1)
    expected = np_seq_aux(scores, "softmax", cfg.top_k, moe.aux_loss_coeff)
    assert float(aux.asnumpy()) == pytest.approx(expected, rel=1e-5)
    assert float(layer_stats.asnumpy()[3]) == pytest.approx(expected, rel=1e-5)
    assert expected != pytest.approx(np_switch_aux(scores.reshape(-1, LAYER_EXPERTS), cfg.top_k, 0.1), rel=1e-3)


@pytest.mark.parametrize("aux_loss", ["seq", "switch"])
def test_layer_with_bias_and_groups_routes_like_hf_and_balances_the_plain_topk(aux_loss):
    cfg, moe = aux_layer_config(aux_loss, expert_bias=True, n_group=4, topk_group=2)
    layer = build_layer(cfg, moe, seed=67)
    rng = np.random.default_rng(71)
    layer.router.e_score_correction_bias.set_data(Tensor(rng.uniform(-0.15, 0.15, LAYER_EXPERTS).astype(np.float32)))
    weights = layer_weights(layer)
    x = rng.normal(size=(LAYER_BATCH, LAYER_SEQ, LAYER_HIDDEN)).astype(np.float32)
    x_TH = x.reshape(-1, LAYER_HIDDEN).astype(np.float64)
    logits = x_TH @ weights["router.weight"].T
    scores = np_sigmoid(logits)
    selected, _ = np_deepseek_v3_gate(logits, weights["router.e_score_correction_bias"], cfg.top_k, 4, 2, 2.5)
    plain = np_plain_topk(scores, cfg.top_k)
    assert (np.sort(selected) != np.sort(plain)).any(-1).sum() >= 3
    assert (np.take_along_axis(scores + weights["router.e_score_correction_bias"], selected, 1) > 0).all()

    out, aux, _, routing_stats, _ = layer(Tensor(x), Tensor(np.zeros(x.shape[:2], np.int32)))
    with torch.no_grad():
        expected_out = hf_moe_from(layer, cfg)(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out.asnumpy(), expected_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(routing_stats.asnumpy()[0], np.bincount(selected.reshape(-1), minlength=8))

    # Megatron: the balancing loss sees the plain top-k of the unbiased scores, not the selection.
    scores_BSE = scores.reshape(LAYER_BATCH, LAYER_SEQ, -1)
    selected_BSK = selected.reshape(LAYER_BATCH, LAYER_SEQ, -1)
    if aux_loss == "seq":
        expected = np_seq_aux(scores_BSE, "sigmoid", cfg.top_k, moe.aux_loss_coeff)
        with_selection = np_seq_aux(scores_BSE, "sigmoid", cfg.top_k, moe.aux_loss_coeff, selected_BSK)
    else:
        expected = np_switch_aux(scores, cfg.top_k, moe.aux_loss_coeff)
        with_selection = np_switch_aux(scores, cfg.top_k, moe.aux_loss_coeff, selected)
    assert float(aux.asnumpy()) == pytest.approx(expected, rel=1e-5)
    assert abs(with_selection - expected) > 1e-2 * expected  # the convention is visible in the value


# ---- the bias update in a training step ----------------------------------------------------------


def test_trainer_step_moves_each_bias_by_rate_times_sign_of_mean_minus_kept_load():
    from mindmoe.train.routing import RouterStepUpdates
    from mindmoe.train.step import CompiledStep

    rate = 0.01
    cfg, moe = transformer_config(expert_lock=False, expert_bias=True, bias_update_rate=rate, capacity_factor=0.75)
    model = MoETransformer(cfg, seed=3, moe=moe)
    rng = np.random.default_rng(73)
    biases = [layer.mlp.router.e_score_correction_bias for layer in model.layers]
    for bias in biases:  # a non-zero starting bias, so selection depends on it
        bias.set_data(Tensor(rng.uniform(-0.02, 0.02, cfg.num_experts).astype(np.float32)))
    # Plain SGD keeps the compile short; the trainer hands the optimizer model.trainable_params() as
    # train.loop does, so what matters here, the bias staying out of it, is the same as with AdamW.
    optimizer = ms.nn.SGD(model.trainable_params(), learning_rate=0.05)
    trainer = CompiledStep(model, optimizer, 1.0, 1, RouterStepUpdates(model, cfg))
    bias_names = {bias.name for bias in biases}
    assert bias_names <= {p.name for p in model.get_parameters()}
    assert not bias_names & {p.name for p in optimizer.parameters}
    assert not any(bias.requires_grad for bias in biases)

    window = {
        "input_ids": rng.integers(0, cfg.vocab_size, (2, 17)),
        "doc_ids": np.array([[0] * 17, [0] * 7 + [1] * 10]),
    }
    input_ids = Tensor(window["input_ids"][:, :-1].astype(np.int32))
    doc_ids = window["doc_ids"][:, :-1].astype(np.int32)
    expected_stats = np_model_routing(model, cfg, moe, input_ids, doc_ids)  # NumPy routing of captured inputs
    chosen, kept = expected_stats[:, 0], expected_stats[:, 1]
    assert (chosen > kept).any(), "some assignments must be dropped"
    before = np.stack([bias.asnumpy() for bias in biases])

    stats = trainer.step([window])
    np.testing.assert_array_equal(stats.routing_stats[:, :2], expected_stats[:, :2])
    np.testing.assert_array_equal(stats.layer_stats[:, 0], (chosen - kept).sum(-1))  # dropped
    after = np.stack([bias.asnumpy() for bias in biases])
    sign = np.sign(kept.mean(-1, keepdims=True) - kept)
    assert (sign > 0).any() and (sign < 0).any() and (sign == 0).any()
    # Teeth: the chosen (pre-drop) load would move some biases the other way.
    assert (np.sign(chosen.mean(-1, keepdims=True) - chosen) != sign).any()
    np.testing.assert_allclose(after - before, rate * sign, rtol=1e-4, atol=1e-7)


# ---- configuration ------------------------------------------------------------------------------


def validate_sections(cfg, moe):
    validate_model_config(cfg)
    validate_moe_config(moe, cfg.expert_bias)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (dict(num_experts=8, n_group=3), "model.n_group"),
        (dict(num_experts=8, n_group=2, topk_group=3), "model.topk_group"),
        (dict(expert_bias=False, bias_update_rate=1e-3), "moe.bias_update_rate"),
        (dict(isolation_mode="gradient"), "moe.isolation_mode"),
    ],
)
def test_invalid_routing_settings_are_rejected_naming_the_key(overrides, key):
    model_fields, moe_fields = split_fields(overrides)
    pattern = rf"^{re.escape(key)}="
    with pytest.raises(ValueError, match=pattern):
        validate_sections(ModelConfig(**model_fields), MoEConfig(**moe_fields))
    with pytest.raises(ValueError, match=pattern):
        MoETransformer(ModelConfig(vocab_size=32, **model_fields), moe=MoEConfig(**moe_fields))


def test_valid_routing_settings_are_accepted():
    validate_sections(
        ModelConfig(num_experts=8, n_group=4, topk_group=2, expert_bias=True),
        MoEConfig(bias_update_rate=1e-3, expert_lock=True, isolation_mode="token_grad"),
    )
