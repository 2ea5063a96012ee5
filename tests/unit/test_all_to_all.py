"""The ``all_to_all`` kernel: the CPU emulation (G - 1 rounds, each a gather of one block per rank, and its
custom backward, the reverse exchange) against a NumPy all-to-all of G simulated ranks, and the Ascend op call
against the installed MindSpore 2.9.

One process cannot run a collective, so the rank under test gets a stand-in for the gather: rank s's
tensor is the affine image ``a_s * x + b_s`` of this rank's (``a_r = 1, b_r = 0``), which lets the same
stand-in produce every rank's sends in the forward and every rank's output gradient in the backward.

The grouped dropless dispatch over the exchange (``train.parallel.grouped_exchange``) is checked with the G ranks of a
group simulated in one graph, against every rank's micro-batch through the all-experts reference.
"""

import inspect

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from mindmoe.model import kernels
from mindmoe.model.kernels import ascend_collectives
from mindmoe.model.kernels.cpu_collectives import EmulatedAllToAll

GROUP = 3


def affine(rank: int):
    """``(a_s, b_s)`` of every simulated rank s, the identity at ``rank``."""
    a_G = np.array([1.0 + 0.5 * (s - rank) for s in range(GROUP)], np.float32)
    b_G = np.array([0.25 * (s - rank) for s in range(GROUP)], np.float32)
    return a_G, b_G


class AffineSends(nn.Cell):
    """Stand-in for one round's AllGather on one rank: ``[G_src, n, F]`` whose entry s is rank s's block for
    rank ``(s + k) % G``, rank s's tensor being ``a_s * x + b_s``."""

    def __init__(self, rank: int):
        super().__init__()
        self.a_G, self.b_G = (Tensor(v) for v in affine(rank))
        self.blocks = tuple(Tensor(np.array([(s + k) % GROUP for s in range(GROUP)], np.int32)) for k in range(GROUP))

    def construct(self, x_GnF, k):
        shape = (GROUP,) + (1,) * (x_GnF.ndim - 1)
        return self.a_G.reshape(shape) * ops.gather(x_GnF, self.blocks[k], 0) + self.b_G.reshape(shape)


class Objective(nn.Cell):
    """This rank's share ``sum(out * w)`` of the global objective, and ``out``."""

    def __init__(self, exchange):
        super().__init__()
        self.exchange = exchange

    def construct(self, x_GnF, w_GnF):
        out = self.exchange(x_GnF)
        return (out * w_GnF).sum(), out


def numpy_all_to_all(sends_S):
    """``received[r][s] = sends[s][r]`` for the sends ``[G_src][G_dst, n, F]`` of all ranks."""
    return np.swapaxes(np.asarray(sends_S), 0, 1)


def test_emulated_all_to_all_and_its_backward_match_numpy_on_every_rank():
    shape = (GROUP, 2, 4)
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape).astype(np.float32)
    w = rng.normal(size=shape).astype(np.float32)  # this rank's output gradient: objective sum(out * w)
    for rank in range(GROUP):
        a_G, b_G = affine(rank)
        expand = (GROUP,) + (1,) * len(shape)
        sends = a_G.reshape(expand) * x + b_G.reshape(expand)  # every rank's input
        grads = a_G.reshape(expand) * w + b_G.reshape(expand)  # every rank's output gradient
        exchange = EmulatedAllToAll("unused", GROUP, rank, sends=AffineSends(rank))

        forward_and_grad = ms.jit(ms.value_and_grad(Objective(exchange), grad_position=0, has_aux=True))
        (_, out), dx = forward_and_grad(Tensor(x), Tensor(w))
        np.testing.assert_allclose(out.asnumpy(), numpy_all_to_all(sends)[rank], rtol=1e-6)
        # d/dx_r[j] of the global objective sum_s sum(out_s * w_s): out_j[r] = x_r[j], so it is w_j[r].
        np.testing.assert_allclose(dx.asnumpy(), numpy_all_to_all(grads)[rank], rtol=1e-6)


