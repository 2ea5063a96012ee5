"""ZeRO-1 (train/parallel/zero.py) in one process: the sharded AdamW against FusedAdamW over several steps, with two
weight-decay groups, a per-expert-row update scale and a tensor whose size is not a multiple of the ranks.

k > 1 ranks are simulated: each simulated rank has its own copy of the parameters and its own optimizer; its
reduce-scatter is a stand-in that keeps its rows of the (already averaged) gradient, and its all-gather a
stand-in that puts its range in zeros. The test sums the ranks' parameters (their ranges are disjoint) to get
the gathered parameter and writes it back to every rank, as the real all-gather does. The CPU collectives
themselves are checked against NumPy with a stand-in for the AllReduce they are built on, and run for real in
tests/integration/test_zero.py.
"""

import inspect
from types import SimpleNamespace

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops

from mindmoe.model import kernels
from mindmoe.model.kernels import ascend_collectives
from mindmoe.model.kernels.cpu_collectives import EmulatedReduceScatter
from mindmoe.train.config import TrainConfig
from mindmoe.train.optim import build_optimizer
from mindmoe.train.parallel.range_views import MomentView
from mindmoe.train.parallel.ranges import ShardSpec

SHAPES = {"experts.w": (3, 3, 5), "proj.weight": (4, 6), "norm.weight": (7,)}  # 45 elements: odd, padded
ROW_SCALES = np.array([1.0, 0.5, 0.25], np.float32).reshape(3, 1, 1)  # expert_update isolation of experts.w
STEPS = 4
CFG = TrainConfig(lr=0.05, weight_decay=0.1, warmup_ratio=0.25, max_steps=STEPS, betas=[0.9, 0.95], eps=1e-8)


def make_params(rng_seed=0):
    rng = np.random.default_rng(rng_seed)
    return [Parameter(Tensor(rng.normal(size=shape).astype(np.float32)), name=n) for n, shape in SHAPES.items()]


def gradients(step):
    rng = np.random.default_rng(100 + step)
    return [rng.normal(size=shape).astype(np.float32) for shape in SHAPES.values()]


class OwnRows(nn.Cell):
    """Reduce-scatter stand-in: this rank's rows of the sum over k ranks that all hold this gradient."""

    def __init__(self, group, k, rank):
        super().__init__()
        self.k, self.rank = k, rank

    def construct(self, x):
        rows = x.shape[0] // self.k
        return x[self.rank * rows : (self.rank + 1) * rows] * self.k


class PlaceRows(nn.Cell):
    """All-gather stand-in: this rank's rows at its place, zeros elsewhere."""

    def __init__(self, group, k, rank):
        super().__init__()
        self.k, self.rank = k, rank

    def construct(self, x):
        rows = x.shape[0]
        return ops.pad(x, (self.rank * rows, (self.k - 1 - self.rank) * rows))


def reference_run():
    """FusedAdamW (the zero=0 optimizer): parameters and moments after each step."""
    params = make_params()
    optimizer = build_optimizer(params, CFG)
    scales = (Tensor(ROW_SCALES), None, None)

    @ms.jit
    def step(grads):
        return optimizer(grads, scales)

    history = []
    for t in range(STEPS):
        step(ms.mutable(tuple(Tensor(g) for g in gradients(t))))
        history.append(
            (
                [p.asnumpy().copy() for p in params],
                [m.asnumpy().copy() for m in optimizer.exp_avg],
                [v.asnumpy().copy() for v in optimizer.exp_avg_sq],
            )
        )
    return history


def zero_rank(k, rank):
    """One simulated rank of ``k``: its parameters, ZeRO optimizer (built as the trainer builds it) and steps."""
    params = make_params()
    dist = SimpleNamespace(world_size=k, rank=rank, expert_rows={}, track_zero=lambda optimizer: None)
    optimizer = build_optimizer(params, CFG, dist, zero=1, collectives=(OwnRows, PlaceRows))
    scales = (Tensor(ROW_SCALES), None, None)

    @ms.jit
    def step(grads):
        shards = optimizer.scatter(grads)
        return optimizer.apply(shards, Tensor(True), scales)

    @ms.jit
    def write(values):
        for param, value in zip(params, values):
            ops.assign(param, value)
        return values[0]

    return params, optimizer, step, write


