"""Grouped dropless dispatch (``moe.dispatch=dropless``) against the all-experts reference.

The reference, :class:`AllExpertsDispatcher`, runs every expert on every token and combines with a
``[T, E]`` weight matrix that is zero off the chosen experts: exact by construction. The grouped
dispatcher sorts the assignments by expert into groups padded to blocks of b rows; both must give the
same outputs and the same gradients of the input, the combine (router) weights and the expert weights,
for any routing, including experts without tokens, every token on one expert and T * K not a
multiple of b, with ``token_grad`` isolation's row scaling, LoRA on the experts, and locking.
"""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from mindmoe.model.config import ModelConfig
from mindmoe.model.lora.layers import AdapterSpec
from mindmoe.model.moe import AllExpertsDispatcher, DroplessDispatcher, MoELayer, RoutedExperts, local_dispatcher
from mindmoe.model.moe.dispatch import grouped_rows
from mindmoe.model.moe.lora_experts import LoraRoutedExperts
from mindmoe.model.moe.routed_part import GroupedRoutedPart
from mindmoe.model.moe_config import MoEConfig
from tests.helpers.moe import GivenDispatcher, build_layer
from tests.unit.test_locking import lock_layer_config, runs_input

TOKENS, HIDDEN, WIDTH, EXPERTS, TOP_K = 11, 6, 5, 5, 2  # A = 22 assignments: not a multiple of 4


class ExpertsRoundTrip(nn.Cell):
    """The grouped routed part: dispatch -> experts (grouped or on the [E, C, H] buffer, row-scaled when the experts
    are) -> combine."""

    def __init__(self, dispatcher, experts):
        super().__init__()
        self.routed = GroupedRoutedPart(dispatcher, experts.row_scaled)
        self.experts = experts

    def construct(self, x_TH, topk_idx_TK, weight_TK, scale_T):
        return self.routed(self.experts, x_TH, (topk_idx_TK, weight_TK), scale_T)


def make_experts(lora: bool, scaled: bool = False):
    rng = np.random.default_rng(3)
    if not lora:
        return RoutedExperts(EXPERTS, HIDDEN, WIDTH, 0.5, rng, row_scaled=scaled)
    spec = AdapterSpec(2, 1.5, 0.0, np.random.default_rng(4))
    experts = LoraRoutedExperts(EXPERTS, HIDDEN, WIDTH, 0.5, rng, ("gate_proj", "down_proj"), spec, row_scaled=scaled)
    for proj in experts.projections:  # B starts at zero; make the adapters contribute
        lora_B = getattr(experts, f"{proj}_lora")[1]
        lora_B.set_data(Tensor(rng.normal(0, 0.3, size=lora_B.shape).astype(np.float32)))
    return experts


def values_and_grads(dispatcher, routing_TK, scaled=False, lora=False, seed=0):
    """Loss ``sum(out * probe)``, kept mask, and gradients of x, the combine weights and every parameter."""
    rng = np.random.default_rng(seed)
    x_TH = Tensor(rng.normal(size=(TOKENS, HIDDEN)).astype(np.float32))
    weight_TK = Tensor(rng.uniform(0.1, 1.0, size=routing_TK.shape).astype(np.float32))
    scale_T = Tensor(rng.uniform(0.2, 1.0, size=TOKENS).astype(np.float32))
    probe_TH = Tensor(rng.normal(size=(TOKENS, HIDDEN)).astype(np.float32))
    net = ExpertsRoundTrip(dispatcher, make_experts(lora, scaled))
    params = net.trainable_params()

    def loss(x, weight):
        out_TH, kept_A = net(x, Tensor(routing_TK), weight, scale_T)
        return (out_TH * probe_TH).sum(), kept_A

    (value, kept), (grads_in, grads_params) = ms.jit(ms.value_and_grad(loss, (0, 1), params, has_aux=True))(
        x_TH, weight_TK
    )
    named = {p.name.removeprefix("experts."): g.asnumpy() for p, g in zip(params, grads_params)}
    return value.asnumpy(), kept.asnumpy(), [g.asnumpy() for g in grads_in], named


def routing(case: str):
    rng = np.random.default_rng(11)
    if case == "random":
        return np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(TOKENS)]).astype(np.int32)
    if case == "empty_experts":  # experts 1 and 3 get no token
        return np.stack([rng.permutation([0, 2, 4])[:TOP_K] for _ in range(TOKENS)]).astype(np.int32)
    assert case == "one_expert"  # every token's first choice is expert 2, the second expert 4
    return np.tile(np.array([[2, 4]], np.int32), (TOKENS, 1))


