"""Expert locking (README, "Routing") vs a brute-force per-token NumPy transcription of its definition,
hand-written cases with exact expected arrays, and the MoE layer vs a naive per-token loop.

Definition, as transcribed below: ``N_t`` is token t's natural top-k *set*; ``run(t)`` counts the
consecutive tokens ending at t, inside t's document, whose set equals ``N_t``; t is locked when some
s with ``t - span <= s <= t - 1`` in t's document has ``run(s) >= run_length``, and is then routed to
``N_{s*}`` of the most recent such s*, with weights gathered from t's *own* unbiased scores.
"""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindmoe.model.moe import MoELayer, flip_rate, lock_routing
from tests.helpers.moe import EXPERTS, HIDDEN, TOP_K, build_layer, layer_configs, layer_weights, np_swiglu

# ---- brute-force NumPy transcriptions ----------------------------------------------------------


def np_runs(topk_idx_SK, doc_ids_S):
    """run(t) for every t of one sequence, by walking back from t."""
    sets = [frozenset(row.tolist()) for row in topk_idx_SK]
    runs = []
    for t in range(len(sets)):
        run, s = 1, t - 1
        while s >= 0 and doc_ids_S[s] == doc_ids_S[t] and sets[s] == sets[t]:
            run, s = run + 1, s - 1
        runs.append(run)
    return runs


def np_lock_routing(topk_idx_BSK, doc_ids_BS, run_length, span):
    """``(locked [B,S] bool, routed top-k [B,S,K])`` straight from the definition, one token at a time."""
    batch, seq_len, _ = topk_idx_BSK.shape
    locked = np.zeros((batch, seq_len), bool)
    routed = topk_idx_BSK.copy()
    for b in range(batch):
        runs = np_runs(topk_idx_BSK[b], doc_ids_BS[b])
        for t in range(seq_len):
            # Most recent first; leaving t's document (walking back) ends the search.
            for s in range(t - 1, max(t - span, 0) - 1, -1):
                if doc_ids_BS[b, s] != doc_ids_BS[b, t]:
                    break
                if runs[s] >= run_length:
                    locked[b, t] = True
                    routed[b, t] = topk_idx_BSK[b, s]
                    break
    return locked, routed


def np_flip_rate(topk_idx_BSK, doc_ids_BS):
    changed, pairs = 0, 0
    for b in range(topk_idx_BSK.shape[0]):
        for t in range(1, topk_idx_BSK.shape[1]):
            if doc_ids_BS[b, t] == doc_ids_BS[b, t - 1]:
                pairs += 1
                changed += set(topk_idx_BSK[b, t].tolist()) != set(topk_idx_BSK[b, t - 1].tolist())
    return changed / max(pairs, 1)


def as_sets(topk_idx):
    """Top-k rows compared as sets: sort each row."""
    return np.sort(np.asarray(topk_idx), -1)


def random_routing(seed, batch, seq_len, num_experts, top_k, p_repeat=0.65, p_boundary=0.08):
    """Natural top-k with frequent runs (the previous set again, half the time in another order),
    fresh random sets otherwise, and documents that start at random positions."""
    rng = np.random.default_rng(seed)
    idx = np.zeros((batch, seq_len, top_k), np.int32)
    for b in range(batch):
        for t in range(seq_len):
            if t > 0 and rng.random() < p_repeat:
                previous = idx[b, t - 1]
                idx[b, t] = rng.permutation(previous) if rng.random() < 0.5 else previous
            else:
                idx[b, t] = rng.permutation(num_experts)[:top_k]
    doc_ids = np.cumsum(rng.random((batch, seq_len)) < p_boundary, 1).astype(np.int32)
    return idx, doc_ids


# Different shapes and (run_length, span) pairs; 6 x 24 = 144 random sequences in all.
RANDOM_CASES = [  # (seed, top_k, num_experts, run_length, span)
    (0, 2, 6, 3, 4),
    (1, 2, 6, 5, 10),
    (2, 1, 4, 2, 3),
    (3, 3, 8, 1, 2),
    (4, 2, 5, 4, 1),
    (5, 4, 8, 2, 7),
]
RANDOM_BATCH, RANDOM_SEQ = 24, 24


