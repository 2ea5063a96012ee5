"""Kernel functions (``mindmoe.model.kernels``) against NumPy and torch autograd, and the per-device choice."""

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor

from mindmoe.model import kernels
from mindmoe.model.kernels import ascend, cpu


@pytest.mark.parametrize("rows,dim,eps", [(7, 16, 1e-6), (1, 5, 1e-5), (12, 64, 1e-2)])
def test_rms_norm_and_its_gradients_match_torch(rows, dim, eps):
    rng = np.random.default_rng(rows * dim)
    x = rng.normal(size=(rows, dim)).astype(np.float32)
    weight = rng.normal(1.0, 0.3, size=dim).astype(np.float32)
    upstream = rng.normal(size=(rows, dim)).astype(np.float32)
    norm = kernels.rms_norm(dim, eps, "CPU")

    def weighted(x_ZH, weight_H):
        out_ZH = norm(x_ZH, weight_H)
        return (out_ZH * Tensor(upstream)).sum(), out_ZH

    (_, out), (dx, dweight) = ms.jit(ms.value_and_grad(weighted, (0, 1), has_aux=True))(Tensor(x), Tensor(weight))
    x_t, w_t = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, weight))
    expected = x_t * torch.rsqrt((x_t * x_t).mean(-1, keepdim=True) + eps) * w_t
    (expected * torch.tensor(upstream, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(out.asnumpy(), expected.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx.asnumpy(), x_t.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dweight.asnumpy(), w_t.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_swiglu_is_silu_of_gate_times_up():
    rng = np.random.default_rng(0)
    gate, up = rng.normal(size=(2, 3, 8)).astype(np.float32), rng.normal(size=(2, 3, 8)).astype(np.float32)
    expected = gate / (1.0 + np.exp(-gate)) * up
    np.testing.assert_allclose(
        kernels.swiglu("CPU")(Tensor(gate), Tensor(up)).asnumpy(), expected, rtol=1e-5, atol=1e-6
    )


def test_each_device_target_gets_its_implementation_chosen_in_one_table():
    assert isinstance(kernels.rms_norm(8, 1e-6, "CPU"), cpu.RowRMSNormalize)
    assert isinstance(kernels.rms_norm(8, 1e-6, "Ascend"), ascend.AscendRMSNorm)
    assert isinstance(kernels.attention_core(0.5, "Ascend"), cpu.GroupedAttentionCore)
    assert kernels.swiglu("Ascend") is cpu.swiglu
    # Without a device target, the MindSpore context's (CPU on these machines) decides.
    assert kernels.implementation("rms_norm") is kernels.IMPLEMENTATIONS[ms.get_context("device_target")]["rms_norm"]
    with pytest.raises(ValueError, match="device_target='TPU'"):
        kernels.rms_norm(8, 1e-6, "TPU")