def test_the_kernel_function_picks_the_emulation_on_cpu_and_alltoall_on_ascend():
    assert kernels.implementation("all_to_all", "CPU") is EmulatedAllToAll
    ascend = kernels.all_to_all("hccl_world_group", 4, 1, device_target="Ascend")
    assert isinstance(ascend, ascend_collectives.AscendAllToAll)
    primitive = ascend.all_to_all
    assert isinstance(primitive, ops.AlltoAll)
    assert (primitive.split_count, primitive.split_dim, primitive.concat_dim) == (4, 0, 0)


def test_the_ascend_all_to_all_uses_mindspore_2_9_arguments_it_takes():
    """AlltoAll has no CPU kernel, so the call cannot run here: the op and the keyword arguments used exist
    in the installed MindSpore, and AlltoAllV (counts per rank, for exchanges of data-dependent sizes) too."""
    assert ms.__version__.startswith("2.9")
    assert list(inspect.signature(ops.AlltoAll.__init__).parameters) == [
        "self",
        "split_count",
        "split_dim",
        "concat_dim",
        "group",
    ]
    assert {"group", "block_size"} <= set(inspect.signature(ops.AlltoAllV.__init__).parameters)
    assert "send_numel_list" in inspect.getdoc(ops.AlltoAllV) and "recv_numel_list" in inspect.getdoc(ops.AlltoAllV)
    source = inspect.getsource(ascend_collectives.AscendAllToAll.__init__)
    assert "ops.AlltoAll(split_count=group_size, split_dim=0, concat_dim=0, group=group)" in source


# --- grouped dropless dispatch over the exchange (train.parallel.grouped_exchange) -----------------------------------
#
# The G ranks of a group run in one graph: each rank's GroupedExchange prepares its sends, the exchange is
# the swap of the source and destination axes, and each rank runs its share of the experts on what it
# received. The reference is every rank's micro-batch through the all-experts dispatcher with all experts.

RANKS, EXPERTS, TOP_K, TOKENS, HIDDEN, WIDTH = 3, 6, 2, 7, 4, 3


class NoExchange(nn.Cell):
    """The exchanges a rank's GroupedExchange would call; the simulated group swaps the axes itself."""

    def __init__(self, group, group_size, rank_in_group):
        super().__init__()

    def construct(self, x):
        return x


def swap(sends):
    """``received[r][s] = sends[s][r]``: the all-to-all of the G ranks' sends."""
    return [ops.stack([sends[s][r] for s in range(RANKS)]) for r in range(RANKS)]


class SimulatedGroup(nn.Cell):
    """Every rank's dispatch, experts share and combine: ``(sum over ranks of sum(out * w_out), outs)``."""

    def __init__(self, block: int, scaled: bool):
        from mindmoe.train.parallel.grouped_exchange import GroupedExchange

        super().__init__()
        self.block = block
        self.scaled = scaled
        self.exchanges = nn.CellList(
            [GroupedExchange(EXPERTS, r, RANKS, "unused", NoExchange, alignment=block) for r in range(RANKS)]
        )
        share = EXPERTS // RANKS
        self.experts = nn.CellList([make_experts(range(r * share, (r + 1) * share), scaled) for r in range(RANKS)])

    def construct(self, x_GTH, topk_GTK, weight_GTK, scale_GT, w_out_GTH):
        sends = [self.exchanges[r].send(x_GTH[r], (topk_GTK[r], weight_GTK[r])) for r in range(RANKS)]
        slot_rows = sends[0][0].shape[1]
        arrived = swap([self.exchanges[r].attach_sizes(sends[r][0], sends[r][1]) for r in range(RANKS)])
        received = [self.exchanges[r].detach_sizes(arrived[r], slot_rows)[0] for r in range(RANKS)]
        received_sizes = [self.exchanges[r].detach_sizes(arrived[r], slot_rows)[1] for r in range(RANKS)]
        received_scale = swap(
            [self.exchanges[r].send_scale(scale_GT[r], sends[r][2], weight_GTK[r]) for r in range(RANKS)]
        )
        outputs = []
        for r in range(RANKS):
            x_NbH, group_sizes_E, dest_R = self.exchanges[r].receive(received[r], received_sizes[r], self.block)
            scale_Nb = self.exchanges[r].receive_scale(received_scale[r], dest_R, self.block) if self.scaled else None
            y_NbH = self.experts[r](x_NbH, group_sizes_E, scale_Nb)
            outputs.append(self.exchanges[r].send_back(y_NbH, dest_R))
        returned = swap(outputs)
        outs = ops.stack(
            [self.exchanges[r].receive_back(returned[r], sends[r][2], weight_GTK[r]) for r in range(RANKS)]
        )
        return (outs * w_out_GTH).sum(), outs


