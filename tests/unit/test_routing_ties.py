"""Expert selection with exact ties and one-ulp differences, plain and group-limited, compiled and eager,
against NumPy with a stable sort (equal scores go to the lower expert index, equal group scores to the
lower group); and the order-preserving integer encoding of fp32 scores it sorts by."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindmoe.model.moe.router import ordered_int, select_experts, selection_keys
from tests.helpers.float_bits import every_exponent, np_ordered_int


def np_select(choice, top_k, n_group=1, topk_group=1):
    """Top-K of fp32 ``choice`` by a stable descending sort; groups ranked by their two best scores."""
    choice = np.asarray(choice, np.float32)
    if n_group > 1:
        tokens, experts = choice.shape
        grouped = choice.reshape(tokens, n_group, experts // n_group)
        best_two = np.sort(grouped, -1)[..., -2:]
        group_scores = best_two[..., 1] + best_two[..., 0]  # fp32, as the graph adds them
        kept = np.argsort(-group_scores, -1, kind="stable")[:, :topk_group]
        mask = np.zeros((tokens, n_group), bool)
        np.put_along_axis(mask, kept, True, -1)
        choice = np.where(mask[:, :, None], grouped, np.float32(-1e30)).reshape(tokens, experts)
    return np.argsort(-choice, -1, kind="stable")[:, :top_k]


def run(mode, fn, *arrays):
    if mode == "jit":
        return ms.jit(fn)(*[Tensor(a) for a in arrays]).asnumpy()
    return fn(*[Tensor(a) for a in arrays]).asnumpy()


def tied_scores(seed, tokens, experts, levels=3):
    """Scores drawn from a few values, so most rows hold exact ties, some at the top-K boundary."""
    values = np.random.default_rng(seed).choice(np.float32([0.125, 0.5, 0.75][:levels]), size=(tokens, experts))
    return values.astype(np.float32)


def special_values():
    tiny = np.finfo(np.float32).tiny
    values = [0.0, -0.0, 1.0, -1.0, 2.0, 0.5, tiny, -tiny, 1e-40, -1e-45, 3e38, -3e38, 1e30, -1e30, 0.1]
    values += list(np.random.default_rng(0).normal(scale=10.0, size=40)) + [np.nextafter(np.float32(0.5), 1)]
    return np.asarray(values, np.float32).reshape(1, -1)


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_ordered_int_is_the_sign_magnitude_bit_pattern_and_orders_like_the_floats(mode):
    x = special_values()

    def encode(x):
        return ordered_int(x)

    ours = run(mode, encode, x)
    expected = np_ordered_int(x)
    normal = np.abs(x) >= np.finfo(np.float32).tiny
    np.testing.assert_array_equal(ours[normal], expected[normal])
    # Subnormals: exact where the backend keeps them, zero where it flushes them; the order holds either way.
    assert np.all((ours[~normal] == expected[~normal]) | (ours[~normal] == 0))
    order = np.argsort(x.ravel(), kind="stable")
    assert np.all(np.diff(ours.ravel()[order].astype(np.int64)) >= 0)
    assert ours[0, 0] == ours[0, 1] == 0  # -0 and +0 are one value


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_ordered_int_is_exact_at_every_binade_edge(mode):
    x = every_exponent()
    ours = run(mode, ordered_int, x)
    expected = np_ordered_int(x)
    normal = np.abs(x) >= np.finfo(np.float32).tiny
    np.testing.assert_array_equal(ours[normal], expected[normal])
    assert np.all((ours[~normal] == expected[~normal]) | (ours[~normal] == 0))


def test_selection_keys_are_unique_so_any_sort_gives_the_stable_order():
    scores = tied_scores(5, 32, 8)
    keys = run("jit", selection_keys, scores)
    assert keys.dtype == np.int64
    assert all(len(set(row)) == len(row) for row in keys)
    # An unstable sort of the keys gives the stable order of the scores: ties no longer exist.
    np.testing.assert_array_equal(np.argsort(-keys, -1, kind="quicksort"), np.argsort(-scores, -1, kind="stable"))


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_plain_selection_breaks_exact_ties_toward_the_lower_expert(mode, top_k):
    scores = tied_scores(1, 64, 8)
    # A bias that makes different scores equal after it is added, as aux-loss-free balancing can.
    bias = np.float32([0.0, 0.25, -0.25, 0.0, 0.625, 0.0, -0.375, 0.25])

    def select(scores, bias):
        return select_experts(scores, top_k, bias)

    ours = run(mode, select, scores, bias)
    assert ours.dtype == np.int32
    np.testing.assert_array_equal(ours, np_select(scores + bias, top_k))


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("n_group,topk_group,top_k", [(4, 2, 2), (4, 1, 2), (2, 1, 3), (8, 3, 2)])
def test_group_limited_selection_breaks_group_and_expert_ties_toward_the_lower_index(mode, n_group, topk_group, top_k):
    scores = tied_scores(2, 96, 16)
    # Rows where every group scores alike, and where only the groups' second-best scores decide.
    scores[0] = 0.5
    scores[1, ::2] = 0.75

    def select(scores):
        return select_experts(scores, top_k, None, n_group, topk_group)

    ours = run(mode, select, scores)
    np.testing.assert_array_equal(ours, np_select(scores, top_k, n_group, topk_group))


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_scores_one_ulp_apart_are_ordered_by_value_not_tied(mode):
    ulps = np.random.default_rng(3).permutation(16)
    # 0.3 plus `ulps` units in the last place (consecutive fp32 values have consecutive bit patterns).
    scores = (np.float32(0.3).view(np.int32) + ulps.astype(np.int32)).view(np.float32).reshape(1, 16)

    def select(scores):
        return select_experts(scores, 16)

    np.testing.assert_array_equal(run(mode, select, scores)[0], np.argsort(-ulps, kind="stable"))
    grouped = np.concatenate([scores, scores[:, ::-1]], 0)

    def select_grouped(scores):
        return select_experts(scores, 4, None, 4, 2)

    np.testing.assert_array_equal(run(mode, select_grouped, grouped), np_select(grouped, 4, 4, 2))


def test_random_scores_select_as_before():
    """Without ties the selection is the plain descending order (the numerics did not move)."""
    scores = np.random.default_rng(4).random((128, 16)).astype(np.float32)

    def select(scores):
        return select_experts(scores, 4, None, 4, 2)

    np.testing.assert_array_equal(run("jit", select, scores), np_select(scores, 4, 4, 2))
    np.testing.assert_array_equal(select_experts(Tensor(scores), 4).asnumpy(), np.argsort(-scores, -1)[:, :4])
