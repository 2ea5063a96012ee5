"""The ``all_to_all`` kernel: the CPU emulation (selection from every rank's stacked sends, and its custom
backward, the reverse exchange) against a NumPy all-to-all of G simulated ranks, and the Ascend op call
against the installed MindSpore 2.9.

One process cannot run a collective, so the rank under test gets a stand-in for the gather: rank s's
tensor is the affine image ``a_s * x + b_s`` of this rank's (``a_r = 1, b_r = 0``), which lets the same
stand-in produce every rank's sends in the forward and every rank's output gradient in the backward.
"""

import inspect

import mindspore as ms
import numpy as np
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
    """Stand-in for AllGather on one rank: ``[G_src, G, n, F]`` with rank s's tensor ``a_s * x + b_s``."""

    def __init__(self, rank: int):
        super().__init__()
        self.a_G, self.b_G = (Tensor(v) for v in affine(rank))

    def construct(self, x):
        shape = (GROUP,) + (1,) * x.ndim
        return self.a_G.reshape(shape) * x.expand_dims(0) + self.b_G.reshape(shape)


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