class ReferenceGroup(nn.Cell):
    """Every rank's micro-batch through the all-experts dispatcher and all experts."""

    def __init__(self, scaled: bool):
        from mindmoe.model.moe import AllExpertsDispatcher

        super().__init__()
        self.scaled = scaled
        self.dispatcher = AllExpertsDispatcher(EXPERTS)
        self.experts = make_experts(None, scaled)

    def construct(self, x_GTH, topk_GTK, weight_GTK, scale_GT, w_out_GTH):
        outs = []
        for r in range(RANKS):
            inputs, state = self.dispatcher.dispatch(x_GTH[r], (topk_GTK[r], weight_GTK[r]))
            group_sizes, row_scale = self.dispatcher.expert_args(state, scale_GT[r] if self.scaled else None)
            y = self.experts(inputs, group_sizes, row_scale)
            outs.append(self.dispatcher.combine(y, state))
        outs = ops.stack(outs)
        return (outs * w_out_GTH).sum(), outs


def make_experts(held, row_scaled=False):
    from mindmoe.model.moe import RoutedExperts

    return RoutedExperts(
        EXPERTS, HIDDEN, WIDTH, 0.5, np.random.default_rng(7), held_experts=held, row_scaled=row_scaled
    )


def group_problem(case: str):
    rng = np.random.default_rng(11)
    if case == "random":  # expert 4 gets no token from any rank
        choices = [0, 1, 2, 3, 5]
        topk = np.stack([[rng.permutation(choices)[:TOP_K] for _ in range(TOKENS)] for _ in range(RANKS)])
    else:  # every rank's every assignment on rank 1's experts (2 and 3): a full slot
        topk = np.stack([[rng.permutation([2, 3]) for _ in range(TOKENS)] for _ in range(RANKS)])
    return (
        rng.normal(size=(RANKS, TOKENS, HIDDEN)).astype(np.float32),
        topk.astype(np.int32),
        rng.uniform(0.1, 1.0, size=(RANKS, TOKENS, TOP_K)).astype(np.float32),
        rng.uniform(0.2, 1.0, size=(RANKS, TOKENS)).astype(np.float32),
        rng.normal(size=(RANKS, TOKENS, HIDDEN)).astype(np.float32),
    )


def values_and_grads(net, problem):
    weights = net.trainable_params()
    step = ms.jit(ms.value_and_grad(net, grad_position=(0, 2), weights=weights, has_aux=True))
    (loss, outs), (input_grads, weight_grads) = step(*(Tensor(a) for a in problem))
    return (
        loss.asnumpy(),
        outs.asnumpy(),
        [g.asnumpy() for g in input_grads],
        weights,
        [g.asnumpy() for g in weight_grads],
    )


# Block 1 is Ascend's alignment; "one_rank" fills a slot exactly (X = T * K there).
@pytest.mark.parametrize(("case", "block", "scaled"), [("random", 4, True), ("one_rank", 1, False)])
def test_grouped_exchange_over_a_simulated_group_equals_the_all_experts_reference(case, block, scaled):
    problem = group_problem(case)
    loss, outs, input_grads, weights, weight_grads = values_and_grads(SimulatedGroup(block, scaled), problem)
    ref_loss, ref_outs, ref_input_grads, ref_weights, ref_weight_grads = values_and_grads(
        ReferenceGroup(scaled), problem
    )
    np.testing.assert_allclose(outs, ref_outs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for grad, ref in zip(input_grads, ref_input_grads):  # the tokens' rows and the combine weights
        np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-6)
    # The ranks' shares of every expert weight gradient, side by side, are the full one.
    share_grads = {}
    for weight, grad in zip(weights, weight_grads):
        share_grads.setdefault(weight.name.split(".")[-1], []).append(grad)
    for weight, ref in zip(ref_weights, ref_weight_grads):
        full = np.concatenate(share_grads[weight.name.split(".")[-1]], 0)
        np.testing.assert_allclose(full, ref, rtol=1e-5, atol=1e-6)
    if case == "random":
        assert np.all(ref_weight_grads[0][4] == 0)  # the expert without tokens


