"""Router math vs a NumPy transcription of the published formulas, HF ``Glm4MoeTopkRouter``
(transformers 4.57.1; zero correction bias, n_group = topk_group = 1) and the Megatron-Core
test vectors (values computed with the published code: HF Mixtral load_balancing_loss_func,
Megatron-Core moe_utils, DeepSeek's gates).
"""

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor
from transformers import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from mindmoe.model.config import ModelConfig
from mindmoe.model.moe import Router, aux_probs, expert_counts, router_scores, switch_aux_loss, topk_routing, z_loss

# Reference vectors computed with the published code (HF Mixtral load_balancing_loss_func, Megatron-Core
# moe_utils, DeepSeek's gates); T = 4 tokens, E = 4 experts, k = 2.
REF_LOGITS = np.array([[2, 1, 0, -1], [0.5, 0.4, 2, 0], [-1, 3, 0, 1], [0.2, 1.7, -0.3, 1.5]], np.float32)
REF_SWITCH_AUX_SOFTMAX = 1.103122540625911
REF_SWITCH_AUX_SIGMOID = 1.0415414155603706
REF_Z_LOSS = 7.054552002231462


# ---- NumPy transcriptions (float64) ------------------------------------------------------------


def np_softmax(logits):
    shifted = np.exp(logits - logits.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


def np_sigmoid(logits):
    return 1.0 / (1.0 + np.exp(-logits))


def np_scores(logits, score_func):
    return np_sigmoid(logits) if score_func == "sigmoid" else np_softmax(logits)


def np_topk_routing(scores, top_k, norm_topk_prob, scaling):
    """DeepSeek-V3 / Megatron: top-k by score, weights = chosen scores (renormalised) * scaling."""
    idx = np.argsort(-scores, axis=-1, kind="stable")[:, :top_k]
    weight = np.take_along_axis(scores, idx, -1)
    if norm_topk_prob:
        weight = weight / (weight.sum(-1, keepdims=True) + 1e-20)
    return idx, weight * scaling


def np_switch_aux_loss(scores, score_func, idx, num_experts, coeff):
    """Megatron ``switch_load_balancing_loss_func``; sigmoid scores are normalised over experts."""
    probs = scores / scores.sum(-1, keepdims=True) if score_func == "sigmoid" else scores
    tokens, top_k = idx.shape
    tokens_per_expert = np.bincount(idx.reshape(-1), minlength=num_experts)
    return (probs.sum(0) * tokens_per_expert).sum() * num_experts * coeff / (top_k * tokens * tokens)


def np_z_loss(logits, coeff):
    lse = np.log(np.exp(logits).sum(-1))
    return coeff * np.mean(lse**2)


def random_logits(seed, tokens=16, experts=8):
    return np.random.default_rng(seed).normal(scale=1.5, size=(tokens, experts)).astype(np.float32)


def sorted_by_expert(idx, weight):
    """HF returns its top-k unsorted: compare (expert, weight) pairs in expert order."""
    order = np.argsort(idx, -1)
    return np.take_along_axis(idx, order, -1), np.take_along_axis(weight, order, -1)


# ---- scores and top-k ---------------------------------------------------------------------------


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_scores_match_numpy(score_func):
    logits = random_logits(0)
    np.testing.assert_allclose(
        router_scores(Tensor(logits), score_func).asnumpy(),
        np_scores(logits.astype(np.float64), score_func),
        rtol=1e-5,
        atol=1e-7,
    )


@pytest.mark.parametrize("scaling", [1.0, 2.5])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_topk_routing_matches_numpy(score_func, norm_topk_prob, scaling):
    logits = random_logits(1)
    scores = np_scores(logits.astype(np.float64), score_func)
    idx, weight = topk_routing(router_scores(Tensor(logits), score_func), 3, norm_topk_prob, scaling)
    ref_idx, ref_weight = np_topk_routing(scores, 3, norm_topk_prob, scaling)
    assert idx.dtype == ms.int32
    np.testing.assert_array_equal(idx.asnumpy(), ref_idx)
    np.testing.assert_allclose(weight.asnumpy(), ref_weight, rtol=1e-5, atol=1e-7)
    if norm_topk_prob:
        np.testing.assert_allclose(weight.asnumpy().sum(-1), scaling, rtol=1e-6)


def test_topk_routing_breaks_ties_toward_the_lower_expert_index():
    scores = Tensor(np.array([[0.1, 0.5, 0.5, 0.5], [0.7, 0.2, 0.7, 0.7]], np.float32))
    idx, _ = topk_routing(scores, 2, True, 1.0)
    np.testing.assert_array_equal(idx.asnumpy(), [[1, 2], [0, 2]])


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_sigmoid_routing_matches_hf_glm4_moe_topk_router(norm_topk_prob):
    hidden, experts, top_k, tokens = 16, 8, 3, 24
    rng = np.random.default_rng(2)
    weight = (0.4 * rng.normal(size=(experts, hidden))).astype(np.float32)
    x = rng.normal(size=(tokens, hidden)).astype(np.float32)

    hf_config = Glm4MoeConfig(
        hidden_size=hidden,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_group=1,
        topk_group=1,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=2.5,
    )
    hf_router = Glm4MoeTopkRouter(hf_config)
    with torch.no_grad():
        hf_router.weight.copy_(torch.from_numpy(weight))
    assert not hf_router.e_score_correction_bias.any()
    with torch.no_grad():
        hf_idx, hf_weight = hf_router(torch.from_numpy(x))

    router = Router(ModelConfig(hidden_size=hidden, num_experts=experts), np.random.default_rng(0))
    router.weight.set_data(Tensor(weight))
    logits = router(Tensor(x))
    idx, ours = topk_routing(router_scores(logits, "sigmoid"), top_k, norm_topk_prob, 2.5)

    ours_idx, ours_weight = sorted_by_expert(idx.asnumpy(), ours.asnumpy())
    hf_idx, hf_weight = sorted_by_expert(hf_idx.numpy(), hf_weight.numpy())
    np.testing.assert_array_equal(ours_idx, hf_idx)
    np.testing.assert_allclose(ours_weight, hf_weight, rtol=1e-5, atol=1e-6)


def test_routing_under_jit_matches_numpy():
    @ms.jit
    def route_sigmoid_top2(logits):
        return topk_routing(router_scores(logits, "sigmoid"), 2, True, 2.5)

    logits = random_logits(3)
    idx, weight = route_sigmoid_top2(Tensor(logits))
    ref_idx, ref_weight = np_topk_routing(np_sigmoid(logits.astype(np.float64)), 2, True, 2.5)
    np.testing.assert_array_equal(idx.asnumpy(), ref_idx)
    np.testing.assert_allclose(weight.asnumpy(), ref_weight, rtol=1e-5)


# ---- balancing losses and counts ----------------------------------------------------------------


def our_switch_aux(logits, score_func, coeff, top_k=2):
    scores = router_scores(Tensor(logits), score_func)
    idx, _ = topk_routing(scores, top_k, True, 1.0)
    return float(switch_aux_loss(aux_probs(scores, score_func), idx, coeff).asnumpy())


def test_switch_aux_loss_softmax_matches_megatron_test_vector():
    assert our_switch_aux(REF_LOGITS, "softmax", 1.0) == pytest.approx(REF_SWITCH_AUX_SOFTMAX, rel=1e-6)


def test_switch_aux_loss_sigmoid_uses_scores_normalised_over_experts():
    # Megatron compute_routing_scores_for_aux_loss: sigmoid scores divided by their sum over experts.
    assert our_switch_aux(REF_LOGITS, "sigmoid", 1.0) == pytest.approx(REF_SWITCH_AUX_SIGMOID, rel=1e-6)


def test_aux_probs_sigmoid_are_scores_normalised_over_experts():
    scores = np_sigmoid(REF_LOGITS.astype(np.float64))
    probs = aux_probs(router_scores(Tensor(REF_LOGITS), "sigmoid"), "sigmoid").asnumpy()
    np.testing.assert_allclose(probs, scores / scores.sum(-1, keepdims=True), rtol=1e-6)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_switch_aux_loss_matches_numpy_megatron_formula(score_func):
    logits = random_logits(4, tokens=32, experts=8)
    scores = np_scores(logits.astype(np.float64), score_func)
    ref_idx, _ = np_topk_routing(scores, 3, True, 1.0)
    expected = np_switch_aux_loss(scores, score_func, ref_idx, 8, 1e-2)
    assert our_switch_aux(logits, score_func, 1e-2, top_k=3) == pytest.approx(expected, rel=1e-5)


def test_switch_aux_loss_of_perfectly_balanced_routing_is_exactly_the_coefficient():
    # Each of 4 experts chosen twice by 4 tokens with k = 2, uniform probabilities.
    probs = Tensor(np.full((4, 4), 0.25, np.float32))
    idx = Tensor(np.array([[0, 1], [2, 3], [1, 0], [3, 2]], np.int32))
    for coeff in (1.0, 1e-2):
        assert float(switch_aux_loss(probs, idx, coeff).asnumpy()) == pytest.approx(coeff, rel=1e-7)


def test_z_loss_matches_test_vector_and_numpy():
    assert float(z_loss(Tensor(REF_LOGITS), 1.0).asnumpy()) == pytest.approx(REF_Z_LOSS, rel=1e-6)
    logits = random_logits(5)
    assert float(z_loss(Tensor(logits), 1e-3).asnumpy()) == pytest.approx(
        np_z_loss(logits.astype(np.float64), 1e-3), rel=1e-6
    )


def test_expert_counts_match_bincount():
    idx = np.random.default_rng(6).integers(0, 6, size=(20, 2)).astype(np.int32)
    counts = expert_counts(Tensor(idx), 6).asnumpy()
    assert counts.dtype == np.float32
    np.testing.assert_array_equal(counts, np.bincount(idx.reshape(-1), minlength=6))


def test_balancing_losses_under_jit_match_test_vectors():
    @ms.jit
    def losses(logits):
        scores = router_scores(logits, "softmax")
        idx, _ = topk_routing(scores, 2, True, 1.0)
        return switch_aux_loss(aux_probs(scores, "softmax"), idx, 1.0), z_loss(logits, 1.0), expert_counts(idx, 4)

    aux, router_z, counts = losses(Tensor(REF_LOGITS))
    assert float(aux.asnumpy()) == pytest.approx(REF_SWITCH_AUX_SOFTMAX, rel=1e-6)
    assert float(router_z.asnumpy()) == pytest.approx(REF_Z_LOSS, rel=1e-6)
    ref_idx, _ = np_topk_routing(np_softmax(REF_LOGITS.astype(np.float64)), 2, True, 1.0)
    np.testing.assert_array_equal(counts.asnumpy(), np.bincount(ref_idx.reshape(-1), minlength=4))
