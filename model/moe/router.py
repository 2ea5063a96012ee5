"""The router: pure functions of the routing math (fp32, usable eagerly and under ``ms.jit``) and the
:class:`Router` cell that owns the router weights and applies them in order.

Shape legend: B batch, S sequence, T tokens, E routed experts, K experts chosen per token, J router groups.

Conventions follow Megatron-Core / DeepSeek-V3 / HF ``glm4_moe``:
- selection uses the top-K of the scores; the combine weights are gathered from the same
  scores, optionally renormalised over the K chosen and multiplied by a scaling factor;
- the switch aux loss is ``coeff * E * sum_e f_e * P_e`` with ``f_e = c_e / (K * T)`` so that
  perfectly balanced routing costs exactly ``coeff`` (HF Mixtral's form would give ``K * coeff``);
- ``P_e`` uses softmax probabilities, or for sigmoid routers the scores normalised over experts.
"""

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindmoe.model.config import ModelConfig
from mindmoe.model.linear import normal_init
from mindmoe.model.moe.locking import lock_routing
from mindmoe.model.moe_config import MoEConfig, moe_policy
from mindmoe.model.weights import add_seams

# Keeps the renormalisation finite when every chosen sigmoid score underflows (HF uses the same).
NORM_EPS = 1e-20
# Score of experts outside the chosen groups: below any sigmoid/softmax score plus a sane bias.
MASKED_SCORE = -1e30


def router_scores(logits_TE, score_func: str):
    """Scores in fp32: softmax over experts or an independent sigmoid per expert."""
    logits_TE = logits_TE.astype(ms.float32)
    if score_func == "sigmoid":
        return ops.sigmoid(logits_TE)
    return ops.softmax(logits_TE, -1)


