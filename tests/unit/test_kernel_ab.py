"""The CPU ``expand`` kernel function and bench/kernel_ab.py's swap of it for its earlier implementation.

``expand`` tiles static shapes (``BroadcastTo`` copied at about 1.6 GB/s on CPU): the values must be NumPy's
broadcast, in a graph (where the shape is static) and eagerly, for every way an operand broadcasts in the model
(a row statistic ``[Z, 1]``, a weight ``[H]``, a table with leading axes to add). The A/B bench must put the earlier
implementation in every module that calls it and put today's back afterwards, even when the block raises."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindmoe.bench import kernel_ab
from mindmoe.model.kernels import cpu, cpu_rope


@pytest.mark.parametrize(
    "operand, shape",
    [((5, 1), (5, 7)), ((7,), (5, 7)), ((3, 4), (2, 1, 3, 4)), ((1, 4), (2, 3, 4)), ((2, 3), (2, 3))],
)
def test_expand_is_numpys_broadcast_eagerly_and_in_a_graph(operand, shape):
    x = np.random.default_rng(0).standard_normal(operand).astype(np.float32)
    want = np.broadcast_to(x, shape)

    def graph(x_in):
        return cpu.expand(x_in, shape) * 1.0

    np.testing.assert_array_equal(cpu.expand(Tensor(x), shape).asnumpy(), want)
    np.testing.assert_array_equal(ms.jit(graph)(Tensor(x)).asnumpy(), want)


def test_earlier_kernel_replaces_every_caller_and_restores_them():
    today = (cpu.expand, cpu_rope.expand)
    with kernel_ab.earlier_kernel("expand=broadcast_to"):
        assert cpu.expand is cpu_rope.expand is kernel_ab._broadcast_expand
    assert (cpu.expand, cpu_rope.expand) == today
    with pytest.raises(RuntimeError, match="inside"):
        with kernel_ab.earlier_kernel("expand=broadcast_to"):
            raise RuntimeError("inside")
    assert (cpu.expand, cpu_rope.expand) == today


def test_every_variant_names_attributes_that_exist():
    for replacements in kernel_ab.VARIANTS.values():
        for paths, _ in replacements:
            for path in paths:
                get, _ = kernel_ab.module_attribute(path)
                assert callable(get()), path


def test_a_variant_may_replace_an_entry_of_a_kernel_table():
    from mindmoe.model import kernels

    today = kernels.CPU_KERNELS["slot_gather"]
    with kernel_ab.earlier_kernel("slots=formula"):
        assert kernels.slot_gather("CPU") is cpu.gather_source_rows
        assert kernels.slot_combine("CPU") is cpu.combine_slot_rows
    assert kernels.CPU_KERNELS["slot_gather"] is today


def test_a_b_row_names_today_and_the_earlier_variant():
    row = kernel_ab._renamed({"baseline_step_s": 2.0, "option_step_s": 2.2, "model": "dense", "max_loss_difference": 0})
    assert row == {"today_step_s": 2.0, "earlier_step_s": 2.2, "model": "dense", "max_loss_difference": 0}


def test_the_earlier_ordered_int_gives_todays_keys():
    """The A/B of the router's ordering keys compares two ways to the same keys: the bit pattern NumPy reads."""
    from mindmoe.model.moe.router import ordered_int
    from tests.helpers.float_bits import every_exponent, np_ordered_int

    x = np.concatenate([every_exponent(), np.float32([[0.0, -0.0]])], 1)
    want = np_ordered_int(x)
    exact = (np.abs(x) >= np.finfo(np.float32).tiny) | (x == 0)
    for encode in (kernel_ab._stepped_ordered_int, ordered_int):
        got = ms.jit(encode)(Tensor(x)).asnumpy()
        np.testing.assert_array_equal(got[exact], want[exact])
        # Subnormals: exact where the backend keeps them, zero where it flushes them.
        assert np.all((got[~exact] == want[~exact]) | (got[~exact] == 0))


@pytest.mark.parametrize("rotary_dim", [8, 16])
def test_splits_give_the_values_and_gradients_of_the_slices_they_replaced(rotary_dim):
    """Queries cut into causal chunks and RoPE's channel halves are taken by splits (a split's gradient is one concat);
    the values and the gradients must be the slices' exactly, partial (8 of 16 channels) and full rotation."""
    from mindspore import ops

    from mindmoe.model import attention, rope

    rng = np.random.default_rng(1)
    x = Tensor(rng.standard_normal((2, 4, 8, 16)).astype(np.float32))
    weights = Tensor(rng.standard_normal((2, 4, 8, 16)).astype(np.float32))
    angles = rng.standard_normal((8, rotary_dim // 2)).astype(np.float32)
    cos = Tensor(np.cos(np.concatenate([angles, angles], 1)))
    sin = Tensor(np.sin(np.concatenate([angles, angles], 1)))

    def rope_loss(apply):
        def loss(x_in):
            return (apply(x_in, cos, sin, False, rope.cpu_rope.rope_rotate_half) * weights).sum()

        return loss

    def chunk_loss(chunks_of):
        def loss(x_in):
            parts = chunks_of(x_in, 4)
            weighted = sum((part * (c + 1.0)).sum() for c, part in enumerate(parts))
            return weighted + (ops.concat(parts, 2) * weights).sum()

        return loss

    with kernel_ab.earlier_kernel("split=slices"):  # compiled inside: the slices in every function
        assert attention.query_chunks is kernel_ab._sliced_query_chunks
        assert rope.cpu_rope._rotate_half is kernel_ab._sliced_rotate_half
        earlier_value, earlier_grad = ms.jit(ms.value_and_grad(rope_loss(kernel_ab._sliced_apply_rope)))(x)
        chunk_value, chunk_grad = ms.jit(ms.value_and_grad(chunk_loss(attention.query_chunks)))(x)
    value, grad = ms.jit(ms.value_and_grad(rope_loss(rope.apply_rope)))(x)
    np.testing.assert_array_equal(value.asnumpy(), earlier_value.asnumpy())
    np.testing.assert_array_equal(grad.asnumpy(), earlier_grad.asnumpy())
    split_value, split_grad = ms.jit(ms.value_and_grad(chunk_loss(attention.query_chunks)))(x)
    np.testing.assert_array_equal(split_value.asnumpy(), chunk_value.asnumpy())
    np.testing.assert_array_equal(split_grad.asnumpy(), chunk_grad.asnumpy())
