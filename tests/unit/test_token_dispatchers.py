"""Token dispatchers as parts: dispatch -> experts -> combine (compiled as graph code) vs a NumPy per-token loop.

Each expert here is a plain linear map ``y = W_e x``, so the loop states the dispatch contract alone:
``out_t = sum_k kept_tk * w_tk * W_{e_tk} x_t``, with ``kept`` the capacity rule (an expert keeps its
first C assignments in token order, a token's K choices in rank order) or always 1 (dropless).
"""

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from mindmoe.model.config import ModelConfig
from mindmoe.model.moe import (
    AllExpertsDispatcher,
    CapacityDispatcher,
    DroplessDispatcher,
    RoutedExperts,
    local_dispatcher,
)
from mindmoe.model.moe_config import MoEConfig

TOKENS, HIDDEN, EXPERTS, TOP_K = 10, 6, 4, 2


class RoundTrip(nn.Cell):
    """Dispatch, a linear map per expert, combine; also the dispatcher's kept mask and row scale."""

    def __init__(self, dispatcher):
        super().__init__()
        self.dispatcher = dispatcher
        self.bmm = ops.BatchMatMul(transpose_b=True)

    def construct(self, x_TH, topk_idx_TK, weight_TK, w_EHH, scale_T):
        expert_inputs, state = self.dispatcher.dispatch(x_TH, (topk_idx_TK, weight_TK))
        y_TH = self.dispatcher.combine(self.bmm(expert_inputs, w_EHH), state)
        return y_TH, self.dispatcher.kept(state), self.dispatcher.expert_args(state, scale_T)[1]


def routing_problem(seed: int):
    rng = np.random.default_rng(seed)
    x_TH = rng.normal(size=(TOKENS, HIDDEN)).astype(np.float32)
    topk_idx_TK = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(TOKENS)]).astype(np.int32)
    weight_TK = rng.uniform(0.1, 1.0, size=(TOKENS, TOP_K)).astype(np.float32)
    w_EHH = rng.normal(size=(EXPERTS, HIDDEN, HIDDEN)).astype(np.float32)
    scale_T = rng.uniform(0.2, 1.0, size=TOKENS).astype(np.float32)
    return x_TH, topk_idx_TK, weight_TK, w_EHH, scale_T


def np_dispatch_loop(x_TH, topk_idx_TK, weight_TK, w_EHH, capacity=None):
    """``(out [T, H], kept [T, K], row of each kept assignment in its expert's buffer [T, K])``."""
    out_TH = np.zeros_like(x_TH, dtype=np.float64)
    kept_TK = np.zeros(topk_idx_TK.shape, bool)
    row_TK = np.full(topk_idx_TK.shape, -1)
    filled_E = np.zeros(EXPERTS, int)
    for t in range(TOKENS):
        for k in range(TOP_K):
            e = topk_idx_TK[t, k]
            if capacity is not None and filled_E[e] >= capacity:
                continue
            kept_TK[t, k] = True
            row_TK[t, k] = filled_E[e] if capacity is not None else t
            filled_E[e] += 1
            out_TH[t] += weight_TK[t, k] * (w_EHH[e].astype(np.float64) @ x_TH[t])
    return out_TH, kept_TK, row_TK


def run(dispatcher, problem):
    return [out.asnumpy() for out in RoundTrip(dispatcher)(*(Tensor(a) for a in problem))]


