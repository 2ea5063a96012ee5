"""Exact float64 sums over an expert group (train/parallel/exact_sum.py) against NumPy, one process standing in for the
ranks."""

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindmoe.train.parallel.exact_sum import ExactGroupSum, float32_parts


def partial_sums(rng, rows, features, terms):
    """float64 sums of ``terms`` float32 values of magnitudes 2**-20 .. 2**6 each: a rank's exact partial sums."""
    values = rng.standard_normal((terms, rows, features)) * np.exp2(rng.integers(-20, 7, (terms, rows, features)))
    return values.astype(np.float32).astype(np.float64).sum(0)


def test_float32_parts_add_up_to_the_float64_value_exactly():
    rng = np.random.default_rng(0)
    x = partial_sums(rng, 64, 32, 4)
    parts = ms.jit(float32_parts)(Tensor(x)).asnumpy().reshape(3, 64, 32)
    assert parts.dtype == np.float32
    assert np.array_equal((parts[0].astype(np.float64) + parts[1]) + parts[2], x)
    assert np.count_nonzero(parts[2]) > 0  # a third part is needed: 48 bits do not hold every sum


class StandInGather(nn.Cell):
    """The group's AllGather seen from ``rank``: the other ranks' inputs are fixed tensors."""

    def __init__(self, others: list, rank: int):
        super().__init__()
        self.others, self.rank = others, rank

    def construct(self, x):
        return ops.concat(self.others[: self.rank] + [x] + self.others[self.rank :])


def test_the_group_sum_of_partial_sums_is_exact_and_the_same_on_every_rank():
    rng = np.random.default_rng(1)
    partials = [partial_sums(rng, 9, 16, 3) for _ in range(3)]
    exact = (partials[0] + partials[1]) + partials[2]  # the terms' sums are exact in float64, so is this
    assert np.array_equal(exact, partials[2] + (partials[1] + partials[0]))
    # A float32 all-reduce of the rounded partials does not give the exact sum rounded once.
    rounded = [p.astype(np.float32) for p in partials]
    assert not np.array_equal((rounded[0] + rounded[1]) + rounded[2], exact.astype(np.float32))
    parts = [float32_parts(Tensor(p)) for p in partials]
    for rank in range(3):
        gather = StandInGather([p for r, p in enumerate(parts) if r != rank], rank)
        for keep_rows, expected in ((False, exact), (True, exact[3 * rank : 3 * rank + 3])):
            summed = ExactGroupSum("hccl_world_group", 3, rank, keep_rows=keep_rows)
            summed.gather = gather
            got = summed(Tensor(partials[rank])).asnumpy()
            assert got.dtype == np.float64 and np.array_equal(got, expected), (rank, keep_rows)