@pytest.mark.parametrize("seed,top_k,num_experts,run_length,span", RANDOM_CASES)
def test_lock_routing_eager_matches_brute_force_definition(seed, top_k, num_experts, run_length, span):
    idx, doc_ids = random_routing(seed, RANDOM_BATCH, RANDOM_SEQ, num_experts, top_k)
    locked, routed = lock_routing(Tensor(idx), Tensor(doc_ids), run_length, span)
    ref_locked, ref_routed = np_lock_routing(idx, doc_ids, run_length, span)
    assert locked.dtype == ms.bool_ and routed.dtype == ms.int32
    assert locked.shape == (RANDOM_BATCH, RANDOM_SEQ) and routed.shape == idx.shape
    # The random cases must exercise both outcomes, inherited sets that differ from the natural one,
    # and permuted repeats inside runs.
    assert 0.05 < ref_locked.mean() < 0.95
    assert (as_sets(ref_routed) != as_sets(idx)).any(-1).sum() > 5
    np.testing.assert_array_equal(locked.asnumpy(), ref_locked)
    np.testing.assert_array_equal(as_sets(routed.asnumpy()), as_sets(ref_routed))


@pytest.mark.parametrize("seed,top_k,num_experts,run_length,span", RANDOM_CASES[:3])
def test_lock_routing_under_jit_matches_brute_force_definition(seed, top_k, num_experts, run_length, span):
    @ms.jit
    def lock_fixed(topk_idx, doc_ids):
        return lock_routing(topk_idx, doc_ids, run_length, span)

    idx, doc_ids = random_routing(seed + 100, 40, RANDOM_SEQ, num_experts, top_k)  # 3 x 40 sequences
    locked, routed = lock_fixed(Tensor(idx), Tensor(doc_ids))
    ref_locked, ref_routed = np_lock_routing(idx, doc_ids, run_length, span)
    assert ref_locked.any() and not ref_locked.all()
    np.testing.assert_array_equal(locked.asnumpy(), ref_locked)
    np.testing.assert_array_equal(as_sets(routed.asnumpy()), as_sets(ref_routed))


# ---- hand-written cases (k = 2) ------------------------------------------------------------------

A, A_SWAPPED, B, C, D = [0, 1], [1, 0], [2, 3], [0, 2], [1, 3]


def run_lock(sets, doc_ids, run_length, span):
    idx = np.array([sets], np.int32)
    locked, routed = lock_routing(Tensor(idx), Tensor(np.array([doc_ids], np.int32)), run_length, span)
    return locked.asnumpy()[0], as_sets(routed.asnumpy()[0])


def expected_routes(sets, inherited):
    """The natural sets with ``inherited = {t: set}`` overriding the locked tokens."""
    return as_sets([inherited.get(t, s) for t, s in enumerate(sets)])