@pytest.mark.parametrize("capacity_factor", [0.5, 0.75, 2.0])
def test_capacity_dispatcher_keeps_each_experts_first_assignments_and_combines_like_the_per_token_loop(
    capacity_factor,
):
    problem = routing_problem(0)
    capacity = max(1, math.ceil(capacity_factor * TOKENS * TOP_K / EXPERTS))
    out_TH, kept_TK, row_TK = np_dispatch_loop(*problem[:4], capacity=capacity)
    y_TH, kept_A, scale_EC = run(CapacityDispatcher(EXPERTS, capacity_factor), problem)
    np.testing.assert_allclose(y_TH, out_TH, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(kept_A, kept_TK.reshape(-1).astype(np.float32))
    # The row scale is the token's own factor in the rows it filled and 1 in unused rows (as 1 + (s - 1)).
    expected_EC = np.ones((EXPERTS, capacity), np.float32)
    for t, k in zip(*np.nonzero(kept_TK)):
        expected_EC[problem[1][t, k], row_TK[t, k]] = problem[4][t]
    np.testing.assert_allclose(scale_EC, expected_EC, rtol=1e-6)
    if capacity_factor < 1:
        assert not kept_TK.all()  # the problem exercises drops


def test_all_experts_reference_runs_every_expert_on_every_token_and_combines_like_the_per_token_loop():
    # The grouped DroplessDispatcher is checked against this reference in test_grouped_dropless.py.
    problem = routing_problem(1)
    out_TH, kept_TK, _ = np_dispatch_loop(*problem[:4])
    y_TH, kept_A, scale_ET = run(AllExpertsDispatcher(EXPERTS), problem)
    np.testing.assert_allclose(y_TH, out_TH, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(kept_A, np.ones(TOKENS * TOP_K, np.float32))
    np.testing.assert_array_equal(scale_ET, np.broadcast_to(problem[4], (EXPERTS, TOKENS)))


def test_moe_dispatch_key_picks_the_dispatcher_class():
    cfg = ModelConfig(num_experts=EXPERTS)
    capacity = local_dispatcher(cfg, MoEConfig(dispatch="capacity", capacity_factor=1.5))
    assert isinstance(capacity, CapacityDispatcher) and capacity.capacity_factor == 1.5
    assert isinstance(local_dispatcher(cfg, MoEConfig(dispatch="dropless")), DroplessDispatcher)
    # An unresolved auto is a model initialised here: capacity.
    assert type(local_dispatcher(cfg, MoEConfig(dispatch="auto"))) is CapacityDispatcher


def test_expert_parallel_ranks_hold_contiguous_shares_that_start_from_the_single_process_rows():
    from mindmoe.train.parallel.expert_parallel import ExpertParallelDispatch

    experts, ep = 8, 4
    full_rng = np.random.default_rng(5)
    full = RoutedExperts(experts, HIDDEN, 3, 0.02, full_rng)
    after_full = full_rng.normal()
    for rank in range(ep):
        held = ExpertParallelDispatch(rank, ep, "unused").held_experts(experts)
        assert held == range(rank * 2, rank * 2 + 2)
        rng = np.random.default_rng(5)
        share = RoutedExperts(experts, HIDDEN, 3, 0.02, rng, held_experts=held)
        assert share.first_expert == held.start
        for name in ("gate_proj", "up_proj", "down_proj"):
            np.testing.assert_array_equal(
                getattr(share, name).asnumpy(), getattr(full, name).asnumpy()[held.start : held.stop]
            )
        assert rng.normal() == after_full  # later parameters draw the same numbers as in one process


def test_dispatchers_hold_no_parameters():
    for dispatcher in (CapacityDispatcher(EXPERTS, 1.0), DroplessDispatcher(EXPERTS), AllExpertsDispatcher(EXPERTS)):
        assert not list(dispatcher.get_parameters())
    assert ms.get_context("mode") == ms.GRAPH_MODE


def test_every_dispatcher_in_model_and_train_subclasses_the_one_interface():
    """A new dispatcher is a subclass of ``TokenDispatcher``, not a new set of members the layer hopes for."""
    import importlib
    import inspect
    import pkgutil

    import mindmoe.model
    import mindmoe.train
    from mindmoe.model.moe.token_dispatcher import TokenDispatcher
    from mindmoe.train.parallel.grouped_exchange import GroupedExchange

    found = {}
    for package in (mindmoe.model, mindmoe.train):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith(("_cli", ".cli")):
                continue
            module = importlib.import_module(info.name)
            for name, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ == module.__name__ and name.endswith("Dispatcher"):
                    found[name] = cls
    assert {"CapacityDispatcher", "DroplessDispatcher", "AllGatherDispatcher", "AllToAllDispatcher"} <= set(found)
    for name, cls in {**found, "GroupedExchange": GroupedExchange}.items():
        assert issubclass(cls, TokenDispatcher), f"{cls.__module__}.{name} does not subclass TokenDispatcher"
    declared = {name for name, member in vars(TokenDispatcher).items() if inspect.isfunction(member)}
    assert declared == {"dispatch", "expert_args", "combine", "kept"}
