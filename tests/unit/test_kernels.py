"""Kernel functions (``mindmoe.model.kernels``) against NumPy and torch autograd, and the per-device choice."""

import ast
import inspect

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor

from mindmoe.model import kernels
from mindmoe.model.kernels import ascend, cpu, cpu_rope
from mindmoe.model.rope import apply_rope, default_inv_freq, rope_tables


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
    assert kernels.swiglu("GPU") is cpu.swiglu
    assert kernels.swiglu("Ascend") is ascend.swiglu
    assert kernels.rope(False, "GPU") is cpu_rope.rope_rotate_half
    assert kernels.rope(True, "GPU") is cpu_rope.rope_interleaved
    assert isinstance(kernels.rope(False, "Ascend"), ascend.AscendRope)
    assert [kernels.rope(interleaved, "Ascend").mode for interleaved in (False, True)] == [0, 1]
    # Without a device target, the MindSpore context's (CPU on these machines) decides.
    assert kernels.implementation("rms_norm") is kernels.IMPLEMENTATIONS[ms.get_context("device_target")]["rms_norm"]
    with pytest.raises(ValueError, match="device_target='TPU'"):
        kernels.rms_norm(8, 1e-6, "TPU")


def rope_reference(x, positions, inv_freq, interleaved):
    """float64 RoPE: pair p of channels ``(a_p, b_p)`` turns by ``position * inv_freq[p]``; the pairs are
    ``(p, p + R/2)`` (rotate-half) or ``(2p, 2p + 1)`` (interleaved); channels from R on pass through."""
    out = x.astype(np.float64).copy()
    half = len(inv_freq)
    theta = np.outer(positions, inv_freq)  # [S, R/2]
    for p in range(half):
        a, b = (2 * p, 2 * p + 1) if interleaved else (p, p + half)
        xa, xb = x[..., a].astype(np.float64), x[..., b].astype(np.float64)
        out[..., a] = xa * np.cos(theta[:, p]) - xb * np.sin(theta[:, p])
        out[..., b] = xa * np.sin(theta[:, p]) + xb * np.cos(theta[:, p])
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim,rotary_dim", [(8, 8), (16, 8), (12, 4)])
def test_cpu_rope_kernel_in_the_graph_matches_the_rotation_formula(interleaved, head_dim, rotary_dim):
    batch, heads, seq = 2, 3, 5
    x = np.random.default_rng(head_dim + rotary_dim).normal(size=(batch, heads, seq, head_dim)).astype(np.float32)
    inv_freq = default_inv_freq(rotary_dim, 100.0)
    cos, sin = rope_tables(inv_freq, seq, interleaved)
    rotate = kernels.rope(interleaved, "CPU")

    @ms.jit
    def rope_with_kernel(x, cos, sin):
        return apply_rope(x, cos, sin, interleaved, rotate)

    out = rope_with_kernel(Tensor(x), cos, sin).asnumpy()
    np.testing.assert_allclose(out, rope_reference(x, np.arange(seq), inv_freq, interleaved), rtol=1e-5, atol=1e-5)


def test_per_sequence_tables_use_the_formula_not_the_kernel():
    """Decoding gives each sequence its own position: tables ``[B, 1, S, R]``, which the fused op does not take."""
    inv_freq = default_inv_freq(4, 10000.0)
    cos, sin = rope_tables(inv_freq, 8, interleaved=False)
    positions = np.array([3, 6])
    cos_B11R, sin_B11R = (t.asnumpy()[positions].reshape(2, 1, 1, 4) for t in (cos, sin))
    x = np.random.default_rng(3).normal(size=(2, 2, 1, 6)).astype(np.float32)

    def unusable_kernel(*args):
        raise AssertionError("the kernel got per-sequence tables")

    out = apply_rope(Tensor(x), Tensor(cos_B11R), Tensor(sin_B11R), False, unusable_kernel).asnumpy()
    expected = np.stack([rope_reference(x[b : b + 1], positions[b : b + 1], inv_freq, False)[0] for b in range(2)])
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def documented_rope(x, cos, sin, mode):
    """``ops.rotary_position_embedding`` as its MindSpore 2.9 documentation states it (0 rotate-half, 1 interleaved)."""
    if mode == 0:
        half = x.shape[-1] // 2
        rotated = np.concatenate((-x[..., half:], x[..., :half]), -1)
    else:
        rotated = np.stack((-x[..., 1::2], x[..., 0::2]), -1).reshape(x.shape)
    return x * cos + rotated * sin