def test_run_of_exactly_run_length_locks_the_following_tokens_not_its_own_last_token():
    sets = [A, A, A, B, C, D, D]
    locked, routed = run_lock(sets, [0] * 7, run_length=3, span=2)
    np.testing.assert_array_equal(locked, [0, 0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(routed, expected_routes(sets, {3: A, 4: A}))


def test_run_one_short_of_run_length_locks_nothing():
    locked, _ = run_lock([A, A, B, C, D], [0] * 5, run_length=3, span=4)
    np.testing.assert_array_equal(locked, [0, 0, 0, 0, 0])


def test_lock_expires_span_tokens_after_the_qualifying_token():
    sets = [A, A, B, C, D, B, C]
    locked, routed = run_lock(sets, [0] * 7, run_length=2, span=3)
    np.testing.assert_array_equal(locked, [0, 0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(routed, expected_routes(sets, {2: A, 3: A, 4: A}))


def test_continuing_run_keeps_renewing_the_lock():
    sets = [A, A, A, A, B, C]
    locked, routed = run_lock(sets, [0] * 6, run_length=2, span=1)
    # run(1..3) >= 2: tokens 2, 3, 4 each have a qualifying predecessor; token 5's predecessor runs 1.
    np.testing.assert_array_equal(locked, [0, 0, 1, 1, 1, 0])
    np.testing.assert_array_equal(routed, expected_routes(sets, {4: A}))


def test_document_boundary_inside_a_run_restarts_the_run():
    sets = [A, A, A, A, B, B]
    locked, _ = run_lock(sets, [0, 0, 1, 1, 1, 1], run_length=3, span=4)
    np.testing.assert_array_equal(locked, [0, 0, 0, 0, 0, 0])
    # The same sets in one document do qualify, so the boundary is what prevented the lock.
    locked, routed = run_lock(sets, [0] * 6, run_length=3, span=4)
    np.testing.assert_array_equal(locked, [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(routed, expected_routes(sets, {4: A, 5: A}))


def test_lock_does_not_cross_a_document_boundary():
    sets = [A, A, A, B, C, D]
    locked, _ = run_lock(sets, [0, 0, 0, 1, 1, 1], run_length=3, span=4)
    np.testing.assert_array_equal(locked, [0, 0, 0, 0, 0, 0])
    locked, _ = run_lock(sets, [0, 0, 0, 0, 1, 1], run_length=3, span=4)
    np.testing.assert_array_equal(locked, [0, 0, 0, 1, 0, 0])


def test_a_set_repeated_in_another_order_is_the_same_set():
    sets = [A, A_SWAPPED, A, B]
    locked, routed = run_lock(sets, [0] * 4, run_length=3, span=1)
    np.testing.assert_array_equal(locked, [0, 0, 0, 1])
    np.testing.assert_array_equal(routed, expected_routes(sets, {3: A}))


def test_locked_token_inherits_the_most_recent_qualifying_set():
    sets = [A, A, B, B, C, D]
    locked, routed = run_lock(sets, [0] * 6, run_length=2, span=5)
    # Token 3 closes B's run but its lock comes from token 1 (A); tokens 4, 5 inherit B from token 3.
    np.testing.assert_array_equal(locked, [0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(routed, expected_routes(sets, {2: A, 3: A, 4: B, 5: B}))


def test_run_length_one_locks_every_token_to_its_predecessor_within_a_document():
    sets = [A, B, C, D, A]
    locked, routed = run_lock(sets, [0, 0, 0, 1, 1], run_length=1, span=1)
    np.testing.assert_array_equal(locked, [0, 1, 1, 0, 1])
    np.testing.assert_array_equal(routed, expected_routes(sets, {1: A, 2: B, 4: D}))


def test_hand_written_cases_agree_with_the_brute_force_transcription():
    # The transcription used for the random cases gives the hand-written answers too.
    for sets, docs, run_length, span, expected in [
        ([A, A, A, B, C, D, D], [0] * 7, 3, 2, [0, 0, 0, 1, 1, 0, 0]),
        ([A, A, B, B, C, D], [0] * 6, 2, 5, [0, 0, 1, 1, 1, 1]),
        ([A, A, A, A, B, B], [0, 0, 1, 1, 1, 1], 3, 4, [0] * 6),
    ]:
        locked, _ = np_lock_routing(np.array([sets]), np.array([docs]), run_length, span)
        np.testing.assert_array_equal(locked[0], expected)


def test_flip_rate_matches_numpy():
    idx, doc_ids = random_routing(7, 8, 20, 6, 2, p_repeat=0.5, p_boundary=0.15)
    expected = np_flip_rate(idx, doc_ids)
    assert 0.1 < expected < 0.9
    assert float(flip_rate(Tensor(idx), Tensor(doc_ids)).asnumpy()) == pytest.approx(expected, rel=1e-6)


# ---- the MoE layer --------------------------------------------------------------------------------

BATCH, SEQ = 2, 12


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_natural_routing(x_TH, weights, top_k):
    """Sigmoid scores and the natural top-k of ``scores + bias`` (ties to the lower index)."""
    scores = sigmoid(x_TH @ weights["router.weight"].T)
    bias = weights.get("router.e_score_correction_bias", np.zeros(scores.shape[-1]))
    return scores, np.argsort(-(scores + bias), -1, kind="stable")[:, :top_k]


def np_capacity_kept(routed_TK, num_experts, capacity):
    """Which assignments find a slot: per expert in token order, a token's choices in rank order."""
    load = np.zeros(num_experts, int)
    kept = np.zeros(routed_TK.shape, bool)
    for t, k in np.ndindex(*routed_TK.shape):
        e = routed_TK[t, k]
        kept[t, k] = capacity is None or load[e] < capacity
        load[e] += kept[t, k]
    return kept


def naive_locked_moe(x_BSH, doc_ids_BS, weights, cfg, moe, capacity=None):
    """Per-token loop of the locked layer (sigmoid router) in float64, architecture ``cfg``, policy ``moe``.

    Returns ``out``, the routed top-k, the locked mask, and per-assignment ``kept`` flags
    (capacity is taken per expert in token order, choices in rank order).
    """
    batch, seq_len, hidden = x_BSH.shape
    x_TH = x_BSH.reshape(-1, hidden).astype(np.float64)
    scores, natural = np_natural_routing(x_TH, weights, cfg.top_k)
    if moe.expert_lock:
        locked, routed = np_lock_routing(
            natural.reshape(batch, seq_len, -1), doc_ids_BS, moe.lock_run_length, moe.lock_span
        )
        locked, routed = locked.reshape(-1), routed.reshape(-1, cfg.top_k)
    else:
        locked, routed = np.zeros(len(x_TH), bool), natural
    weight = np.take_along_axis(scores, routed, -1)  # the token's OWN unbiased scores
    weight = weight / weight.sum(-1, keepdims=True) * cfg.routed_scaling_factor
    kept = np_capacity_kept(routed, cfg.num_experts, capacity)
    out = np.zeros_like(x_TH)
    for t in range(len(x_TH)):
        for k in range(cfg.top_k):
            e = routed[t, k]
            if not kept[t, k]:
                continue
            out[t] += weight[t, k] * np_swiglu(
                x_TH[t], weights["experts.gate_proj"][e], weights["experts.up_proj"][e], weights["experts.down_proj"][e]
            )
        out[t] += np_swiglu(
            x_TH[t],
            weights["shared_experts.gate_proj.weight"],
            weights["shared_experts.up_proj.weight"],
            weights["shared_experts.down_proj.weight"],
        )
    return out.reshape(x_BSH.shape), natural, routed, locked, kept, weight


def runs_input(seed=23):
    """Rows made of runs of identical token vectors (identical vectors route identically), so locks
    trigger; the tokens after a run are fresh vectors whose own routing usually differs."""
    rng = np.random.default_rng(seed)
    pattern = [[0, 0, 0, 1, 2, 3, 4, 4, 5, 6, 7, 8], [0, 1, 1, 1, 2, 3, 3, 4, 4, 4, 5, 6]]
    x = np.zeros((BATCH, SEQ, HIDDEN), np.float32)
    for b, row in enumerate(pattern):
        vectors = rng.normal(size=(max(row) + 1, HIDDEN)).astype(np.float32)
        x[b] = vectors[row]
    doc_ids = np.array([[0] * SEQ, [0] * 8 + [1] * 4], np.int32)  # a document boundary inside a run
    return x, doc_ids


def lock_layer_config(dispatch, capacity_factor, **overrides):
    """``(ModelConfig, MoEConfig)`` of a sigmoid layer with a correction bias and locking on."""
    fields = dict(
        score_func="sigmoid",
        expert_bias=True,
        routed_scaling_factor=2.5,
        expert_lock=True,
        lock_run_length=2,
        lock_span=3,
    )
    fields.update(overrides)
    return layer_configs(dispatch, capacity_factor, **fields)


def copy_parameters_by_name(source, target):
    target_params = dict(target.parameters_and_names())
    source_params = dict(source.parameters_and_names())
    assert set(target_params) == set(source_params)
    for name, param in source_params.items():
        target_params[name].set_data(Tensor(param.asnumpy().copy()))


def test_layer_with_locking_that_never_triggers_equals_layer_without_locking():
    dispatch = "capacity"
    run_length = SEQ + 1  # longer than any sequence: no token can qualify
    locking = build_layer(*lock_layer_config(dispatch, 4.0, lock_run_length=run_length, isolation_decay=1.0), seed=3)
    plain_cfg, plain_moe = lock_layer_config(dispatch, 4.0, expert_lock=False)
    plain = MoELayer(plain_cfg, np.random.default_rng(1), moe=plain_moe)
    copy_parameters_by_name(locking, plain)
    x, doc_ids = runs_input()
    # The same input does lock with the layer's usual run length, so nothing else hides the effect.
    _, natural, _, _, _, _ = naive_locked_moe(x, doc_ids, layer_weights(locking), *lock_layer_config(dispatch, 4.0))
    assert np_lock_routing(natural.reshape(BATCH, SEQ, -1), doc_ids, 2, 3)[0].any()

    ours = locking(Tensor(x), Tensor(doc_ids))
    reference = plain(Tensor(x), Tensor(doc_ids))
    for got, expected in zip(ours, reference):
        np.testing.assert_array_equal(got.asnumpy(), expected.asnumpy())
    assert float(ours[4][1].asnumpy()) == 0.0  # lock_rate


@pytest.mark.parametrize("dispatch,capacity_factor", [("dropless", 1.0), ("capacity", 0.75)])
def test_locked_layer_matches_per_token_loop_with_inherited_experts_and_own_scores(dispatch, capacity_factor):
    cfg, moe = lock_layer_config(dispatch, capacity_factor)
    layer = build_layer(cfg, moe, seed=5)
    weights = layer_weights(layer)
    assert np.abs(weights["router.e_score_correction_bias"]).max() > 0.1
    x, doc_ids = runs_input()
    capacity = None
    if dispatch == "capacity":
        capacity = int(np.ceil(capacity_factor * BATCH * SEQ * TOP_K / EXPERTS))
    expected, natural, routed, locked, kept, _ = naive_locked_moe(x, doc_ids, weights, cfg, moe, capacity)
    # Teeth: some locked tokens go to experts their own routing did not choose.
    assert (as_sets(routed)[locked] != as_sets(natural)[locked]).any(-1).sum() >= 2
    if capacity is not None:
        assert 0 < (~kept).sum() < kept.size, "the capacity case must drop some assignments"

    out, _, _, routing_stats, layer_stats = layer(Tensor(x), Tensor(doc_ids))
    np.testing.assert_allclose(out.asnumpy(), expected, rtol=1e-5, atol=1e-5)
    dropped, lock_rate, flip = layer_stats.asnumpy()[:3]
    assert lock_rate == pytest.approx(locked.mean(), rel=1e-6)
    assert flip == pytest.approx(np_flip_rate(natural.reshape(BATCH, SEQ, -1), doc_ids), rel=1e-6)
    assert dropped == (~kept).sum()
    chosen, kept_load, locked_kept = routing_stats.asnumpy()
    np.testing.assert_array_equal(chosen, np.bincount(routed.reshape(-1), minlength=EXPERTS))
    np.testing.assert_array_equal(kept_load, np.bincount(routed[kept], minlength=EXPERTS))
    locked_and_kept = kept & locked[:, None]
    np.testing.assert_array_equal(locked_kept, np.bincount(routed[locked_and_kept], minlength=EXPERTS))