# 2**-(e // 2) and 2**-(e - e // 2) for the exponents e in [-149, 127] of positive finite fp32 (index e + 149):
# their product scales |x| into [1, 2) and neither factor leaves the normal fp32 range.
_EXPONENTS = np.arange(-149, 128)
_SCALE_A = Tensor(np.ldexp(np.float32(1), -(_EXPONENTS // 2)).astype(np.float32))
_SCALE_B = Tensor(np.ldexp(np.float32(1), -(_EXPONENTS - _EXPONENTS // 2)).astype(np.float32))


def ordered_int(x):
    """An int32 per element that orders like the finite fp32 ``x`` and is equal exactly where ``x`` is
    (-0 and +0 alike): the sign times the IEEE-754 bit pattern of ``|x|``.

    MindSpore 2.9 graphs have no bitcast, so the pattern is computed: ``floor(log2 |x|)`` estimates the exponent,
    a product by two tabulated powers of two (exact) scales ``|x|`` near [1, 2), and one comparison each way
    corrects the estimate where ``log2`` rounded across a power of two; the exponent and the scaled value's
    fraction are the bits.
    """
    x = x.astype(ms.float32)
    magnitude = ops.abs(x)
    nonzero = magnitude > 0
    y = ops.select(nonzero, magnitude, ops.ones_like(magnitude))
    exponent = ops.clamp(ops.floor(ops.log2(y)), -149.0, 127.0).astype(ms.int32)
    index = exponent + 149
    y = y * ops.gather(_SCALE_A, index, 0) * ops.gather(_SCALE_B, index, 0)
    big = y >= 2.0
    y = ops.select(big, y * 0.5, y)
    exponent = exponent + big.astype(ms.int32)
    small = y < 1.0
    y = ops.select(small, y * 2.0, y)
    exponent = exponent - small.astype(ms.int32)
    normal_bits = (exponent + 127) * (1 << 23) + ((y - 1.0) * 2.0**23).astype(ms.int32)
    subnormal_bits = (magnitude * 2.0**100 * 2.0**49).astype(ms.int32)
    bits = ops.select(exponent >= -126, normal_bits, subnormal_bits)
    bits = ops.select(nonzero, bits, ops.zeros_like(bits))
    return ops.select(x < 0, -bits, bits)


def selection_keys(x_TE):
    """Unique int64 keys ``ordered_int(x) * E + (E - 1 - e)`` along the last axis: larger key, better
    expert; among equal values the lower index has the larger key."""
    num = x_TE.shape[-1]
    reversed_index_E = Tensor(np.arange(num - 1, -1, -1, dtype=np.int64))
    return ordered_int(x_TE).astype(ms.int64) * num + reversed_index_E


def descending_order(x_TE):
    """Indices ``[..., E]`` int32 ordering the last axis of ``x`` best first, equal values by lower index.

    One sort of unique integer keys (:func:`selection_keys`): the order depends neither on a float
    sort's precision (MindSpore documents a loss for float32 ``ops.sort``) nor on its stability.
    """
    _, order_TE = ops.sort(selection_keys(x_TE), -1, True)
    return order_TE.astype(ms.int32)


def selection_scores(scores_TE, bias_E=None):
    """The scores the selection orders (plus the correction bias), without gradient: indices carry none, and
    without the stop MindSpore 2.9 still built the backward of every op on the way to the sort keys (all zeros)."""
    return ops.stop_gradient(scores_TE if bias_E is None else scores_TE + bias_E.astype(ms.float32))


def select_experts(scores_TE, top_k: int, bias_E=None, n_group: int = 1, topk_group: int = 1):
    """Natural top-K expert indices ``[T, K]`` int32, best first, ties to the lower index.

    The correction bias shifts *selection* only (DeepSeek-V3 aux-loss-free balancing): it
    steers tokens towards under-loaded experts without changing how much an expert's output
    counts, which stays the router's own score. With ``n_group > 1`` a token may only pick
    from the ``topk_group`` groups whose two best (biased) scores sum highest (equal sums: the lower
    group). Ties are broken exactly (:func:`descending_order`): expert locking compares top-K sets, so
    equal scores must resolve alike on every backend.
    """
    choice_TE = selection_scores(scores_TE, bias_E)
    if n_group > 1:
        num_tokens, num_experts = choice_TE.shape
        per_group = num_experts // n_group
        # The last axis holds the E / J experts of one group.
        grouped_TJE = choice_TE.reshape(num_tokens, n_group, per_group)
        best_two_TJ2 = descending_order(grouped_TJE)[:, :, :2]
        group_score_TJ = ops.gather_elements(grouped_TJE, 2, best_two_TJ2).sum(-1)
        group_order_TJ = descending_order(group_score_TJ)
        keep_TJ = (
            ops.one_hot(
                group_order_TJ[:, :topk_group], n_group, ops.ones((), ms.float32), ops.zeros((), ms.float32)
            ).sum(1)
            > 0
        )
        keep_TE = ops.broadcast_to(keep_TJ.expand_dims(-1), grouped_TJE.shape).reshape(num_tokens, num_experts)
        choice_TE = ops.select(keep_TE, choice_TE, ops.full_like(choice_TE, MASKED_SCORE))
    return descending_order(choice_TE)[:, :top_k]


def gather_weights(scores_TE, topk_idx_TK, norm_topk_prob: bool, routed_scaling_factor: float):
    """Combine weights: the unbiased scores at the chosen experts, renormalised and scaled."""
    weight_TK = ops.gather_elements(scores_TE, 1, topk_idx_TK)
    if norm_topk_prob:
        weight_TK = weight_TK / (weight_TK.sum(-1, keepdims=True) + NORM_EPS)
    return weight_TK * routed_scaling_factor


def topk_routing(
    scores_TE,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    bias_E=None,
    n_group: int = 1,
    topk_group: int = 1,
):
    """Selection and weights in one call: ``(topk_idx_TK int32, topk_weight_TK fp32)``."""
    topk_idx_TK = select_experts(scores_TE, top_k, bias_E, n_group, topk_group)
    return topk_idx_TK, gather_weights(scores_TE, topk_idx_TK, norm_topk_prob, routed_scaling_factor)


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


def seq_aux_loss(probs_BSE, topk_idx_BSK, coeff: float):
    """Sequence-wise balance loss (DeepSeek-V3): the switch loss of each sequence, averaged."""
    batch, seq_len, num_experts = probs_BSE.shape
    top_k = topk_idx_BSK.shape[-1]
    one_hot_BSKE = ops.one_hot(topk_idx_BSK, num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32))
    fraction_BE = one_hot_BSKE.sum((1, 2)) / (top_k * seq_len)
    mean_prob_BE = probs_BSE.mean(1)
    return coeff * num_experts * (fraction_BE * mean_prob_BE).sum(-1).mean()


def updated_bias(bias_E, load_E, rate: float):
    """Aux-loss-free bias step: ``b + rate * sign(mean_load - load)`` (no change at the mean)."""
    mean_load = load_E.mean(-1, keep_dims=True)
    return bias_E + rate * ops.sign(mean_load - load_E)


class Router(nn.Cell):
    """Linear router ``[E, H]`` evaluated in fp32 whatever the compute dtype, and the routing steps of one
    MoE layer as methods, so a serving graph that carries its own lock state calls the same code.

    ``e_score_correction_bias`` (if ``expert_bias``) is state, not a trained weight: the
    optimizer never sees it; the trainer moves it once per step from the observed load.
    """

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator, moe: MoEConfig = None):
        super().__init__()
        self.weight = Parameter(
            normal_init((cfg.num_experts, cfg.hidden_size), cfg.initializer_range, rng), name="weight"
        )
        add_seams(self, "weight")
        self.has_bias = cfg.expert_bias
        if cfg.expert_bias:
            self.e_score_correction_bias = Parameter(
                Tensor(np.zeros(cfg.num_experts, np.float32)), name="e_score_correction_bias", requires_grad=False
            )
        self.matmul = ops.MatMul(transpose_b=True)
        self.top_k = cfg.top_k
        self.score_func = cfg.score_func
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        moe = moe_policy(moe)
        self.expert_lock = moe.expert_lock
        self.lock_run_length = moe.lock_run_length
        self.lock_span = moe.lock_span
        self.aux_loss_type = moe.aux_loss
        self.aux_loss_coeff = moe.aux_loss_coeff
        self.z_loss_coeff = moe.z_loss_coeff
        # Megatron computes the balancing loss on the plain top-K of the scores, whatever bias or
        # group limits did to selection; only then do the two differ.
        self.aux_needs_plain_topk = cfg.expert_bias or cfg.n_group > 1

    def construct(self, x_TH):
        """Router logits ``[T, E]`` fp32."""
        return self.matmul(x_TH.astype(ms.float32), self.weight_full(self.weight).astype(ms.float32))

    def natural_routing(self, x_TH):
        """``(logits [T, E], scores [T, E], natural top-K [T, K])``: the router's own choice, before locking."""
        logits_TE = self.construct(x_TH)
        scores_TE = router_scores(logits_TE, self.score_func)
        bias_E = self.e_score_correction_bias if self.has_bias else None
        return logits_TE, scores_TE, select_experts(scores_TE, self.top_k, bias_E, self.n_group, self.topk_group)

    def locked_routing(self, natural_TK, doc_ids_BS):
        """``(top-K to route with [T, K], locked [T] fp32)`` of a packed micro-batch (:func:`lock_routing`)."""
        num_tokens = natural_TK.shape[0]
        if not self.expert_lock:
            return natural_TK, ops.zeros((num_tokens,), ms.float32)
        batch, seq_len = doc_ids_BS.shape
        locked_BS, locked_idx_BSK = lock_routing(
            natural_TK.reshape(batch, seq_len, self.top_k), doc_ids_BS, self.lock_run_length, self.lock_span
        )
        return locked_idx_BSK.reshape(num_tokens, self.top_k), locked_BS.reshape(num_tokens).astype(ms.float32)

    def combine_weights(self, scores_TE, topk_idx_TK):
        """Weights ``[T, K]`` of the experts routed to (:func:`gather_weights`)."""
        return gather_weights(scores_TE, topk_idx_TK, self.norm_topk_prob, self.routed_scaling_factor)

    def balance_loss(self, scores_TE, natural_TK, batch: int, seq_len: int):
        """The configured aux loss (``moe.aux_loss``: switch, seq or none) of the natural routing."""
        if self.aux_loss_type == "none":
            return ops.zeros((), ms.float32)
        aux_topk_TK = natural_TK
        if self.aux_needs_plain_topk:
            aux_topk_TK = select_experts(scores_TE, self.top_k)
        probs_TE = aux_probs(scores_TE, self.score_func)
        if self.aux_loss_type == "seq":
            return seq_aux_loss(
                probs_TE.reshape(batch, seq_len, -1), aux_topk_TK.reshape(batch, seq_len, -1), self.aux_loss_coeff
            )
        return switch_aux_loss(probs_TE, aux_topk_TK, self.aux_loss_coeff)

    def router_z_loss(self, logits_TE):
        """:func:`z_loss` with ``moe.z_loss_coeff`` (zero when it is 0)."""
        if self.z_loss_coeff > 0:
            return z_loss(logits_TE, self.z_loss_coeff)
        return ops.zeros((), ms.float32)