@pytest.mark.parametrize("interleaved", [False, True])
def test_ascend_rope_passes_the_tables_in_the_layout_and_mode_the_fused_op_takes(monkeypatch, interleaved):
    """The op has no CPU kernel: stand in its documented semantics and check what the Ascend kernel gives it."""
    calls = []

    def fused_op(x, cos, sin, mode):
        calls.append((cos.shape, cos.dtype, mode))
        return Tensor(documented_rope(x.asnumpy(), cos.asnumpy(), sin.asnumpy(), mode).astype(np.float32))

    monkeypatch.setattr(ms.ops, "rotary_position_embedding", fused_op)
    inv_freq = default_inv_freq(4, 10000.0)
    cos, sin = rope_tables(inv_freq, 6, interleaved)
    x = np.random.default_rng(4).normal(size=(1, 2, 6, 8)).astype(np.float32)
    rotate = kernels.rope(interleaved, "Ascend").construct  # eager: a cell call would compile the stand-in
    out = apply_rope(Tensor(x), cos, sin, interleaved, rotate).asnumpy()
    assert calls == [((1, 1, 6, 4), ms.float32, int(interleaved))]
    np.testing.assert_allclose(out, rope_reference(x, np.arange(6), inv_freq, interleaved), rtol=1e-5, atol=1e-5)


def test_ascend_swiglu_gives_the_fused_op_gate_then_up_on_the_last_axis(monkeypatch):
    def fused_op(x, dim):
        assert dim == -1
        first, second = np.split(x.asnumpy(), 2, axis=-1)  # documented: Swish(first half) * second half
        return Tensor(first / (1.0 + np.exp(-first)) * second)

    monkeypatch.setattr(ms.ops, "swiglu", fused_op)
    rng = np.random.default_rng(5)
    gate, up = rng.normal(size=(4, 3, 6)).astype(np.float32), rng.normal(size=(4, 3, 6)).astype(np.float32)
    out = kernels.swiglu("Ascend")(Tensor(gate), Tensor(up)).asnumpy()
    np.testing.assert_allclose(out, gate / (1.0 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-6)


def op_calls(name: str) -> list:
    return [
        node
        for node in ast.walk(ast.parse(inspect.getsource(ascend)))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == name
    ]


def test_the_ascend_kernels_call_mindspore_2_9_fused_ops_with_arguments_they_take():
    """The fused ops have no CPU kernel: check each exists in the installed MindSpore with the parameters
    ``kernels/ascend.py`` passes, and that the documented modes and layouts are the ones used."""
    assert ms.__version__.startswith("2.9")
    for name, params, doc_says in (
        ("rms_norm", ["x", "gamma", "epsilon"], ["reciprocal of the input standard deviation"]),
        ("swiglu", ["input", "dim"], ["the first half of the `input`"]),
        (
            "rotary_position_embedding",
            ["x", "cos", "sin", "mode"],
            ["0: rotate_half(GPT-NeoX style); 1: rotate_interleaved(GPT-J style)", "`x` is BNSD: 11SD"],
        ),
    ):
        op = getattr(ms.ops, name)
        assert list(inspect.signature(op).parameters) == params, name
        doc = " ".join(inspect.getdoc(op).split())
        assert all(" ".join(text.split()) in doc for text in doc_says), name
        (call,) = op_calls(name)
        assert not call.keywords and len(call.args) == len(params), name