def padded_range(full, spec):
    flat = np.zeros(spec.size * spec.k, np.float32)
    flat[: spec.numel] = full.reshape(-1)
    return flat[spec.start : spec.start + spec.size]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sharded_adamw_equals_fused_adamw_over_steps_in_params_and_moments(k):
    reference = reference_run()
    ranks = [zero_rank(k, rank) for rank in range(k)]
    for t in range(STEPS):
        grads = ms.mutable(tuple(Tensor(g) for g in gradients(t)))
        for _, _, step, _ in ranks:
            step(grads)
        # The all-gather: every rank's range summed (the others are zeros), written back to every rank.
        gathered = [sum(rank[0][i].asnumpy() for rank in ranks) for i in range(len(SHAPES))]
        for _, _, _, write in ranks:
            write(ms.mutable(tuple(Tensor(g) for g in gathered)))
        ref_params, ref_m, ref_v = reference[t]
        for i, (name, shape) in enumerate(SHAPES.items()):
            np.testing.assert_allclose(gathered[i], ref_params[i], rtol=1e-6, atol=1e-7, err_msg=f"{name} step {t}")
            for _, optimizer, _, _ in ranks:
                spec = optimizer.specs[i]
                assert optimizer.exp_avg[i].shape == (spec.size,) and spec.size == -(-int(np.prod(shape)) // k)
                for local, full in ((optimizer.exp_avg[i], ref_m[i]), (optimizer.exp_avg_sq[i], ref_v[i])):
                    # k = 3: the stand-in's sum 3 g times the mean's 1/3 rounds in the last bit.
                    np.testing.assert_allclose(local.asnumpy(), padded_range(full, spec), rtol=1e-5, atol=1e-9)
    # The step moved every parameter, and the isolated expert rows less than the others.
    assert not np.allclose(gathered[0], make_params()[0].asnumpy())


def test_row_scales_map_to_the_elements_of_each_range():
    spec = ShardSpec("experts.w", (3, 3, 5), k=2, rank=1)
    _, optimizer, _, _ = zero_rank(2, 1)

    @ms.jit
    def scale_of(scale):
        return optimizer.shards[0].owned_scale(scale)

    element_rows = np.minimum((spec.start + np.arange(spec.size)) // 15, 2)
    np.testing.assert_array_equal(scale_of(Tensor(ROW_SCALES)).asnumpy(), ROW_SCALES.reshape(-1)[element_rows])


def test_moment_views_give_full_moments_and_set_ranges():
    spec = ShardSpec("experts.w", (3, 3, 5), k=2, rank=1, ep=2, first_row=3)  # rows 3..5 of a [6, 3, 5] tensor
    local = Parameter(Tensor(np.arange(spec.size, dtype=np.float32)), name="adam_m.experts.w")
    other = np.full(spec.size, -1.0, np.float32)

    def gather_range(tensor):  # rank 0's range, then this rank's
        return Tensor(np.concatenate([other, tensor.asnumpy()]))

    def gather_rows(tensor):  # the other expert group's rows first
        return Tensor(np.concatenate([np.zeros((3, 3, 5), np.float32), tensor.asnumpy()]))

    view = MomentView(local, spec, gather_range, gather_rows)
    assert view.shape == (6, 3, 5) and view.name == "adam_m.experts.w" and view.writer
    assert view.part == ("flat", 45 + 23, 45 + 45)  # 22 existing elements; the 23rd is padding
    full = view.asnumpy()
    np.testing.assert_array_equal(full.reshape(-1)[45 + 23 :], np.arange(22, dtype=np.float32))
    np.testing.assert_array_equal(full.reshape(-1)[45 : 45 + 23], -1.0)
    np.testing.assert_array_equal(view.local_part(), np.arange(22, dtype=np.float32))
    target = np.random.default_rng(1).normal(size=(6, 3, 5)).astype(np.float32)
    view.set_data(Tensor(target))
    np.testing.assert_array_equal(view.local_part(), target.reshape(-1)[view.part[1] : view.part[2]])
    assert local.asnumpy()[-1] == 0.0  # the padding stays zero
    view.set_part(np.ones(22))
    np.testing.assert_array_equal(view.local_part(), 1.0)
    with pytest.raises(ValueError, match="adam_m.experts.w: 23 values"):
        view.set_part(np.ones(23))
    empty = MomentView(local, ShardSpec("b", (3,), k=4, rank=3), None)
    assert empty.part == ("flat", 3, 3) and not empty.writer


class SumOfRanks(nn.Cell):
    """AllReduce stand-in: rank s of the group holds ``x + s`` (s = 0 .. G-1; this rank is s = rank), so
    the sum is ``G x + G (G - 1) / 2 - G * rank``."""

    def __init__(self, group_size, rank):
        super().__init__()
        self.g, self.rank = group_size, rank

    def construct(self, x):
        offsets = sum(range(self.g)) - self.g * self.rank
        return x * self.g + offsets


@pytest.mark.parametrize("rank", [0, 2])
def test_cpu_reduce_scatter_is_the_sum_then_this_ranks_rows(rank):
    group = 3
    x = np.random.default_rng(2).normal(size=(6, 4)).astype(np.float32)
    sends = [x + (s - rank) for s in range(group)]
    expected = np.sum(sends, axis=0)[2 * rank : 2 * rank + 2]
    kernel = EmulatedReduceScatter("g", group, rank, all_reduce=SumOfRanks(group, rank))
    np.testing.assert_allclose(kernel(Tensor(x)).asnumpy(), expected, rtol=1e-6)


def test_the_ascend_collectives_are_the_mindspore_2_9_ops_with_the_arguments_used():
    """ReduceScatter has no CPU kernel: the op and its keyword arguments exist in the installed MindSpore."""
    assert ms.__version__.startswith("2.9")
    assert list(inspect.signature(ops.ReduceScatter.__init__).parameters) == ["self", "op", "group"]
    assert list(inspect.signature(ops.AllGather.__init__).parameters) == ["self", "group"]
    scatter = inspect.getsource(ascend_collectives.AscendReduceScatter.__init__)
    assert 'ops.ReduceScatter(op="sum", group=group)' in scatter
    assert "ops.AllGather(group=group)" in inspect.getsource(ascend_collectives.AscendAllGather.__init__)
    assert kernels.implementation("reduce_scatter", "Ascend") is ascend_collectives.AscendReduceScatter
    assert kernels.implementation("reduce_scatter", "CPU") is EmulatedReduceScatter
    assert kernels.implementation("all_gather", "Ascend") is ascend_collectives.AscendAllGather


def test_parallel_zero_out_of_range_names_the_key_and_the_values_it_takes():
    from mindmoe.conf.ranges import range_errors, section_range_errors
    from mindmoe.data.config import DataConfig
    from mindmoe.launch.config import ParallelConfig

    (error,) = section_range_errors("parallel", ParallelConfig(zero=4))
    assert error.startswith("parallel.zero=4 must be in [0, 3] (0 = every rank holds all its AdamW moments")
    cfg = SimpleNamespace(train=CFG, data=DataConfig(), parallel=ParallelConfig(zero=-1))
    assert range_errors(cfg) == ["parallel.zero=-1 must be in [0, 3] " + error.split("[0, 3] ", 1)[1]]
    assert all(section_range_errors("parallel", ParallelConfig(zero=stage)) == [] for stage in (1, 2, 3))
