"""Router math as pure functions (fp32), usable eagerly and under ``ms.jit``.

Shape legend: T tokens, E routed experts, K experts chosen per token.

Conventions follow Megatron-Core / DeepSeek-V3 / HF ``glm4_moe``:
- selection uses the top-K of the scores; the combine weights are gathered from the same
  scores, optionally renormalised over the K chosen and multiplied by a scaling factor;
- the switch aux loss is ``coeff * E * sum_e f_e * P_e`` with ``f_e = c_e / (K * T)`` so that
  perfectly balanced routing costs exactly ``coeff`` (HF Mixtral's form would give ``K * coeff``);
- ``P_e`` uses softmax probabilities, or for sigmoid routers the scores normalised over experts.
"""
from mindspore import ops
import mindspore as ms

# Keeps the renormalisation finite when every chosen sigmoid score underflows (HF uses the same).
NORM_EPS = 1e-20


def router_scores(logits_TE, score_func: str):
    """Scores in fp32: softmax over experts or an independent sigmoid per expert."""
    logits_TE = logits_TE.astype(ms.float32)
    if score_func == "sigmoid":
        return ops.sigmoid(logits_TE)
    return ops.softmax(logits_TE, -1)


def topk_routing(scores_TE, top_k: int, norm_topk_prob: bool, routed_scaling_factor: float):
    """Top-K experts by score (ties to the lower index) and their combine weights.

    Returns ``(topk_idx_TK int32, topk_weight_TK fp32)``.
    """
    # A stable descending sort, not ops.topk: topk orders ties arbitrarily, and expert locking
    # compares top-K sets, so equal scores must resolve to the lower expert index.
    _, order_TE = ops.sort(scores_TE, -1, True)
    topk_idx_TK = order_TE[:, :top_k].astype(ms.int32)
    weight_TK = ops.gather_elements(scores_TE, 1, topk_idx_TK)
    if norm_topk_prob:
        weight_TK = weight_TK / (weight_TK.sum(-1, keepdims=True) + NORM_EPS)
    return topk_idx_TK, weight_TK * routed_scaling_factor


def expert_counts(topk_idx_TK, num_experts: int):
    """``c_e``: how many of the T*K assignments went to each expert, fp32 ``[E]``."""
    one_hot_TKE = ops.one_hot(topk_idx_TK, num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32))
    return one_hot_TKE.sum((0, 1))


def aux_probs(scores_TE, score_func: str):
    """Per-token probabilities ``p_{t,e}`` entering ``P_e`` (sigmoid scores normalised over experts)."""
    if score_func == "sigmoid":
        return scores_TE / (scores_TE.sum(-1, keepdims=True) + NORM_EPS)
    return scores_TE


def switch_aux_loss(probs_TE, topk_idx_TK, coeff: float):
    """``coeff * E * sum_e f_e P_e`` with ``f_e = c_e / (K T)`` and ``P_e = mean_t p_{t,e}``."""
    num_tokens, num_experts = probs_TE.shape
    top_k = topk_idx_TK.shape[-1]
    fraction_E = expert_counts(topk_idx_TK, num_experts) / (top_k * num_tokens)
    mean_prob_E = probs_TE.mean(0)
    return coeff * num_experts * (fraction_E * mean_prob_E).sum()


def z_loss(logits_TE, coeff: float):
    """Router z-loss (ST-MoE): ``coeff * mean_t logsumexp(logits_t)^2``."""
    lse_T = ops.logsumexp(logits_TE.astype(ms.float32), -1)
    return coeff * (lse_T * lse_T).mean()