def assert_same(grouped, reference):
    np.testing.assert_allclose(grouped[0], reference[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(grouped[1], np.ones(TOKENS * TOP_K, np.float32))
    for got, expected in zip(grouped[2], reference[2]):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert set(grouped[3]) == set(reference[3])
    for name, expected in reference[3].items():
        np.testing.assert_allclose(grouped[3][name], expected, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    "case,alignment,scaled,lora",
    [
        ("empty_experts", 4, True, False),
        ("one_expert", 4, False, True),
        ("random", None, True, True),  # the CPU kernel's own block size (1 for so few rows)
    ],
)
def test_grouped_dispatch_equals_all_experts_reference_in_values_and_gradients(
    case, alignment, scaled, lora, static_path
):
    """With ``scaled`` the row scale (uniform in [0.2, 1]) must reach the expert weight gradients exactly as
    the reference's; the input and combine-weight gradients are unscaled in both."""
    routing_TK = routing(case)
    reference = values_and_grads(AllExpertsDispatcher(EXPERTS), routing_TK, scaled, lora)
    grouped = values_and_grads(DroplessDispatcher(EXPERTS, alignment=alignment), routing_TK, scaled, lora)
    assert_same(grouped, reference)
    if case == "empty_experts":
        assert not grouped[3]["gate_proj"][[1, 3]].any() and grouped[3]["gate_proj"][[0, 2, 4]].all()


def test_grouped_rows_sort_stably_by_expert_and_pad_each_group_to_the_block():
    routing_TK = routing("empty_experts")
    block = 4
    row_A, sizes_E, num_rows = grouped_rows(Tensor(routing_TK), EXPERTS, block)
    row_A, sizes_E = row_A.asnumpy(), sizes_E.asnumpy()
    counts = np.bincount(routing_TK.reshape(-1), minlength=EXPERTS)
    np.testing.assert_array_equal(sizes_E, -(-counts // block) * block)
    assert num_rows == (TOKENS * TOP_K + EXPERTS * (block - 1)) // block * block >= sizes_E.sum()
    starts = np.cumsum(sizes_E) - sizes_E
    expert_A = routing_TK.reshape(-1)
    for e in range(EXPERTS):  # token order within each expert, from the group's first row
        np.testing.assert_array_equal(row_A[expert_A == e], starts[e] + np.arange(counts[e]))


def test_model_dispatch_dropless_is_the_grouped_dispatcher_and_reports_its_groups():
    dispatcher = local_dispatcher(ModelConfig(num_experts=EXPERTS), MoEConfig(dispatch="dropless"))
    assert type(dispatcher) is DroplessDispatcher and dispatcher.alignment is None
    assert not list(dispatcher.get_parameters())


def layer_loss(layer, probe, doc_ids):
    def loss(x_BSH):
        out, aux, z, stats, layer_stats = layer(x_BSH, doc_ids)
        return (out * probe).sum() + aux + z, (stats, layer_stats)

    return loss


def test_locked_moe_layer_with_grouped_dispatch_equals_the_reference_layer(static_path):
    """A whole MoE layer with locking on (locks trigger on this input): output, losses, statistics and
    the gradients of input, router and experts equal those of the layer on the all-experts reference."""
    cfg, moe = lock_layer_config("dropless", 1.0, isolation_mode="token_grad")
    x, doc_ids = runs_input()
    probe = Tensor(np.random.default_rng(2).normal(size=x.shape).astype(np.float32))
    results = []
    for make in (
        lambda: DroplessDispatcher(cfg.num_experts, alignment=4),
        lambda: AllExpertsDispatcher(cfg.num_experts),
    ):
        layer = build_layer(cfg, moe, seed=5, placement=GivenDispatcher(make))
        params = layer.trainable_params()
        step = ms.jit(ms.value_and_grad(layer_loss(layer, probe, Tensor(doc_ids)), 0, params, has_aux=True))
        (value, (stats, layer_stats)), (dx, dparams) = step(Tensor(x))
        results.append((value, stats, layer_stats, dx, {p.name: g.asnumpy() for p, g in zip(params, dparams)}))
    grouped, reference = results
    assert reference[2].asnumpy()[1] > 0  # some tokens are locked
    for got, expected in zip(grouped[:4], reference[:4]):
        np.testing.assert_allclose(got.asnumpy(), expected.asnumpy(), rtol=1e-5, atol=1e-6)
    for name, expected in reference[4].items():
        # A weight gradient sums a group's rows in BLAS's order, the reference in its own: fp32 rounding of sums of
        # terms up to ~5 (about 1e-6 relative to the largest entry) in the entries that nearly cancel.
        atol = 1e-5 * np.abs(expected).max()
        np.testing.assert_allclose(grouped[4][name], expected, rtol=1e-5, atol=atol, err_msg=name)


def test_expert_share_runs_only_its_groups_and_the_shares_sum_to_the_whole(static_path):
    """Expert parallelism with grouped dispatch: a process holding a contiguous share runs the whole
    sorted buffer with zero outputs for the other experts' rows; the shares' outputs add up exactly."""
    routing_TK = routing("random")
    rng = np.random.default_rng(1)
    x_TH = Tensor(rng.normal(size=(TOKENS, HIDDEN)).astype(np.float32))
    weight_TK = Tensor(rng.uniform(0.1, 1.0, size=routing_TK.shape).astype(np.float32))
    dispatcher = DroplessDispatcher(EXPERTS, alignment=2)
    whole = RoutedExperts(EXPERTS, HIDDEN, WIDTH, 0.5, np.random.default_rng(3))
    shares = nn.CellList(
        [
            RoutedExperts(EXPERTS, HIDDEN, WIDTH, 0.5, np.random.default_rng(3), held_experts=held)
            for held in (range(0, 2), range(2, 4), range(4, 5))
        ]
    )

    @ms.jit
    def outputs(x, topk, weight):
        inputs, state = dispatcher.dispatch(x, (topk, weight))
        sizes, _ = dispatcher.expert_args(state, None)
        parts = [dispatcher.combine(share(inputs, sizes), state) for share in shares]
        return dispatcher.combine(whole(inputs, sizes), state), parts

    full, parts = outputs(x_TH, Tensor(routing_TK), weight_TK)
    np.testing.assert_allclose(sum(p.asnumpy() for p in parts), full.asnumpy(), rtol=1e-6, atol=1e-7)
    for part, held in zip(parts, ((0, 1), (2, 3), (4,))):
        touches = np.isin(routing_TK, held).any(1)
        assert not part.asnumpy()[~touches].any() and part.asnumpy()[touches].any()


def test_a_share_gets_its_rows_of_the_whole_expert_gradient_at_every_call_of_the_compiled_graph(static_path):
    """The zero-weight groups of the other experts must not cut the share's weight gradient: with a padding
    op whose gradient was zero from the second call of a graph on, the experts of every expert-parallel
    rank stopped training after step 1 while the forward stayed right."""
    held = range(2, 4)
    whole = RoutedExperts(EXPERTS, HIDDEN, WIDTH, 0.5, np.random.default_rng(3))
    share = RoutedExperts(EXPERTS, HIDDEN, WIDTH, 0.5, np.random.default_rng(3), held_experts=held)
    dispatcher = DroplessDispatcher(EXPERTS, alignment=2)

    def objective(experts):
        def loss(x, topk, weight, w_out):
            inputs, state = dispatcher.dispatch(x, (topk, weight))
            sizes, _ = dispatcher.expert_args(state, None)
            return (dispatcher.combine(experts(inputs, sizes), state) * w_out).sum()

        return ms.jit(ms.value_and_grad(loss, None, experts.trainable_params()))

    whole_grads, share_grads = objective(whole), objective(share)
    rng = np.random.default_rng(5)
    for call in range(3):  # a different routing each call, as in successive training steps
        topk_TK = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(TOKENS)]).astype(np.int32)
        args = (
            Tensor(rng.normal(size=(TOKENS, HIDDEN)).astype(np.float32)),
            Tensor(topk_TK),
            Tensor(rng.uniform(0.1, 1.0, size=topk_TK.shape).astype(np.float32)),
            Tensor(rng.normal(size=(TOKENS, HIDDEN)).astype(np.float32)),
        )
        _, expected = whole_grads(*args)
        _, actual = share_grads(*args)
        for got, want in zip(actual, expected):
            want_rows = want.asnumpy()[held.start : held.stop]
            assert np.abs(want_rows).sum() > 0
            np.testing.assert_allclose(got.asnumpy(), want_rows, rtol=1e-5, atol=1e-6, err_msg=f"call {call}")


def test_moe_layer_class_is_unchanged_for_capacity():
    layer = MoELayer(ModelConfig(num_experts=EXPERTS), np.random.default_rng(0), moe=MoEConfig(dispatch="capacity"))
    assert type(layer.routed) is GroupedRoutedPart and not layer.routed.dispatcher.grouped