def test_the_receiver_sorts_whole_blocks_by_local_expert_then_source_and_its_group_sizes_cover_every_row():
    """Sizes ``[G, e]`` of the groups three sources sent (blocks of 2 rows, slots of 8 rows): rank 0 puts its
    unused rows after its experts, the others before (GroupedMatmul on Ascend needs sizes summing to the rows)."""
    from mindmoe.train.parallel.grouped_exchange import GroupedExchange

    sizes_Ge = np.array([[2, 4], [0, 0], [6, 2]], np.float32)
    x_GXH = np.arange(RANKS * 8, dtype=np.float32).reshape(RANKS, 8, 1) + 1.0
    expected = [x_GXH[0, 0:2], x_GXH[2, 0:6], x_GXH[0, 2:6], x_GXH[2, 6:8]]  # expert 0: sources 0, 2; expert 1
    used = np.concatenate(expected)[:, 0]
    for rank, unused_first in ((0, False), (1, True)):
        exchange = GroupedExchange(EXPERTS, rank, RANKS, "unused", NoExchange, alignment=2)
        x_NbH, group_sizes_E, dest_R = exchange.receive(Tensor(x_GXH), Tensor(sizes_Ge), 2)
        rows = x_NbH.asnumpy().reshape(-1)
        unused = np.zeros(RANKS * 8 - len(used), np.float32)
        np.testing.assert_array_equal(rows, np.concatenate((unused, used) if unused_first else (used, unused)))
        expected_sizes = np.zeros(EXPERTS, np.int32)
        expected_sizes[2 * rank : 2 * rank + 2] = [8, 6]
        expected_sizes[2 * rank - 1 if unused_first else 2] = len(unused)
        np.testing.assert_array_equal(group_sizes_E.asnumpy(), expected_sizes)
        # Back to the slots: every used row where it came from, zero in unused rows.
        back = exchange.send_back(x_NbH, dest_R).asnumpy()
        np.testing.assert_array_equal(back, x_GXH * (back != 0))
        assert (back != 0).sum() == len(used)


def test_token_routed_dropless_sends_the_routed_rows_and_capacity_keeps_the_fixed_exchange():
    """``moe.dispatch=dropless`` with ``parallel.ep_dispatcher=alltoall`` is the grouped exchange: a slot
    holds at most one source's assignments for one rank's experts plus their padding, so a rank runs its
    experts on about ``ep * T * K`` rows, not the ``E * T`` of a capacity exchange with ``C = T`` slots."""
    from mindmoe.model.config import ModelConfig
    from mindmoe.model.moe_config import MoEConfig
    from mindmoe.train.parallel.expert_parallel import ExpertParallelDispatch
    from mindmoe.train.parallel.grouped_exchange import GroupedExchange, slot_rows
    from mindmoe.train.parallel.token_exchange import AllToAllDispatcher

    placement = ExpertParallelDispatch(1, 2, "hccl_world_group", "alltoall")
    cfg = ModelConfig(num_experts=128, top_k=8)
    grouped = placement.dispatcher(cfg, MoEConfig(dispatch="dropless"))
    assert isinstance(grouped, GroupedExchange) and (grouped.num_local, grouped.ep) == (64, 2)
    capacity = placement.dispatcher(cfg, MoEConfig(dispatch="capacity"))
    assert isinstance(capacity, AllToAllDispatcher)
    tokens, top_k, block = 4096, 8, 32
    rows = 2 * slot_rows(tokens, top_k, 64, block)
    assert rows <= 2 * (tokens * top_k + 64 * (block - 1))
    assert rows < 128 * tokens / 7  # the C = T exchange: every expert on every token
